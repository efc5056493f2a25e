"""One rank's failure ends the whole run, loudly and once (real torchrun, 2 CPU ranks, the demo model): a reward
function that raises on rank 1 only, Ctrl-C (SIGINT) to one worker, and a SIGKILLed torchrun whose workers must
not outlive it; and a successful run that must not abort in Python's teardown. Each run is bounded by a
subprocess timeout: before failures.py the first two hung forever."""
import os
import re
import signal
import subprocess
import time

import pytest

from launch import ROOT, launch_env, torchrun_cmd

BOUND_S = 120          # a run that has not ended by then is the hang these tests exist to catch


def overrides(demo_dir, out, reward_file):
    return ["--config", ROOT / "config.yaml", f"actor_rollout_ref.model.path={demo_dir}/model",
            f"data.train_files={demo_dir}/data/train.parquet", "data.val_files=null", f"af_output_dir={out}",
            "trainer.total_training_steps=2", "trainer.val_before_train=false", "trainer.test_freq=-1",
            "trainer.save_freq=-1", "trainer.logger=[console]", "data.train_batch_size=2",
            "data.max_response_length=4", "actor_rollout_ref.rollout.n=2",
            "actor_rollout_ref.actor.ppo_mini_batch_size=2", "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=2",
            f"custom_reward_function.path={reward_file}"]


def reward_file(tmp_path, body):
    """A custom reward function; `body` runs first on every call, with `rank` and `marker` (a folder) defined."""
    path = tmp_path / "reward.py"
    path.write_text(f"""
import os, time
import torch.distributed as dist

def compute_score(data_source, solution_str, ground_truth, extra_info=None):
    rank, marker = dist.get_rank(), {str(tmp_path)!r}
{body}
    return 0.0
""")
    return path


def start(demo_dir, tmp_path, body, *extra, env=None):
    reward = reward_file(tmp_path, body)
    return subprocess.Popen(torchrun_cmd(2, "minirl.py", *overrides(demo_dir, tmp_path / "out", reward), *extra),
                            cwd=ROOT, env=env or launch_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, start_new_session=True)


def finish(proc):
    try:
        stdout, stderr = proc.communicate(timeout=BOUND_S)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        stdout, stderr = proc.communicate()
        pytest.fail(f"the run still hung after {BOUND_S} s:\n{stdout[-2000:]}\n{stderr[-4000:]}")
    return proc.returncode, stdout + stderr


def wait_for(paths, timeout=BOUND_S):
    deadline = time.time() + timeout
    while not all(p.exists() for p in paths):
        assert time.time() < deadline, f"never appeared: {paths}"
        time.sleep(0.2)
    time.sleep(0.5)                                     # the writer has finished writing the pid


def test_a_reward_function_raising_on_one_rank_ends_every_rank_once(demo_dir, tmp_path):
    """...with the user's traceback once and minirl's summary naming the dataset file and row: the row named is
    the one the function was called on (the demo's extra_info.index is the row's position in its file)."""
    body = ('    if rank == 1:\n'
            '        raise ValueError("scorer broke on rank " + str(rank) + " at index " + str(extra_info["index"]))')
    code, output = finish(start(demo_dir, tmp_path, body))
    assert code != 0
    assert output.count("ValueError: scorer broke on rank 1") == 1, output[-4000:]
    assert output.count("reward.py\", line") == 1, output[-4000:]        # the user's traceback, once
    summary = re.search(r"error: rank 1: reward function compute_score raised ValueError on (\S+), row (\d+) "
                        r"\(data_source='minirl/add'.*at index (\d+)", output)
    assert summary, output[-4000:]
    assert summary.group(1) == f"{demo_dir}/data/train.parquet" and summary.group(2) == summary.group(3)


