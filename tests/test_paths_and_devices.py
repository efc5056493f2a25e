"""hdfs:// copies (tested against a local pyarrow filesystem), `~` in path keys, output folders (local only, one run
at a time), the device helper and a CPU rank's settings."""
import contextlib
import os
import platform
import re
import subprocess
import sys
import textwrap
from pathlib import Path

import pyarrow.fs as pafs
import pytest

from config import get_dotted, load_config
from launch import torchrun
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


def test_a_leading_tilde_is_the_home_folder_in_every_local_path_key(tmp_path, monkeypatch):
    """`data.train_files=~/x` on a command line reaches minirl unexpanded (a shell expands ~ only at the start of a
    word), and verl's own defaults are written so: every key that names a local path gets the home folder, once,
    so the path checks and every reader (dataset, from_pretrained, checkpoints) see the same path."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    from config import LOCAL_PATH_KEYS
    monkeypatch.setenv("HOME", str(tmp_path))
    (tmp_path / "model").mkdir()
    (tmp_path / "ckpt" / "global_step_1").mkdir(parents=True)
    (tmp_path / "reward.py").write_text("def compute_score(*args, **kwargs):\n    return 0.0\n")
    for name in ("train.parquet", "test.parquet"):
        pq.write_table(pa.table({"data_source": ["x"] * 16}), tmp_path / name)
    homed = {"af_output_dir": "~/out", "data.tokenizer": "~/model", "data.train_files": ["~/train.parquet"],
             "data.val_files": "~/test.parquet", "actor_rollout_ref.model.path": "~/model",
             "actor_rollout_ref.rollout.multi_turn.tool_config_path": "~/tools.yaml",
             "actor_rollout_ref.rollout.multi_turn.interaction_config_path": "~/interactions.yaml",
             "critic.model.path": "~/model",
             "critic.model.tokenizer_path": "~/model", "reward_model.model.path": "~/model",
             "reward_model.model.input_tokenizer": "~/model", "custom_reward_function.path": "~/reward.py",
             "trainer.rollout_data_dir": "~/dumps", "trainer.validation_data_dir": "~/val_dumps",
             "trainer.resume_from_path": "~/ckpt/global_step_1", "trainer.default_local_dir": "~/ckpts",
             "trainer.hdfs_cache_dir": "~/hdfs_cache"}
    assert sorted(homed) == sorted(LOCAL_PATH_KEYS)
    overrides = [f"{key}=[{value[0]}]" if isinstance(value, list) else f"{key}={value}" for key, value in homed.items()]
    cfg = load_config(Path(__file__).resolve().parents[1] / "config.yaml",
                      [*overrides, "trainer.resume_mode=resume_path", "data.train_batch_size=8",
                       "actor_rollout_ref.actor.ppo_mini_batch_size=8", "algorithm.adv_estimator=gae",
                       "reward_model.enable=true"])
    home = str(tmp_path)
    for key, value in homed.items():
        assert get_dotted(cfg, key) == ([item.replace("~", home, 1) for item in value] if isinstance(value, list)
                                        else value.replace("~", home, 1)), key


@pytest.mark.parametrize("key", ["af_output_dir", "trainer.default_local_dir", "trainer.rollout_data_dir",
                                 "trainer.hdfs_cache_dir"])
def test_an_hdfs_output_folder_is_refused_naming_the_key(tmp_path, monkeypatch, key):
    """Found: af_output_dir=hdfs://nn/out trained and wrote metrics and checkpoints into a local folder 'hdfs:/nn/out'
    under the working directory. Refused with the config, so `--print-config` says so too."""
    from config import ConfigError
    monkeypatch.chdir(tmp_path)
    with pytest.raises(ConfigError, match=rf"{re.escape(key)}='hdfs://namenode/out': minirl writes its outputs to a "
                                          r"local folder"):
        load_config(Path(__file__).resolve().parents[1] / "config.yaml",
                    [f"af_output_dir={tmp_path / 'run'}", f"{key}=hdfs://namenode/out"], check_paths=False)
    assert not (tmp_path / "hdfs:").exists()


@pytest.mark.parametrize("name, kind", [("metrics.jsonl", "folder"), (".minirl_run.lock", "folder"),
                                        ("tensorboard", "file")])
def test_an_output_entry_of_the_wrong_kind_is_named_before_models_load(tmp_path, name, kind):
    """Found: a folder named metrics.jsonl (or .minirl_run.lock), a file named tensorboard, gave an OSError
    traceback after the models had loaded."""
    from config import ConfigError
    from runtime import check_output_folders
    run = tmp_path / "run"
    run.mkdir()
    (run / name).mkdir() if kind == "folder" else (run / name).touch()
    cfg = load_config(Path(__file__).resolve().parents[1] / "config.yaml", [f"af_output_dir={run}"],
                      check_paths=False)
    with pytest.raises(ConfigError, match=rf"af_output_dir: '{re.escape(str(run / name))}' is a {kind}, where the "
                                          r"run keeps its .* move it away or give this run another af_output_dir"):
        check_output_folders(cfg, rank=0)


HOLD_THE_FOLDER = textwrap.dedent("""
    import sys, time
    sys.path.insert(0, {root!r})
    from runtime import claim_output_folder
    lock = claim_output_folder({folder!r})
    print("held", flush=True)
    time.sleep(600)
