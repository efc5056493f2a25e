"""One-step-off-policy on split devices (offpolicy.py), on CPU under real torchrun: 1 trainer + 1 rollout rank and
2 + 1, with the hf and the vLLM engine, and 1 + 2 with vLLM TP 2; the staleness of every batch (exactly one update behind), the update on a
stale batch against a colocated update fed the same batch, SIGKILL + resume, and the config errors for bad splits.

Runs train on the first 8 demo prompts, 4 per step, n=2, 8 response tokens, with a large learning rate so that
one update visibly moves the log-probs.
"""
import json
import os
import re
import signal
import subprocess
import threading
import time
import weakref

import pytest
import torch
import torch.distributed as dist
from transformers import AutoModelForCausalLM

import offpolicy
import rollout
from config import ConfigError, load_config
from launch import ROOT, assert_resumed, launch_env, torchrun, torchrun_cmd
from offpolicy_probe import sampled_logprobs
from test_checkpoint import data_file, metric_rows, run_overrides, worker_pids  # noqa: F401  (data_file: fixture)

SPLIT_1_1 = ["trainer.n_gpus_per_node=1", "rollout.n_gpus_per_node=1"]
SPLIT_2_1 = ["trainer.n_gpus_per_node=2", "rollout.n_gpus_per_node=1"]
FAST = ["actor_rollout_ref.actor.optim.lr=5e-3", "trainer.save_freq=-1"]


def overrides(demo_dir, data_file, out, *extra, steps=4):
    return [*run_overrides(demo_dir, data_file, out), f"trainer.total_training_steps={steps}", *FAST, *extra]


def rows_of(out):
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines() if line.strip()]


# ---------------------------------------------------------------------------------------------------------------
# 1 + 1 with the hf engine: staleness and the shared update path


@pytest.fixture(scope="module")
def recorded(demo_dir, data_file, tmp_path_factory):
    out = tmp_path_factory.mktemp("split_1_1")
    torchrun(2, "tests/offpolicy_probe.py", "record", out / "record.pt",
             *overrides(demo_dir, data_file, out, *SPLIT_1_1), timeout=400)
    return {"dir": out, "record": torch.load(out / "record.pt", weights_only=False), "demo": demo_dir}


def logprobs_under(model_dir, weights, batch, temperature=1.0):
    """Log-probs of each row's sampled tokens under `weights`: a plain HF model, one sequence at a time."""
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    model.load_state_dict(weights, strict=False)
    responses = [r[m.bool()].tolist() for r, m in zip(batch["responses"], batch["response_mask"])]
    with torch.no_grad():
        return sampled_logprobs(model.eval(), batch["raw_prompt_ids"], responses, temperature)


def largest_gap(rollout_log_probs, batch, logprobs):
    mask = batch["response_mask"].bool()
    return max(float((rollout_log_probs[i][mask[i]] - torch.tensor(lp)).abs().max()) for i, lp in enumerate(logprobs))


def test_every_batch_is_exactly_one_update_behind(recorded):
    """Step k trains on a batch sampled by w_{k-2} (the weights the trainer held at step k-1) while it holds
    w_{k-1}; step 1 trains on-policy. The rollout ranks' own log-probs of their samples say which weights
    sampled: they match a kept copy of w_{k-2} and not w_{k-1}."""
    steps, model_dir = recorded["record"]["steps"], recorded["demo"] / "model"
    assert [s["step"] for s in steps] == [1, 2, 3, 4]
    for k, entry in enumerate(steps, start=1):
        batch = entry["batch"]
        sampler = steps[max(k - 2, 0)]["weights"]          # the weights the trainer held one step earlier
        assert largest_gap(batch["rollout_log_probs"], batch, logprobs_under(model_dir, sampler, batch)) < 1e-4
        if k >= 2:
            held = entry["weights"]                         # w_{k-1}: what the trainer holds now
            assert any(not torch.equal(held[n], sampler[n]) for n in held)
            assert largest_gap(batch["rollout_log_probs"], batch, logprobs_under(model_dir, held, batch)) > 1e-3


