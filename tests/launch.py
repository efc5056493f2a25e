"""Launching minirl (or a probe script) under real torchrun from tests: one helper for every test file."""
import os
import resource
import signal
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
# vLLM puts its temporary files under the run's folder unless these are inherited (its cache, VLLM_CACHE_ROOT, is
# the session's: conftest.shared_vllm_cache)
RUN_SCOPED = ("TMPDIR", "TORCHINDUCTOR_CACHE_DIR")


def torchrun_cmd(nproc, *args):
    """torchrun on a free local port (--standalone), so concurrent or back-to-back launches never collide."""
    return [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", str(nproc),
            *map(str, args)]


def launch_env():
    env = {k: v for k, v in os.environ.items() if k not in RUN_SCOPED}
    # PYTHONFAULTHANDLER: probe scripts do not go through minirl.train (failures.report_crashes), and a probe
    # that dies of a native crash in CI should leave its Python stack in the log too
    env.update(HF_HUB_OFFLINE="1", OMP_NUM_THREADS="1", PYTHONFAULTHANDLER="1")
    return env


def torchrun(nproc, *args, timeout=600, expect_ok=True):
    """Run to completion in the repo root; with expect_ok, fail the test with the output's tail on error."""
    out = subprocess.run(torchrun_cmd(nproc, *args), cwd=ROOT, env=launch_env(), capture_output=True, text=True,
                         timeout=timeout)
    if expect_ok:
        assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-5000:]
    return out


def assert_resumed(out, step):
    """`out` (a finished run) resumed from its global_step_<step> checkpoint, as checkpoint.load says. Seeded runs
    are deterministic, so a restart from scratch would log the same metrics as a resume: a resume test that
    compares metrics must also see the resume happen."""
    text = out.stdout + out.stderr
    assert "resumed from " in text and f"global_step_{step} (global step {step}," in text, text[-3000:]


def times_said(stderr, message):
    """How many times the ranks printed `message`, not counting torchrun's Root Cause block, which repeats the
    failing rank's line after "traceback : ". Counted in the text, not at line starts: a C++ warning from another
    rank can be written in pieces around the line."""
    return stderr.count(message) - stderr.count(f"traceback : {message}")


def limit_file_size(limit_bytes=32 * 1024):
    """From now on no file this process (or a child) writes may grow past `limit_bytes` (RLIMIT_FSIZE): a write past
    it fails with EFBIG, as a write to a full disk fails with ENOSPC, instead of SIGXFSZ killing the process."""
    signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
    resource.setrlimit(resource.RLIMIT_FSIZE, (limit_bytes, resource.getrlimit(resource.RLIMIT_FSIZE)[1]))
