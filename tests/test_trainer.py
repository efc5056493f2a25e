"""The GRPO trainer end to end on the tiny model (real torchrun, gloo, FSDP2, HF rollout), and the oracle
promise: one update on a fixed batch gives the same gradients and weights whatever the micro-batching, world
size, remove-padding, dynamic batch size or gradient checkpointing."""
import json
import re

import numpy as np
import psutil
import pyarrow.parquet as pq
import pytest
import torch
from transformers import AutoModelForCausalLM

from conftest import padded_batch
from launch import ROOT, torchrun
from test_logging import verl_validation_metrics


# ---------------------------------------------------------------------------------------------------------------
# End to end


@pytest.fixture(scope="module")
def e2e_run(demo_dir, tmp_path_factory):
    """Three GRPO steps on 2 ranks with validation, tensorboard, wandb (offline) and the KL loss (so a reference is
    built)."""
    out = tmp_path_factory.mktemp("e2e")
    run = torchrun(2, "minirl.py", "--config", ROOT / "config.yaml",
                   f"actor_rollout_ref.model.path={demo_dir}/model", f"data.train_files={demo_dir}/data/train.parquet",
                   f"data.val_files={demo_dir}/data/test.parquet", f"af_output_dir={out}",
                   "trainer.total_training_steps=3", "trainer.test_freq=3", "trainer.save_freq=-1",
                   "trainer.logger=[console,tensorboard,wandb]", "trainer.log_val_generations=3",
                   "data.train_batch_size=4",
                   "actor_rollout_ref.actor.ppo_mini_batch_size=2", "actor_rollout_ref.rollout.n=4",
                   "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=2", "actor_rollout_ref.actor.optim.lr=1e-3",
                   f"trainer.rollout_data_dir={out}/rollouts", f"trainer.validation_data_dir={out}/validation")
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    return {"dir": out, "rows": rows, "stdout": run.stdout, "demo": demo_dir}


VERL_NAMES = ["critic/score/mean", "critic/rewards/mean", "critic/advantages/mean", "critic/returns/mean",
              "response_length/mean", "response_length/clip_ratio", "prompt_length/mean", "actor/pg_loss",
              "actor/kl_loss", "actor/entropy", "actor/grad_norm", "actor/lr", "actor/pg_clipfrac", "actor/ppo_kl",
              "timing_s/gen", "timing_s/reward", "timing_s/old_log_prob", "timing_s/ref", "timing_s/adv",
              "timing_s/update_actor", "timing_s/step", "perf/throughput", "perf/total_num_tokens",
              "training/global_step", "global_seqlen/mean", "perf/cpu_memory_used_gb"]


def test_metrics_jsonl_has_verl_names_per_step(e2e_run):
    rows = e2e_run["rows"]
    assert [r["step"] for r in rows] == [0, 1, 2, 3]            # validation before training, then 3 steps
    assert "val-core/minirl/add/reward/mean@1" in rows[0]
    for row in rows[1:]:
        missing = [name for name in VERL_NAMES if name not in row]
        assert not missing, missing
    assert "val-core/minirl/add/reward/mean@1" in rows[3]       # test_freq=3: validated at the last step
    assert all(0.0 <= r["critic/score/mean"] <= 1.0 for r in rows[1:])
    host_gb = psutil.virtual_memory().total / 2**30                   # in GiB, as verl: below the host's total
    assert all(0.0 < r["perf/cpu_memory_used_gb"] < host_gb for r in rows[1:])
    assert not any("perf/max_memory_allocated_gb" in r for r in rows)  # a device peak only where there is a device


def test_tensorboard_events_read_back(e2e_run):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    acc = EventAccumulator(str(e2e_run["dir"] / "tensorboard"))
    acc.Reload()
    scalars = acc.Tags()["scalars"]
    assert "actor/pg_loss" in scalars and "critic/score/mean" in scalars
    logged = [event.value for event in acc.Scalars("critic/score/mean")]
    expected = [r["critic/score/mean"] for r in e2e_run["rows"][1:]]
    assert logged == pytest.approx(expected, rel=1e-6)


