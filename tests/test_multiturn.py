"""Multi-turn GRPO end to end (real torchrun, 2 ranks, FSDP2) on the tool demo's model: the hf engine in sync and
async mode (same conversations), vLLM in async mode, a flaky tool (raises, hangs past its timeout) whose errors are
counted while the run goes on; config errors for bad tool yamls before any model loads."""
import json
import subprocess
import sys

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import yaml

import demo_tools
from launch import ROOT, assert_resumed, launch_env, torchrun


@pytest.fixture(scope="module")
def box_dir(tmp_path_factory):
    """The tool demo's assets, its warm-up cut at 100 steps with the call in 90% of the examples (so nearly every
    conversation calls the tool), and a tool yaml whose open_box is tool_fixtures.FlakyBoxTool with a 0.5 s
    timeout."""
    out = tmp_path_factory.mktemp("box")
    demo_tools.make_assets(out, target_copy_accuracy=0.0, check_every=100, call_rate=0.9)
    flaky = json.loads(json.dumps(demo_tools.TOOL_YAML))
    flaky["tools"][0].update(class_name="tests.tool_fixtures.FlakyBoxTool", config={"type": "native", "timeout": 0.5})
    (out / "flaky.yaml").write_text(yaml.safe_dump(flaky))
    return out


def overrides(box_dir, out, engine, mode):
    return [f"actor_rollout_ref.model.path={box_dir}/model", f"data.train_files={box_dir}/data/train.parquet",
            "data.val_files=null", f"af_output_dir={out}", "trainer.total_training_steps=2", "trainer.save_freq=-1",
            "trainer.val_before_train=False", "trainer.test_freq=-1", "trainer.logger=[console]",
            "data.train_batch_size=4", "data.max_prompt_length=48", "data.max_response_length=160",
            "data.return_raw_chat=True", "actor_rollout_ref.actor.ppo_mini_batch_size=2",
            "actor_rollout_ref.rollout.n=2", "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=2",
            f"actor_rollout_ref.rollout.name={engine}", f"actor_rollout_ref.rollout.mode={mode}",
            "actor_rollout_ref.rollout.multi_turn.enable=True",
            f"actor_rollout_ref.rollout.multi_turn.tool_config_path={box_dir}/flaky.yaml",
            "actor_rollout_ref.rollout.multi_turn.max_assistant_turns=3",
            f"trainer.rollout_data_dir={out}/rollouts"]


def run(box_dir, out, engine, mode, *extra):
    torchrun(2, "minirl.py", "--config", ROOT / "config.yaml", *overrides(box_dir, out, engine, mode), *extra)
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    dumps = {step: [json.loads(line) for line in (out / "rollouts" / f"{step}.jsonl").read_text().splitlines()]
             for step in (1, 2)}
    return rows, dumps


@pytest.fixture(scope="module")
def hf_runs(box_dir, tmp_path_factory):
    return {mode: run(box_dir, tmp_path_factory.mktemp(f"hf_{mode}"), "hf", mode) for mode in ("sync", "async")}


def check_run(rows, dumps):
    assert [r["step"] for r in rows] == [1, 2]
    for row in rows:
        assert row["num_turns/min"] >= 2 and row["num_turns/max"] <= 6
        assert row["num_turns/min"] <= row["num_turns/mean"] <= row["num_turns/max"]
    assert sum(r["tool_calls/total"] for r in rows) > 0
    assert sum(r["tool_calls/errors"] for r in rows) > 0                   # the flaky tool failed, the run went on
    tool_answers = [m["content"] for lines in dumps.values() for line in lines for m in line["messages"]
                    if m["role"] == "tool"]
    stuck, late = "Error: tool 'open_box' failed: RuntimeError: the lid is stuck", \
        "Error: tool 'open_box' did not answer within 0.5 s"
    assert stuck in tool_answers and (late in tool_answers or any(a.startswith("code ") for a in tool_answers)), \
        tool_answers
    errors = [a for a in tool_answers if a.startswith("Error:")]
    # every error is counted; one whose answer would overrun the response budget is not appended
    assert 0 < len(errors) <= sum(r["tool_calls/errors"] for r in rows)
    assert all(a in (stuck, late) or a.startswith(("Error: the tool call is not valid JSON", "Error: a tool call must",
                                                     "Error: unknown tool")) for a in errors), errors
    for lines in dumps.values():                 # the dumped output is the whole conversation after the prompt
        for line in lines:
            assert line["messages"][0]["role"] == "user" and line["messages"][-1]["role"] == "assistant"
            for m in line["messages"][1:]:
                if m["role"] == "tool":
                    assert m["content"] in line["output"]


