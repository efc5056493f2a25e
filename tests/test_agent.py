"""The multi-turn agent loop (agent.py) and tools (tools.py) with a scripted engine: the expected token ids and
masks are written out by hand from the chat template's text, independently of the loop's templating."""
import asyncio
import json

import pytest
import torch
import yaml
from transformers import AutoTokenizer

import agent
import tools
from config import Config, ConfigError, default_tree
from demo_tools import TOOL_CHAT_TEMPLATE
from rollout import Sampling
from tool_fixtures import schema, write_tool_yaml

EOS = "<|im_end|>"


@pytest.fixture(scope="module")
def tok(tiny_tokenizer_dir):
    return AutoTokenizer.from_pretrained(tiny_tokenizer_dir)


@pytest.fixture(scope="module")
def fixture_tools(tmp_path_factory):
    path = write_tool_yaml(tmp_path_factory.mktemp("tools") / "tools.yaml", sleepy=0.2)
    return tools.load_tools(path)


def multi_turn(**overrides):
    cfg = Config.wrap(default_tree()["actor_rollout_ref"]["rollout"]["multi_turn"])
    cfg.update({"enable": True, "max_parallel_calls": 4, **overrides})
    return cfg


def call(name, **arguments):
    return f'<tool_call>{json.dumps({"name": name, "arguments": arguments})}</tool_call>'


class ScriptedEngine:
    """Answers each request with script[question][turn] + eos (cut to max_tokens), where turn counts the
    assistant turns already in the request. Records every call's request sizes."""

    def __init__(self, tokenizer, script):
        self.tok, self.script, self.calls = tokenizer, script, []

    def generate(self, prompt_ids, sampling, seed):
        self.calls.append(len(prompt_ids))
        out = []
        for ids in prompt_ids:
            text = self.tok.decode(ids, skip_special_tokens=False)
            question = next(q for q in self.script if q in text)
            turn = text.count("<|im_start|>assistant") - 1
            reply = self.script[question][min(turn, len(self.script[question]) - 1)]
            tokens = self.tok.encode(reply, add_special_tokens=False) + [self.tok.eos_token_id]
            out.append(tokens[:sampling.max_tokens])
        return out, None


def run_loop(tok, tool_map, script, mode="sync", response_length=2048, seed=0, interactions=None, extra_info=None,
             **mt):
    loop = agent.AgentLoop(tok, tool_map, multi_turn(**mt), response_length, mode=mode,
                           eos_ids=[tok.eos_token_id], chat_template=TOOL_CHAT_TEMPLATE, interactions=interactions)
    schemas = [dict(t.get_openai_tool_schema()) for t in tool_map.values()]
    rows = {"raw_prompt_ids": [], "raw_prompt": [], "extra_info": []}
    for question in script:
        messages = [{"role": "user", "content": question}]
        text = tok.apply_chat_template(messages, tools=schemas, chat_template=TOOL_CHAT_TEMPLATE,
                                       add_generation_prompt=True, tokenize=False)
        rows["raw_prompt_ids"].append(tok.encode(text, add_special_tokens=False))
        rows["raw_prompt"].append(messages)
        rows["extra_info"].append(dict(extra_info or {}))
    engine = ScriptedEngine(tok, script)
    sampling = Sampling(max_tokens=response_length)
    return loop.run(rows, agent.engine_generate(engine, sampling, batched=True), seed), engine


def ids(tok, text):
    return tok.encode(text, add_special_tokens=False)


# ---------------------------------------------------------------------------------------------------------------
# The loop


def test_two_turn_conversation_token_ids_and_mask_exactly(tok, fixture_tools):
    """prompt -> call add(2, 3) -> tool answers 5 -> '#### 5'. Model tokens (each turn's text + eos) mask 1; the
    template's tokens between turns (newline after <|im_end|>, the tool turn, the generation prompt) mask 0."""
    first, final = call("add", a=2, b=3), "#### 5"
    (conv,), _ = run_loop(tok, {"add": fixture_tools["add"]}, {"What is 2+3?": [first, final]})
    prompt = ("<|im_start|>system\nTools: add<|im_end|>\n<|im_start|>user\nWhat is 2+3?<|im_end|>\n"
              "<|im_start|>assistant\n")
    between = "\n<|im_start|>user\n<tool_response>\n5\n</tool_response><|im_end|>\n<|im_start|>assistant\n"
    assert conv.prompt_ids == ids(tok, prompt)
    turn1, turn2, tool_turn = ids(tok, first + EOS), ids(tok, final + EOS), ids(tok, between)
    assert conv.response_ids == turn1 + tool_turn + turn2
    assert conv.mask == [1] * len(turn1) + [0] * len(tool_turn) + [1] * len(turn2)
    assert (conv.assistant_turns, conv.user_turns, conv.num_turns) == (2, 1, 4)
    assert conv.messages[-2:] == [{"role": "tool", "content": "5"}, {"role": "assistant", "content": final}]
    assert not conv.tokenization_mismatch and (conv.tool_calls, conv.tool_errors) == (1, 0)


def test_batch_layout_attends_tool_tokens_but_masks_them(tok, fixture_tools):
    first, final, R = call("add", a=1, b=1), "#### 2", 128
    convs, _ = run_loop(tok, {"add": fixture_tools["add"]}, {"What is 1+1?": [first, final]}, response_length=R)
    p = len(convs[0].prompt_ids)
    prompts = {"input_ids": torch.tensor([[0, 0] + convs[0].prompt_ids]),
               "attention_mask": torch.tensor([[0, 0] + [1] * p]),
               "position_ids": torch.tensor([[0, 0] + list(range(p))])}
    batch = agent.conversations_to_batch(prompts, convs, R, tok.pad_token_id, [{"index": 7}])
    n = len(convs[0].response_ids)
    assert convs[0].user_turns == 1
    assert batch["responses"][0, :n].tolist() == convs[0].response_ids
    assert batch["attention_mask"][0, -R:].tolist() == [1] * n + [0] * (R - n)
    assert batch["response_mask"][0].tolist() == convs[0].mask + [0] * (R - n)
    assert batch["position_ids"][0, -R:].tolist() == list(range(p, p + R))
    assert batch["extra_info"] == [{"index": 7, "num_turns": 4, "rollout_reward_scores": {"add": 0.0}}]


