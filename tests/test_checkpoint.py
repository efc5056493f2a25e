"""Checkpoints end to end on 2 CPU ranks (real torchrun, gloo, FSDP2): verl's layout, pruning, determinism of a
seeded run, a real SIGKILL of the whole job followed by resume_mode=auto (across an epoch boundary), resume_path,
Hugging Face export, the non-finite guard, and clear errors for every kind of bad checkpoint.

Every run trains on 8 prompts, 4 per step (so 2 steps per epoch), n=2, 8 response tokens, 5 steps, and saves
every 2 steps and at the last: global_step_2 (the end of epoch 0), global_step_4, global_step_5.
"""
import hashlib
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pyarrow.parquet as pq
import pytest
import torch

import checkpoint

from conftest import padded_batch
from launch import ROOT, assert_resumed, launch_env, limit_file_size, times_said, torchrun_cmd
WALL_CLOCK_PREFIXES = ("timing_s/", "timing_per_token_ms/", "perf/")


def run_overrides(demo_dir, data_file, out, *extra):
    return [f"actor_rollout_ref.model.path={demo_dir}/model", f"data.train_files={data_file}", "data.val_files=null",
            f"af_output_dir={out}", "trainer.total_training_steps=5", "trainer.val_before_train=false",
            "trainer.test_freq=-1", "trainer.logger=[console]", "data.train_batch_size=4", "data.max_response_length=8",
            "actor_rollout_ref.rollout.n=2", "actor_rollout_ref.actor.ppo_mini_batch_size=2",
            "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=2", "trainer.save_freq=2",
            "trainer.max_actor_ckpt_to_keep=2",
            "actor_rollout_ref.actor.checkpoint.save_contents=[model,optimizer,extra,hf_model]", *extra]


ENV = launch_env()


def run(cmd, expect_rc=0, timeout=300):
    out = subprocess.run(cmd, cwd=ROOT, env=ENV, capture_output=True, text=True, timeout=timeout)
    assert out.returncode == expect_rc, out.stdout[-3000:] + out.stderr[-5000:]
    return out


def train(demo_dir, data_file, out, *extra, expect_rc=0):
    return run(torchrun_cmd(2, "minirl.py", "--config", ROOT / "config.yaml",
                            *run_overrides(demo_dir, data_file, out, *extra)), expect_rc)


def metric_rows(path):
    """metrics.jsonl rows without the wall-clock keys (the only ones allowed to differ between runs)."""
    rows = [json.loads(line) for line in Path(path).read_text().splitlines() if line.strip()]
    return [{k: v for k, v in row.items() if not k.startswith(WALL_CLOCK_PREFIXES)} for row in rows]


@pytest.fixture(scope="module")
def data_file(demo_dir, tmp_path_factory):
    """The first 8 prompts of the demo training set: 2 steps per epoch at 4 prompts a step."""
    path = tmp_path_factory.mktemp("ckpt_data") / "train8.parquet"
    pq.write_table(pq.read_table(demo_dir / "data" / "train.parquet").slice(0, 8), path)
    return path


@pytest.fixture(scope="module")
def run_a(demo_dir, data_file, tmp_path_factory):
    """The reference run: 5 uninterrupted steps."""
    out = tmp_path_factory.mktemp("run_a")
    train(demo_dir, data_file, out)
    return out


# ---------------------------------------------------------------------------------------------------------------
# Layout, pruning, determinism


def test_layout_is_verls_and_old_checkpoints_are_pruned(run_a):
    root = run_a / "checkpoints"
    # saved at 2, 4, 5; max_actor_ckpt_to_keep=2 keeps the newest two
    assert sorted(p.name for p in root.iterdir()) == ["global_step_4", "global_step_5",
                                                      "latest_checkpointed_iteration.txt"]
    assert (root / "latest_checkpointed_iteration.txt").read_text() == "5"
    step = root / "global_step_5"
    for rank in (0, 1):
        for kind in ("model", "optim", "extra_state"):
            assert (step / "actor" / f"{kind}_world_size_2_rank_{rank}.pt").is_file()
    assert json.loads((step / "actor" / "fsdp_config.json").read_text()) == {"FSDP_version": 2, "world_size": 2}
    for name in ("config.json", "tokenizer.json", "model.safetensors"):
        assert (step / "actor" / "huggingface" / name).is_file(), name
    # step 5 = epoch 2 (steps 1-2 are epoch 0, 3-4 epoch 1), one of its 2 batches done
    data = torch.load(step / "data.pt")
    assert (data["epoch"], data["batches_done_in_epoch"]) == (2, 1)
    assert json.loads((step / "trainer_state.json").read_text())["global_step"] == 5
    extra = torch.load(step / "actor" / "extra_state_world_size_2_rank_1.pt")
    assert extra["lr_scheduler"]["last_epoch"] == 5                   # one scheduler step per training step
    assert set(extra["rng"]) >= {"python", "numpy", "torch"}
    assert extra["counters"] == {"skipped_steps": 0}
    manifest = json.loads((step / "manifest.json").read_text())
    on_disk = {str(p.relative_to(step)) for p in step.rglob("*") if p.is_file() and p.name != "manifest.json"}
    assert set(manifest["files"]) == on_disk                       # every file, each with its size and checksum
    for name in ("data.pt", "actor/model_world_size_2_rank_1.pt", "actor/huggingface/model.safetensors"):
        content = (step / name).read_bytes()
        assert manifest["files"][name] == {"bytes": len(content), "blake2b": hashlib.blake2b(content).hexdigest()}
    assert not list(root.glob("*.incomplete"))