def test_split_metrics_report_the_gap_and_the_pipeline_timers(recorded):
    rows = rows_of(recorded["dir"])
    assert [r["step"] for r in rows] == [1, 2, 3, 4]
    for row in rows:
        assert "timing_s/wait_prev_gen" in row and "training/rollout_probs_diff_mean" in row
    assert all("timing_s/sync_rollout_weights" in r for r in rows[:-1])       # the last step launches nothing
    assert rows[0]["training/rollout_probs_diff_max"] < 1e-4                  # step 1 is on-policy
    assert all(r["training/rollout_probs_diff_max"] > 1e-4 for r in rows[1:])   # later: one update behind


def test_the_update_on_a_stale_batch_equals_a_colocated_update_on_it(recorded, data_file, tmp_path):
    """A colocated 1-rank run whose generation returns the split run's batches ends with the same weights and
    logs the same metrics: the split run's update path is the colocated one."""
    out = tmp_path
    torchrun(1, "tests/offpolicy_probe.py", "replay", recorded["dir"] / "record.pt", out / "replay.pt",
             *overrides(recorded["demo"], data_file, out), timeout=300)
    split_final, colocated_final = recorded["record"]["final"], torch.load(out / "replay.pt")["final"]
    for name in split_final:
        torch.testing.assert_close(colocated_final[name], split_final[name], rtol=0, atol=0)
    drop = ("timing_s/", "timing_per_token_ms/", "perf/")
    strip = [{k: v for k, v in r.items() if not k.startswith(drop)} for r in rows_of(recorded["dir"])]
    assert strip == [{k: v for k, v in r.items() if not k.startswith(drop)} for r in rows_of(out)]


def test_skipping_the_old_log_prob_pass_on_stale_batches_changes_no_metric(demo_dir, data_file, tmp_path):
    """One epoch and one mini-batch a step on split devices: the batch was sampled one update ago, but the old
    log-probs are the actor's before this update either way, so the update's own stand in for them
    (minirl.update_is_on_policy) and the run logs the same metrics as one that recomputes them in a separate pass
    (tests/on_policy_probe.py), minus that pass's timing."""
    rows = {}
    for mode in ("skip", "recompute"):
        out = tmp_path / mode
        torchrun(2, "tests/on_policy_probe.py", mode, *overrides(
            demo_dir, data_file, out, *SPLIT_1_1, "actor_rollout_ref.actor.ppo_mini_batch_size=4", steps=3),
                 timeout=400)
        rows[mode] = rows_of(out)
    assert [r["step"] for r in rows["skip"]] == [r["step"] for r in rows["recompute"]] == [1, 2, 3]
    timing = ("timing_s/", "timing_per_token_ms/", "perf/")
    for skip, recompute in zip(rows["skip"], rows["recompute"]):
        assert "timing_s/old_log_prob" in recompute and "timing_s/old_log_prob" not in skip
        compared = sorted(k for k in recompute if not k.startswith(timing))
        assert sorted(k for k in skip if not k.startswith(timing)) == compared
        for key in compared:
            assert skip[key] == pytest.approx(recompute[key], rel=1e-5, abs=1e-6), key
        # the ratio starts at 1 against the actor's log-probs before the update, stale batch or not
        assert abs(recompute["actor/ppo_kl"]) < 1e-6 and skip["actor/ppo_kl"] == 0.0
    assert all("timing_s/wait_prev_gen" in r and r["actor/grad_norm"] > 0 for r in rows["skip"])    # the pipeline ran


# ---------------------------------------------------------------------------------------------------------------
# 2 + 1 with both engines