def test_failures_become_error_answers_and_are_counted(tok, fixture_tools):
    """Malformed JSON, an unknown tool, a raising tool, a tool past its timeout (0.2 s; it sleeps 5 s): each gets
    an 'Error: ...' answer, counted; the conversation goes on to its final answer."""
    calls = ("<tool_call>{not json}</tool_call>" + call("nosuch") + call("boom") + call("sleepy", delay=5)
             + call("add", a=2, b=2))
    (conv,), _ = run_loop(tok, fixture_tools, {"Q?": [calls, "#### 4"]}, max_parallel_calls=5)
    answers = [m["content"] for m in conv.messages if m["role"] == "tool"]
    assert answers[0].startswith("Error: the tool call is not valid JSON")
    assert answers[1].startswith("Error: unknown tool 'nosuch'")
    assert answers[2] == "Error: tool 'boom' failed: RuntimeError: the tool broke"
    assert answers[3] == "Error: tool 'sleepy' did not answer within 0.2 s"
    assert answers[4] == "4"
    assert (conv.tool_calls, conv.tool_errors) == (5, 4)
    assert conv.messages[-1]["content"] == "#### 4"


def test_max_parallel_calls_runs_only_the_first_calls(tok, fixture_tools):
    three = call("add", a=1, b=1) + call("add", a=2, b=2) + call("add", a=3, b=3)
    (conv,), _ = run_loop(tok, fixture_tools, {"Q?": [three, "done"]}, max_parallel_calls=2)
    assert [m["content"] for m in conv.messages if m["role"] == "tool"] == ["2", "4"]


@pytest.mark.parametrize("side, expected", [("left", "aaaaa...(truncated)"), ("right", "(truncated)...56789"),
                                            ("middle", "aa...(truncated)...89")])
def test_tool_answer_truncation_sides(tok, fixture_tools, side, expected):
    (conv,), _ = run_loop(tok, fixture_tools, {"Q?": [call("echo", n=20), "done"]}, max_tool_response_length=5,
                          tool_response_truncate_side=side)
    assert conv.messages[2] == {"role": "tool", "content": expected}
    assert tools.truncate_tool_text("short", 5, side) == "short"


@pytest.mark.parametrize("limits, turns", [({"max_assistant_turns": 2}, (2, 1)), ({"max_user_turns": 3}, (4, 3)),
                                           ({"max_assistant_turns": 1}, (1, 0))])
def test_turn_limits(tok, fixture_tools, limits, turns):
    """A model that always calls a tool stops at max_assistant_turns, or after max_user_turns tool turns (verl:
    checked after each generation, tool turns counting as user turns)."""
    (conv,), _ = run_loop(tok, fixture_tools, {"Q?": [call("add", a=1, b=2)]}, **limits)
    assert (conv.assistant_turns, conv.user_turns) == turns
    assert conv.messages[-1]["role"] == "assistant" and conv.mask[-1] == 1


def test_budget_cuts_an_overlong_answer_and_never_ends_on_a_tool_turn(tok, fixture_tools):
    """The budget covers the whole conversation: an overlong second answer is cut at response_length; and a tool
    turn that would leave no room for another model token is not appended (the conversation ends instead)."""
    first = call("add", a=1, b=2)
    turn1 = ids(tok, first + EOS)
    tool_turn = ids(tok, "\n<|im_start|>user\n<tool_response>\n3\n</tool_response><|im_end|>\n<|im_start|>assistant\n")
    budget = len(turn1) + len(tool_turn) + 10
    (conv,), _ = run_loop(tok, fixture_tools, {"Q?": [first, "x" * 400]}, response_length=budget)
    assert conv.response_ids == turn1 + tool_turn + ids(tok, "x" * 400)[:10]
    assert conv.mask == [1] * len(turn1) + [0] * len(tool_turn) + [1] * 10 and conv.assistant_turns == 2
    tight = len(turn1) + len(tool_turn)          # the tool turn would fill the budget exactly
    (conv,), _ = run_loop(tok, fixture_tools, {"Q?": [first, "#### 3"]}, response_length=tight)
    assert conv.response_ids == turn1 and conv.mask == [1] * len(turn1) and conv.user_turns == 0


def test_async_scheduler_lets_fast_conversations_overtake_slow_tools(tok, fixture_tools):
    """Two conversations: one waits 0.3 s on its tool, the other's tools are instant. Async: the fast one's later
    turns are generated while the slow tool runs (more, smaller engine calls); the tokens are the same as sync."""
    script = {"slow?": [call("sleepy", delay=0.3), "#### 1"],
              "fast?": [call("add", a=1, b=1), call("add", a=2, b=2), "#### 4"]}
    slow_tools = dict(fixture_tools)
    slow_tools["sleepy"].timeout = 5.0
    sync, sync_engine = run_loop(tok, slow_tools, script, mode="sync")
    asyn, async_engine = run_loop(tok, slow_tools, script, mode="async")
    assert [c.response_ids for c in sync] == [c.response_ids for c in asyn]
    assert sync_engine.calls == [2, 2, 1]            # turn-synchronous: the fast one's 3rd turn waits for round 3
    assert async_engine.calls[:1] == [2] and sorted(async_engine.calls[1:]) == [1, 1, 1]
    slow_tools["sleepy"].timeout = 0.2