def test_same_seeded_config_gives_identical_metrics(run_a, demo_dir, data_file, tmp_path):
    train(demo_dir, data_file, tmp_path)
    first, second = metric_rows(run_a / "metrics.jsonl"), metric_rows(tmp_path / "metrics.jsonl")
    assert [r["step"] for r in first] == [1, 2, 3, 4, 5]
    assert first == second                                           # equal numbers, not close ones


def worker_pids(agent_pid):
    children = Path(f"/proc/{agent_pid}/task/{agent_pid}/children").read_text().split()
    return [int(pid) for pid in children]


def kill_after_step_2_checkpoint(demo_dir, data_file, out, *extra):
    """Start a run and kill the whole job (the torchrun agent and both workers, each in its own process group)
    with SIGKILL as soon as the step-2 checkpoint is complete, i.e. while step 3 runs."""
    cmd = torchrun_cmd(2, "minirl.py", "--config", ROOT / "config.yaml",
                       *run_overrides(demo_dir, data_file, out, *extra))
    tracker = out / "checkpoints" / "latest_checkpointed_iteration.txt"
    with open(out / "killed.log", "w") as log:
        agent = subprocess.Popen(cmd, cwd=ROOT, env=ENV, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        deadline = time.time() + 180
        metrics = out / "metrics.jsonl"
        while not (tracker.is_file() and tracker.read_text() == "2" and metrics.is_file()
                   and '"step": 2,' in metrics.read_text()):
            assert agent.poll() is None and time.time() < deadline, (out / "killed.log").read_text()[-3000:]
            time.sleep(0.005)
        for pid in worker_pids(agent.pid) + [agent.pid]:
            os.killpg(pid, signal.SIGKILL)
        agent.wait()
    assert not (out / "checkpoints" / "global_step_4").exists(), "the kill came too late to test anything"


def test_sigkill_then_auto_resume_matches_the_uninterrupted_run(run_a, demo_dir, data_file, tmp_path):
    """Kill the job while step 3 runs (the step-2 checkpoint complete), then rerun the same command."""
    kill_after_step_2_checkpoint(demo_dir, data_file, tmp_path)
    assert_resumed(train(demo_dir, data_file, tmp_path), 2)           # trainer.resume_mode=auto (the default)
    rows = metric_rows(tmp_path / "metrics.jsonl")
    assert [r["step"] for r in rows] == [1, 2, 3, 4, 5], "each step once: rows logged after the checkpoint dropped"
    resumed = rows[2:]
    assert resumed == metric_rows(run_a / "metrics.jsonl")[2:]
    # global_step_2 closed epoch 0 (2 batches of 2): the resumed run trains epoch 1, then epoch 2
    assert [r["training/epoch"] for r in resumed] == [1, 1, 2]


def test_a_kill_between_the_save_and_the_metrics_append_loses_no_row(run_a, demo_dir, data_file, tmp_path):
    """The state a kill leaves right after the step-4 checkpoint is in place but before step 4's row reaches
    metrics.jsonl (found killing a run by hand: the resumed file went 1, 2, 3, 5): made from run_a's files, then
    resumed. The checkpoint keeps the step's row, so the file reads 1..5 with run_a's numbers."""
    out = tmp_path / "run"
    shutil.copytree(run_a, out)
    shutil.rmtree(out / "checkpoints" / "global_step_5")
    (out / "checkpoints" / "latest_checkpointed_iteration.txt").write_text("4")
    lines = (out / "metrics.jsonl").read_text().splitlines(keepends=True)
    (out / "metrics.jsonl").write_text("".join(lines[:3]))
    assert_resumed(train(demo_dir, data_file, out), 4)
    rows = metric_rows(out / "metrics.jsonl")
    assert [r["step"] for r in rows] == [1, 2, 3, 4, 5]
    assert rows == metric_rows(run_a / "metrics.jsonl")


def test_rerunning_a_finished_run_adds_nothing(run_a, demo_dir, data_file, tmp_path):
    """The same command again after the run finished (a retried job): found appending a validation row for the
    last step on every rerun. Now it says the run is complete and leaves metrics.jsonl as it was."""
    out = tmp_path / "run"
    shutil.copytree(run_a, out)
    before = (out / "metrics.jsonl").read_text()
    again = train(demo_dir, data_file, out, f"data.val_files={data_file}", "trainer.val_before_train=true")
    assert "the run is already complete (resumed at step 5 of 5)" in again.stdout
    assert (out / "metrics.jsonl").read_text() == before


def test_the_validation_a_resumed_run_starts_with_joins_its_steps_row(run_a, demo_dir, data_file, tmp_path):
    """Resumed with val_before_train, a run validates first at the step it resumed from, as verl does; that step's
    row is in metrics.jsonl already, so the validation joins it: every step keeps one row (found: a second,
    validation-only row for the step, which a reader keying rows by step took for the step's whole row)."""
    out = tmp_path / "run"
    shutil.copytree(run_a, out)
    before = metric_rows(out / "metrics.jsonl")
    train(demo_dir, data_file, out, f"data.val_files={data_file}", "trainer.val_before_train=true",
          "trainer.test_freq=-1", "trainer.total_training_steps=6")
    rows = metric_rows(out / "metrics.jsonl")
    assert [r["step"] for r in rows] == [1, 2, 3, 4, 5, 6]
    assert rows[:4] == before[:4]
    validation = {k: v for k, v in rows[4].items() if k.startswith(("val-core/", "val-aux/"))}
    assert validation and "val-core/minirl/add/reward/mean@1" in validation
    assert rows[4] == {**before[4], **validation}         # step 5's training metrics, its validation beside them


# ---------------------------------------------------------------------------------------------------------------
# resume_path and Hugging Face export


@pytest.fixture(scope="module")
def probe_batch(tmp_path_factory):
    """4 rows: left-padded prompts (P=6), right-padded responses (R=5)."""
    batch = padded_batch([6, 3, 1, 4], [5, 2, 4, 1])
    path = tmp_path_factory.mktemp("probe") / "batch.pt"
    torch.save(batch, path)
    return path


def hand_logprobs(model, batch):
    """log softmax of the logits at positions P-1 .. P+R-2, gathered at the response tokens. [b, R]"""
    R = batch["responses"].shape[1]
    with torch.no_grad():
        logits = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"],
                       position_ids=batch["position_ids"]).logits[:, -R - 1:-1]
    return torch.log_softmax(logits.float(), -1).gather(-1, batch["responses"].unsqueeze(-1)).squeeze(-1)


