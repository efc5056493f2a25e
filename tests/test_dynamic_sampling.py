"""DAPO's dynamic sampling (algorithm.filter_groups, data.gen_batch_size; verl's recipe/dapo RayDAPOTrainer.fit):
the groups kept by hand, and real 2-rank runs whose kept prompts are worked out here from the data's layout, with an
exact resume across the epoch boundary a step's batches straddle, and the errors that stop a run."""
import json
import re
import shutil

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch

from config import ConfigError
from launch import ROOT, assert_resumed, torchrun
from minirl import varied_groups
from test_checkpoint import metric_rows


def batch_of(groups, extras=None):
    """A scored batch: one uid per group of scores, rows in group order."""
    uids = [uid for uid, scores in groups.items() for _ in scores]
    scores = [score for group in groups.values() for score in group]
    extras = extras or [{} for _ in scores]
    return {"uid": uids, "scores": torch.tensor(scores, dtype=torch.float64), "reward_extras": extras,
            "origin": [f"row {i}" for i in range(len(uids))]}


def test_varied_groups_by_hand():
    """verl's rule: keep a prompt's group when np.std of its values is > 0, or when it holds one response."""
    batch = batch_of({"same": [1.0, 1.0, 1.0], "differ": [0.0, 1.0], "alone": [0.5], "zeros": [0.0, 0.0],
                      "tenths": [0.1, 0.1, 0.1]})
    # rows: same 0-2, differ 3-4, alone 5, zeros 6-7, tenths 8-10. Three 0.1s have a mean of 0.10000000000000002
    # in floating point, so their std is 1.4e-17 > 0: verl keeps that group, and so does minirl (the same batches)
    assert varied_groups(batch, "seq_reward") == [[3, 4], [5], [8, 9, 10]]
    assert varied_groups(batch, "seq_final_reward") == [[3, 4], [5], [8, 9, 10]]
    accuracy = [{"acc": a} for a in (True, True, False, False, False, True, False, False, False, False, False)]
    assert varied_groups(batch_of({"same": [1.0] * 3, "differ": [0.0, 1.0], "alone": [0.5], "zeros": [0.0] * 2,
                                   "tenths": [0.1] * 3}, accuracy), "acc") == [[0, 1, 2], [5]]


def test_a_metric_the_reward_does_not_return_or_that_is_not_a_number_is_named():
    batch = batch_of({"a": [1.0, 0.0]}, [{"score": 1.0, "pred": "7"}, {"score": 0.0, "pred": "8"}])
    with pytest.raises(ConfigError, match=r"metric='acc' is not in what the reward function returned for row 0 "
                                          r"\(its keys: \['pred', 'score'\]\)"):
        varied_groups(batch, "acc")
    with pytest.raises(ConfigError, match="metric='pred' holds values that are not numbers"):
        varied_groups(batch, "pred")
    with pytest.raises(ConfigError, match="its keys: none, it returns a number"):
        varied_groups(batch_of({"a": [1.0, 0.0]}), "acc")


# ---------------------------------------------------------------------------------------------------------------
# Real runs


ODD_SPREADS = """
import itertools

_calls = itertools.count()


def compute_score(data_source, solution_str, ground_truth, extra_info=None, **kwargs):
    # "spread" differs on every call for an odd sum and is 0 for an even one: dynamic sampling on it keeps
    # exactly the prompts whose answer is odd, whatever the model writes
    odd = int(ground_truth) % 2 == 1
    return {"score": float(("#### " + ground_truth) in solution_str), "spread": next(_calls) if odd else 0}
"""


def question(row):
    return re.search(r"What is \d \+ \d\?", row["prompt"][-1]["content"]).group(0)


@pytest.fixture(scope="module")
def layout(demo_dir, tmp_path_factory):
    """12 demo prompts in three loader batches of 4 (no shuffling): 2 odd sums + 2 even, 4 odd, 2 odd + 2 even."""
    rows, seen, table = [], set(), pq.read_table(demo_dir / "data" / "train.parquet")
    for row in table.to_pylist():
        if question(row) not in seen:
            seen.add(question(row))
            rows.append(row)
    odd = [row for row in rows if int(row["reward_model"]["ground_truth"]) % 2]
    even = [row for row in rows if not int(row["reward_model"]["ground_truth"]) % 2]
    batches = [odd[0:2] + even[0:2], odd[2:6], odd[6:8] + even[2:4]]
    folder = tmp_path_factory.mktemp("dynamic")
    pq.write_table(pa.Table.from_pylist([row for b in batches for row in b], table.schema), folder / "train.parquet")
    (folder / "reward.py").write_text(ODD_SPREADS)
    odd_questions = [[question(row) for row in b if int(row["reward_model"]["ground_truth"]) % 2] for b in batches]
    return {"dir": folder, "odd": odd_questions}