def test_a_rows_agent_name_picks_verls_agent_loop(tok, fixture_tools):
    """verl's `agent_name` column: single_turn_agent generates once (a tool call in it is text, not run; no tool
    instance is made, the row's interaction is not started), tool_agent runs the tool loop, and so does a row without
    the column when multi_turn.enable is on (one turn when only rollout.mode=async is); another name is a config
    error naming the row."""
    script = {"A?": [call("add", a=2, b=3), "#### 5"], "B?": [call("add", a=2, b=3), "#### 5"],
              "C?": [call("add", a=2, b=3), "#### 5"]}
    loop = agent.AgentLoop(tok, {"add": fixture_tools["add"]}, multi_turn(), 512, eos_ids=[tok.eos_token_id],
                           chat_template=TOOL_CHAT_TEMPLATE, interactions=gsm8k_interaction())
    rows = {"raw_prompt_ids": [], "raw_prompt": [], "agent_name": ["single_turn_agent", "tool_agent", None],
            "extra_info": [{"interaction_kwargs": {"ground_truth": "5"}}, {}, {}]}
    for question in script:
        messages = [{"role": "user", "content": question}]
        rows["raw_prompt"].append(messages)
        rows["raw_prompt_ids"].append(ids(tok, tok.apply_chat_template(
            messages, chat_template=TOOL_CHAT_TEMPLATE, add_generation_prompt=True, tokenize=False)))
    single, tool, unnamed = loop.run(rows, agent.engine_generate(ScriptedEngine(tok, script), Sampling(max_tokens=512),
                                                                 batched=True), seed=0)
    assert single.response_ids == ids(tok, call("add", a=2, b=3) + EOS) and single.mask == [1] * len(single.mask)
    assert (single.assistant_turns, single.tool_calls, single.instances, single.interaction) == (1, 0, {}, None)
    rewards = [info["rollout_reward_scores"] for info in agent.conversations_to_batch(
        {"input_ids": torch.zeros(3, 1, dtype=torch.long), "attention_mask": torch.ones(3, 1),
         "position_ids": torch.zeros(3, 1, dtype=torch.long)}, [single, tool, unnamed], 64, 0, [{}] * 3)["extra_info"]]
    assert rewards == [{}, {"add": 0.0}, {"add": 0.0}]           # no tool instance for the single turn
    assert (tool.assistant_turns, tool.tool_calls) == (unnamed.assistant_turns, unnamed.tool_calls) == (2, 1)
    # rollout.mode=async without multi_turn.enable (verl's async agent loop): a row without the column, one turn
    async_loop = agent.AgentLoop(tok, {"add": fixture_tools["add"]}, multi_turn(enable=False), 512, mode="async",
                                 eos_ids=[tok.eos_token_id], chat_template=TOOL_CHAT_TEMPLATE)
    rows.update(agent_name=[None, "tool_agent", None], extra_info=[{}, {}, {}])
    unnamed, tool, _ = async_loop.run(rows, agent.engine_generate(ScriptedEngine(tok, script),
                                                                  Sampling(max_tokens=512), batched=True), seed=0)
    assert unnamed.response_ids == single.response_ids and (unnamed.assistant_turns, unnamed.tool_calls) == (1, 0)
    assert (tool.assistant_turns, tool.tool_calls) == (2, 1)
    # sampled ids that re-tokenise otherwise ('#' '#' '#' '#' for '####'): a tool-loop row is checked against a
    # re-templating and counted; one generation is trained as sampled, not re-templated
    spelled = [i for ch in "#### 5" for i in tok.encode(ch, add_special_tokens=False)] + [tok.eos_token_id]
    rows["raw_prompt_ids"] = [ids(tok, async_loop.render(messages, add_generation_prompt=True))   # as the dataset
                              for messages in rows["raw_prompt"]]                              # templates them
    with pytest.warns(UserWarning, match="multi-turn tokenization: the trained token ids differ"):
        unnamed, tool, _ = async_loop.run(rows, lambda requests: [(spelled, None) for _ in requests], seed=0)
    assert (unnamed.response_ids, unnamed.tokenization_mismatch, tool.tokenization_mismatch) == (spelled, False, True)
    agent.check_agent_names([("t, row 0", {"agent_name": "tool_agent"}), ("t, row 1", {})], "data file")
    with pytest.raises(ConfigError, match="data file t, row 4: agent_name 'react_agent' is not an agent loop minirl "
                                          "runs; use tool_agent or single_turn_agent"):
        agent.check_agent_names([("t, row 4", {"agent_name": "react_agent"})], "data file")



def test_tools_kwargs_must_name_the_yamls_tools_and_verls_method_keys(fixture_tools):
    """A parquet struct holds None for a tool or key other rows set: absent, not an error."""
    tool = next(iter(fixture_tools))
    good = {"extra_info": {"tools_kwargs": {tool: {"create_kwargs": {"x": 1}, "execute_kwargs": None},
                                            "other": None}}}
    agent.check_tools_kwargs([("t, row 0", good), ("t, row 1", {"extra_info": {}})], fixture_tools, "data file")
    no_tools = {}                                # without a tool yaml the rows' tools_kwargs are not used
    agent.check_tools_kwargs([("t, row 0", {"extra_info": {"tools_kwargs": {"calc": {}}}})], no_tools, "data file")
    with pytest.raises(ConfigError, match=rf"data file t, row 3: extra_info.tools_kwargs\['{tool}'\] has "
                                          r"\['creat_kwargs'\]; verl's keys are create_kwargs, execute_kwargs"):
        agent.check_tools_kwargs([("t, row 3", {"extra_info": {"tools_kwargs": {tool: {"creat_kwargs": {"x": 1}}}}})],
                                 fixture_tools, "data file")


def test_rows_that_need_tools_kwargs_and_lack_them_are_warned_about(fixture_tools):
    """verl's dataset warns about such a row: its tools are created without the row's arguments."""
    tool = next(iter(fixture_tools))
    given = {"extra_info": {"need_tools_kwargs": True, "tools_kwargs": {tool: {"create_kwargs": {"x": 1}}}}}
    unasked = {"extra_info": {"tools_kwargs": {}}}
    lacking = {"extra_info": {"need_tools_kwargs": True, "tools_kwargs": {tool: None}}}     # a parquet struct's None
    assert agent.missing_tools_kwargs_warning([("t, row 0", given), ("t, row 1", unasked)], fixture_tools,
                                              "data file") is None
    assert agent.missing_tools_kwargs_warning([("t, row 2", lacking)], {}, "data file") is None     # no tools
    warning = agent.missing_tools_kwargs_warning([("t, row 0", given), ("t, row 2", lacking), ("t, row 5", lacking),
                                                  ("t, row 6", lacking)], fixture_tools, "data file")
    assert warning.startswith("data file t, row 2 and 2 more rows: extra_info.need_tools_kwargs is true but "
                              "tools_kwargs is empty"), warning


def test_hermes_parsing():
    parsed = tools.parse_hermes('a <tool_call>{"name": "f", "arguments": {"x": 1}}</tool_call> b '
                                '<tool_call>{"name": "g", "arguments": "{\\"y\\": 2}"}</tool_call>'
                                '<tool_call>{"name": 3}</tool_call>')
    assert [(c.name, c.arguments, c.error) for c in parsed[:2]] == [("f", {"x": 1}, None), ("g", {"y": 2}, None)]
    assert parsed[2].error.startswith("Error: a tool call must be")
    assert tools.parse_hermes("no calls here") == []


# ---------------------------------------------------------------------------------------------------------------
# verl's gsm8k example: tool yaml and data.py gsm8k --multiturn