def test_resume_path_and_hf_export_give_the_trained_models_logprobs(run_a, demo_dir, data_file, probe_batch,
                                                                    tmp_path):
    from transformers import AutoModelForCausalLM, AutoTokenizer
    step5 = run_a / "checkpoints" / "global_step_5"
    out = tmp_path / "probe.pt"
    run(torchrun_cmd(2, ROOT / "tests" / "checkpoint_launcher.py", "logprobs", probe_batch, out,
                     *run_overrides(demo_dir, data_file, tmp_path, "trainer.resume_mode=resume_path",
                                    f"trainer.resume_from_path={step5}")))
    fsdp = torch.load(out)
    assert fsdp["global_step"] == 5
    assert (fsdp["loader"]["epoch"], fsdp["loader"]["batches_done_in_epoch"]) == (2, 1)
    assert fsdp["lr"] == pytest.approx(1e-3)

    run([sys.executable, "minirl.py", "--export", step5 / "actor", tmp_path / "export"])
    batch = torch.load(probe_batch)
    mask = batch["response_mask"].bool()
    for folder in (tmp_path / "export", step5 / "actor" / "huggingface"):
        model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
        AutoTokenizer.from_pretrained(folder)
        logp = hand_logprobs(model, batch)
        assert torch.allclose(logp[mask], fsdp["logp"][mask], atol=1e-5), folder
    initial = AutoModelForCausalLM.from_pretrained(demo_dir / "model", dtype=torch.float32)
    assert not torch.allclose(hand_logprobs(initial, batch)[mask], fsdp["logp"][mask], atol=1e-3), \
        "5 steps at lr 1e-3 should have moved the log-probs"


def without_optimizer_and_extra(step_dir, copy):
    """A copy of a checkpoint as save_contents=[model, hf_model] would have written it: no optimizer or extra
    state shards, and a manifest that says so."""
    shutil.copytree(step_dir, copy)
    manifest = json.loads((copy / "manifest.json").read_text())
    for name in [name for name in manifest["files"] if "/optim_" in name or "/extra_state_" in name]:
        (copy / name).unlink()
        del manifest["files"][name]
    contents = manifest["roles"]["actor"]["contents"]
    manifest["roles"]["actor"]["contents"] = [c for c in contents if c not in ("optimizer", "extra")]
    (copy / "manifest.json").write_text(json.dumps(manifest))
    return copy