def test_hf_async_run_counts_tool_errors_and_dumps_conversations(hf_runs):
    check_run(*hf_runs["async"])


def test_hf_sync_and_async_give_the_same_conversations(hf_runs):
    (sync_rows, sync_dumps), (async_rows, async_dumps) = hf_runs["sync"], hf_runs["async"]
    assert sync_dumps == async_dumps
    for a, b in zip(sync_rows, async_rows):
        assert a["critic/score/mean"] == b["critic/score/mean"]
        assert a["actor/pg_loss"] == pytest.approx(b["actor/pg_loss"])


def test_vllm_async_run(box_dir, tmp_path):
    """Also validates before training: verl's val-aux/num_turns/* (and the tool-call counts), checked against the
    conversations of the validation dump."""
    rows, dumps = run(box_dir, tmp_path, "vllm", "async", f"data.val_files={box_dir}/data/test.parquet",
                      "trainer.val_before_train=True", f"trainer.validation_data_dir={tmp_path}/validation")
    validation, rows = rows[0], rows[1:]
    check_run(rows, dumps)
    assert all("training/rollout_probs_diff_max" in r for r in rows)
    conversations = [json.loads(line)["messages"] for line in
                     (tmp_path / "validation" / "0.jsonl").read_text().splitlines()]
    # verl's count: the prompt, each assistant turn, and each turn of tool answers (one per run of tool messages)
    turns = [1 + sum(m["role"] == "assistant" or (m["role"] == "tool" and previous["role"] != "tool")
                     for previous, m in zip(messages, messages[1:])) for messages in conversations]
    assert validation["step"] == 0 and max(turns) >= 3
    assert (validation["val-aux/num_turns/min"], validation["val-aux/num_turns/max"]) == (min(turns), max(turns))
    assert validation["val-aux/num_turns/mean"] == pytest.approx(sum(turns) / len(turns))
    calls = sum(m["role"] == "tool" for messages in conversations for m in messages)
    assert validation["val-aux/tool_calls/total"] >= calls > 0


def test_bad_tool_yaml_fails_before_models_load(box_dir, tmp_path):
    (tmp_path / "bad.yaml").write_text(yaml.safe_dump({"tools": [{"class_name": "nowhere.Tool", "tool_schema": {
        "type": "function", "function": {"name": "t"}}}]}))
    args = [arg.replace(f"{box_dir}/flaky.yaml", str(tmp_path / "bad.yaml")) for arg in
            overrides(box_dir, tmp_path, "hf", "async")]
    out = subprocess.run([sys.executable, "minirl.py", "--config", str(ROOT / "config.yaml"), *args], cwd=ROOT,
                         env=launch_env(), capture_output=True, text=True, timeout=300)
    assert out.returncode == 2
    assert "config error: actor_rollout_ref.rollout.multi_turn.tool_config_path" in out.stderr and "cannot import 'nowhere'" in out.stderr
    assert "Loading weights" not in out.stderr + out.stdout



def _name_agents(rows):          # every row: pyarrow takes the columns from the first row
    for index, row in enumerate(rows):
        row["agent_name"] = "react_agent" if index == 2 else "tool_agent"


def _misspell_tool(rows):
    rows[2]["extra_info"]["tools_kwargs"] = {"open_safe": rows[2]["extra_info"]["tools_kwargs"]["open_box"]}


@pytest.mark.parametrize("change, message", [
    (_name_agents,
     "agent_name 'react_agent' is not an agent loop minirl runs; use tool_agent or single_turn_agent"),
    # found: the tool then ran without its create_kwargs (code None), and the run trained on it
    (_misspell_tool, "extra_info.tools_kwargs names tool 'open_safe', which the tool yaml (actor_rollout_ref."
                     "rollout.multi_turn.tool_config_path) does not define; its tools: ['open_box']"),
])
def test_a_row_naming_an_unknown_agent_or_tool_fails_before_models_load(box_dir, tmp_path, change, message):
    """A row whose agent_name is no agent loop minirl runs (verl's column), or whose tools_kwargs names a tool the
    tool yaml lacks (here the train file's row 2), stops the run under torchrun before any model loads, naming the
    file, the row and the names that work."""
    rows = pq.read_table(box_dir / "data" / "train.parquet").to_pylist()
    change(rows)
    pq.write_table(pa.Table.from_pylist(rows), tmp_path / "train.parquet")
    args = [arg.replace(f"{box_dir}/data/train.parquet", str(tmp_path / "train.parquet"))
            for arg in overrides(box_dir, tmp_path, "hf", "async")]
    out = torchrun(2, "minirl.py", "--config", ROOT / "config.yaml", *args, expect_ok=False)
    assert out.returncode != 0
    assert f"config error: data file {tmp_path / 'train.parquet'}, row 2: {message}" in out.stderr, out.stderr[-3000:]
    assert "Loading weights" not in out.stderr + out.stdout


