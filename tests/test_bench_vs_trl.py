"""bench/vs_trl.py's own arithmetic (TRL itself is not a dependency and never runs here): minirl's metrics
become per-step phases, both engines get one dtype, and the tables pick each side's best layout and divide the
medians of tokens/s."""
import importlib.util
import json
from pathlib import Path

import pytest

spec = importlib.util.spec_from_file_location("vs_trl", Path(__file__).resolve().parents[1] / "bench" / "vs_trl.py")
vs_trl = importlib.util.module_from_spec(spec)
spec.loader.exec_module(vs_trl)


def step(step_s, tokens, gen=0.0, logprob=0.0, update=0.0):
    return {"step_s": step_s, "tokens": tokens, "gen": gen, "logprob": logprob, "update": update,
            "other": step_s - gen - logprob - update}


def test_minirl_metrics_become_phases(tmp_path):
    rows = [{"timing_s/gen": 2.0, "timing_s/ref": 0.5, "timing_s/update_actor": 1.0, "timing_s/reward": 0.25,
             "timing_s/step": 4.0, "response_length/mean": 60.0},
            {"timing_s/gen": 1.0, "timing_s/old_log_prob": 0.25, "timing_s/ref": 0.5, "timing_s/update_actor": 1.0,
             "timing_s/step": 3.0, "response_length/mean": 30.0},
            {"val-core/acc": 0.5}]                                  # a validation row has no step timing
    (tmp_path / "metrics.jsonl").write_text("\n".join(json.dumps(r) for r in rows))
    got = vs_trl.minirl_steps(tmp_path, {"prompts": 8, "n": 4})
    assert got == [step(4.0, 60.0 * 32, gen=2.0, logprob=0.5, update=1.0),
                   step(3.0, 30.0 * 32, gen=1.0, logprob=0.75, update=1.0)]


def test_both_vllm_engines_get_the_workloads_dtype(tmp_path):
    """TRL builds vllm.LLM without a dtype (vLLM's auto would make the fp32 checkpoint bf16 on CPU): the bench
    gives TRL's engine the dtype minirl's command sets, and passes every other argument through."""
    import types
    built = []
    trl_module = types.SimpleNamespace(LLM=lambda **kwargs: built.append(kwargs))
    vs_trl.pin_engine_dtype(trl_module, vs_trl.ROLLOUT_DTYPE)
    trl_module.LLM(model="m", seed=3)
    assert built == [{"model": "m", "seed": 3, "dtype": "float32"}]
    command = vs_trl.minirl_command(tmp_path, tmp_path, "vllm", 2, 1, dict(vs_trl.FULL, prompt_set="add"))
    assert "actor_rollout_ref.rollout.dtype=float32" in command


def test_tables_take_each_sides_best_layout_and_the_ratio_of_medians():
    results = {
        # minirl, 2 processes: tokens/s 100, 200, 300 -> median 200 (step s median 2.0)
        ("minirl", "hf", 2): [step(1.0, 100, gen=0.5), step(2.0, 400, gen=1.0), step(3.0, 900, gen=2.0)],
        ("minirl", "hf", 1): [step(4.0, 400), step(4.0, 400)],                  # 100 tokens/s
        ("trl", "hf", 2): [step(5.0, 250), step(5.0, 250)],                     # 50
        ("trl", "hf", 1): [step(2.0, 160), step(2.0, 160), step(8.0, 160)],     # 80, 80, 20 -> 80
    }
    tables = vs_trl.summary_tables(results)
    assert "| hf | 200 (2p) | 80 (1p) | x2.50 |" in tables
    assert "| minirl | hf | 2 | 3 | 2.00 | 200 |" in tables
    assert "| hf | minirl | 2 | 1.00 | 0.00 | 0.00 | 1.00 | 2.00 |" in tables      # median of each phase
    assert "| hf | trl | 1 |" in tables and "| hf | trl | 2 |" not in tables       # only the best layout's phases


def test_gsm8k_prompts_fit_the_benchs_max_prompt_length(tmp_path):
    """--prompts gsm8k: the shipped GSM8K rows, verl-formatted, all within the bench's max prompt length (minirl
    would refuse a longer one: truncation=error) and of the varied lengths the prompt set is there for."""
    import pyarrow.parquet as pq
    from transformers import AutoTokenizer
    vs_trl.build_assets(tmp_path, "gsm8k")
    rows = pq.read_table(tmp_path / "train.parquet").to_pylist()
    tokenizer = AutoTokenizer.from_pretrained(tmp_path / "model")
    lengths = [len(tokenizer.apply_chat_template(row["prompt"], add_generation_prompt=True, tokenize=True)["input_ids"])
               for row in rows]
    assert len(rows) == 64 and {row["data_source"] for row in rows} == {"openai/gsm8k"}
    assert max(lengths) <= vs_trl.MAX_PROMPT_LENGTH["gsm8k"] and max(lengths) > 3 * min(lengths)