@pytest.mark.parametrize("engine", ["hf", "vllm"])
def test_two_trainers_and_one_rollout_rank_train_end_to_end(engine, demo_dir, data_file, tmp_path):
    extra = ["trainer.val_before_train=true", f"data.val_files={demo_dir}/data/test.parquet", "trainer.test_freq=3"]
    if engine == "vllm":
        extra += ["actor_rollout_ref.rollout.name=vllm", "actor_rollout_ref.rollout.enforce_eager=true"]
    run = torchrun(3, "minirl.py", "--config", ROOT / "config.yaml",
                   *overrides(demo_dir, data_file, tmp_path, *SPLIT_2_1, *extra, steps=3), timeout=500)
    rows = rows_of(tmp_path)
    assert [r["step"] for r in rows] == [0, 1, 2, 3]
    assert "val-core/minirl/add/reward/mean@1" in rows[0] and "val-core/minirl/add/reward/mean@1" in rows[3]
    assert all(r["actor/grad_norm"] > 0 and "timing_s/wait_prev_gen" in r for r in rows[1:])
    if engine == "vllm":                       # vLLM's own log-probs of its samples against the actor's
        assert rows[1]["training/rollout_probs_diff_max"] < 1e-2 < rows[2]["training/rollout_probs_diff_max"]
    assert "error" not in run.stderr.lower().replace("error_file", "")


def test_vllm_tensor_parallel_inside_the_rollout_ranks(demo_dir, data_file, tmp_path_factory):
    """1 trainer + 2 rollout ranks forming one vLLM TP group: the synced weights reach both shards (step 1 is
    on-policy: vLLM's log-probs equal the actor's), and step 2 trains one update behind."""
    tmp_path = tmp_path_factory.mktemp("tp")       # short: vLLM's TP sockets live under it (107-character limit)
    torchrun(3, "minirl.py", "--config", ROOT / "config.yaml",
             *overrides(demo_dir, data_file, tmp_path, "trainer.n_gpus_per_node=1", "rollout.n_gpus_per_node=2",
                        "actor_rollout_ref.rollout.name=vllm", "actor_rollout_ref.rollout.tensor_model_parallel_size=2",
                        steps=2), timeout=500)
    rows = rows_of(tmp_path)
    assert rows[0]["training/rollout_probs_diff_max"] < 1e-4 < rows[1]["training/rollout_probs_diff_max"]
    # on AVX-512 hosts vLLM-CPU's TP group talks through shared memory whose names the ranks' os._exit would leak,
    # failing the host's next TP run (rollout.unlink_cpu_shared_memory); AVX2 builds make none
    assert not [name for name in os.listdir(rollout.SHARED_MEMORY_FOLDER) if "cpushm" in name]


# ---------------------------------------------------------------------------------------------------------------
# LoRA: the adapter over the bridge


def lora_logprobs_under(model_dir, weights, batch):
    """logprobs_under for a LoRA actor: `weights` are a peft model's (base + adapter, peft's names)."""
    from peft import LoraConfig, get_peft_model
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    model = get_peft_model(model, LoraConfig(task_type="CAUSAL_LM", r=8, lora_alpha=16, target_modules="all-linear"))
    model.load_state_dict(weights, strict=True)
    responses = [r[m.bool()].tolist() for r, m in zip(batch["responses"], batch["response_mask"])]
    with torch.no_grad():
        return sampled_logprobs(model.eval(), batch["raw_prompt_ids"], responses, 1.0)


