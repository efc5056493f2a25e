"""Where a run happens: the device and process group, a CPU rank's threads and malloc settings, seeds, and the
paths it reads and writes (hdfs:// copied into a local cache; output folders checked writable and claimed for this
run before any model loads). Used by minirl.py before the models load, and by the probes and benchmarks that run a
piece of a step on their own."""
from __future__ import annotations

import ctypes
import fcntl
import hashlib
import os
import random
import shutil
import socket
from pathlib import Path

import numpy as np
import pyarrow.fs as pafs
import torch
import torch.distributed as dist

import failures
from config import OUTPUT_FOLDER_KEYS, ConfigError, get_dotted
from tracking import METRICS_FILE, TENSORBOARD_DIR

# ----------------------------------------------------------------------------------------------------------------
# Devices, processes, seeds


def pick_device(requested="auto"):
    """(device type, process-group backend): npu/hccl when torch_npu is usable, cuda/nccl, else cpu/gloo."""

    def npu_available():
        try:
            import torch_npu  # noqa: F401  (registers torch.npu)
        except ImportError:
            return False
        return torch.npu.is_available()

    available = {"npu": npu_available, "cuda": torch.cuda.is_available, "cpu": lambda: True}
    backend = {"npu": "hccl", "cuda": "nccl", "cpu": "gloo"}
    if requested == "auto":
        device = next(name for name in ("npu", "cuda", "cpu") if available[name]())
    elif not available[requested]():
        raise ConfigError(f"trainer.device={requested} but no {requested} device is usable here; "
                          f"set trainer.device=auto")
    else:
        device = requested
    return device, backend[device]


def init_distributed(device_type, backend):
    """Join torchrun's process group (or make a one-process group). Returns (rank, world_size, device)."""
    os.environ.setdefault("RANK", "0")
    os.environ.setdefault("WORLD_SIZE", "1")
    os.environ.setdefault("LOCAL_RANK", "0")
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", str(29500 + os.getpid() % 1000))
    local_rank = int(os.environ["LOCAL_RANK"])
    if device_type == "cpu":
        device = torch.device("cpu")
    else:
        device = torch.device(device_type, local_rank)
        getattr(torch, device_type).set_device(device)
    if not dist.is_initialized():
        failures.watch_parent()          # first: joining the group waits on torchrun's store (no-op once started)
        dist.init_process_group(backend=backend, timeout=failures.COLLECTIVE_TIMEOUT)
    return dist.get_rank(), dist.get_world_size(), device


def share_cpu(local_processes):
    """Settings of a rank that computes on the CPU: an equal share of this node's cores as torch threads, and
    freed memory kept for the next tensors (keep_freed_memory)."""
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // local_processes))
    keep_freed_memory()


FREED_BLOCK_KEPT = 32 << 20      # glibc's largest M_MMAP_THRESHOLD on 64-bit
FREED_TOP_KEPT = 256 << 20


def keep_freed_memory():
    """Ask glibc's malloc to keep freed memory for reuse instead of handing it back to the kernel: blocks of up
    to FREED_BLOCK_KEPT come from the heap (M_MMAP_THRESHOLD), and up to FREED_TOP_KEPT free at its top stays
    (M_TRIM_THRESHOLD). On CPU every activation is a malloc; by default glibc maps the larger ones afresh and
    trims the heap, so each new tensor faults its pages in again: about 4,500 page faults per update micro-batch
    of bench/vs_trl.py's workload, about 300 with these settings (forward+backward 100 -> 88 ms). Nothing
    happens where the C library is not glibc (macOS, musl): there is no libc.so.6 to load."""
    try:
        mallopt = ctypes.CDLL("libc.so.6").mallopt
    except (OSError, AttributeError):
        return
    m_trim_threshold, m_mmap_threshold = -1, -3         # glibc's malloc.h
    mallopt(m_mmap_threshold, FREED_BLOCK_KEPT)
    mallopt(m_trim_threshold, FREED_TOP_KEPT)


def seed_everything(seed):
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)


def sampling_seed(seed, step, rank, purpose="train"):
    """A fixed seed per (run seed, step, rank): sampling is reproducible and differs across ranks and steps."""
    digest = hashlib.sha256(f"{seed}/{purpose}/{step}/{rank}".encode()).digest()
    return int.from_bytes(digest[:4], "little")


# ----------------------------------------------------------------------------------------------------------------
# hdfs:// paths: copied once into a local cache