VERL_GSM8K_TOOL_YAML = """
tools:
  - class_name: "verl.tools.gsm8k_tool.Gsm8kTool"
    config:
      type: native
    tool_schema:
      type: "function"
      function:
        name: "calc_gsm8k_reward"
        description: "A tool for calculating the reward of gsm8k. (1.0 if parsed answer is correct, 0.0 if parsed answer is incorrect or not correctly parsed)"
        parameters:
          type: "object"
          properties:
            answer:
              type: "string"
              description: "The model's answer to the GSM8K math problem, must be a digits"
          required: ["answer"]
"""


def test_verl_gsm8k_yaml_and_multiturn_row_through_the_loop(tok, tmp_path):
    import data
    (tmp_path / "in").mkdir()
    example = {"question": "Tom has 3 apples and buys 4 more. How many?", "answer": "3 + 4 = 7\n#### 7"}
    for split in ("train", "test"):
        (tmp_path / "in" / f"{split}.jsonl").write_text(json.dumps(example) + "\n")
    data.main(["gsm8k", "--multiturn", "--input", str(tmp_path / "in"), "--out", str(tmp_path / "out")])
    written = tmp_path / "out" / "gsm8k_tool_config.yaml"                    # the rows come with verl's yaml
    assert yaml.safe_load(written.read_text()) == yaml.safe_load(VERL_GSM8K_TOOL_YAML)
    tool_map = tools.load_tools(written)
    assert type(tool_map["calc_gsm8k_reward"]) is tools.Gsm8kTool
    dataset = data.RLHFDataset(tmp_path / "out" / "train.parquet", tok, max_prompt_length=1024, return_raw_chat=True,
                               chat_template=TOOL_CHAT_TEMPLATE,
                               tools=[dict(t.get_openai_tool_schema()) for t in tool_map.values()])
    row = dataset[0]
    assert row["raw_prompt"][0]["role"] == "system" and "calc_gsm8k_reward" in row["raw_prompt"][0]["content"]
    assert row["raw_prompt"][1]["content"].endswith("after `####`.")
    assert row["extra_info"]["need_tools_kwargs"] is True
    assert row["extra_info"]["tools_kwargs"]["calc_gsm8k_reward"]["create_kwargs"] == {"ground_truth": "7"}
    assert row["extra_info"]["interaction_kwargs"]["ground_truth"] == "7"
    script = {"How many?": [call("calc_gsm8k_reward", answer="6"), call("calc_gsm8k_reward", answer="7"),
                            "#### 7"]}
    loop = agent.AgentLoop(tok, tool_map, multi_turn(), 512, eos_ids=[tok.eos_token_id],
                           chat_template=TOOL_CHAT_TEMPLATE)
    engine = ScriptedEngine(tok, script)
    generate = agent.engine_generate(engine, Sampling(max_tokens=512), batched=False)
    (conv,) = loop.run(data.collate([row]), generate, seed=0)
    answers = [m["content"] for m in conv.messages if m["role"] == "tool"]
    assert answers == ["Current parsed answer='6' reward=0.0", "Current parsed answer='7' reward=1.0"]
    assert conv.reward_scores == {"calc_gsm8k_reward": 1.0} and conv.num_turns == 6


# ---------------------------------------------------------------------------------------------------------------
# Tool yaml errors: clear, before any model loads


@pytest.mark.parametrize("entry, message", [
    ({"class_name": "no_such_module.Tool", "tool_schema": schema("t")}, "cannot import 'no_such_module'"),
    ({"class_name": "tools.NoSuchTool", "tool_schema": schema("t")}, "has no class 'NoSuchTool'"),
    # a typo in the class (found by hand: the message named the module but not the class meant)
    ({"class_name": "tools.Gsm8kTol", "tool_schema": schema("t")}, "has no class 'Gsm8kTol': did you mean 'Gsm8kTool'?"),
    # a verl tool minirl has no stand-in for: say which one it has
    ({"class_name": "verl.tools.search_tool.SearchTool", "tool_schema": schema("t")},
     "of verl's tools minirl has verl.tools.gsm8k_tool.Gsm8kTool"),
    ({"class_name": "tools.ToolCall", "tool_schema": schema("t")}, "has no async 'create'"),
    ({"class_name": "tools.BaseTool", "tool_schema": {"type": "function", "function": {}}}, "needs function.name"),
    ({"class_name": "tools.BaseTool", "tool_schema": {"type": "function", "function": {"name": "t", "parameters": {
        "type": "object", "properties": {}, "required": ["x"]}}}}, "required parameters ['x']"),
    # found by fuzzing verl's gsm8k tool yaml: a mapping in `required` was a TypeError
    ({"class_name": "tools.BaseTool", "tool_schema": {"type": "function", "function": {"name": "t", "parameters": {
        "type": "object", "properties": {"x": {"type": "string"}}, "required": [{}]}}}}, "required parameters [{}]"),
    ({"tool_schema": schema("t")}, "needs 'class_name'"),
    ({"class_name": "tools.BaseTool", "config": {"timeout": -1}, "tool_schema": schema("t")}, "config.timeout"),
])
def test_invalid_tool_yaml_is_a_clear_error(tmp_path, entry, message):
    import yaml
    path = tmp_path / "tools.yaml"
    path.write_text(yaml.safe_dump({"tools": [entry]}))
    with pytest.raises(ConfigError, match="tools\\[0\\]") as err:
        tools.load_tools(path)
    assert message in str(err.value)
    assert str(err.value).startswith(f"actor_rollout_ref.rollout.multi_turn.tool_config_path '{path}'")  # the whole key
    path.write_text("tools: [\n")
    with pytest.raises(ConfigError, match="not valid yaml"):
        tools.load_tools(path)
    path.write_bytes(bytes(range(256)))                         # not text: named, not a UnicodeDecodeError
    with pytest.raises(ConfigError, match=r"tool_config_path .*is not a text file"):
        tools.load_tools(path)


def test_scheduler_propagates_engine_errors():
    def broken(requests):
        raise RuntimeError("engine down")

    async def go():
        return await agent.Scheduler(broken).generate(agent.Request([1], 1, 0))
    with pytest.raises(RuntimeError, match="engine down"):
        asyncio.run(go())


# ---------------------------------------------------------------------------------------------------------------
# Tool tokens never get gradient


