"""The Tracker: metrics.jsonl always, TensorBoard and wandb (offline) when asked; a resumed run keeps each step once."""
import json
from pathlib import Path

import numpy as np
import pytest

from config import load_config
from tracking import Tracker, validation_metrics

ROOT_CONFIG = Path(__file__).resolve().parents[1] / "config.yaml"


def tracker(tmp_path, loggers, start_step=0):
    cfg = load_config(ROOT_CONFIG, [f"af_output_dir={tmp_path}", f"trainer.logger={loggers}"], check_paths=False)
    return Tracker(cfg, enabled=True, start_step=start_step)


def test_wandb_logs_offline_with_the_step(tmp_path, monkeypatch):
    monkeypatch.delenv("WANDB_MODE", raising=False)
    monkeypatch.setenv("WANDB_SILENT", "true")
    t = tracker(tmp_path, "[wandb]")
    t.log({"critic/score/mean": 0.25, "actor/pg_loss": -1.5}, step=1)
    t.log({"critic/score/mean": 0.5}, step=2)          # wandb commits step 1 when step 2 starts
    summary = dict(t.wandb.summary)
    t.close()
    assert summary["_step"] == 1 and summary["critic/score/mean"] == 0.25 and summary["actor/pg_loss"] == -1.5
    assert len(list((tmp_path / "wandb").glob("offline-run-*"))) == 1          # offline: nothing left the machine
    rows = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert rows == [{"step": 1, "critic/score/mean": 0.25, "actor/pg_loss": -1.5},
                    {"step": 2, "critic/score/mean": 0.5}]


def test_resume_drops_rows_logged_after_the_checkpoint(tmp_path):
    t = tracker(tmp_path, "[console]")
    for step in (1, 2, 3):
        t.log({"x": float(step)}, step=step)
    t.close()
    t = tracker(tmp_path, "[console]", start_step=2)      # resumed from global_step_2: step 3 is trained again
    t.log({"x": 30.0}, step=3)
    t.close()
    rows = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert rows == [{"step": 1, "x": 1.0}, {"step": 2, "x": 2.0}, {"step": 3, "x": 30.0}]