@pytest.mark.parametrize("sig, said", [(signal.SIGINT, "interrupted"), (signal.SIGTERM, "terminated (SIGTERM)")])
def test_a_signal_to_one_worker_ends_every_rank_naming_that_rank(demo_dir, tmp_path, sig, said):
    """Ctrl-C, or SIGTERM (timeout, Slurm, Kubernetes), reaching one worker (rank 1, inside its reward function)
    while rank 0 waits for it: rank 1 says so once, as one line, and torchrun's closing report names it (before,
    a SIGTERMed rank died silently and rank 0's lost connection looked like the cause)."""
    body = ('    if rank == 1:\n        open(os.path.join(marker, "pid1"), "w").write(str(os.getpid()))\n'
            '        time.sleep(300)')
    proc = start(demo_dir, tmp_path, body)
    wait_for([tmp_path / "pid1"])
    os.kill(int((tmp_path / "pid1").read_text()), sig)
    code, output = finish(proc)
    assert code != 0
    # once from minirl, and quoted again, indented, in torchrun's closing report (failures.tell_torchrun)
    assert output.count(f"rank 1: {said}; stopping every rank") == 2, output[-4000:]
    assert f"traceback : rank 1: {said}" in output, output[-4000:]
    assert "minirl.py\", line" not in output, output[-4000:]        # one line, no traceback of ours
    assert "rank 0: stopped as well" in output and "Connection closed" not in output, output[-4000:]


def test_sigterm_to_the_rollout_rank_of_a_split_run_is_reported_once_under_torchruns_rank(demo_dir, tmp_path):
    """Split devices (1 trainer + 1 rollout rank): each side has a process group of its own, but a failure is
    counted over torchrun's job, and the rollout rank names itself by torchrun's rank (not its own world's 0)."""
    body = ('    open(os.path.join(marker, "pid0"), "w").write(str(os.getpid()))\n'
            '    time.sleep(300)')
    proc = start(demo_dir, tmp_path, body, "trainer.n_gpus_per_node=1", "rollout.n_gpus_per_node=1")
    wait_for([tmp_path / "pid0"])                              # the trainer scores: the rollout rank waits
    rollout_rank = next(pid for pid in _children(proc.pid) if pid != int((tmp_path / "pid0").read_text()))
    os.kill(rollout_rank, signal.SIGTERM)
    code, output = finish(proc)
    assert code != 0
    assert output.count("rank 1: terminated (SIGTERM); stopping every rank") == 2, output[-4000:]  # and torchrun's
    assert "rank 0: stopped as well" in output, output[-4000:]
    assert not re.search(r"(minirl|offpolicy)\.py\", line", output), output[-4000:]     # no traceback of ours


def test_a_rank_killed_without_a_word_is_named_as_the_cause_not_the_one_that_lost_it(demo_dir, tmp_path):
    """kill -9 (or the out-of-memory killer) on rank 1 while rank 0 waits for it in a collective: rank 0 says so in
    one line, and torchrun's Root Cause block names rank 1."""
    body = ('    if rank == 1:\n        open(os.path.join(marker, "pid1"), "w").write(str(os.getpid()))\n'
            '        time.sleep(300)')
    proc = start(demo_dir, tmp_path, body)
    wait_for([tmp_path / "pid1"])
    os.kill(int((tmp_path / "pid1").read_text()), signal.SIGKILL)
    code, output = finish(proc)
    assert code != 0
    assert "rank 0: stopped: another rank closed its connection without reporting an error" in output, output[-4000:]
    assert "minirl.py\", line" not in output, output[-4000:]
    root_cause = output[output.index("Root Cause"):]
    assert "rank      : 1 (local_rank: 1)" in root_cause and "SIGKILL" in root_cause, root_cause


def test_a_rank_that_crashes_below_python_names_the_line_it_was_on(demo_dir, tmp_path):
    """A segmentation fault (here a reward function reading address 0, as a crashing C extension would) leaves no
    exception to report: the dying rank prints its threads' Python stacks, the crashing line among them, and
    torchrun's report names it. The tests' own launches set PYTHONFAULTHANDLER; this one must not."""
    body = ('    if rank == 1:\n        import ctypes\n'
            '        ctypes.string_at(0)')
    env = {k: v for k, v in launch_env().items() if k != "PYTHONFAULTHANDLER"}
    code, output = finish(start(demo_dir, tmp_path, body, env=env))
    assert code != 0
    assert output.count("Fatal Python error: Segmentation fault") == 1, output[-4000:]
    assert re.search(r'File ".*reward\.py", line 9 in compute_score', output), output[-4000:]
    root_cause = output[output.index("Root Cause"):]
    assert "rank      : 1 (local_rank: 1)" in root_cause and "SIGSEGV" in root_cause, root_cause


