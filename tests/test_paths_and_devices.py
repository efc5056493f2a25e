"""hdfs:// copies (tested against a local pyarrow filesystem) and the device helper."""
from pathlib import Path

import pyarrow.fs as pafs
import pytest

from config import load_config
from runtime import local_path, pick_device, resolve_paths


def test_hdfs_folder_copy_is_complete_and_cached(tmp_path):
    remote = tmp_path / "remote" / "model"
    (remote / "sub").mkdir(parents=True)
    (remote / "config.json").write_text('{"a": 1}')
    (remote / "sub" / "weights.bin").write_bytes(bytes(range(256)) * 10)
    cache = tmp_path / "cache"
    fs = pafs.LocalFileSystem()
    local = local_path(f"hdfs://{remote}", cache, filesystem=fs)
    assert local != str(remote) and local.startswith(str(cache))
    copied = sorted(p.relative_to(local).as_posix() for p in Path(local).rglob("*"))
    assert copied == ["config.json", "sub", "sub/weights.bin"]
    assert (Path(local) / "sub" / "weights.bin").read_bytes() == bytes(range(256)) * 10
    # a second call reuses the copy: change the source, the cached copy stays
    (remote / "config.json").write_text('{"a": 2}')
    assert local_path(f"hdfs://{remote}", cache, filesystem=fs) == local
    assert (Path(local) / "config.json").read_text() == '{"a": 1}'
    assert not list(cache.rglob("*.tmp-*")), "no staging folder is left behind"


def test_hdfs_single_file_copy(tmp_path):
    src = tmp_path / "train.parquet"
    src.write_bytes(b"PAR1data")
    local = local_path(f"hdfs://{src}", tmp_path / "cache", filesystem=pafs.LocalFileSystem())
    assert open(local, "rb").read() == b"PAR1data" and local.endswith("train.parquet")


def test_hdfs_missing_remote_path(tmp_path):
    with pytest.raises(FileNotFoundError, match="does not exist"):
        local_path(f"hdfs://{tmp_path}/nope", tmp_path / "cache", filesystem=pafs.LocalFileSystem())


def test_local_paths_pass_through(tmp_path):
    assert local_path("/data/train.parquet", tmp_path) == "/data/train.parquet"


def has_libhdfs():
    try:
        pafs.FileSystem.from_uri("hdfs://namenode:9000/x")
    except OSError:
        return False
    return True


needs_no_libhdfs = pytest.mark.skipif(has_libhdfs(), reason="this machine has a working libhdfs")


@needs_no_libhdfs
def test_hdfs_without_libhdfs_is_a_clear_error(tmp_path):
    with pytest.raises(RuntimeError, match="libhdfs.*HADOOP_HOME"):
        local_path("hdfs://namenode:9000/models/qwen", tmp_path)


def test_device_helper_on_a_cpu_host():
    import torch
    if torch.cuda.is_available():
        pytest.skip("a CUDA host")
    assert pick_device("auto") == ("cpu", "gloo")
    assert pick_device("cpu") == ("cpu", "gloo")
    with pytest.raises(ValueError, match="trainer.device=cuda but no cuda device"):
        pick_device("cuda")


@needs_no_libhdfs
def test_resolve_paths_names_the_key_of_an_hdfs_path_it_cannot_open(tmp_path):
    cfg = load_config(Path(__file__).resolve().parents[1] / "config.yaml",
                      [f"af_output_dir={tmp_path}", "critic.model.path=hdfs://namenode:9000/models/critic"],
                      check_paths=False)
    with pytest.raises(ValueError, match=r"'critic.model.path': cannot open 'hdfs://namenode:9000/models/critic'.*"
                                         r"libhdfs"):
        resolve_paths(cfg)