# verl's examples/sglang_multiturn gsm8k settings (run_qwen2.5-3b_gsm8k_multiturn.sh + gsm8k_multiturn_grpo.yaml),
# on its agent-loop path (rollout.mode=async, vllm); paths point at local files
VERL_GSM8K_MULTITURN = [
    "algorithm.adv_estimator=grpo", "data.train_batch_size=256", "data.max_prompt_length=1024",
    "data.max_response_length=1024", "data.filter_overlong_prompts=True", "data.truncation=error",
    "data.return_raw_chat=True", "actor_rollout_ref.actor.optim.lr=1e-6",
    "actor_rollout_ref.model.use_remove_padding=True",
    "actor_rollout_ref.actor.ppo_mini_batch_size=256", "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=32",
    "actor_rollout_ref.actor.use_kl_loss=True", "actor_rollout_ref.actor.kl_loss_coef=0.001",
    "actor_rollout_ref.actor.kl_loss_type=low_var_kl", "actor_rollout_ref.actor.entropy_coeff=0",
    "actor_rollout_ref.model.enable_gradient_checkpointing=True",
    "actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu=32",
    "actor_rollout_ref.rollout.tensor_model_parallel_size=2", "actor_rollout_ref.rollout.name=vllm",
    "actor_rollout_ref.rollout.mode=async", "actor_rollout_ref.rollout.gpu_memory_utilization=0.5",
    "actor_rollout_ref.rollout.n=16", "actor_rollout_ref.ref.log_prob_micro_batch_size_per_gpu=32",
    "algorithm.use_kl_in_reward=False", "trainer.critic_warmup=0", "trainer.save_freq=-1", "trainer.test_freq=20",
    "trainer.total_epochs=15", "actor_rollout_ref.rollout.multi_turn.enable=True",
    "actor_rollout_ref.rollout.multi_turn.max_assistant_turns=5"]


@pytest.fixture(scope="module")
def verl_gsm8k(tmp_path_factory, gsm8k_dir):
    import data
    out = tmp_path_factory.mktemp("gsm8k_tool")
    data.main(["gsm8k", "--multiturn", "--input", str(gsm8k_dir), "--out", str(out)])
    from test_agent import VERL_GSM8K_TOOL_YAML
    (out / "gsm8k_tool_config.yaml").write_text(VERL_GSM8K_TOOL_YAML)
    return out