def test_workers_never_outlive_a_torchrun_killed_while_they_start(demo_dir, tmp_path):
    """torchrun SIGKILLed while its workers are still importing: they must notice once they can (before they
    would wait 10 minutes for its store), not outlive it."""
    proc = start(demo_dir, tmp_path, "")
    deadline = time.time() + 30
    workers = []
    while len(workers) < 2 and time.time() < deadline:
        workers = _children(proc.pid)
        time.sleep(0.05)
    assert len(workers) == 2, "torchrun started no workers"
    assert not workers_left_after_killing(proc, workers, BOUND_S), "workers outlived torchrun"


def _children(pid):
    """The pids whose parent is `pid`."""
    found = []
    for entry in os.listdir("/proc"):
        try:
            with open(f"/proc/{entry}/stat") as stat:
                if int(stat.read().split(")")[-1].split()[1]) == pid:
                    found.append(int(entry))
        except (OSError, ValueError):
            continue
    return found


def test_workers_never_outlive_a_killed_torchrun(demo_dir, tmp_path):
    body = ('    open(os.path.join(marker, f"pid{rank}"), "w").write(str(os.getpid()))\n'
            '    time.sleep(300)')
    proc = start(demo_dir, tmp_path, body)
    pid_files = [tmp_path / "pid0", tmp_path / "pid1"]
    wait_for(pid_files)
    workers = [int(p.read_text()) for p in pid_files]
    assert not workers_left_after_killing(proc, workers, 30), "workers outlived torchrun"


def workers_left_after_killing(proc, workers, wait_s):
    """SIGKILL torchrun itself (the workers are its children) and return the workers still alive after wait_s,
    killed then so nothing outlives the test."""
    proc.send_signal(signal.SIGKILL)
    proc.wait(timeout=30)                # not communicate: an orphan would hold the output pipes open
    deadline = time.time() + wait_s
    alive = workers
    while alive and time.time() < deadline:
        alive = [pid for pid in workers if _alive(pid)]
        time.sleep(0.2)
    for pid in alive:
        os.kill(pid, signal.SIGKILL)
    proc.stdout.close()
    proc.stderr.close()
    return alive


def _alive(pid):
    try:
        with open(f"/proc/{pid}/stat") as stat:
            return stat.read().split(")")[-1].split()[0] != "Z"      # a zombie has exited
    except FileNotFoundError:
        return False


@pytest.mark.parametrize("bad", ["unknown_key", "unknown_key_rank0_late", "data_without_prompt_column"])
def test_torchruns_own_report_ends_with_the_error(demo_dir, tmp_path, bad):
    """torchrun closes a failed job with its own traceback and a 'Root Cause' block; that block (the last thing on
    screen) names minirl's one-line error, not a link to torch's docs (found by hand: a typo in a key ended in 40
    lines whose last ones said nothing about it). rank0_late: rank 0 starts 20 s after rank 1, so rank 1 fails
    first and torchrun stops rank 0 before it reads the config (the order CI once hit by chance)."""
    import pyarrow.parquet as pq
    env = launch_env()
    if bad == "unknown_key_rank0_late":
        (tmp_path / "sitecustomize.py").write_text(
            "import os, time\nif os.environ.get('RANK') == '0':\n    time.sleep(20)\n")
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(tmp_path), env.get("PYTHONPATH")]))
    data = demo_dir / "data" / "train.parquet"
    if bad == "data_without_prompt_column":
        data = tmp_path / "no_prompt.parquet"
        pq.write_table(pq.read_table(demo_dir / "data" / "train.parquet").drop(["prompt"]), data)
    extra = ["actor_rollout_ref.actor.ppo_mini_bach_size=4"] if bad.startswith("unknown_key") else []
    out = subprocess.run(torchrun_cmd(2, "minirl.py", "--config", ROOT / "config.yaml",
                                      f"actor_rollout_ref.model.path={demo_dir}/model", f"data.train_files={data}",
                                      "data.val_files=null", f"af_output_dir={tmp_path / 'out'}", *extra),
                         cwd=ROOT, env=env, capture_output=True, text=True, timeout=BOUND_S)
    assert out.returncode != 0
    root_cause = out.stderr[out.stderr.rindex("Root Cause"):]
    expected = ("traceback : config error: unknown config key 'actor_rollout_ref.actor.ppo_mini_bach_size'"
                if bad.startswith("unknown_key") else f"traceback : error: {data}: column 'prompt' is missing")
    assert expected in root_cause, out.stderr[-3000:]