def test_tool_tokens_get_no_gradient(tok, fixture_tools, tiny_model_dir):
    """On a real multi-turn batch: the actor's objective (losses.actor_loss: dual-clip PG + k3 KL + entropy,
    token-mean over the response mask) gives bit-identical parameter gradients when the log-probs, old/ref
    log-probs and advantages of tool tokens are perturbed; and GAE's advantages on model tokens ignore values and
    rewards on tool tokens."""
    from transformers import AutoModelForCausalLM

    import losses
    import forward
    script = {"Q1?": [call("add", a=1, b=2), "#### 3"], "Q2?": [call("echo", n=3), call("add", a=2, b=2), "ok"]}
    convs, _ = run_loop(tok, fixture_tools, script, response_length=256)
    width = max(len(c.prompt_ids) for c in convs)
    prompt_ids = torch.tensor([[tok.pad_token_id] * (width - len(c.prompt_ids)) + c.prompt_ids for c in convs])
    prompt_mask = torch.tensor([[0] * (width - len(c.prompt_ids)) + [1] * len(c.prompt_ids) for c in convs])
    prompts = {"input_ids": prompt_ids, "attention_mask": prompt_mask,
               "position_ids": torch.clamp(prompt_mask.cumsum(-1) - 1, min=0)}
    batch = agent.conversations_to_batch(prompts, convs, 256, tok.pad_token_id, [{}, {}])
    mask = batch["response_mask"].float()                                                    # [B, R]
    tool = batch["attention_mask"][:, width:].bool() & ~batch["response_mask"].bool()       # tool/template tokens
    assert tool.sum() > 20 and mask.sum() > 20
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    gen = torch.Generator().manual_seed(0)
    noise = lambda: torch.randn(mask.shape, generator=gen) * tool                            # noqa: E731
    old = -torch.rand(mask.shape, generator=gen)
    ref = -torch.rand(mask.shape, generator=gen)
    adv = torch.randn(mask.shape, generator=gen)

    def grads(logp_shift, old, ref, adv):
        model.zero_grad()
        logp, entropy = forward.token_logprobs(model, batch, calc_entropy=True)
        loss, _ = losses.actor_loss(logp + logp_shift, old, ref, adv, entropy, mask, entropy_coeff=0.01,
                                    use_kl_loss=True, kl_loss_coef=0.1)
        loss.backward()
        return [p.grad.clone() for p in model.parameters()]

    clean = grads(torch.zeros_like(mask), old, ref, adv)
    perturbed = grads(noise() * 5, old + noise(), ref + noise(), adv + noise() * 10)
    assert all(torch.equal(a, b) for a, b in zip(clean, perturbed))
    assert any(g.abs().sum() > 0 for g in clean)
    # a perturbation on a model token does move the gradient (the check can fail)
    model_token = mask.bool() & (torch.rand(mask.shape, generator=gen) < 0.2)
    moved = grads(torch.zeros_like(mask), old, ref, adv + model_token.float())
    assert not all(torch.equal(a, b) for a, b in zip(clean, moved))
    values, rewards = torch.randn(mask.shape, generator=gen), torch.randn(mask.shape, generator=gen) * mask
    base, _ = losses.gae_advantages(token_rewards=rewards, mask=mask, values=values * mask, lam=0.95)
    shifted, _ = losses.gae_advantages(token_rewards=rewards + noise(), mask=mask,
                                       values=(values + noise()) * mask + noise(), lam=0.95)
    assert torch.allclose(base[mask.bool()], shifted[mask.bool()], atol=0, rtol=0)


@pytest.mark.parametrize("overrides, message", [
    (["actor_rollout_ref.rollout.multi_turn.enable=True"], "set data.return_raw_chat=True"),
    (["actor_rollout_ref.rollout.mode=async", "actor_rollout_ref.rollout.ignore_eos=True"], "ignore_eos=True"),
    (["actor_rollout_ref.rollout.multi_turn.max_user_turns=0"], "max_user_turns'=0 is out of range"),
    (["actor_rollout_ref.rollout.multi_turn.max_parallel_calls=0"], "max_parallel_calls'=0 is out of range"),
    (["actor_rollout_ref.rollout.multi_turn.format=chatml"], "choose one of: hermes"),
    (["actor_rollout_ref.rollout.multi_turn.tool_response_truncate_side=top"], "left, right, middle"),
])
def test_multi_turn_config_errors(overrides, message):
    from config import load_config
    base = ["actor_rollout_ref.model.path=m", "data.train_files=t.parquet", "algorithm.adv_estimator=grpo",
            "actor_rollout_ref.rollout.multi_turn.enable=True", "data.return_raw_chat=True"]
    if overrides[0].endswith("multi_turn.enable=True"):
        base = base[:-1]
    with pytest.raises(ConfigError, match=message.replace("(", "\\(").replace(")", "\\)")):
        load_config(None, base + overrides, check_paths=False)


def test_rollout_mode_async_alone_names_itself_as_what_needs_the_raw_chat():
    """rollout.mode=async runs the agent loop without multi_turn.enable: the error names the key that did."""
    from config import load_config
    with pytest.raises(ConfigError, match=r"^actor_rollout_ref\.rollout\.mode=async runs the agent loop .* set "
                                          r"data\.return_raw_chat=True"):
        load_config(None, ["actor_rollout_ref.model.path=m", "data.train_files=t.parquet",
                           "algorithm.adv_estimator=grpo", "actor_rollout_ref.rollout.mode=async"], check_paths=False)


# ---------------------------------------------------------------------------------------------------------------
# Interactions (a simulated user): verl's gsm8k interaction, turn scores, limits, failures, yaml and row errors

import interactions  # noqa: E402
import tool_fixtures  # noqa: E402

ASK_AGAIN = "Your response is incorrect! You need to reflect on your answer and try again."


def gsm8k_interaction():
    return {"gsm8k": interactions.Gsm8kInteraction({"name": "gsm8k"})}