def test_a_few_validation_generations_go_to_tensorboard_and_wandb(e2e_run):
    """trainer.log_val_generations=3: verl's pick (sorted by input, shuffled by numpy's RandomState(42), the first 3),
    written out here and applied to the validation dump, as TensorBoard text at each validation and as wandb's table
    val/generations, one row per validation so far."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    picked = {}
    for step in (0, 3):
        dump = e2e_run["dir"] / "validation" / f"{step}.jsonl"
        lines = [json.loads(line) for line in dump.read_text().splitlines()]
        samples = sorted(((line["input"], line["output"], line["score"]) for line in lines), key=lambda s: s[0])
        np.random.RandomState(42).shuffle(samples)
        picked[step] = samples[:3]
    acc = EventAccumulator(str(e2e_run["dir"] / "tensorboard"), size_guidance={"tensors": 0})
    acc.Reload()
    texts = {event.step: event.tensor_proto.string_val[0].decode()
             for event in acc.Tensors("val/generations/text_summary")}
    assert sorted(texts) == [0, 3]
    for step, samples in picked.items():
        for number, (prompt, response, score) in enumerate(samples, 1):
            assert (f"### Sample {number}\n**Input:** {prompt}\n\n**Output:** {response}\n\n**Score:** {score}\n"
                    in texts[step]), (step, number)
    tables = [json.loads(path.read_text()) for path in
              (e2e_run["dir"] / "wandb").glob("offline-run-*/files/media/table/val/generations_*.table.json")]
    assert sorted(len(table["data"]) for table in tables) == [1, 2]           # one table per validation
    table = max(tables, key=lambda table: len(table["data"]))
    assert table["columns"] == ["step", "input_1", "output_1", "score_1", "input_2", "output_2", "score_2",
                                "input_3", "output_3", "score_3"]
    assert table["data"] == [[step] + [value for sample in picked[step] for value in sample] for step in (0, 3)]


def test_generation_dumps_hold_each_response_with_its_score(e2e_run):
    """trainer.rollout_data_dir / validation_data_dir: <step>.jsonl with input, output, score; each score agrees
    with the demo rule applied here to the dumped text (1.0 right '#### a+b', 0.1 other number, 0 none)."""
    for folder, steps, rows in (("rollouts", [1, 2, 3], 16), ("validation", [0, 3], 100)):
        assert sorted(int(p.stem) for p in (e2e_run["dir"] / folder).glob("*.jsonl")) == steps
        for step in steps:
            lines = [json.loads(line) for line in (e2e_run["dir"] / folder / f"{step}.jsonl").read_text().splitlines()]
            assert len(lines) == rows and all(line["step"] == step for line in lines)
            for line in lines:
                a, b = map(int, re.search(r"What is (\d) \+ (\d)\?", line["input"]).groups())
                answers = re.findall(r"#### (\-?[0-9\.\,]+)", line["output"])
                expected = 0.0 if not answers else (1.0 if answers[-1] == str(a + b) else 0.1)
                assert line["score"] == pytest.approx(expected), line


REWARD_RETURNING_A_DICT = """
import numpy as np

def compute_score(data_source, solution_str, ground_truth, extra_info=None, **kwargs):
    right = ("#### " + ground_truth) in solution_str
    return {"score": 0.5 + 0.5 * right, "acc": right, "chars": np.int64(len(solution_str)),
            "pred": solution_str.split("####")[-1].strip()}