def optimizer_steps(step_dir):
    """Adam's step count in rank 0's optimizer shard of the actor."""
    saved = torch.load(step_dir / "actor" / "optim_world_size_2_rank_0.pt", weights_only=False)["state_dict"]
    return {float(entries["step"]) for entries in saved["state"].values()}


def test_load_contents_model_only_resumes_the_weights_with_a_fresh_optimizer(run_a, demo_dir, data_file, tmp_path):
    """verl's checkpoint.load_contents=[model]: the resume takes the step-4 weights and leaves the optimizer, LR
    schedule and RNG fresh, exactly as a resume from a checkpoint saved without them does."""
    step4 = run_a / "checkpoints" / "global_step_4"
    asked, saved_less = tmp_path / "asked", tmp_path / "saved_less"
    train(demo_dir, data_file, asked, "trainer.resume_mode=resume_path", f"trainer.resume_from_path={step4}",
          "actor_rollout_ref.actor.checkpoint.load_contents=[model]")
    copy = without_optimizer_and_extra(step4, tmp_path / "copy" / "global_step_4")
    train(demo_dir, data_file, saved_less, "trainer.resume_mode=resume_path", f"trainer.resume_from_path={copy}")
    assert metric_rows(asked / "metrics.jsonl") == metric_rows(saved_less / "metrics.jsonl")
    step5 = [root / "checkpoints" / "global_step_5" for root in (asked, saved_less, run_a)]
    # 2 optimizer steps a training step (4 prompts, mini-batches of 2): 2 since the resume, against 10 in all
    assert optimizer_steps(step5[0]) == optimizer_steps(step5[1]) == {2.0}
    assert optimizer_steps(step5[2]) == {10.0}
    weights = [torch.load(d / "actor" / "model_world_size_2_rank_0.pt", weights_only=False) for d in step5]
    assert all(torch.equal(weights[0][name], weights[1][name]) for name in weights[0])
    assert not all(torch.equal(weights[0][name], weights[2][name]) for name in weights[0]), \
        "a fresh Adam's first steps should move the weights otherwise than the continued one"


def test_a_resume_with_another_lr_trains_at_it_from_the_checkpoints_step(run_a, demo_dir, data_file, tmp_path):
    """Found by fuzzing: the LR schedule's state carried the checkpoint's base lr, so a resume with another optim.lr
    trained on at the old one. Resumed from step 4 with lr 5e-4 (the run's 1e-3 halved; constant schedule), step 5
    logs 5e-4 and says so; step 4's row, which the checkpoint keeps, is the checkpointed run's."""
    step4 = run_a / "checkpoints" / "global_step_4"
    out = train(demo_dir, data_file, tmp_path, "trainer.resume_mode=resume_path", f"trainer.resume_from_path={step4}",
                "actor_rollout_ref.actor.optim.lr=5e-4")
    rows = metric_rows(tmp_path / "metrics.jsonl")
    assert [(r["step"], r["actor/lr"]) for r in rows] == [(4, 1e-3), (5, 5e-4)]
    assert "the LR schedule follows this run's optim settings from here: lr 0.0005 where the checkpointed run would " \
           "have gone on at 0.001" in out.stderr


def test_load_contents_must_name_the_model(ckpt_copy):
    cfg = resume_cfg("trainer.resume_mode=resume_path", f"trainer.resume_from_path={ckpt_copy / 'global_step_4'}",
                     "actor_rollout_ref.actor.checkpoint.load_contents=[optimizer]")
    with pytest.raises(checkpoint.CheckpointError, match=r"'actor_rollout_ref.actor.checkpoint.load_contents'="
                                                         r"\['optimizer'\] lacks 'model'"):
        checkpoint.resume(cfg, roles={"actor": None}, loader=None)        # refused before any model is touched
    with pytest.raises(checkpoint.CheckpointError, match=r"load_contents'=\['optimizer'\] lacks 'model'"):
        checkpoint.check_before_loading(cfg, world_size=2)                # and before any model loads
    cfg = resume_cfg("actor_rollout_ref.actor.checkpoint.load_contents=[model,hf_model]")
    with pytest.raises(checkpoint.CheckpointError, match=r"has \['hf_model'\]; allowed: \['model', 'optimizer', "
                                                         r"'extra'\]"):
        checkpoint.load_contents(cfg, "actor")