def test_gsm8k_interaction_token_ids_mask_and_turn_scores_exactly(tok):
    """'#### 6' (wrong: the interaction asks again, as a user turn masked out) -> '#### 7' (right: the interaction
    ends the conversation, and its closing reply is not appended, so the conversation ends on the model's turn).
    The turn scores, 0.0 then 1.0, reach the reward function as rollout_reward_scores["user_turn_rewards"]."""
    question = "What is 3+4?"
    gsm8k = gsm8k_interaction()
    (conv,), _ = run_loop(tok, {}, {question: ["#### 6", "#### 7"]}, interactions=gsm8k,
                          extra_info={"interaction_kwargs": {"name": "gsm8k", "query": question, "ground_truth": "7"}})
    prompt = f"<|im_start|>user\n{question}<|im_end|>\n<|im_start|>assistant\n"
    between = f"\n<|im_start|>user\n{ASK_AGAIN}<|im_end|>\n<|im_start|>assistant\n"
    turn1, turn2, user_turn = ids(tok, "#### 6" + EOS), ids(tok, "#### 7" + EOS), ids(tok, between)
    assert conv.prompt_ids == ids(tok, prompt)
    assert conv.response_ids == turn1 + user_turn + turn2
    assert conv.mask == [1] * len(turn1) + [0] * len(user_turn) + [1] * len(turn2)
    assert [m["role"] for m in conv.messages] == ["user", "assistant", "user", "assistant"]
    assert conv.messages[2]["content"] == ASK_AGAIN and conv.messages[-1]["content"] == "#### 7"
    assert (conv.assistant_turns, conv.user_turns, conv.num_turns) == (2, 1, 4)
    assert conv.user_turn_rewards == [0.0, 1.0] and conv.interaction_errors == 0 and not conv.tokenization_mismatch
    assert gsm8k["gsm8k"].instances == {}                                     # finalize_interaction was called
    prompts = {"input_ids": torch.tensor([conv.prompt_ids]), "attention_mask": torch.ones(1, len(conv.prompt_ids)),
               "position_ids": torch.arange(len(conv.prompt_ids)).unsqueeze(0)}
    batch = agent.conversations_to_batch(prompts, [conv], 64, tok.pad_token_id, [{"index": 3}])
    assert batch["extra_info"] == [{"index": 3, "num_turns": 4,
                                    "rollout_reward_scores": {"user_turn_rewards": [0.0, 1.0]}}]
    assert batch["response_mask"][0].tolist() == conv.mask + [0] * (64 - len(conv.mask))


def test_interaction_after_tools_sees_the_whole_conversation(tok, fixture_tools):
    """A turn with a tool call goes to the tool; a turn without one goes to the interaction, which gets every
    message so far (tool answers included) and the row's interaction_kwargs; 'bye' ends it."""
    echo = tool_fixtures.EchoInteraction({"name": "echo"})
    script = {"Q?": [call("add", a=2, b=3), "five", "bye"]}
    (conv,), _ = run_loop(tok, {"add": fixture_tools["add"]}, script, interactions={"echo": echo},
                          extra_info={"interaction_kwargs": {"name": "echo", "unused": None}})
    assert [m["role"] for m in conv.messages] == ["user", "assistant", "tool", "assistant", "user", "assistant"]
    assert conv.messages[4] == {"role": "user", "content": "heard five"}
    assert echo.seen == [conv.messages[:4], conv.messages]          # after "five", then after "bye"
    assert conv.user_turn_rewards == [4.0, 3.0] and (conv.user_turns, conv.num_turns) == (2, 6)
    assert conv.reward_scores == {"add": 0.0} and echo.open == set()


def test_interaction_instance_ids_are_the_same_on_a_rerun(tok):
    """The id each conversation's interaction starts under comes from the call's seed and the row: a seeded rerun
    hands the interaction the same ids (an interaction may seed itself from it); rows and seeds differ."""
    def started(seed):
        echo = tool_fixtures.EchoInteraction({"name": "echo"})
        run_loop(tok, {}, {"A?": ["bye"], "B?": ["bye"]}, interactions={"echo": echo}, seed=seed,
                 extra_info={"interaction_kwargs": {"name": "echo"}})
        return echo.started
    first = started(seed=3)
    assert first == started(seed=3) and len(set(first)) == 2 and not set(first) & set(started(seed=4))


@pytest.mark.parametrize("limits, assistant_turns", [({"max_user_turns": 2}, 3), ({"max_assistant_turns": 2}, 2)])
def test_interaction_turns_stop_at_the_turn_limits(tok, limits, assistant_turns):
    """The interaction keeps answering (never 'bye'): the conversation stops when the next model turn would pass
    max_user_turns, or at max_assistant_turns; the interaction is not asked after the last turn."""
    echo = tool_fixtures.EchoInteraction({"name": "echo"})
    (conv,), _ = run_loop(tok, {}, {"Q?": ["hello"]}, interactions={"echo": echo},
                          extra_info={"interaction_kwargs": {"name": "echo"}}, **limits)
    assert conv.assistant_turns == assistant_turns and conv.user_turns == assistant_turns - 1
    assert conv.user_turn_rewards == [5.0] * (assistant_turns - 1) and len(echo.seen) == assistant_turns - 1
    assert conv.messages[-1] == {"role": "assistant", "content": "hello"}


def test_interaction_reply_that_leaves_no_room_ends_the_conversation(tok):
    """The budget is the whole conversation's: a reply whose tokens would leave no room for another model token is
    not appended (the score it came with is kept), so the conversation still ends on a model token."""
    echo = tool_fixtures.EchoInteraction({"name": "echo"})
    first = len(ids(tok, "hello" + EOS))
    (conv,), _ = run_loop(tok, {}, {"Q?": ["hello"]}, interactions={"echo": echo}, response_length=first + 3,
                          extra_info={"interaction_kwargs": {"name": "echo"}})
    assert conv.mask == [1] * first and conv.user_turn_rewards == [5.0] and conv.user_turns == 0


def test_rows_without_interaction_kwargs_take_no_part_and_name_defaults_to_gsm8k(tok):
    """Two rows: one without interaction_kwargs (ends after its first turn, as without interactions), one whose
    interaction_kwargs has no name (verl v0.5.0 gives it 'gsm8k')."""
    script = {"A?": ["#### 1", "#### 2"], "B?": ["#### 1", "#### 2"]}
    loop = agent.AgentLoop(tok, {}, multi_turn(), 512, eos_ids=[tok.eos_token_id], chat_template=TOOL_CHAT_TEMPLATE,
                           interactions=gsm8k_interaction())
    rows = {"raw_prompt_ids": [], "raw_prompt": [], "extra_info": [{}, {"interaction_kwargs": {"ground_truth": "2"}}]}
    for question in script:
        messages = [{"role": "user", "content": question}]
        rows["raw_prompt"].append(messages)
        rows["raw_prompt_ids"].append(ids(tok, tok.apply_chat_template(
            messages, chat_template=TOOL_CHAT_TEMPLATE, add_generation_prompt=True, tokenize=False)))
    plain, asked = loop.run(rows, agent.engine_generate(ScriptedEngine(tok, script), Sampling(max_tokens=512),
                                                        batched=True), seed=0)
    assert (plain.assistant_turns, plain.user_turn_rewards, plain.interaction) == (1, [], None)
    assert (asked.assistant_turns, asked.user_turn_rewards) == (2, [0.0, 1.0])