def test_a_micro_batch_that_does_not_divide_a_process_share_is_refused(tmp_path, monkeypatch, capsys):
    """64 prompts x 4 = 256 responses: 128 per process with --procs 2, 256 with 1; 48 divides neither, 64 both."""
    monkeypatch.setattr("sys.argv", ["vs_trl.py", "--sides", "minirl", "--procs", "2", "1", "--micro", "48",
                                     "--work", str(tmp_path / "work")])
    with pytest.raises(SystemExit) as stop:
        vs_trl.main()
    assert stop.value.code == 2
    assert "--micro 48 must divide the 128 responses each of 2 process(es)" in capsys.readouterr().err
    assert not (tmp_path / "work").exists()                  # refused before anything was built


def test_a_negative_number_of_warm_up_runs_is_refused(tmp_path, monkeypatch, capsys):
    monkeypatch.setattr("sys.argv", ["vs_trl.py", "--sides", "minirl", "--warmup-runs", "-1",
                                     "--work", str(tmp_path / "work")])
    with pytest.raises(SystemExit) as stop:
        vs_trl.main()
    assert stop.value.code == 2
    assert "--warmup-runs -1: the number of untimed runs must be 0 or more" in capsys.readouterr().err
    assert not (tmp_path / "work").exists()


def test_runs_finish_one_mode_before_the_next_and_swap_which_side_goes_first(tmp_path, monkeypatch):
    """An HF run right after a vLLM run was measured slower, so the order is every HF run, then every vLLM run;
    within a mode an untimed warm-up run of each side (--warmup + 1 steps) comes first, then the sides swap who goes
    first each round. Only the order is checked: no run starts."""
    calls = []

    def fake_run(side, work, root, mode, procs, steps, w, timeout):
        calls.append((mode, side, steps))
        return [{"step_s": 1.0 + len(calls), "tokens": 100, **{p: 0.25 for p in vs_trl.PHASES}}] * steps

    (tmp_path / "trl-venv" / "lib" / "python3" / "site-packages" / "trl").mkdir(parents=True)
    monkeypatch.setattr(vs_trl, "TRL_VENV", tmp_path / "trl-venv")
    monkeypatch.setattr(vs_trl, "build_assets", lambda work, prompt_set: None)
    monkeypatch.setattr(vs_trl, "run", fake_run)
    monkeypatch.setattr("sys.argv", ["vs_trl.py", "--procs", "2", "--rounds", "3", "--steps", "4", "--warmup", "2",
                                     "--work", str(tmp_path / "work")])
    vs_trl.main()
    timed = ["minirl", "trl", "trl", "minirl", "minirl", "trl"]
    assert calls == [(mode, side, steps) for mode in ("hf", "vllm")
                     for side, steps in [("minirl", 3), ("trl", 3)] + [(side, 4) for side in timed]]
    # each run's steps carry its call number: the warm-up runs' (calls 1-2 and 9-10) are in no table
    results = vs_trl.load_results(tmp_path / "work" / "results.json")
    timed_steps = [r["step_s"] - 1 for records in results.values() for r in records]
    assert len(timed_steps) == 2 * 6 * (4 - 2) and set(timed_steps) == set(range(3, 9)) | set(range(11, 17))


def busy_children():
    """This process's children running the bench's busy loop (Linux's /proc)."""
    pids = [pid for task in Path("/proc/self/task").iterdir() for pid in (task / "children").read_text().split()]
    return [pid for pid in pids if vs_trl.BUSY_LOOP.encode() in Path(f"/proc/{pid}/cmdline").read_bytes()]


def test_busy_loops_run_beside_every_run_and_stop_with_the_bench(tmp_path, monkeypatch):
    """--busy N: N processes burning a core each, alive during every run of both sides, gone when the bench ends."""
    seen = []

    def fake_run(side, work, root, mode, procs, steps, w, timeout):
        seen.append(len(busy_children()))
        return [{"step_s": 1.0, "tokens": 100, **{p: 0.25 for p in vs_trl.PHASES}}] * steps

    (tmp_path / "trl-venv" / "lib" / "python3" / "site-packages" / "trl").mkdir(parents=True)
    monkeypatch.setattr(vs_trl, "TRL_VENV", tmp_path / "trl-venv")
    monkeypatch.setattr(vs_trl, "build_assets", lambda work, prompt_set: None)
    monkeypatch.setattr(vs_trl, "run", fake_run)
    monkeypatch.setattr("sys.argv", ["vs_trl.py", "--procs", "2", "--rounds", "1", "--modes", "hf", "--busy", "2",
                                     "--work", str(tmp_path / "work")])
    assert busy_children() == []
    vs_trl.main()
    assert seen == [2, 2, 2, 2]                              # minirl's and TRL's warm-up runs, then their timed ones
    assert busy_children() == []