def test_other_fsdp_grouping_is_refused_before_models_load(ckpt_copy):
    """run A's 2 ranks shard one copy of the actor; fsdp_size=1 would give each rank a whole copy (HSDP groups of 1),
    whose shards are not the checkpoint's: refused from the manifest alone, as a resume of it with -1 or 2 is not."""
    step = ckpt_copy / "global_step_4"
    where = ("trainer.resume_mode=resume_path", f"trainer.resume_from_path={step}")
    for fsdp_size in (-1, 2, 4):
        checkpoint.check_before_loading(resume_cfg(*where, f"actor_rollout_ref.actor.fsdp_config.fsdp_size="
                                                             f"{fsdp_size}"), world_size=2)
    cfg = resume_cfg(*where, "actor_rollout_ref.actor.fsdp_config.fsdp_size=1")
    with pytest.raises(checkpoint.CheckpointError, match=r"shards its actor model over groups of 2 ranks and this "
                                                         r"run over 1 \(actor_rollout_ref.actor.fsdp_config.fsdp_size"
                                                         r"\).*Resume with actor_rollout_ref.actor.fsdp_config."
                                                         r"fsdp_size=2 \(or -1: all ranks\)"):
        checkpoint.check_before_loading(cfg, world_size=2)


# ---------------------------------------------------------------------------------------------------------------
# The non-finite guard


def test_nan_steps_are_skipped_and_three_in_a_row_stop_the_run(demo_dir, data_file, tmp_path):
    result = run(torchrun_cmd(2, ROOT / "tests" / "checkpoint_launcher.py", "nan", 3,
                              *run_overrides(demo_dir, data_file, tmp_path, "trainer.save_freq=1",
                                             "trainer.total_training_steps=8", "trainer.max_actor_ckpt_to_keep=null")),
                 expect_rc=1)                                        # torchrun: a worker failed
    rows = metric_rows(tmp_path / "metrics.jsonl")
    assert [r["step"] for r in rows] == [1, 2, 3, 4, 5]             # stopped after the 3rd NaN step in a row
    # 2 optimizer steps per training step (4 prompts, mini-batches of 2); each NaN step skips both
    assert [r["actor/skipped_steps"] for r in rows] == [0, 0, 2, 4, 6]
    assert result.stderr.count("non-finite loss or gradient norm") == 3
    message = result.stderr[result.stderr.index("training stopped"):]
    for cause in ("learning rate", "KL", "data", "global_step_2"):
        assert cause in message, message
    root = tmp_path / "checkpoints"
    assert sorted(p.name for p in root.glob("global_step_*")) == ["global_step_1", "global_step_2"]
    assert (root / "latest_checkpointed_iteration.txt").read_text() == "2"
    assert checkpoint.problems(root / "global_step_2") is None


def test_a_save_that_cannot_write_names_the_folder_and_keeps_the_last_checkpoint(demo_dir, data_file, tmp_path):
    """From step 2 on no file may grow past 32 KiB (RLIMIT_FSIZE, standing in for a full disk: the shard writes
    fail inside torch.save, which reports them as a bare RuntimeError): the run stops with a checkpoint error that
    names the staging folder and the fix, and global_step_1 stays the intact latest checkpoint."""
    result = run(torchrun_cmd(2, ROOT / "tests" / "checkpoint_launcher.py", "small-files", 2,
                              *run_overrides(demo_dir, data_file, tmp_path, "trainer.save_freq=1",
                                             "trainer.total_training_steps=3")), expect_rc=1)
    root = tmp_path / "checkpoints"
    message = result.stderr[result.stderr.index("checkpoint error: "):].splitlines()[0]
    assert f"writing {root / 'global_step_2.incomplete'} failed (RuntimeError: " in message, message
    assert "free of" in message and "trainer.default_local_dir" in message, message
    assert [r["step"] for r in metric_rows(tmp_path / "metrics.jsonl")] == [1]
    assert (root / "latest_checkpointed_iteration.txt").read_text() == "1"
    assert checkpoint.problems(root / "global_step_1") is None and not (root / "global_step_2").exists()


def test_export_never_mixes_with_an_earlier_export(run_a, tmp_path):
    """Found exporting a LoRA checkpoint's adapter into the folder of its merged export: adapter_config.json and
    the merged model.safetensors ended up side by side. A non-empty folder is refused, untouched."""
    step5 = run_a / "checkpoints" / "global_step_5"
    out = tmp_path / "export"
    run([sys.executable, "minirl.py", "--export", step5, out])
    before = {p.name: p.read_bytes() for p in out.iterdir()}
    assert "model.safetensors" in before and not list(tmp_path.glob("*.incomplete"))
    again = run([sys.executable, "minirl.py", "--export", run_a / "checkpoints" / "global_step_4", out], expect_rc=2)
    assert f"checkpoint error: --export: '{out}' exists and is not an empty folder" in again.stderr
    assert {p.name: p.read_bytes() for p in out.iterdir()} == before