""")


@contextlib.contextmanager
def held_by_another_process(folder):
    """`folder` claimed (runtime.claim_output_folder) by a separate process for the duration; yields its pid, and
    SIGKILLs it at the end: no cleanup of its own."""
    root = str(Path(__file__).resolve().parents[1])
    holder = subprocess.Popen([sys.executable, "-c", HOLD_THE_FOLDER.format(root=root, folder=str(folder))],
                              stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "held"
        yield holder.pid
    finally:
        holder.kill()
        holder.wait()


def test_a_folder_a_running_run_holds_is_refused_and_freed_when_it_dies(tmp_path):
    """While one process holds af_output_dir, claiming it again fails naming the holder; once the holder is killed
    (SIGKILL: no cleanup of its own), the folder is free at once."""
    from config import ConfigError
    from runtime import claim_output_folder
    with held_by_another_process(tmp_path) as pid:
        with pytest.raises(ConfigError, match=rf"af_output_dir='{tmp_path}' is in use by a run that is still going "
                                              rf"\(pid {pid} on .*\); .* give this run its own af_output_dir"):
            claim_output_folder(tmp_path)
    claim_output_folder(tmp_path).close()


def test_a_second_run_in_a_busy_output_folder_stops_before_loading_models(demo_dir, tmp_path):
    """The real entry point under torchrun: a run given the af_output_dir of a run still going is a config error,
    and it logs and saves nothing there."""
    with held_by_another_process(tmp_path):
        second = torchrun(2, "minirl.py", "--config", "config.yaml", f"af_output_dir={tmp_path}",
                          f"actor_rollout_ref.model.path={demo_dir}/model",
                          f"data.train_files={demo_dir}/data/train.parquet",
                          f"data.val_files={demo_dir}/data/test.parquet", expect_ok=False, timeout=300)
    assert second.returncode != 0
    assert f"config error: af_output_dir='{tmp_path}' is in use by a run that is still going" in second.stderr
    assert not (tmp_path / "metrics.jsonl").exists() and not any((tmp_path / "checkpoints").iterdir())


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


FAULT_PROBE = textwrap.dedent("""
    import ctypes, resource, sys, torch
    import runtime
    libc = ctypes.CDLL("libc.so.6")
    libc.prctl(41, 1, 0, 0, 0)      # PR_SET_THP_DISABLE: fault in 4 KiB pages whatever the host's THP setting
    libc.mallopt(-3, 128 << 10)     # glibc's starting M_MMAP_THRESHOLD, pinned: big tensors mapped and unmapped
    if sys.argv[1] == "share_cpu":
        runtime.share_cpu(local_processes=2)
    def activations():        # a forward's worth of live tensors, then all freed
        return [torch.ones(4 << 20) for _ in range(6)]         # 6 x 16 MiB
    for _ in range(3):        # the heap settles in the first rounds (up to 7 x 16 MiB faulted in, observed)
        activations()
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    for _ in range(10):
        activations()
    print(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before, torch.get_num_threads())