@pytest.mark.parametrize("cls", ["RaisingInteraction", "SlowInteraction", "MalformedInteraction",
                                 "FailingStartInteraction"])
def test_interaction_failures_end_the_conversation_counted_and_warned(tok, cls):
    """A generate_response that raises, runs past its timeout or answers malformed ends its conversation after the
    model's turn; a start_interaction that fails leaves the conversation without one. Counted, warned once."""
    interaction = getattr(tool_fixtures, cls)({"name": "x"})
    interaction.timeout = 0.2
    with pytest.warns(UserWarning, match="interaction 'x': .*counted in multi_turn/interaction_errors"):
        (conv,), _ = run_loop(tok, {}, {"Q?": ["hello"]}, interactions={"x": interaction},
                              extra_info={"interaction_kwargs": {"name": "x"}})
    assert (conv.interaction_errors, conv.assistant_turns, conv.user_turn_rewards) == (1, 1, [])
    assert agent.multi_turn_metrics(agent.conversations_to_batch(
        {"input_ids": torch.tensor([conv.prompt_ids]), "attention_mask": torch.ones(1, len(conv.prompt_ids)),
         "position_ids": torch.arange(len(conv.prompt_ids)).unsqueeze(0)}, [conv], 32, 0, [{}])
    )["multi_turn/interaction_errors"] == 1


def test_rows_naming_an_interaction_the_yaml_lacks_are_refused(tok):
    rows = [("train.parquet, row 0", {"extra_info": {"interaction_kwargs": {"name": "gsm8k"}}}),
            ("train.parquet, row 1", {"extra_info": {"interaction_kwargs": {"name": "judge", "ground_truth": "1"}}})]
    with pytest.raises(ConfigError, match="data file train.parquet, row 1: extra_info.interaction_kwargs names "
                                          "interaction 'judge', but .*interaction_config_path has only 'gsm8k'"):
        interactions.check_rows(gsm8k_interaction(), rows, "data file")
    nameless = [("t, row 5", {"extra_info": {"interaction_kwargs": {"ground_truth": "1"}}})]
    with pytest.raises(ConfigError, match="without a name, which means 'gsm8k'"):
        interactions.check_rows({"echo": None}, nameless, "data file")
    interactions.check_rows(gsm8k_interaction(), rows[:1] + [("t, row 2", {"extra_info": {}})], "data file")
    for kwargs, message in (("gsm8k", "must be a mapping .*got str"), ({"name": 3}, "name must be a string, got 3")):
        with pytest.raises(ConfigError, match=f"data file t, row 7: extra_info.interaction_kwargs.{message}"):
            interactions.check_rows(gsm8k_interaction(), [("t, row 7", {"extra_info": {"interaction_kwargs": kwargs}})],
                                    "data file")
    with pytest.raises(ValueError, match="names interaction 'judge'; the interaction yaml has 'gsm8k'"):
        run_loop(tok, {}, {"Q?": ["a"]}, interactions=gsm8k_interaction(),
                 extra_info={"interaction_kwargs": {"name": "judge"}})


# verl's examples/sglang_multiturn/config/interaction_config/gsm8k_interaction_config.yaml (v0.5.0), verbatim
VERL_GSM8K_INTERACTION_YAML = """\
interaction:
  - name: "gsm8k"
    class_name: "verl.interactions.gsm8k_interaction.Gsm8kInteraction"
    config: {}
"""


def test_verl_gsm8k_interaction_yaml_loads_and_names_default_from_the_class(tmp_path):
    path = tmp_path / "interaction.yaml"
    path.write_text(VERL_GSM8K_INTERACTION_YAML)
    (name, interaction), = interactions.load_interactions(path).items()
    assert name == "gsm8k" and type(interaction) is interactions.Gsm8kInteraction
    assert interaction.config == {"name": "gsm8k"} and interaction.timeout == 30.0
    path.write_text("interaction:\n  - class_name: tool_fixtures.EchoInteraction\n    config: {timeout: 2}\n")
    (name, interaction), = interactions.load_interactions(path).items()
    assert name == "echo" and interaction.timeout == 2.0 and interaction.config == {"timeout": 2, "name": "echo"}


@pytest.mark.parametrize("content, message", [
    ({"interaction": []}, "expected a top-level 'interaction:' list"),
    ({"tools": [{"class_name": "x.Y"}]}, "expected a top-level 'interaction:' list"),
    ({"interaction": [{"name": "g"}]}, "interaction[0]: needs 'class_name'"),
    ({"interaction": [{"class_name": "nowhere.Judge"}]}, "cannot import 'nowhere'"),
    ({"interaction": [{"class_name": "verl.interactions.weather_interaction.WeatherInteraction"}]},
     "of verl's interactions minirl has verl.interactions.gsm8k_interaction.Gsm8kInteraction"),
    ({"interaction": [{"class_name": "interactions.Gsm8kInteracton"}]}, "did you mean 'Gsm8kInteraction'?"),
    ({"interaction": [{"class_name": "tools.BaseTool"}]}, "has no async 'start_interaction'"),
    ({"interaction": [{"class_name": "interactions.BaseInteraction", "config": [1]}]}, "'config' must be a mapping"),
    ({"interaction": [{"class_name": "interactions.BaseInteraction", "config": {"timeout": 0}}]}, "config.timeout"),
    ({"interaction": [{"class_name": "interactions.Gsm8kInteraction"},
                      {"name": "gsm8k", "class_name": "interactions.BaseInteraction"}]},
     "interaction[1]: a second interaction named 'gsm8k'"),
])
def test_invalid_interaction_yaml_is_a_clear_error(tmp_path, content, message):
    import yaml
    path = tmp_path / "interaction.yaml"
    path.write_text(yaml.safe_dump(content))
    with pytest.raises(ConfigError) as err:
        interactions.load_interactions(path)
    assert message in str(err.value)
    assert str(err.value).startswith(f"actor_rollout_ref.rollout.multi_turn.interaction_config_path '{path}'")
    with pytest.raises(ConfigError, match="interaction_config_path '.*missing.yaml' does not exist"):
        interactions.load_interactions(tmp_path / "missing.yaml")