def dynamic_run(demo_dir, layout, out, *extra, nproc=2, expect_ok=True):
    return torchrun(nproc, "minirl.py", "--config", ROOT / "config.yaml",
                    f"actor_rollout_ref.model.path={demo_dir}/model",
                    f"data.train_files={layout['dir']}/train.parquet", "data.val_files=null", f"af_output_dir={out}",
                    f"custom_reward_function.path={layout['dir']}/reward.py",
                    "data.shuffle=false", "data.train_batch_size=3", "data.gen_batch_size=4",
                    "algorithm.filter_groups.enable=true", "algorithm.filter_groups.metric=spread",
                    "trainer.total_epochs=2", "trainer.total_training_steps=null", "trainer.save_freq=1",
                    "actor_rollout_ref.rollout.n=4", "data.max_response_length=8",
                    "actor_rollout_ref.actor.ppo_mini_batch_size=3",
                    "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=3",
                    f"trainer.rollout_data_dir={out}/rollouts", *extra, expect_ok=expect_ok)


@pytest.fixture(scope="module")
def dynamic_a(demo_dir, layout, tmp_path_factory):
    out = tmp_path_factory.mktemp("dynamic_a")
    return out, dynamic_run(demo_dir, layout, out)


def test_each_step_trains_the_first_train_batch_size_varied_groups_in_loader_order(dynamic_a, layout):
    """Worked out from the layout (3 prompts a step, batches of 4 with 2, 4 and 2 odd sums, 2 epochs):
    step 1 = batch 1's two odd + batch 2's first (2 generation batches; batch 2's other three are dropped),
    step 2 = batch 3's two odd + epoch 2's batch 1's first (2 batches, across the epoch boundary),
    step 3 = batch 2's first three (1 batch); then batch 3's two are too few and the data is used up: 3 steps of
    the 6 that len(loader) x total_epochs plans."""
    out, run = dynamic_a
    (b1, b2, b3) = layout["odd"]
    expected = {1: (b1 + b2[:1], 2, 0), 2: (b3 + b1[:1], 2, 1), 3: (b2[:3], 1, 1)}
    rows = metric_rows(out / "metrics.jsonl")
    assert [row["step"] for row in rows] == [1, 2, 3]
    for row in rows:
        questions, gen_batches, epoch = expected[row["step"]]
        lines = [json.loads(line) for line in (out / "rollouts" / f"{row['step']}.jsonl").read_text().splitlines()]
        asked = [re.search(r"What is \d \+ \d\?", line["input"]).group(0) for line in lines]
        assert sorted(asked) == sorted(q for q in questions for _ in range(4)), row["step"]   # each prompt's 4
        assert (row["train/num_gen_batches"], row["training/epoch"]) == (gen_batches, epoch)
        assert row["critic/score/mean"] == pytest.approx(sum(line["score"] for line in lines) / 12, rel=1e-6)
    assert "trainer.total_epochs=2 of data were used up after step 3 of 6" in run.stdout


def test_a_resume_inside_a_run_of_dynamic_sampling_is_exact(dynamic_a, demo_dir, layout, tmp_path):
    """From run A's step-1 checkpoint: steps 2 (its batches straddle the epochs) and 3 as A logged them."""
    run_a, _ = dynamic_a
    out = tmp_path / "run"
    shutil.copytree(run_a, out)
    for step in (2, 3):
        shutil.rmtree(out / "checkpoints" / f"global_step_{step}")
    (out / "checkpoints" / "latest_checkpointed_iteration.txt").write_text("1")
    (out / "metrics.jsonl").write_text((out / "metrics.jsonl").read_text().splitlines(keepends=True)[0])
    assert_resumed(dynamic_run(demo_dir, layout, out), 1)
    assert metric_rows(out / "metrics.jsonl") == metric_rows(run_a / "metrics.jsonl")


def test_too_few_varied_groups_stop_the_run_with_the_fix(demo_dir, layout, tmp_path):
    """The score as the metric and a reward that gives every response the same: no group is ever kept."""
    flat = tmp_path / "flat.py"
    flat.write_text("def compute_score(data_source, solution_str, ground_truth, extra_info=None):\n    return 0.5\n")
    run = dynamic_run(demo_dir, layout, tmp_path / "out", f"custom_reward_function.path={flat}",
                      "algorithm.filter_groups.metric=seq_reward", "algorithm.filter_groups.max_num_gen_batches=2",
                      nproc=1, expect_ok=False)
    assert run.returncode != 0 and "exitcode  : 3" in run.stderr, run.stderr[-3000:]      # minirl's code for it
    assert ("training stopped: step 1: algorithm.filter_groups.max_num_gen_batches=2 batches of 4 prompts kept 0 "
            "whose responses' seq_reward differ, fewer than data.train_batch_size=3") in run.stderr
    assert "set algorithm.filter_groups.max_num_gen_batches=0 to keep drawing batches" in run.stderr
    run = dynamic_run(demo_dir, layout, tmp_path / "out2", f"custom_reward_function.path={flat}",
                      "algorithm.filter_groups.metric=acc", nproc=1, expect_ok=False)
    assert run.returncode != 0 and "exitcode  : 2" in run.stderr, run.stderr[-3000:]
    assert ("config error: algorithm.filter_groups.metric='acc' is not in what the reward function returned"
            in run.stderr)