def local_path(path, cache_dir, filesystem=None):
    """A local path for `path`. hdfs:// paths (files or folders) are copied into `cache_dir` with pyarrow's
    HadoopFileSystem (or `filesystem`, for tests); the copy lands under a temporary name and is renamed into
    place, so a half-copied folder is never used."""
    if not str(path).startswith("hdfs://") and filesystem is None:
        return str(path)
    if filesystem is None:
        try:
            filesystem, remote = pafs.FileSystem.from_uri(path)
        except OSError as err:
            raise RuntimeError(f"cannot open '{path}': pyarrow's HadoopFileSystem needs libhdfs (set HADOOP_HOME "
                               f"and ARROW_LIBHDFS_DIR, and CLASSPATH from `hadoop classpath --glob`), or copy "
                               f"the files to a local path and point the config there. "
                               f"({str(err).splitlines()[0]})") from err
    else:
        remote = str(path).replace("hdfs://", "", 1)
    target = Path(cache_dir) / hashlib.sha256(str(path).encode()).hexdigest()[:16] / Path(remote).name
    if target.exists():
        return str(target)
    if filesystem.get_file_info(remote).type == pafs.FileType.NotFound:
        raise FileNotFoundError(f"'{path}' does not exist on its filesystem")
    staging = target.with_name(target.name + f".tmp-{os.getpid()}")
    staging.parent.mkdir(parents=True, exist_ok=True)
    pafs.copy_files(remote, str(staging), source_filesystem=filesystem, destination_filesystem=pafs.LocalFileSystem())
    try:
        os.rename(staging, target)
    except OSError:            # another rank finished first
        shutil.rmtree(staging, ignore_errors=True) if staging.is_dir() else staging.unlink(missing_ok=True)
    return str(target)


def resolve_paths(cfg):
    """Replace every hdfs:// model and data path of the config by its local copy; errors name the key."""
    cache = cfg.trainer.hdfs_cache_dir or str(Path(cfg.af_output_dir) / "hdfs_cache")
    for dotted in ("data.train_files", "data.val_files", "actor_rollout_ref.model.path", "critic.model.path",
                   "reward_model.model.path"):
        parent, key = dotted.rsplit(".", 1)
        section = get_dotted(cfg, parent)
        value = section[key]
        if not value:
            continue
        try:
            section[key] = [local_path(v, cache) for v in value] if isinstance(value, list) else local_path(value, cache)
        except (RuntimeError, OSError) as err:
            raise ConfigError(f"'{dotted}': {err}") from err


def check_output_folders(cfg, rank):
    """Every folder the run will write to (local: config checked that) exists or can be made, and takes a file: a
    clear error naming the key before any model loads, not an OSError at the first log line or checkpoint."""
    for key in OUTPUT_FOLDER_KEYS:
        folder = get_dotted(cfg, key)
        if not folder:
            continue
        probe = Path(folder) / f".minirl_write_check_{rank}"
        try:
            probe.parent.mkdir(parents=True, exist_ok=True)
            probe.write_text("")
            probe.unlink()
        except OSError as error:
            raise ConfigError(f"{key}={folder!r} is not a folder minirl can write to ({error.strerror or error}); "
                              f"point it at a writable folder") from None
    _check_run_entries(Path(cfg.af_output_dir))


RUN_LOCK = ".minirl_run.lock"
# what a run opens inside af_output_dir (claim_output_folder; tracking.Tracker's log and TensorBoard events)
RUN_ENTRIES = {RUN_LOCK: "file", METRICS_FILE: "file", TENSORBOARD_DIR: "folder"}


def _check_run_entries(folder):
    """An entry of af_output_dir that the run will open, there already as the wrong kind (a folder where the log
    file goes, a file where TensorBoard's folder goes): named now, not an OSError once the models have loaded."""
    for name, kind in RUN_ENTRIES.items():
        path = folder / name
        found = "folder" if path.is_dir() else "file" if path.exists() else None
        if found and found != kind:
            raise ConfigError(f"af_output_dir: {str(path)!r} is a {found}, where the run keeps its {name} {kind}; "
                              f"move it away or give this run another af_output_dir")


def claim_output_folder(folder):
    """Hold an exclusive lock on <folder>/.minirl_run.lock for as long as this process lives (rank 0 calls it for
    af_output_dir). A second run given a folder that a running one writes to (a job retried while the first still
    runs, two experiments left on the same af_output_dir) would interleave metrics.jsonl rows and resume from the
    other's checkpoints; it is refused instead, naming the holder. The kernel drops the lock when the process ends,
    however it ends (kill -9 too), so it is never stale. Returns the open file, which holds the lock."""
    handle = open(Path(folder) / RUN_LOCK, "a+")
    try:
        fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        handle.seek(0)
        holder = handle.read().strip() or "a process that has not said which"
        handle.close()
        raise ConfigError(f"af_output_dir={str(folder)!r} is in use by a run that is still going ({holder}); a "
                          f"second run there would mix its metrics and checkpoints with that run's: give this run "
                          f"its own af_output_dir, or wait for that run to end") from None
    except OSError:               # a file system without locks (some network mounts): nothing to guard with
        return handle
    handle.seek(0)
    handle.truncate()
    handle.write(f"pid {os.getpid()} on {socket.gethostname()}\n")
    handle.flush()
    return handle