def test_a_rank_that_fails_second_lets_the_first_failure_reach_torchruns_report(tmp_path):
    """torchrun stops every rank once one exits. Rank 0 fails first and takes 3 s to write its error file; rank 1
    fails just after it and must not exit before that, or torchrun ends rank 0 mid-report and its Root Cause block
    names nobody's error (it fails so with failures._wait_for_first_report made a no-op)."""
    probe = tmp_path / "probe.py"
    probe.write_text(f"""
import sys, time
sys.path.insert(0, {str(ROOT)!r})
import torch.distributed as dist
import failures

dist.init_process_group("gloo")
rank, tell = dist.get_rank(), failures.tell_torchrun
failures.tell_torchrun = lambda line, failed_at: (time.sleep(3), tell(line, failed_at))
if rank == 0:
    err = ValueError("row 7 of train.parquet has no prompt")
else:
    dist.distributed_c10d._get_default_store().wait([failures.FAILURE_KEY])     # rank 0 has claimed the failure
    err = RuntimeError("Connection closed by peer")
failures.exit_now(failures.report(err, rank, [(ValueError, "error", 2)]))
""")
    out = subprocess.run(torchrun_cmd(2, probe), cwd=ROOT, env=launch_env(), capture_output=True, text=True,
                         timeout=BOUND_S)
    assert out.returncode != 0
    root_cause = out.stderr[out.stderr.rindex("Root Cause"):]
    assert "traceback : error: row 7 of train.parquet has no prompt" in root_cause, out.stderr[-3000:]


def test_a_successful_run_with_other_ranks_never_aborts_in_pythons_teardown(tmp_path):
    """gloo's worker threads may still be releasing a collective's tensors when a successful run returns; one
    that takes the GIL for it while the interpreter finalizes aborts the process (SIGABRT, exit code -6 after a
    run that succeeded: 1 run in 25 on the 2-core host with two busy loops beside it). Made certain here: the stub trainer's last
    all-gather completes only once the interpreter is finalizing (rank 1 joins it 2 s late, and an object torn
    down with the module takes 4 s). minirl.train must end the process before that (it aborts when train
    returns instead)."""
    probe = tmp_path / "probe.py"
    probe.write_text(f"""
import sys, time
sys.path.insert(0, {str(ROOT)!r})
import torch
import torch.distributed as dist
import minirl


class SlowTeardown:
    def __del__(self):
        time.sleep(4)


class StubTrainer:
    def __init__(self, cfg):
        dist.init_process_group("gloo")
        self.rank = dist.get_rank()

    def fit(self):
        if self.rank == 1:
            time.sleep(2)
        gathered = [torch.zeros(1000) for _ in range(2)]
        dist.all_gather(gathered, torch.ones(1000), async_op=True)    # its work holds the tensors until done
        print(f"rank {{self.rank}} trained", flush=True)

    def close(self):
        pass


slow_teardown = SlowTeardown()
minirl.offpolicy.is_rollout_rank = lambda cfg: False
minirl.Trainer = StubTrainer
sys.exit(minirl.train(cfg=None))
""")
    out = subprocess.run(torchrun_cmd(2, probe), cwd=ROOT, env=launch_env(), capture_output=True, text=True,
                         timeout=BOUND_S)
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-3000:]
    assert "rank 0 trained" in out.stdout and "rank 1 trained" in out.stdout