def test_an_export_that_cannot_write_is_named_and_leaves_nothing(run_a, tmp_path):
    """No file may grow past 32 KiB (RLIMIT_FSIZE, standing in for a full disk; the weights file is larger): the
    export stops with a checkpoint error naming its folder and the fix, and neither it nor its staging folder
    is left."""
    out = tmp_path / "export"
    failed = subprocess.run([sys.executable, "minirl.py", "--export", run_a / "checkpoints" / "global_step_5", out],
                            cwd=ROOT, env=ENV, capture_output=True, text=True, timeout=300,
                            preexec_fn=limit_file_size)
    assert failed.returncode == 2, failed.stderr[-3000:]
    assert f"checkpoint error: writing {out}.incomplete failed (" in failed.stderr, failed.stderr[-3000:]
    assert "Free space or export to a larger disk" in failed.stderr
    assert list(tmp_path.iterdir()) == []


# ---------------------------------------------------------------------------------------------------------------
# Bad checkpoints


@pytest.fixture
def ckpt_copy(run_a, tmp_path):
    """A private copy of run A's checkpoints to damage."""
    root = tmp_path / "checkpoints"
    shutil.copytree(run_a / "checkpoints", root)
    return root


def layout_of(step_dir):
    """The actor's parameter layout as this run would compute it (names and shapes from the manifest)."""
    return {"actor": json.loads((step_dir / "manifest.json").read_text())["roles"]["actor"]["params"]}


def test_missing_file_is_named(ckpt_copy):
    step = ckpt_copy / "global_step_4"
    (step / "actor" / "optim_world_size_2_rank_1.pt").unlink()
    with pytest.raises(checkpoint.CheckpointError, match=r"optim_world_size_2_rank_1\.pt is missing"):
        checkpoint.validate(step, 2, layout_of(step))