"""


def test_a_reward_functions_dict_results_reach_validation_metrics_and_dumps(demo_dir, tmp_path):
    """verl's reward_extra_info: a custom compute_score returning {"score", "acc", ...} makes acc the core
    validation variable (val-core/<source>/acc/..., the reward's in val-aux), its other numbers val-aux
    variables, and every key a field of the dumped lines. Checked against the dumped texts, scored here."""
    reward_file = tmp_path / "reward.py"
    reward_file.write_text(REWARD_RETURNING_A_DICT)
    val = tmp_path / "val.parquet"
    pq.write_table(pq.read_table(demo_dir / "data" / "test.parquet").slice(0, 6), val)
    out = tmp_path / "out"
    torchrun(2, "minirl.py", "--config", ROOT / "config.yaml", f"actor_rollout_ref.model.path={demo_dir}/model",
             f"data.train_files={demo_dir}/data/train.parquet", f"data.val_files={val}", f"af_output_dir={out}",
             f"custom_reward_function.path={reward_file}", "trainer.total_training_steps=1", "trainer.test_freq=-1",
             "data.train_batch_size=4", "actor_rollout_ref.actor.ppo_mini_batch_size=4",
             "actor_rollout_ref.rollout.n=2", "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=4",
             "actor_rollout_ref.rollout.val_kwargs.n=4", "actor_rollout_ref.rollout.val_kwargs.do_sample=true",
             "actor_rollout_ref.rollout.val_kwargs.temperature=1",
             f"trainer.rollout_data_dir={out}/rollouts", f"trainer.validation_data_dir={out}/validation")
    row = json.loads((out / "metrics.jsonl").read_text().splitlines()[0])
    lines = [json.loads(line) for line in (out / "validation" / "0.jsonl").read_text().splitlines()]
    assert len(lines) == 6 * 4
    for line in lines:
        a, b = map(int, re.search(r"What is (\d) \+ (\d)\?", line["input"]).groups())
        right = f"#### {a + b}" in line["output"]
        assert (line["acc"], line["score"], line["chars"]) == (right, 0.5 + 0.5 * right, len(line["output"]))
        assert line["pred"] == line["output"].split("####")[-1].strip()
    acc = [float(line["acc"]) for line in lines]                              # a prompt's 4 responses in a row
    expected = verl_validation_metrics({"acc": acc}, ["minirl/add"] * 24, 4, [line["pred"] for line in lines],
                                       core="acc")
    assert row["val-core/minirl/add/acc/mean@4"] == pytest.approx(sum(acc) / 24)
    for name in ("val-core/minirl/add/acc/best@4/mean", "val-core/minirl/add/acc/maj@4/mean",
                 "val-aux/minirl/add/acc/maj@2/std", "val-aux/minirl/add/acc/worst@4/mean"):
        assert row[name] == pytest.approx(expected[name]), name
    assert row["val-aux/minirl/add/reward/mean@4"] == pytest.approx(sum(line["score"] for line in lines) / 24)
    assert row["val-aux/minirl/add/score/mean@4"] == row["val-aux/minirl/add/reward/mean@4"]   # verl's, as "score"
    assert row["val-aux/minirl/add/chars/mean@4"] == pytest.approx(sum(line["chars"] for line in lines) / 24)
    assert not any(key.startswith("val-core/minirl/add/reward") or "/pred/" in key for key in row)
    rollouts = [json.loads(line) for line in (out / "rollouts" / "1.jsonl").read_text().splitlines()]
    assert len(rollouts) == 8 and all(line["acc"] == (line["score"] == 1.0) for line in rollouts)


BATCH_REWARD = """
import json
import os


def compute_score(data_sources, solution_strs, ground_truths, extra_infos, bonus, calls_file):
    # each response's score: the share of the batch's responses shorter than it, plus a bonus: the same response
    # scores differently in another batch, so a call per rank would give other scores than one call for the batch
    with open(calls_file, "a") as calls:
        calls.write(json.dumps([os.environ["RANK"], len(solution_strs)]) + "\\n")
    n = len(solution_strs)
    return [sum(len(other) < len(s) for other in solution_strs) / n + bonus for s in solution_strs]
"""


def test_batch_reward_manager_scores_the_whole_batch_in_one_call(demo_dir, tmp_path):
    """reward_model.reward_manager=batch (verl's BatchRewardManager): the custom function gets the step's 8
    responses (2 ranks x 4) in one call with reward_model.reward_kwargs as keywords, on rank 0; each dumped score
    equals the rule applied here to the step's dumped responses as one batch."""
    reward_file = tmp_path / "reward.py"
    reward_file.write_text(BATCH_REWARD)
    out, calls = tmp_path / "out", tmp_path / "calls.jsonl"
    torchrun(2, "minirl.py", "--config", ROOT / "config.yaml", f"actor_rollout_ref.model.path={demo_dir}/model",
             f"data.train_files={demo_dir}/data/train.parquet", "data.val_files=null", f"af_output_dir={out}",
             f"custom_reward_function.path={reward_file}", "trainer.total_training_steps=2",
             "data.train_batch_size=4", "actor_rollout_ref.actor.ppo_mini_batch_size=4",
             "actor_rollout_ref.rollout.n=2", "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=4",
             "actor_rollout_ref.rollout.temperature=1.5", "reward_model.reward_manager=batch",
             "+reward_model.reward_kwargs.bonus=0.25", f"+reward_model.reward_kwargs.calls_file={calls}",
             f"trainer.rollout_data_dir={out}/rollouts")
    assert [json.loads(line) for line in calls.read_text().splitlines()] == [["0", 8], ["0", 8]]
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    for row in rows:
        lines = [json.loads(line) for line in (out / "rollouts" / f"{row['step']}.jsonl").read_text().splitlines()]
        lengths = [len(line["output"]) for line in lines]
        for line, length in zip(lines, lengths):
            assert line["score"] == pytest.approx(sum(other < length for other in lengths) / 8 + 0.25)
        assert row["critic/score/mean"] == pytest.approx(sum(line["score"] for line in lines) / 8, rel=1e-6)


PRIME_REWARD = """
def compute_score(data_source, solution_str, ground_truth, extra_info=None):
    if "####" not in solution_str:
        raise ValueError("no answer to run")
    return 1.0
"""


def test_prime_reward_manager_scores_in_a_process_pool_and_zeroes_failures(demo_dir, tmp_path):
    """reward_model.reward_manager=prime (verl's PrimeRewardManager) in a real 2-rank run: the function runs in
    processes forked from the trainer; a response it raises on scores 0.0 (one warning each) instead of stopping
    the run, the others score as the function says."""
    reward_file = tmp_path / "reward.py"
    reward_file.write_text(PRIME_REWARD)
    out = tmp_path / "out"
    run = torchrun(2, "minirl.py", "--config", ROOT / "config.yaml", f"actor_rollout_ref.model.path={demo_dir}/model",
                   f"data.train_files={demo_dir}/data/train.parquet", "data.val_files=null", f"af_output_dir={out}",
                   f"custom_reward_function.path={reward_file}", "trainer.total_training_steps=2",
                   "data.train_batch_size=4", "actor_rollout_ref.actor.ppo_mini_batch_size=4",
                   "actor_rollout_ref.rollout.n=4", "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=8",
                   "actor_rollout_ref.rollout.temperature=2.0", "reward_model.reward_manager=prime",
                   f"trainer.rollout_data_dir={out}/rollouts")
    lines = [json.loads(line) for step in (1, 2)
             for line in (out / "rollouts" / f"{step}.jsonl").read_text().splitlines()]
    assert len(lines) == 32
    assert [line["score"] for line in lines] == [float("####" in line["output"]) for line in lines]
    failed = sum("####" not in line["output"] for line in lines)
    assert failed and run.stderr.count("(reward_manager=prime) raised ValueError: no answer to run") == failed


BUFFER_KEYS = ("enable", "len", "penalty_factor", "log")
DAPO_FORMS = {  # the same buffer as verl's main_ppo reads it and as DAPO's recipe (main_dapo) does
    "reward_kwargs": [f"+reward_model.reward_kwargs.overlong_buffer_cfg.{key}" for key in BUFFER_KEYS]
    + ["+reward_model.reward_kwargs.max_resp_len=16"],
    "recipe": [f"reward_model.overlong_buffer.{key}" for key in BUFFER_KEYS]}


@pytest.mark.parametrize("form", DAPO_FORMS)
def test_dapo_reward_manager_adds_the_overlong_penalty_to_every_score(demo_dir, tmp_path, form):
    """verl's DAPORewardManager (reward_model.reward_manager=dapo, its arguments under reward_model.reward_kwargs
    as main_ppo's DAPO scripts pass them, or under reward_model.overlong_buffer as the recipe's): responses longer
    than max_resp_len - len lose (L - (max_resp_len - len)) / len x penalty_factor. Here max_resp_len 16, len 16,
    factor 2: every response loses L/8. Each dumped score is the reward function's score of the dumped text (the
    dict's "score", which replaces the penalised one in verl's dump too), the penalties lie on the ramp, the step's
    critic/score/mean is the batch mean of score + penalty, and validation logs overlong_reward as a variable."""
    reward_file = tmp_path / "reward.py"
    reward_file.write_text(REWARD_RETURNING_A_DICT)
    out = tmp_path / "out"
    enable, length, factor, log, *max_resp_len = DAPO_FORMS[form]     # the recipe's is data.max_response_length=16
    torchrun(2, "minirl.py", "--config", ROOT / "config.yaml", f"actor_rollout_ref.model.path={demo_dir}/model",
             f"data.train_files={demo_dir}/data/train.parquet", f"data.val_files={demo_dir}/data/test.parquet",
             f"af_output_dir={out}", f"custom_reward_function.path={reward_file}", "trainer.total_training_steps=1",
             "trainer.val_before_train=false", "data.train_batch_size=4",
             "actor_rollout_ref.actor.ppo_mini_batch_size=4",
             "actor_rollout_ref.rollout.n=2", "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=4",
             "actor_rollout_ref.rollout.temperature=1.5", "reward_model.reward_manager=dapo",
             f"{enable}=true", f"{length}=16", f"{factor}=2.0", f"{log}=true", *max_resp_len,
             f"trainer.rollout_data_dir={out}/rollouts")
    row = json.loads((out / "metrics.jsonl").read_text().splitlines()[0])
    rollouts = [json.loads(line) for line in (out / "rollouts" / "1.jsonl").read_text().splitlines()]
    assert len(rollouts) == 8
    for line in rollouts:
        a, b = map(int, re.search(r"What is (\d) \+ (\d)\?", line["input"]).groups())
        base = 0.5 + 0.5 * (f"#### {a + b}" in line["output"])
        length = -8 * line["overlong_reward"]                   # the length the penalty was computed from
        assert line["overlong"] is True and length == pytest.approx(round(length)) and 1 <= round(length) <= 16
        assert line["score"] == base
    penalised = [line["score"] + line["overlong_reward"] for line in rollouts]
    assert row["critic/score/mean"] == pytest.approx(sum(penalised) / 8, rel=1e-6)
    assert row["response_length/mean"] == pytest.approx(sum(-8 * line["overlong_reward"] for line in rollouts) / 8)
    assert "val-aux/minirl/add/overlong_reward/mean@1" in row and "val-aux/minirl/add/overlong/mean@1" in row


def test_rank0_alone_logs(e2e_run):
    assert e2e_run["stdout"].count("step 1:") == 1


@pytest.mark.parametrize("nproc", [1, 2])
def test_actor_trains_and_reference_stays_frozen(demo_dir, tmp_path, nproc):
    """The real Trainer on N ranks: every actor parameter moves, the reference (a copy of the initial actor)
    does not."""
    report_path = tmp_path / "report.json"
    torchrun(nproc, "tests/trainer_probe.py", report_path, f"actor_rollout_ref.model.path={demo_dir}/model",
             f"data.train_files={demo_dir}/data/train.parquet", f"data.val_files={demo_dir}/data/test.parquet",
             f"af_output_dir={tmp_path}", "trainer.total_training_steps=2", "trainer.val_before_train=false",
             "trainer.test_freq=-1", "data.train_batch_size=4", "actor_rollout_ref.actor.ppo_mini_batch_size=4",
             "actor_rollout_ref.rollout.n=2", "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=4")
    report = json.loads(report_path.read_text())
    assert report["world_size"] == nproc and report["steps"] == 2
    assert report["ref_equals_initial_actor"]
    assert report["ref_changed"] == []
    assert report["actor_changed"] == report["actor_names"]


def test_skipping_the_old_log_prob_pass_changes_no_metric(demo_dir, tmp_path):
    """One epoch and one mini-batch per step: the update's own log-probs stand in for the old log-probs. A seeded
    2-rank run logs the same metrics (fp32 rounding) as one that recomputes them in a separate pass, minus that
    pass's timing."""
    rows = {}
    for mode in ("skip", "recompute"):
        torchrun(2, "tests/on_policy_probe.py", mode, f"actor_rollout_ref.model.path={demo_dir}/model",
                 f"data.train_files={demo_dir}/data/train.parquet", f"data.val_files={demo_dir}/data/test.parquet",
                 f"af_output_dir={tmp_path / mode}", "trainer.total_training_steps=2", "trainer.val_before_train=false",
                 "trainer.test_freq=-1", "data.train_batch_size=4", "actor_rollout_ref.actor.ppo_mini_batch_size=4",
                 "actor_rollout_ref.rollout.n=4", "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=2",
                 "actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu=8")
        rows[mode] = [json.loads(line) for line in (tmp_path / mode / "metrics.jsonl").read_text().splitlines()]
    assert len(rows["skip"]) == len(rows["recompute"]) == 2
    for skip, recompute in zip(rows["skip"], rows["recompute"]):
        assert "timing_s/old_log_prob" in recompute and "timing_s/old_log_prob" not in skip
        timing = ("timing_s/", "timing_per_token_ms/", "perf/")
        compared = sorted(k for k in recompute if not k.startswith(timing))
        assert sorted(k for k in skip if not k.startswith(timing)) == compared
        for key in compared:
            assert skip[key] == pytest.approx(recompute[key], rel=1e-5, abs=1e-6), key
        assert abs(recompute["actor/ppo_kl"]) < 1e-6 and skip["actor/ppo_kl"] == 0.0     # on policy: ratio 1
        # the actor update's FLOPs over its seconds against the made-up peak, 2 ranks
        assert 0 < skip["perf/mfu/actor"] < 1 and 0 < recompute["perf/mfu/actor"] < 1


def test_packed_rows_holding_each_prompt_once_train_as_the_padded_run_does(demo_dir, tmp_path):
    """The demo config (two mini-batches a step: old-log-prob, reference and update passes) on 2 ranks, packed
    (use_remove_padding, the default: on CPU each group's prompt is packed once for its responses) vs padded, with
    balance_batch off so both runs put the same rows in each micro-batch: the same responses are sampled and every
    metric agrees to fp32 rounding over 3 steps, so each step's update moved the weights alike."""
    rows = {}
    for mode in ("true", "false"):
        torchrun(2, "minirl.py", "--config", ROOT / "config.yaml", f"actor_rollout_ref.model.path={demo_dir}/model",
                 f"data.train_files={demo_dir}/data/train.parquet", f"data.val_files={demo_dir}/data/test.parquet",
                 f"af_output_dir={tmp_path / mode}", "trainer.total_training_steps=3", "trainer.val_before_train=false",
                 "trainer.test_freq=-1", "trainer.save_freq=-1", "trainer.balance_batch=false",
                 "actor_rollout_ref.rollout.name=hf", f"actor_rollout_ref.model.use_remove_padding={mode}")
        rows[mode] = [json.loads(line) for line in (tmp_path / mode / "metrics.jsonl").read_text().splitlines()]
    assert len(rows["true"]) == len(rows["false"]) == 3
    for packed, padded in zip(rows["true"], rows["false"]):
        compared = sorted(k for k in padded if not k.startswith(("timing_s/", "timing_per_token_ms/", "perf/")))
        assert {"actor/entropy", "actor/pg_loss", "actor/ppo_kl", "critic/score/mean"} <= set(compared)
        for key in compared:
            assert packed[key] == pytest.approx(padded[key], rel=1e-3, abs=1e-6), key


@pytest.mark.parametrize("overrides, message", [
    (["data.train_batch_size=3", "actor_rollout_ref.rollout.n=3"], "3*3 = 9 responses must be divisible by the world size 2"),
    (["actor_rollout_ref.actor.kl_loss_type=k4"], "'actor_rollout_ref.actor.kl_loss_type' is 'k4'"),
    (["data.max_prompt_length=8"], "row 0: the templated prompt is"),
])
def test_bad_input_is_a_clear_error_before_training(demo_dir, tmp_path, overrides, message):
    """Under torchrun, on 2 ranks: the run stops before any step, with the key (or file and row) named."""
    out = torchrun(2, "minirl.py", "--config", ROOT / "config.yaml", f"actor_rollout_ref.model.path={demo_dir}/model",
                   f"data.train_files={demo_dir}/data/train.parquet", f"data.val_files={demo_dir}/data/test.parquet",
                   f"af_output_dir={tmp_path}", *overrides, expect_ok=False)
    assert out.returncode != 0
    assert message in out.stderr
    assert not (tmp_path / "metrics.jsonl").exists()


def test_a_reward_function_name_the_file_lacks_is_a_config_error_without_a_traceback(demo_dir, tmp_path):
    """custom_reward_function.name naming no function of its file: one line naming both and what the file holds,
    exit code 2 (torchrun's report says it), before any model loads (it was an AttributeError with minirl's
    traceback)."""
    reward = tmp_path / "reward.py"
    reward.write_text("def my_score(data_source, solution_str, ground_truth, extra_info=None):\n    return 0.0\n")
    out = torchrun(2, "minirl.py", "--config", ROOT / "config.yaml", f"actor_rollout_ref.model.path={demo_dir}/model",
                   f"data.train_files={demo_dir}/data/train.parquet", "data.val_files=null",
                   f"af_output_dir={tmp_path / 'out'}", f"custom_reward_function.path={reward}",
                   "custom_reward_function.name=nope", expect_ok=False)
    assert out.returncode != 0 and "(exitcode: 2)" in out.stderr, out.stderr[-3000:]
    assert (f"config error: custom_reward_function.name='nope' is not a function in '{reward}'; functions there: "
            f"['my_score']") in out.stderr
    assert not re.search(r'(minirl|rewards)\.py", line', out.stderr), out.stderr[-3000:]   # torchrun's own only


# ---------------------------------------------------------------------------------------------------------------
# The oracle promise: one update on a fixed batch


VARIANTS = {
    "base": "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=8,actor_rollout_ref.model.use_remove_padding=true",
    "micro1": "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=1",
    "micro4": "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=4",
    "padded": "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=4,actor_rollout_ref.model.use_remove_padding=false",
    "dynamic": "actor_rollout_ref.actor.use_dynamic_bsz=true,actor_rollout_ref.actor.ppo_max_token_len_per_gpu=16",
    "checkpointing": "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=2,"
                     "actor_rollout_ref.model.enable_gradient_checkpointing=true",
    "compiled": "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=8,actor_rollout_ref.actor.use_torch_compile=true",
    "entropy_chunks": "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=8,"
                      "actor_rollout_ref.actor.entropy_from_logits_with_chunking=true",
}


OTHER_POLICY_LOSSES = {   # on 2 ranks, 2 micro-batches each: the hand-written losses below are over the whole batch
    "gspo": "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=2,actor_rollout_ref.actor.policy_loss.loss_mode=gspo,"
            "actor_rollout_ref.actor.loss_agg_mode=seq-mean-token-mean",
    "gpg": "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=2,actor_rollout_ref.actor.policy_loss.loss_mode=gpg",
    # one micro-batch per rank: kl_cov's and clip_cov's token choice is over each rank's 4 rows
    "kl_cov": ",".join(["actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=4"] + [
        f"actor_rollout_ref.actor.policy_loss.{option}" for option in ("loss_mode=kl_cov", "kl_cov_ratio=0.2",
                                                                       "ppo_kl_coef=1.0")]),
    "clip_cov": ",".join(["actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=4"] + [
        f"actor_rollout_ref.actor.policy_loss.{option}" for option in ("loss_mode=clip_cov", "clip_cov_ratio=1.0",
                                                                       "clip_cov_lb=-1e9", "clip_cov_ub=1e9")]),
}


WORLD2_CHECKPOINTING = ("actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=2,"
                        "actor_rollout_ref.model.enable_gradient_checkpointing=true")      # 2 micro-batches per rank
TWO_STEPS = "actor_rollout_ref.actor.ppo_mini_batch_size=2,actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=1"
KEEP_GATHERED = "actor_rollout_ref.actor.fsdp_config.reshard_after_forward=false"


@pytest.fixture(scope="module")
def oracle_results(fixed_batch, tiny_model_dir, tmp_path_factory):
    out = tmp_path_factory.mktemp("oracle_out")
    variants = [f"{name}:{overrides}" for name, overrides in VARIANTS.items()]
    torchrun(1, "tests/oracle_step.py", fixed_batch, out / "w1.pt", tiny_model_dir, *variants)
    world2 = ["world2:actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=4",
              "world2_micro1:actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=1",
              # verl's deprecated global micro-batch: 2 over 2 ranks, 1 per rank
              "world2_deprecated_micro:actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=null,"
              "actor_rollout_ref.actor.ppo_micro_batch_size=2",
              "world2_dynamic:actor_rollout_ref.actor.use_dynamic_bsz=true,"
              "actor_rollout_ref.actor.ppo_max_token_len_per_gpu=16",
              f"world2_checkpointing:{WORLD2_CHECKPOINTING}",
              f"world2_gathered:{WORLD2_CHECKPOINTING},{KEEP_GATHERED}",
              f"world2_two_steps:{TWO_STEPS}", f"world2_two_steps_gathered:{TWO_STEPS},{KEEP_GATHERED}",
              *(f"world2_{name}:{overrides}" for name, overrides in OTHER_POLICY_LOSSES.items())]
    torchrun(2, "tests/oracle_step.py", fixed_batch, out / "w2.pt", tiny_model_dir, *world2)
    return {**torch.load(out / "w1.pt"), **torch.load(out / "w2.pt")}


@pytest.mark.parametrize("variant", [v for v in VARIANTS if v != "base"] + ["world2", "world2_micro1", "world2_dynamic",
                                                                              "world2_checkpointing", "world2_gathered",
                                                                              "world2_deprecated_micro"])
def test_one_update_is_independent_of_batching(oracle_results, variant, tiny_model_dir):
    base, other = oracle_results["base"], oracle_results[variant]
    initial = dict(AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32).named_parameters())
    for name, grad in base["grads"].items():
        assert torch.allclose(other["grads"][name], grad, atol=1e-6, rtol=1e-4), f"{variant}: grad of {name}"
        # AdamW's first step is lr * g / (|g| + eps): where |g| is at round-off level (unused embedding rows) its
        # sign, and so the weight, is noise; everywhere else the weights must agree to fp32 precision.
        signal = grad.abs() > 1e-6
        assert torch.allclose(other["weights"][name][signal], base["weights"][name][signal], atol=1e-6), \
            f"{variant}: weights of {name}"
        assert (other["weights"][name] - base["weights"][name]).abs().max() <= 2 * 1e-3 + 1e-6
    moved = sum(int(not torch.equal(base["weights"][n], initial[n].detach())) for n in base["weights"])
    assert moved == len(base["weights"]), "every parameter should move after one AdamW step"
    assert other["metrics"]["actor/pg_loss"] == pytest.approx(base["metrics"]["actor/pg_loss"], rel=1e-4, abs=1e-6)
    assert other["metrics"]["actor/grad_norm"] == pytest.approx(base["metrics"]["actor/grad_norm"], rel=1e-4)


def test_verls_deprecated_global_micro_batch_is_split_over_the_ranks(oracle_results):
    """actor.ppo_micro_batch_size (verl's deprecated global key) = 2 on 2 ranks is 1 row per micro-batch, as
    ppo_micro_batch_size_per_gpu=1 (the update crashed on it before: only the _per_gpu key was read)."""
    micro_batches = 8 // 2                                  # 8 rows over 2 ranks, 1 per micro-batch
    assert oracle_results["world2_deprecated_micro"]["update_layer_calls"] == micro_batches
    assert oracle_results["world2_micro1"]["update_layer_calls"] == micro_batches


def test_gradient_checkpointing_recomputes_in_the_update(oracle_results):
    """enable_gradient_checkpointing must really recompute: each micro-batch's backward runs every decoder layer's
    forward a second time (transformers checkpoints only in train mode, so an update left in eval mode would not)."""
    micro_batches = 8 // 2                                  # 8 rows, ppo_micro_batch_size_per_gpu=2
    assert oracle_results["micro4"]["update_layer_calls"] == 8 // 4
    assert oracle_results["checkpointing"]["update_layer_calls"] == 2 * micro_batches


def test_reshard_after_forward_false_gathers_each_layer_once_per_mini_batch(oracle_results, tiny_model_dir):
    """verl's fsdp_config.reshard_after_forward: true gathers a layer's parameters for its forward and again for
    its backward, in every micro-batch; false keeps them gathered until the mini-batch's last backward: one
    all-gather per FSDP module (each decoder layer, and the root) and mini-batch. Results do not change
    (test_one_update_is_independent_of_batching)."""
    layers = AutoModelForCausalLM.from_pretrained(tiny_model_dir).config.num_hidden_layers
    micro_batches = 8 // 2 // 2                       # 8 rows over 2 ranks, 2 per micro-batch, one mini-batch
    assert oracle_results["world2_checkpointing"]["update_all_gathers"] >= 2 * layers * micro_batches
    assert oracle_results["world2_gathered"]["update_all_gathers"] == layers + 1


def test_on_cpu_reshard_after_forward_false_reduces_gradients_once_per_mini_batch(oracle_results, tiny_model_dir):
    """On CPU (gloo) with reshard_after_forward=false the gradients of a mini-batch add up unsharded and are
    reduce-scattered in its last backward: one reduce-scatter per FSDP module (each decoder layer, and the root)
    and mini-batch, where the default reduces after every micro-batch's backward. The gradients and weights are
    the single-process run's (test_one_update_is_independent_of_batching: world2_gathered), and a second
    mini-batch starts from zero gradients (test_parameters_kept_gathered_are_gathered_again_after_each_optimizer
    _step: world2_two_steps_gathered)."""
    modules = AutoModelForCausalLM.from_pretrained(tiny_model_dir).config.num_hidden_layers + 1
    micro_batches = 8 // 2 // 2                       # 8 rows over 2 ranks, 2 per micro-batch, one mini-batch
    assert oracle_results["world2_checkpointing"]["update_reduce_scatters"] == modules * micro_batches
    assert oracle_results["world2_gathered"]["update_reduce_scatters"] == modules
    mini_batches = 2                       # TWO_STEPS: 2 mini-batches of 2 rows a rank, 1 row per micro-batch
    assert oracle_results["world2_two_steps_gathered"]["update_reduce_scatters"] == modules * mini_batches


def test_parameters_kept_gathered_are_gathered_again_after_each_optimizer_step(oracle_results):
    """Two mini-batches (two optimizer steps), 2 micro-batches each: with reshard_after_forward=false the second
    mini-batch must run on the weights the first step wrote, not on the copies gathered before it."""
    regathered, kept = oracle_results["world2_two_steps"], oracle_results["world2_two_steps_gathered"]
    assert kept["update_all_gathers"] < regathered["update_all_gathers"]
    for name, weight in regathered["weights"].items():
        assert torch.allclose(kept["weights"][name], weight, atol=1e-6), name
        assert torch.allclose(kept["grads"][name], regathered["grads"][name], atol=1e-6, rtol=1e-4), name


def test_a_log_prob_pass_leaves_no_parameter_gathered(oracle_results):
    """A no-grad pass has no backward to free what its forwards gathered (FSDP2 keeps the root's, and with
    reshard_after_forward=false every layer's); models.frozen_pass frees them at its end, so a frozen reference
    model does not hold its embeddings and LM head, unsharded, through generation."""
    for name, result in oracle_results.items():
        assert result["gathered_after_log_prob"] == [], name


def hand_written_policy_loss(mode, logp, old_logp, A, mask):
    """The per-token policy loss of each loss_mode, written out here: vanilla dual-clip PPO (clip 0.2, dual clip 3),
    GSPO (one clipped ratio per sequence, the geometric mean of its tokens', carrying each token's gradient), GPG."""
    if mode == "gpg":
        return -logp * A
    ratio = torch.exp(logp - old_logp)
    if mode in ("kl_cov", "clip_cov"):         # each rank's 4 rows (one micro-batch) choose their own tokens
        losses = []
        for rows in (slice(0, 4), slice(4, 8)):
            a, lp, m, r = A[rows], logp[rows], mask[rows] > 0, ratio[rows]
            cov = (a - a[m].mean()) * (lp.detach() - lp.detach()[m].mean())
            if mode == "kl_cov":           # the top 20% of the rank's response tokens by cov get |log ratio| added
                top = torch.zeros_like(m)
                top[m] = cov[m] >= cov[m].topk(int(0.2 * int(m.sum()))).values.min()
                losses.append(-a * r + top * (lp - old_logp[rows]).abs())
            else:                          # every token PPO did not clip is cut (its band and count take them all)
                unclipped, clipped = -a * r, -a * torch.clamp(r, 0.8, 1.2)
                losses.append(torch.where(clipped > unclipped, clipped, torch.zeros_like(clipped)))
        return torch.cat(losses)
    if mode == "gspo":
        seq = ((logp - old_logp) * mask).sum(-1) / mask.sum(-1).clamp(min=1)
        ratio = torch.exp(torch.clamp(logp - logp.detach() + seq.detach()[:, None], max=10))
        return torch.maximum(-A * ratio, -A * torch.clamp(ratio, 0.8, 1.2))
    ratio = torch.exp(torch.clamp(logp - old_logp, -20, 20))
    clipped = torch.maximum(-A * ratio, -A * torch.clamp(ratio, 0.8, 1.2))
    return torch.where(A < 0, torch.minimum(clipped, -A * 3.0), clipped)


@pytest.mark.parametrize("result, mode, agg", [("base", "vanilla", "token-mean"),
                                               ("world2_gspo", "gspo", "seq-mean-token-mean"),
                                               ("world2_gpg", "gpg", "token-mean"),
                                               ("world2_kl_cov", "kl_cov", "token-mean"),
                                               ("world2_clip_cov", "clip_cov", "token-mean")])
def test_gradient_matches_a_hand_written_full_batch_loss(oracle_results, fixed_batch, tiny_model_dir, result, mode,
                                                         agg):
    """The trainer's gradient equals autograd of the loss written out here over the whole batch at once: the policy
    loss of actor.policy_loss.loss_mode - 0.01 * entropy + 0.1 * k3 KL, each aggregated by loss_agg_mode (for
    gspo and gpg on 2 ranks with 2 micro-batches each)."""
    batch = torch.load(fixed_batch)
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32)
    mask = batch["response_mask"].float()
    P = batch["prompts"].shape[1]
    logits = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"],
                   position_ids=batch["position_ids"]).logits[:, P - 1:-1].float() / 0.9
    logp_all = torch.log_softmax(logits, -1)
    logp = logp_all.gather(-1, batch["responses"].unsqueeze(-1)).squeeze(-1)
    entropy = -(logp_all.exp() * logp_all).sum(-1)
    pg = hand_written_policy_loss(mode, logp, batch["old_log_probs"], batch["advantages"], mask)
    x = torch.clamp(batch["ref_log_prob"] - logp, -20, 20)
    k3 = torch.clamp(torch.exp(x) - x - 1, -10, 10)

    def agg_over_batch(values):
        if agg == "token-mean":
            return (values * mask).sum() / mask.sum()
        return ((values * mask).sum(-1) / mask.sum(-1)).mean()         # seq-mean-token-mean: no empty rows here

    assert (mask.sum(-1) > 0).all()
    loss = agg_over_batch(pg) - 0.01 * agg_over_batch(entropy) + 0.1 * agg_over_batch(k3)
    loss.backward()
    # the trainer clips the gradient norm to grad_clip=1.0 in place (torch: scale by 1/(norm + 1e-6) when > 1)
    norm = torch.sqrt(sum((p.grad ** 2).sum() for p in model.parameters()))
    assert oracle_results[result]["metrics"]["actor/grad_norm"] == pytest.approx(float(norm), rel=1e-4)
    scale = min(1.0, 1.0 / (float(norm) + 1e-6))
    for name, param in model.named_parameters():
        assert torch.allclose(oracle_results[result]["grads"][name], param.grad * scale, atol=1e-7, rtol=1e-4), name


def test_an_unwritable_output_folder_is_a_clear_error_before_models_load(demo_dir, tmp_path):
    """A checkpoint folder that cannot be made (a file stands in its path) stops the run with the key named,
    before any model loads, not at the first checkpoint."""
    (tmp_path / "blocker").write_text("a file, not a folder")
    out = torchrun(2, "minirl.py", "--config", ROOT / "config.yaml", f"actor_rollout_ref.model.path={demo_dir}/model",
                   f"data.train_files={demo_dir}/data/train.parquet", f"data.val_files={demo_dir}/data/test.parquet",
                   f"af_output_dir={tmp_path / 'run'}", f"trainer.default_local_dir={tmp_path / 'blocker' / 'ckpt'}",
                   expect_ok=False)
    assert out.returncode != 0
    assert "trainer.default_local_dir=" in out.stderr and "not a folder minirl can write to" in out.stderr
    assert "Loading weights" not in out.stdout + out.stderr