def test_verl_gsm8k_multiturn_example_prints_config(verl_gsm8k, tiny_model_dir):
    paths = [f"actor_rollout_ref.model.path={tiny_model_dir}", f"data.train_files={verl_gsm8k}/train.parquet",
             f"data.val_files={verl_gsm8k}/test.parquet",
             f"actor_rollout_ref.rollout.multi_turn.tool_config_path={verl_gsm8k}/gsm8k_tool_config.yaml"]
    out = subprocess.run([sys.executable, "minirl.py", "--print-config", "--world-size", "8", *VERL_GSM8K_MULTITURN,
                          *paths], cwd=ROOT, env=launch_env(), capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    printed = yaml.safe_load(out.stdout.split("\nplanning for")[0].split("batch plan:")[0])     # the config part
    assert printed["actor_rollout_ref"]["rollout"]["multi_turn"]["enable"] is True
    assert printed["actor_rollout_ref"]["rollout"]["mode"] == "async"


def test_verl_gsm8k_multiturn_example_runs_on_the_tiny_model(verl_gsm8k, tiny_model_dir, tmp_path):
    """The same settings scaled to the tiny model and 2 CPU ranks (batch sizes, lengths, the hf engine): one step;
    the random model rarely calls the tool, so this checks the whole path runs, not that tools are used."""
    scaled = {"data.train_batch_size": 2, "actor_rollout_ref.actor.ppo_mini_batch_size": 2,
              "actor_rollout_ref.rollout.n": 2,
              "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu": 2, "data.max_response_length": 32,
              "actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu": 2,
              "actor_rollout_ref.ref.log_prob_micro_batch_size_per_gpu": 2, "actor_rollout_ref.rollout.name": "hf",
              "actor_rollout_ref.rollout.tensor_model_parallel_size": 1}
    args = [a for a in VERL_GSM8K_MULTITURN if a.split("=")[0] not in scaled] + [f"{k}={v}" for k, v in scaled.items()]
    torchrun(2, "minirl.py", "--config", ROOT / "config.yaml", *args, f"actor_rollout_ref.model.path={tiny_model_dir}",
             f"data.train_files={verl_gsm8k}/train.parquet", "data.val_files=null", f"af_output_dir={tmp_path}",
             f"actor_rollout_ref.rollout.multi_turn.tool_config_path={verl_gsm8k}/gsm8k_tool_config.yaml",
             "trainer.total_training_steps=1", "trainer.val_before_train=False", "trainer.logger=[console]")
    (row,) = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert row["num_turns/min"] >= 2 and "tool_calls/total" in row and "actor/pg_loss" in row


def test_hf_async_resume_gives_the_uninterrupted_runs_step_2(box_dir, hf_runs, tmp_path):
    """Exact resume on the multi-turn path: step 1 with a checkpoint, then a second run resumes for step 2; step
    2's metrics (tool calls and errors, turns included) and conversations equal the uninterrupted run's. (Checked
    by hand with SIGKILL mid-checkpoint on the tool demo too.)"""
    def resume_run(steps):
        return torchrun(2, "minirl.py", "--config", ROOT / "config.yaml", *overrides(box_dir, tmp_path, "hf", "async"),
                 f"trainer.total_training_steps={steps}", "trainer.save_freq=1")
    resume_run(1)
    assert_resumed(resume_run(2), 1)
    wall_clock = ("timing_s/", "timing_per_token_ms/", "perf/")
    rows = [{k: v for k, v in json.loads(line).items() if not k.startswith(wall_clock)}
            for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    straight_rows, straight_dumps = hf_runs["async"]
    assert [r["step"] for r in rows] == [1, 2]
    assert rows[1] == {k: v for k, v in straight_rows[1].items() if not k.startswith(wall_clock)}
    assert [json.loads(line) for line in (tmp_path / "rollouts" / "2.jsonl").read_text().splitlines()] == \
        straight_dumps[2]


def test_vllm_run_with_an_interaction_and_tools_and_its_resume(box_dir, tmp_path):
    """The tool demo's rows, each with interaction_kwargs naming tool_fixtures.EchoInteraction (it answers every
    turn without a tool call with 'heard <answer>', its turn score the answer's length), and a reward function
    that returns how many turn scores it was handed. From the dumped conversations: every user message after the
    prompt is the interaction's reply to the model's turn before it, and each score counts those replies (one more
    where a last reply did not fit the budget). The vLLM-vs-actor check runs on every step. A second run resumed
    from the first's step-1 checkpoint gives step 2's metrics and conversations again."""
    import pyarrow as pa
    rows = pq.read_table(box_dir / "data" / "train.parquet").to_pylist()
    for row in rows:
        row["extra_info"]["interaction_kwargs"] = {"name": "echo"}
    pq.write_table(pa.Table.from_pylist(rows), tmp_path / "train.parquet")
    (tmp_path / "echo.yaml").write_text("interaction:\n  - class_name: tests.tool_fixtures.EchoInteraction\n")
    (tmp_path / "reward.py").write_text(
        "def compute_score(data_source, solution_str, ground_truth, extra_info=None):\n"
        "    return float(len(extra_info['rollout_reward_scores']['user_turn_rewards']))\n")
    settings = [f"data.train_files={tmp_path}/train.parquet", "trainer.save_freq=1",
                f"actor_rollout_ref.rollout.multi_turn.interaction_config_path={tmp_path}/echo.yaml",
                f"custom_reward_function.path={tmp_path}/reward.py"]
    rows, dumps = run(box_dir, tmp_path / "straight", "vllm", "async", *settings)
    assert all(r["multi_turn/interaction_errors"] == 0 and "training/rollout_probs_diff_max" in r for r in rows)
    replies = 0
    for lines in dumps.values():
        for line in lines:
            messages = line["messages"]
            feedback = [(before, m) for before, m in zip(messages, messages[1:]) if m["role"] == "user"]
            assert all(before["role"] == "assistant" and m["content"] == "heard " + before["content"]
                       for before, m in feedback)
            assert messages[-1]["role"] == "assistant" and line["score"] - len(feedback) in (0.0, 1.0)
            replies += len(feedback)
    assert replies > 0
    assert [r["critic/score/mean"] for r in rows] == \
        [pytest.approx(sum(line["score"] for line in dumps[step]) / len(dumps[step])) for step in (1, 2)]
    resumed = tmp_path / "resumed"
    out = torchrun(2, "minirl.py", "--config", ROOT / "config.yaml", *overrides(box_dir, resumed, "vllm", "async"),
                   *settings, "trainer.resume_mode=resume_path",
                   f"trainer.resume_from_path={tmp_path}/straight/checkpoints/global_step_1")
    assert_resumed(out, 1)
    wall_clock = ("timing_s/", "timing_per_token_ms/", "perf/")
    (step2,) = [{k: v for k, v in json.loads(line).items() if not k.startswith(wall_clock)}
                for line in (resumed / "metrics.jsonl").read_text().splitlines() if json.loads(line)["step"] == 2]
    assert step2 == {k: v for k, v in rows[1].items() if not k.startswith(wall_clock)}
    assert [json.loads(line) for line in (resumed / "rollouts" / "2.jsonl").read_text().splitlines()] == dumps[2]


def test_split_devices_run_the_conversations_on_the_rollout_rank(box_dir, tmp_path):
    """Multi-turn on split devices (1 trainer + 1 rollout rank, hf engine): the agent loop and its tools run on
    the rollout rank. Step 1 is on-policy there, with the same weights and seed as a 1-rank colocated run, so its
    conversations (messages, scores) and multi-turn metrics equal that run's; step 2 trains on conversations one
    update behind, tool tokens masked out as colocated, and a resume from step 1's checkpoint (which holds the
    conversations generated for step 2) gives step 2 again."""
    def run_with_the_demos_tools(nproc, name, *extra):
        return torchrun(nproc, "minirl.py", "--config", ROOT / "config.yaml",
                 *overrides(box_dir, tmp_path / name, "hf", "sync"),
                 f"actor_rollout_ref.rollout.multi_turn.tool_config_path={box_dir}/tools.yaml", *extra, timeout=600)

    split = ["trainer.n_gpus_per_node=1", "rollout.n_gpus_per_node=1", "trainer.save_freq=1"]
    run_with_the_demos_tools(1, "colocated")
    run_with_the_demos_tools(2, "split", *split)
    step1 = tmp_path / "split" / "checkpoints" / "global_step_1"
    assert_resumed(run_with_the_demos_tools(2, "resumed", *split, "trainer.resume_mode=resume_path",
                                            f"trainer.resume_from_path={step1}"), 1)
    dump = {name: [json.loads(line) for line in (tmp_path / name / "rollouts" / "1.jsonl").read_text().splitlines()]
            for name in ("colocated", "split")}
    assert dump["split"] == dump["colocated"]
    assert sum(m["role"] == "tool" for line in dump["split"] for m in line["messages"]) > 0     # tools were called
    rows = {name: [json.loads(line) for line in (tmp_path / name / "metrics.jsonl").read_text().splitlines()]
            for name in ("colocated", "split")}
    turns = ("num_turns/min", "num_turns/max", "num_turns/mean", "tool_calls/total", "critic/score/mean")
    assert {k: rows["split"][0][k] for k in turns} == {k: rows["colocated"][0][k] for k in turns}
    assert rows["split"][1]["tool_calls/total"] > 0 and rows["split"][1]["training/rollout_probs_diff_max"] > 1e-4
    resumed = [json.loads(line) for line in (tmp_path / "resumed" / "metrics.jsonl").read_text().splitlines()]

    def without_wall_clock(row):
        return {k: v for k, v in row.items() if not k.startswith(("timing_s/", "timing_per_token_ms/", "perf/"))}

    assert resumed[-1]["step"] == 2 and without_wall_clock(resumed[-1]) == without_wall_clock(rows["split"][1])