def test_truncated_file_is_named(ckpt_copy):
    step = ckpt_copy / "global_step_4"
    shard = step / "actor" / "model_world_size_2_rank_0.pt"
    size = shard.stat().st_size
    with open(shard, "r+b") as f:
        f.truncate(size // 2)
    expected = rf"model_world_size_2_rank_0\.pt is truncated or altered: {size // 2} bytes, the manifest says {size}"
    with pytest.raises(checkpoint.CheckpointError, match=expected):
        checkpoint.validate(step, 2, layout_of(step))


def test_resume_path_must_be_a_global_step_folder(ckpt_copy):
    for wrong in (ckpt_copy, ckpt_copy / "global_step_4" / "actor", ckpt_copy / "global_step_9"):
        with pytest.raises(checkpoint.CheckpointError, match="must name a .../global_step_N folder"):
            checkpoint.validate(wrong, 2, {})


def test_other_model_is_refused_naming_the_parameter(ckpt_copy):
    from transformers import AutoConfig, AutoModelForCausalLM
    step = ckpt_copy / "global_step_4"
    config = AutoConfig.from_pretrained(step / "actor" / "huggingface")
    config.intermediate_size = 96                                    # the checkpoint's model has 128
    with torch.device("meta"):
        other = AutoModelForCausalLM.from_config(config)
    with pytest.raises(checkpoint.CheckpointError,
                       match=r"different actor model.*'model\.layers\.0\.mlp\.down_proj\.weight' has shape "
                             r"\[64, 128\] in the checkpoint and \[64, 96\] here"):
        checkpoint.validate(step, 2, {"actor": checkpoint.param_layout(other)})


def test_a_lora_setting_that_differs_from_the_checkpoints_is_named(ckpt_copy):
    """Found by resuming a LoRA run without lora_rank: the error named a peft parameter name, not the key to set."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoConfig, AutoModelForCausalLM
    step = ckpt_copy / "global_step_4"                               # a full fine-tuning checkpoint
    with torch.device("meta"):
        lora_model = get_peft_model(AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(
            step / "actor" / "huggingface")), LoraConfig(r=8, target_modules="all-linear"))
    with pytest.raises(checkpoint.CheckpointError,
                       match=r"the checkpoint was trained with actor_rollout_ref\.model\.lora_rank=0 and this run "
                             r"has 8: set it to 0"):
        checkpoint.validate(step, 2, {"actor": checkpoint.param_layout(lora_model)})


@pytest.mark.parametrize("mode", ["resume_path", "auto"])
def test_other_world_size_is_refused_by_the_trainer_before_models_load(run_a, demo_dir, data_file, tmp_path, mode):
    """The model's weights file holds no weights here (a whole file, so the model-folder check passes it): a run
    that loaded its models before the check would fail on that instead."""
    from safetensors.torch import save_file
    model = tmp_path / "model"
    shutil.copytree(demo_dir / "model", model)
    save_file({}, model / "model.safetensors")
    step = run_a / "checkpoints" / "global_step_4"
    where = ([f"trainer.resume_from_path={step}"] if mode == "resume_path"
             else [f"trainer.default_local_dir={run_a / 'checkpoints'}"])
    result = run(torchrun_cmd(1, "minirl.py", "--config", ROOT / "config.yaml",
                              *run_overrides(demo_dir, data_file, tmp_path / "out", f"trainer.resume_mode={mode}",
                                             *where, f"actor_rollout_ref.model.path={model}")), expect_rc=1)
    assert "checkpoint error" in result.stderr and "written by 2 ranks and this run has 1" in result.stderr


def test_auto_never_picks_an_incomplete_checkpoint(ckpt_copy):
    # global_step_5 damaged, global_step_6 without a manifest (killed mid-save in another tool), and the staging
    # folder a killed minirl save leaves: auto takes global_step_4
    (ckpt_copy / "global_step_5" / "data.pt").write_bytes(b"")
    shutil.copytree(ckpt_copy / "global_step_4", ckpt_copy / "global_step_6")
    (ckpt_copy / "global_step_6" / "manifest.json").unlink()
    shutil.copytree(ckpt_copy / "global_step_4", ckpt_copy / "global_step_7.incomplete")
    assert checkpoint.latest(ckpt_copy) == ckpt_copy / "global_step_4"
    shutil.rmtree(ckpt_copy / "global_step_4")
    assert checkpoint.latest(ckpt_copy) is None                      # auto would start from scratch


def test_corrupt_shard_content_is_named(ckpt_copy):
    shard = ckpt_copy / "global_step_4" / "actor" / "model_world_size_2_rank_1.pt"
    shard.write_bytes(b"\0" * shard.stat().st_size)                 # right size, wrong bytes
    with pytest.raises(checkpoint.CheckpointError, match=r"model_world_size_2_rank_1\.pt is corrupted"):
        checkpoint.consolidate(ckpt_copy / "global_step_4")


def flip_bytes(path, count=64):
    """Invert `count` bytes in the middle of a file: same size, different content (what a bad disk does)."""
    data = bytearray(path.read_bytes())
    middle = len(data) // 2
    data[middle:middle + count] = bytes(255 - b for b in data[middle:middle + count])
    path.write_bytes(bytes(data))


@pytest.mark.parametrize("name", ["actor/model_world_size_2_rank_1.pt", "actor/optim_world_size_2_rank_0.pt",
                                  "actor/extra_state_world_size_2_rank_1.pt", "data.pt", "trainer_state.json",
                                  "actor/huggingface/config.json"])
def test_same_size_damage_to_any_file_is_caught(ckpt_copy, name):
    step = ckpt_copy / "global_step_4"
    assert checkpoint.problems(step) is None
    flip_bytes(step / name)
    assert checkpoint.problems(step) == f"{step / name} is corrupted: its bytes do not match the manifest's " \
                                        f"blake2b checksum"
    assert checkpoint.problems(step, checksums=False) is None       # what a size-only manifest let through


@pytest.mark.parametrize("garbage, reason", [
    (b"\x00\xff\xfe garbage", "UnicodeDecodeError"), (b"{\"files\": ", "JSONDecodeError"), (b"[1, 2]", "TypeError"),
    (b'{"format": 2, "global_step": 4, "world_size": 2, "roles": {}, "files": {"data.pt": "big"}}', "ValueError"),
])
def test_garbage_manifest_is_named(ckpt_copy, garbage, reason):
    step = ckpt_copy / "global_step_4"
    (step / "manifest.json").write_bytes(garbage)
    assert checkpoint.problems(step).startswith(f"{step / 'manifest.json'} is unreadable ({reason}")


def test_a_manifest_must_list_what_a_resume_needs(ckpt_copy):
    step = ckpt_copy / "global_step_4"
    manifest = json.loads((step / "manifest.json").read_text())
    del manifest["files"]["actor/model_world_size_2_rank_1.pt"]
    (step / "manifest.json").write_text(json.dumps(manifest))
    assert "does not list ['actor/model_world_size_2_rank_1.pt']" in checkpoint.problems(step)


def resume_cfg(*overrides):
    from config import load_config
    return load_config(ROOT / "config.yaml", list(overrides), check_paths=False)


def test_resume_path_errors_are_clear(ckpt_copy):
    for path, message in ((ckpt_copy / "global_step_9", "does not exist: trainer.resume_from_path must name"),
                          (ckpt_copy, "is not a checkpoint folder")):
        cfg = resume_cfg("trainer.resume_mode=resume_path", f"trainer.resume_from_path={path}")
        with pytest.raises(checkpoint.CheckpointError, match=message):
            checkpoint.resume(cfg, roles={}, loader=None)
    flip_bytes(ckpt_copy / "global_step_4" / "data.pt")
    cfg = resume_cfg("trainer.resume_mode=resume_path", f"trainer.resume_from_path={ckpt_copy / 'global_step_4'}")
    with pytest.raises(checkpoint.CheckpointError, match=r"global_step_4' is incomplete: .*data\.pt is corrupted"):
        checkpoint.resume(cfg, roles={}, loader=None)


def damaged_copy_of(run_dir, tmp_path):
    """run A's whole output folder (checkpoints global_step_4 and _5, metrics.jsonl), copied to damage."""
    out = tmp_path / "run"
    shutil.copytree(run_dir, out, ignore=shutil.ignore_patterns("tensorboard", "vllm"))
    return out


def test_auto_resume_falls_back_past_a_silently_corrupted_checkpoint(run_a, demo_dir, data_file, tmp_path):
    """The issue's case: 64 bytes flipped inside the newest model shard (same size), garbage in
    latest_checkpointed_iteration.txt and a partial last line in metrics.jsonl (a crash during the append). The
    rerun says what it skipped, resumes from global_step_4 and trains step 5 exactly as the uninterrupted run."""
    out = damaged_copy_of(run_a, tmp_path)
    flip_bytes(out / "checkpoints" / "global_step_5" / "actor" / "model_world_size_2_rank_0.pt")
    (out / "checkpoints" / "latest_checkpointed_iteration.txt").write_text("5\x00garbage")
    with open(out / "metrics.jsonl", "a") as metrics:
        metrics.write('{"step": 6, "critic/sco')
    result = train(demo_dir, data_file, out)
    log = result.stderr
    assert "skipping damaged or incomplete checkpoint" in log and "model_world_size_2_rank_0.pt is corrupted" in log
    assert "latest_checkpointed_iteration.txt holds '5\\x00garbage', not a step number; ignored" in log
    assert f"falling back to the newest intact checkpoint, {out / 'checkpoints' / 'global_step_4'}" in log
    assert "metrics.jsonl, line 6: not a complete metrics row" in log
    assert metric_rows(out / "metrics.jsonl") == metric_rows(run_a / "metrics.jsonl")
    assert checkpoint.problems(out / "checkpoints" / "global_step_5") is None      # saved again, intact


def test_auto_resume_stops_when_no_checkpoint_is_intact(run_a, demo_dir, data_file, tmp_path):
    out = damaged_copy_of(run_a, tmp_path)
    flip_bytes(out / "checkpoints" / "global_step_5" / "actor" / "model_world_size_2_rank_1.pt")
    (out / "checkpoints" / "global_step_4" / "trainer_state.json").write_text("{not json")
    metrics_before = (out / "metrics.jsonl").read_text()
    result = train(demo_dir, data_file, out, expect_rc=1)
    message = "checkpoint error: trainer.resume_mode=auto found checkpoints in"
    # said once by the first rank to fail (torchrun's Root Cause block repeats it after "traceback : ")
    assert times_said(result.stderr, message) == 1, result.stderr[-3000:]
    assert "none is intact (global_step_5, global_step_4;" in result.stderr
    assert "trainer.resume_mode=disable" in result.stderr
    assert (out / "metrics.jsonl").read_text() == metrics_before       # the old rows are kept
    assert not (out / "checkpoints" / "global_step_1").exists()          # and nothing started over


def test_rng_state_round_trips():
    import random

    import numpy as np
    state = checkpoint.rng_state()
    expected = (random.random(), float(np.random.rand()), float(torch.rand(1)))
    random.random(), np.random.rand(), torch.rand(1)                 # move every generator on
    checkpoint.set_rng_state(state)
    assert (random.random(), float(np.random.rand()), float(torch.rand(1))) == expected


def test_resume_mode_disable_ignores_existing_checkpoints(run_a, demo_dir, data_file, tmp_path):
    """A real run in run A's output folder (checkpoints up to global_step_5, metrics of steps 1-5) with
    resume_mode=disable trains from the demo model at step 1: its metrics are run A's first two rows."""
    shutil.copytree(run_a, tmp_path, dirs_exist_ok=True)
    result = train(demo_dir, data_file, tmp_path, "trainer.resume_mode=disable", "trainer.total_training_steps=2",
                   "trainer.max_actor_ckpt_to_keep=null")           # keep=2 would prune the new step 2 behind 4, 5
    assert "resumed from" not in result.stdout + result.stderr
    rows = metric_rows(tmp_path / "metrics.jsonl")
    assert [r["step"] for r in rows] == [1, 2]                       # run A's rows were dropped, not appended to
    assert rows == metric_rows(run_a / "metrics.jsonl")[:2]          # started from the demo model, not step 5's
    root = tmp_path / "checkpoints"
    assert (root / "latest_checkpointed_iteration.txt").read_text() == "2"
    step2 = root / "global_step_2"
    assert json.loads((step2 / "trainer_state.json").read_text())["global_step"] == 2
    data = torch.load(step2 / "data.pt")
    assert (data["epoch"], data["batches_done_in_epoch"]) == (0, 2)  # step 5's loader was at (2, 1)
    assert sorted(p.name for p in root.glob("global_step_*")) == ["global_step_2", "global_step_4", "global_step_5"]