""")


@pytest.mark.skipif(platform.libc_ver()[0] != "glibc", reason="keep_freed_memory tunes glibc's malloc")
def test_a_cpu_rank_reuses_freed_memory_instead_of_faulting_it_in_again():
    """Page faults of the same allocations (6 x 16 MiB allocated and freed, ten rounds after three to settle) in
    a fresh process whose malloc hands freed memory back, without and then with share_cpu. The probe first pins
    glibc's starting M_MMAP_THRESHOLD (128 KiB), so every tensor is mapped afresh and faults its 4,096 pages in
    again each round, unless share_cpu's settings take over. glibc's unpinned defaults do the same in most
    processes (they raise the threshold, then trim the freed heap top) but not in all: whether the top is trimmed
    depends on what else was allocated above it, and a CI host once saw five fresh processes in a row fault only
    in the first round, so as the control they failed the test by chance. Transparent huge pages are off in the
    probe, or a host with THP 'always' would count 2 MiB faults."""
    root = Path(__file__).resolve().parents[1]
    rounds_pages = 10 * 6 * (16 << 20) // 4096

    def faults_and_threads(mode):
        out = subprocess.run([sys.executable, "-c", FAULT_PROBE, mode], cwd=root, capture_output=True, text=True,
                             check=True).stdout.split()
        return int(out[0]), int(out[1])

    returned_faults, _ = faults_and_threads("pinned")
    kept_faults, threads = faults_and_threads("share_cpu")
    assert returned_faults > rounds_pages * 0.9, "the control no longer faults every round: revisit the test"
    assert kept_faults < returned_faults / 5
    assert kept_faults < rounds_pages / 10          # under one round's worth over all ten
    assert threads == max(1, (os.cpu_count() or 1) // 2)


@needs_no_libhdfs
def test_resolve_paths_names_the_key_of_an_hdfs_path_it_cannot_open(tmp_path):
    cfg = load_config(Path(__file__).resolve().parents[1] / "config.yaml",
                      [f"af_output_dir={tmp_path}", "critic.model.path=hdfs://namenode:9000/models/critic"],
                      check_paths=False)
    with pytest.raises(ValueError, match=r"'critic.model.path': cannot open 'hdfs://namenode:9000/models/critic'.*"
                                         r"libhdfs"):
        resolve_paths(cfg)


def _cut_short(path):
    path.write_bytes(path.read_bytes()[:path.stat().st_size // 2])


def _split_into_shards(model, keep_last):
    """The folder's one weights file as Hugging Face's two-shard layout (an index naming each tensor's shard), the
    second shard left out unless keep_last."""
    import json
    from safetensors.torch import load_file, save_file
    tensors = load_file(model / "model.safetensors")
    names = sorted(tensors)
    shards = {"model-00001-of-00002.safetensors": names[:len(names) // 2],
              "model-00002-of-00002.safetensors": names[len(names) // 2:]}
    for shard, shard_names in shards.items():
        if keep_last or shard.startswith("model-00001"):
            save_file({name: tensors[name] for name in shard_names}, model / shard, metadata={"format": "pt"})
    (model / "model.safetensors").unlink()
    weight_map = {name: shard for shard, shard_names in shards.items() for name in shard_names}
    (model / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))


@pytest.mark.parametrize("damage, message", [
    (lambda m: (m / "config.json").unlink(), r"model.path': .*/model has no config.json; point it at a complete"),
    (lambda m: (m / "config.json").write_text("{not json"), r"model.path': .*config.json cannot be read as JSON"),
    (lambda m: [f.unlink() for f in m.glob("*.safetensors")],
     r"model.path': .*/model holds no weights \(\*.safetensors"),
    (lambda m: [f.unlink() for f in m.glob("*") if f.name.startswith(("tokenizer", "vocab"))],
     r"model.path': .*/model has no tokenizer files \(tokenizer.json"),
    (lambda m: _cut_short(m / "model.safetensors"),
     r"model.path': .*/model.safetensors is not a complete safetensors file \(.*\); point it at a complete"),
    (lambda m: _split_into_shards(m, keep_last=False),
     r"model.path': .*model.safetensors.index.json names shards the folder lacks: model-00002-of-00002.safetensors"),
])
def test_a_broken_model_folder_is_named_by_its_key_before_anything_loads(demo_dir, tmp_path, damage, message):
    """Found by fuzzing: inside transformers a folder without weights or with a bad config.json was a traceback, an
    empty one asked for sentencepiece, one without tokenizer files loaded an empty tokenizer (every prompt 0
    tokens), and a weights file cut short or a shard missing from a sharded copy were tracebacks. The demo's model,
    whole and split into two shards, passes."""
    import shutil
    from models import check_model_folders
    model = tmp_path / "model"
    shutil.copytree(demo_dir / "model", model)
    overrides = [f"actor_rollout_ref.model.path={model}", f"data.train_files={demo_dir}/data/train.parquet",
                 f"data.val_files={demo_dir}/data/test.parquet", f"af_output_dir={tmp_path / 'out'}"]
    check_model_folders(load_config(Path(__file__).resolve().parents[1] / "config.yaml", overrides))
    sharded = tmp_path / "sharded"
    shutil.copytree(model, sharded)
    _split_into_shards(sharded, keep_last=True)
    check_model_folders(load_config(Path(__file__).resolve().parents[1] / "config.yaml",
                                    overrides + [f"actor_rollout_ref.model.path={sharded}"]))
    damage(model)
    cfg = load_config(Path(__file__).resolve().parents[1] / "config.yaml", overrides)
    with pytest.raises(ValueError, match=message):
        check_model_folders(cfg)