def test_resume_hides_tensorboard_events_logged_after_the_checkpoint(tmp_path):
    """TensorBoard keeps every event file of a run folder: without a purge step the killed run's steps past the
    checkpoint showed beside the resumed run's, the curve doubling back."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    t = tracker(tmp_path, "[tensorboard]")
    for step in (1, 2, 3, 4):
        t.log({"x": float(step)}, step=step)
    t.close()
    t = tracker(tmp_path, "[tensorboard]", start_step=2)  # resumed from global_step_2: steps 3 and 4 trained again
    for step in (3, 4, 5):
        t.log({"x": 10.0 * step}, step=step)
    t.close()
    events = EventAccumulator(str(tmp_path / "tensorboard"))
    events.Reload()
    assert [(e.step, e.value) for e in events.Scalars("x")] == [(1, 1.0), (2, 2.0), (3, 30.0), (4, 40.0), (5, 50.0)]


def verl_validation_metrics(variables, sources, n, preds=None, core="reward"):
    """verl's validation metrics written out as verl v0.5.0 computes them, loop by loop (metric_utils.py
    process_validation_metrics, bootstrap_metric, calc_maj_val; the val-core rule of ray_trainer.py _validate):
    numpy's global generator seeded with 42 before each bootstrap, one np.random.choice per sample, a dict of
    vote counts per sample. variables: {name: values}, n consecutive values per prompt."""
    metrics = {}
    state = np.random.get_state()
    for name, values in variables.items():
        per_source = {}
        for prompt in range(len(values) // n):
            rows = range(prompt * n, (prompt + 1) * n)
            vals = [values[i] for i in rows]
            stats = {f"mean@{n}": np.mean(vals)}
            if n > 1:
                stats[f"std@{n}"] = np.std(vals)
                sizes, k = [], 2
                while k < n:
                    sizes.append(k)
                    k *= 2
                for k in sizes + [n]:
                    for label, reduce in (("best", max), ("worst", min)):
                        np.random.seed(42)
                        picked = [reduce(vals[i] for i in np.random.choice(n, size=k, replace=True))
                                  for _ in range(1000)]
                        stats[f"{label}@{k}/mean"], stats[f"{label}@{k}/std"] = np.mean(picked), np.std(picked)
                    if preds is not None:
                        np.random.seed(42)
                        picked = []
                        for _ in range(1000):
                            votes = {}
                            for i in np.random.choice(n, size=k, replace=True):
                                votes.setdefault(preds[rows[i]], []).append(vals[i])
                            top = max(votes, key=lambda pred: len(votes[pred]))
                            picked.append(votes[top][0])
                        stats[f"maj@{k}/mean"], stats[f"maj@{k}/std"] = np.mean(picked), np.std(picked)
            for stat, value in stats.items():
                per_source.setdefault(sources[prompt * n], {}).setdefault(stat, []).append(value)
        for source, stats in per_source.items():
            for stat, per_prompt in stats.items():
                core_stat = name == core and stat.split("@")[0] in ("mean", "maj", "best") and f"@{n}" in stat
                section = "val-core" if core_stat else "val-aux"
                metrics[f"{section}/{source}/{name}/{stat}"] = float(np.mean(per_prompt))
    np.random.set_state(state)
    return metrics


def assert_metrics_equal(actual, expected):
    assert actual.keys() == expected.keys()
    for key, value in expected.items():
        assert actual[key] == pytest.approx(value, rel=1e-12, abs=1e-12), key


def test_validation_metrics_by_hand():
    # source a: prompt 1 scores (1, 0), prompt 2 (0, 0); source b: prompt 3 (1, 1)
    scores = [1.0, 0.0, 0.0, 0.0, 1.0, 1.0]
    sources = ["a", "a", "a", "a", "b", "b"]
    m = validation_metrics(scores, sources, n=2)
    assert m["val-core/a/reward/mean@2"] == 0.25                  # (1+0+0+0)/4
    assert m["val-aux/a/reward/std@2"] == 0.25                    # (std(1,0)=0.5 + std(0,0)=0) / 2
    assert m["val-core/b/reward/mean@2"] == 1.0 and m["val-aux/b/reward/std@2"] == 0.0
    # best/worst of 2 drawn with replacement: prompt 3 always 1; prompt 2 always 0; prompt 1's best is 0 only
    # when both draws are its second response (1 draw in 4), its worst 1 only when both are its first
    assert m["val-core/b/reward/best@2/mean"] == 1.0 and m["val-core/b/reward/best@2/std"] == 0.0
    assert 0.7 < 2 * m["val-core/a/reward/best@2/mean"] < 0.8 and 0.2 < 2 * m["val-aux/a/reward/worst@2/mean"] < 0.3
    assert validation_metrics([0.5, 1.0], ["a", "b"], n=1) == {"val-core/a/reward/mean@1": 0.5,
                                                               "val-core/b/reward/mean@1": 1.0}


@pytest.mark.parametrize("n", [2, 3, 4, 5, 8])
def test_validation_metrics_equal_verls_bootstrap_written_out(n):
    """Random scores, a second variable and preds with ties, over 2 sources: every metric verl logs, with verl's
    names, sections and bootstrap draws (best/worst/maj at 2, 4, ... below n and at n, each /mean and /std)."""
    rng = np.random.default_rng(n)
    prompts = 5
    scores = rng.random(prompts * n).round(2).tolist()
    acc = rng.integers(0, 2, prompts * n).tolist()
    preds = [str(p) for p in rng.integers(0, 3, prompts * n)]
    sources = [["x", "y"][prompt % 2] for prompt in range(prompts) for _ in range(n)]
    extras = [{"acc": a, "pred": p} for a, p in zip(acc, preds)]
    actual = validation_metrics(scores, sources, n, extras)
    expected = verl_validation_metrics({"acc": acc, "reward": scores}, sources, n, preds, core="acc")
    assert_metrics_equal(actual, expected)
    assert f"val-core/x/acc/maj@{n}/std" in actual and f"val-aux/y/reward/best@{n}/mean" in actual
    assert_metrics_equal(validation_metrics(scores, sources, n),
                         verl_validation_metrics({"reward": scores}, sources, n))


def test_validation_metrics_of_a_reward_functions_dict_results_by_hand():
    """verl's reward_extra_info: every number a dict result holds is a variable; "acc" becomes the core one (its
    mean, best and maj in val-core, the reward's in val-aux); text ("pred", "note") is left out of the means but
    "pred" votes for maj@n; a key some rows lack is left out."""
    scores = [0.9, 0.1, 0.1, 0.1, 0.9, 0.1]                  # prompts (source a): 1, 2; prompt 3: source b
    extras = [{"acc": True, "pred": "7", "len": 3, "note": "x", "only_here": 1.0},
              {"acc": False, "pred": "8", "len": 5, "note": "y"},
              {"acc": np.bool_(False), "pred": "6", "len": 4, "note": "z"},
              {"acc": 0.0, "pred": "6", "len": 6, "note": "z"},
              {"acc": 1, "pred": "2", "len": 1, "note": "w"},
              {"acc": 0, "pred": "3", "len": 9, "note": "w"}]
    m = validation_metrics(scores, ["a", "a", "a", "a", "b", "b"], n=2, extras=extras)
    assert m["val-core/a/acc/mean@2"] == 0.25                    # (1+0+0+0)/4
    assert m["val-aux/a/acc/std@2"] == 0.25
    # prompt 2: "6" twice, acc 0 in every draw; prompt 1 ("7" acc 1, "8" acc 0): a draw of both ties and the one
    # drawn first wins, so maj is 1 when the first draw is the first response: about half the draws
    assert 0.4 < 2 * m["val-core/a/acc/maj@2/mean"] < 0.6
    assert m["val-core/b/acc/best@2/std"] > 0 and m["val-aux/b/len/worst@2/mean"] >= 1.0
    assert m["val-aux/a/reward/mean@2"] == pytest.approx(0.3)    # (0.9+0.1+0.1+0.1)/4
    assert m["val-aux/a/len/mean@2"] == 4.5 and m["val-aux/b/len/best@2/mean"] <= 9.0
    names = {key.split("/")[2] for key in m}
    assert names == {"acc", "reward", "len"}                     # no "pred", "note" or "only_here"
    assert not any(key.startswith("val-core") for key in m if "/reward/" in key or "/len/" in key)
    # maj@n only where every response has a pred that can be counted
    no_maj = [dict(row) for row in extras]
    del no_maj[5]["pred"]
    assert not any("maj@" in key for key in validation_metrics(scores, ["a"] * 6, n=2, extras=no_maj))
    no_maj[5]["pred"] = ["3"]
    assert not any("maj@" in key for key in validation_metrics(scores, ["a"] * 6, n=2, extras=no_maj))
    # n = 1: means only, acc still the core variable
    assert validation_metrics([0.5, 1.0], ["a", "a"], n=1, extras=[{"acc": 0}, {"acc": 1}]) == {
        "val-core/a/acc/mean@1": 0.5, "val-aux/a/reward/mean@1": 0.75}


def test_plot_draws_a_live_runs_rows_and_leaves_out_a_partial_line(tmp_path, capsys):
    """`minirl.py --plot RUN_DIR` while the run still appends: its last line may be half written."""
    import matplotlib.pyplot as plt
    from tracking import plot
    rows = [{"step": 1, "critic/score/mean": 0.1, "val-core/minirl/add/reward/mean@1": 0.2},
            {"step": 2, "critic/score/mean": 0.3}, {"step": 3, "critic/score/mean": 0.4}]
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows) + '{"step": 4, "critic/sc')
    out = plot(tmp_path)
    assert Path(out).stat().st_size > 0
    train, val = plt.gcf().axes[0].lines
    assert train.get_xydata().tolist() == [[1, 0.1], [2, 0.3], [3, 0.4]] and val.get_xydata().tolist() == [[1, 0.2]]
    assert "metrics.jsonl, line 4: not a complete metrics row" in capsys.readouterr().err
    plt.close("all")