def test_lora_on_split_devices_samples_with_the_adapter_one_update_behind(demo_dir, data_file, tmp_path):
    """LoRA, 1 + 1 with the hf engine: the adapter goes over the bridge at each sync, and the rollout rank samples
    with the one the trainer held a step earlier (the samples' log-probs match a peft model with that adapter, and
    not with the one the trainer holds). Then vLLM started without weights (load_format=dummy): the base goes
    with the first request, so step 1 is on-policy, and step 2 trains one update behind."""
    out, lora_keys = tmp_path / "hf", ["actor_rollout_ref.model.lora_rank=8", "actor_rollout_ref.actor.optim.lr=5e-2"]
    torchrun(2, "tests/offpolicy_probe.py", "record", out / "record.pt",
             *overrides(demo_dir, data_file, out, *SPLIT_1_1, *lora_keys), timeout=400)
    steps = torch.load(out / "record.pt", weights_only=False)["steps"]
    for k, entry in enumerate(steps, start=1):
        batch, sampler = entry["batch"], steps[max(k - 2, 0)]["weights"]
        gap = largest_gap(batch["rollout_log_probs"], batch, lora_logprobs_under(demo_dir / "model", sampler, batch))
        assert gap < 1e-4, (k, gap)
        if k >= 2:
            held = entry["weights"]
            assert any(not torch.equal(held[n], sampler[n]) for n in held if ".lora_" in n)
            assert largest_gap(batch["rollout_log_probs"], batch,
                               lora_logprobs_under(demo_dir / "model", held, batch)) > 1e-3
    out = tmp_path / "vllm"
    torchrun(2, "minirl.py", "--config", ROOT / "config.yaml",
             *overrides(demo_dir, data_file, out, *SPLIT_1_1, *lora_keys, "actor_rollout_ref.rollout.name=vllm",
                        "actor_rollout_ref.rollout.load_format=dummy", steps=2), timeout=500)
    rows = rows_of(out)
    assert rows[0]["training/rollout_probs_diff_max"] < 1e-4 < rows[1]["training/rollout_probs_diff_max"]


# ---------------------------------------------------------------------------------------------------------------
# Kill + resume


def test_sigkill_then_resume_matches_the_uninterrupted_split_run(demo_dir, data_file, tmp_path):
    """Save every 2 steps; kill the job (agent and workers) once the step-2 checkpoint is complete; rerun: steps
    3-5 match an uninterrupted run's (the checkpoint holds the batch that was in flight)."""
    whole, killed = tmp_path / "whole", tmp_path / "killed"
    args = lambda out: overrides(demo_dir, data_file, out, *SPLIT_1_1, "trainer.save_freq=2", steps=5)  # noqa: E731
    torchrun(2, "minirl.py", "--config", ROOT / "config.yaml", *args(whole), timeout=400)
    cmd = torchrun_cmd(2, "minirl.py", "--config", ROOT / "config.yaml", *args(killed))
    tracker = killed / "checkpoints" / "latest_checkpointed_iteration.txt"
    killed.mkdir()
    with open(tmp_path / "killed.log", "w") as log:
        agent = subprocess.Popen(cmd, cwd=ROOT, env=launch_env(), stdout=log, stderr=subprocess.STDOUT,
                                 start_new_session=True)
        deadline, metrics = time.time() + 300, killed / "metrics.jsonl"
        while not (tracker.is_file() and tracker.read_text() == "2" and metrics.is_file()
                   and '"step": 2,' in metrics.read_text()):
            assert agent.poll() is None and time.time() < deadline, (tmp_path / "killed.log").read_text()[-3000:]
            time.sleep(0.005)
        for pid in worker_pids(agent.pid) + [agent.pid]:
            os.killpg(pid, signal.SIGKILL)
        agent.wait()
    assert not (killed / "checkpoints" / "global_step_4").exists(), "the kill came too late to test anything"
    assert_resumed(torchrun(2, "minirl.py", "--config", ROOT / "config.yaml", *args(killed), timeout=400), 2)
    rows = metric_rows(killed / "metrics.jsonl")
    assert [r["step"] for r in rows] == [1, 2, 3, 4, 5]
    assert rows[2:] == metric_rows(whole / "metrics.jsonl")[2:]


# ---------------------------------------------------------------------------------------------------------------
# Config errors, before any model loads


def split_config(demo_dir, *extra, world_size):
    return load_config(ROOT / "config.yaml", [f"actor_rollout_ref.model.path={demo_dir}/model",
                                              f"data.train_files={demo_dir}/data/train.parquet", "data.val_files=null",
                                              "data.train_batch_size=4", "actor_rollout_ref.rollout.n=2",
                                              "actor_rollout_ref.actor.ppo_mini_batch_size=2",
                                              "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=1", *extra],
                       world_size=world_size)