def test_gsm8k_interaction_rows_are_verls(tmp_path):
    """`data.py gsm8k --interaction`: the row verl's gsm8k_multiturn_w_interaction.py writes, written out here."""
    import data
    import pyarrow.parquet as pq
    (tmp_path / "in").mkdir()
    example = {"question": "Tom has 3 apples and buys 4 more. How many?", "answer": "3 + 4 = 7\n#### 7"}
    for split in ("train", "test"):
        (tmp_path / "in" / f"{split}.jsonl").write_text(json.dumps(example) + "\n")
    data.main(["gsm8k", "--interaction", "--input", str(tmp_path / "in"), "--out", str(tmp_path / "out")])
    (row,) = pq.read_table(tmp_path / "out" / "train.parquet").to_pylist()
    asked = example["question"] + " Let's think step by step and output the final answer after `####`."
    assert row == {
        "data_source": "openai/gsm8k", "ability": "math",
        "prompt": [{"role": "system", "content": "You are a math expert. You are given a question and you need to "
                    "solve it step by step. You should rethinking carefully if user point out your answer is wrong. "
                    "Put your final answer in the format of `#### <answer>`."}, {"role": "user", "content": asked}],
        "reward_model": {"style": "rule", "ground_truth": "7"},
        "extra_info": {"split": "train", "index": 0, "answer": example["answer"], "question": example["question"],
                       "interaction_kwargs": {"name": "gsm8k", "query": asked, "ground_truth": "7"}}}
    written = tmp_path / "out" / "gsm8k_interaction_config.yaml"             # with verl's interaction yaml
    assert yaml.safe_load(written.read_text()) == yaml.safe_load(VERL_GSM8K_INTERACTION_YAML)
    assert list(interactions.load_interactions(written)) == ["gsm8k"]
    with pytest.raises(ValueError, match="--multiturn and --interaction"):
        data.preprocess_gsm8k(tmp_path / "in", tmp_path / "both", multiturn=True, interaction=True)
    with pytest.raises(SystemExit) as exit_:          # the command line refuses both, as argparse does
        data.main(["gsm8k", "--multiturn", "--interaction", "--input", str(tmp_path / "in"), "--out",
                   str(tmp_path / "both")])
    assert exit_.value.code == 2 and not (tmp_path / "both").exists()


def test_interaction_turn_scores_may_be_numpy_scalars_or_none(tok):
    """A turn score computed with numpy is a number like any other; None (verl's agent loop allows it) is not
    kept."""
    import numpy as np

    class NumpyScores(interactions.BaseInteraction):
        async def generate_response(self, instance_id, messages, **kwargs):
            turn = sum(m["role"] == "assistant" for m in messages)
            return np.bool_(turn == 3), "again", (np.float32(0.5) if turn == 1 else None), {}

    (conv,), _ = run_loop(tok, {}, {"Q?": ["a"]}, interactions={"n": NumpyScores({"name": "n"})},
                          extra_info={"interaction_kwargs": {"name": "n"}})
    assert (conv.assistant_turns, conv.user_turns, conv.interaction_errors) == (3, 2, 0)
    assert conv.user_turn_rewards == [0.5] and type(conv.user_turn_rewards[0]) is float


class ImageRecordingEngine(ScriptedEngine):
    """ScriptedEngine that keeps each call's multi_modal argument (None when not passed)."""

    def __init__(self, tokenizer, script):
        super().__init__(tokenizer, script)
        self.images = []

    def generate(self, prompt_ids, sampling, seed, multi_modal=None):
        self.images.append(multi_modal)
        return super().generate(prompt_ids, sampling, seed)


@pytest.mark.parametrize("batched", [True, False])
def test_every_turn_of_a_prompt_with_images_is_generated_with_them(tok, batched):
    """Two rows, one with an image: each of its turns reaches the engine with the image, and with the expanded
    prompt ids continued by the conversation so far (what the hf engine generates from); the text row's turns
    carry none (batched: a stand-in entry without images; one request per call: no argument at all)."""
    echo = tool_fixtures.EchoInteraction({"name": "echo"})
    script = {"A?": ["one", "bye"], "B?": ["two", "bye"]}
    loop = agent.AgentLoop(tok, {}, multi_turn(), 512, eos_ids=[tok.eos_token_id], chat_template=TOOL_CHAT_TEMPLATE,
                           interactions={"echo": echo})
    rows = {"raw_prompt_ids": [], "raw_prompt": [], "extra_info": [{"interaction_kwargs": {"name": "echo"}}] * 2}
    for question in script:
        messages = [{"role": "user", "content": question}]
        rows["raw_prompt"].append(messages)
        rows["raw_prompt_ids"].append(ids(tok, tok.apply_chat_template(
            messages, chat_template=TOOL_CHAT_TEMPLATE, add_generation_prompt=True, tokenize=False)))
    picture, expanded = object(), [7, 7, 7] + rows["raw_prompt_ids"][0]     # stand-ins: a PIL image, its tokens
    multi_modal = [{"images": [picture], "prompt_ids": expanded, "inputs": {"pixel_values": "px"}},
                   {"images": [], "prompt_ids": rows["raw_prompt_ids"][1], "inputs": {}}]
    engine = ImageRecordingEngine(tok, script)
    with_image, text = loop.run(rows, agent.engine_generate(engine, Sampling(max_tokens=512), batched=batched), seed=0,
                                multi_modal=multi_modal)
    assert with_image.assistant_turns == text.assistant_turns == 2
    first_turn = ids(tok, "one" + EOS)
    between = ids(tok, "\n<|im_start|>user\nheard one<|im_end|>\n<|im_start|>assistant\n")
    if batched:
        assert len(engine.images) == 2 and all(len(call) == 2 for call in engine.images)
        image_entries = [call[0] for call in engine.images]
        assert all(call[1] == {"images": [], "prompt_ids": call[1]["prompt_ids"], "inputs": {}}
                   for call in engine.images)
    else:
        assert len(engine.images) == 4
        image_entries = [call[0] for call in engine.images if call is not None]
        assert sum(call is None for call in engine.images) == 2
    assert [e["images"] for e in image_entries] == [[picture], [picture]]
    assert all(e["inputs"] == {"pixel_values": "px"} for e in image_entries)
    assert [e["prompt_ids"] for e in image_entries] == [expanded, expanded + first_turn + between]
    assert with_image.response_ids == first_turn + between + ids(tok, "bye" + EOS)