def test_closing_the_bridge_joins_gloo_before_the_last_tensor_is_freed():
    """The exit race CI hit once (3 runs in 94 here: the process aborted after its last step): gloo's worker thread
    freed a broadcast's tensor while the interpreter was finalizing. The last tensor the bridge broadcasts (in
    close) is freed after no thread of the group is left, in this thread (a stress run of 40 exiting pairs: 5
    aborts before, 0 after)."""
    before = os_threads()
    bridge = offpolicy.Bridge(dist.HashStore(), 0, 1, "gloo", "cpu")
    freed, broadcast = [], bridge.broadcast

    def recorded(tensor, src):             # notes, for every broadcast tensor, how many threads are left when freed
        out = broadcast(tensor, src)
        weakref.finalize(out, lambda: freed.append({"threads": os_threads(), "thread": threading.current_thread()}))
        return out

    bridge.broadcast = recorded
    assert bridge.broadcast_object({"step": 1}, src=0) == {"step": 1}
    assert os_threads() > before                                   # gloo's worker and its device loop
    bridge.close()
    assert freed[-1] == {"threads": before, "thread": threading.main_thread()}


def os_threads():
    return len(os.listdir(f"/proc/{os.getpid()}/task"))


@pytest.mark.parametrize("extra, world_size, message", [
    (["trainer.n_gpus_per_node=2", "rollout.n_gpus_per_node=1"], 4, "must equal the 4 processes"),
    (["rollout.n_gpus_per_node=4"], 4, "must equal the 4 processes"),          # no trainer rank left
    (["trainer.n_gpus_per_node=3", "rollout.n_gpus_per_node=1"], 4, "divisible by the world size 3"),
    (["trainer.n_gpus_per_node=1", "rollout.n_gpus_per_node=3", "actor_rollout_ref.rollout.name=vllm",
      "actor_rollout_ref.rollout.tensor_model_parallel_size=2"], 4, "must divide 'rollout.n_gpus_per_node'=3"),
    (["trainer.n_gpus_per_node=1", "rollout.n_gpus_per_node=1", "algorithm.adv_estimator=remax"], 2,
     "not supported on split devices"),
    (["actor_rollout_ref.hybrid_engine=false"], 2, "set 'rollout.n_gpus_per_node'"),
])
def test_impossible_splits_are_config_errors(demo_dir, extra, world_size, message):
    with pytest.raises(ConfigError, match=re.escape(message)):
        split_config(demo_dir, *extra, world_size=world_size)


def test_a_good_split_plans_over_the_trainer_ranks(demo_dir):
    from batch_plan import batch_plan, format_plan
    cfg = split_config(demo_dir, "trainer.n_gpus_per_node=2", "rollout.n_gpus_per_node=2", world_size=4)
    plan = batch_plan(cfg, 4)
    assert (plan["trainer_ranks"], plan["rollout_ranks"], plan["dp"], plan["responses_per_rank"]) == (2, 2, 2, 4)
    assert "ranks 0..1 train (data-parallel 2 x sequence-parallel 1), ranks 2..3 generate" in format_plan(plan)


def test_print_config_shows_the_split(demo_dir):
    out = subprocess.run([*torchrun_cmd(1)[:1], "minirl.py", "--config", "config.yaml", "--print-config",
                          "--world-size", "3", f"actor_rollout_ref.model.path={demo_dir}/model",
                          f"data.train_files={demo_dir}/data/train.parquet", "data.val_files=null",
                          "data.train_batch_size=4", "actor_rollout_ref.rollout.n=2",
                          "actor_rollout_ref.actor.ppo_mini_batch_size=2",
                          "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=1", "rollout.n_gpus_per_node=1"],
                         cwd=ROOT, env=launch_env(), capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert "ranks 0..1 train (data-parallel 2 x sequence-parallel 1), ranks 2..2 generate" in out.stdout
