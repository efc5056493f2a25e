"""The tool-use demo (`python data.py demo-tools --out DIR`): a task the tiny model cannot solve without its tool.

Each prompt asks for the code hidden in a box; the code is a random digit drawn per row, so nothing in the prompt
or the weights can predict it. The `open_box` tool (this module's BoxTool) returns it: the row's tools_kwargs give
the tool the code (create_kwargs), as verl's gsm8k rows give Gsm8kTool the ground truth. The reward is 1.0 for the
right '#### code', 0.1 for a wrong number: about 0.19 for a guess, about 1.0 after opening the box.

The supervised warm-up (warm_up_tool_model) trains on whole conversations as the agent loop lays them out (the
tool's answer masked out of the loss, as in RL), in two phases: every example calls the tool and reports its code,
until the model reads the code out of the tool's answer; then 30% of the examples call the tool and the rest guess
'#### d' without it, until the model samples the call on at most ~40% of the prompts. RL then starts from a policy
that reads the tool but calls it on about a quarter of its samples (and guesses when greedy), so a GRPO group of 8
holds both kinds of conversation, and learns to call the tool. (Warming up every row with the call and noisy
answers instead left one digit token among ~35 trained tokens to carry the signal, and RL did not raise the reward.)

Left out: anything but hermes-format calls. The model is `data.py demo`'s tiny Qwen2 at hidden size 128 (4 heads):
at 64 it does not learn to copy the code out of the tool's answer.
"""
from __future__ import annotations

import json
import random
from pathlib import Path

import torch

from demo import teacher_forcing_batch, warm_up
from rewards import minirl_add_compute_score
from tools import BaseTool

# A Qwen2.5-style template cut to the bone: tool names in a system block, tool answers as <tool_response> blocks
# in a user turn (consecutive tool messages share one turn), assistant tool calls kept as the text the model wrote.
TOOL_CHAT_TEMPLATE = (
    "{%- if tools %}{{- '<|im_start|>system\\n' }}"
    "{%- if messages[0].role == 'system' %}{{- messages[0].content + '\\n' }}{%- endif %}"
    "{{- 'Tools:' }}{%- for tool in tools %}{{- ' ' + tool.function.name }}{%- endfor %}{{- '<|im_end|>\\n' }}"
    "{%- elif messages[0].role == 'system' %}{{- '<|im_start|>system\\n' + messages[0].content + '<|im_end|>\\n' }}"
    "{%- endif %}"
    "{%- for message in messages %}"
    "{%- if message.role == 'system' and loop.first %}"
    "{%- elif message.role == 'tool' %}"
    "{%- if loop.first or messages[loop.index0 - 1].role != 'tool' %}{{- '<|im_start|>user' }}{%- endif %}"
    "{{- '\\n<tool_response>\\n' + message.content + '\\n</tool_response>' }}"
    "{%- if loop.last or messages[loop.index0 + 1].role != 'tool' %}{{- '<|im_end|>\\n' }}{%- endif %}"
    "{%- else %}{{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>\\n' }}{%- endif %}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)


class BoxTool(BaseTool):
    """open_box: returns the code of the row's box (create_kwargs: code). calc_reward: 1.0 once opened."""

    def __init__(self, config, tool_schema):
        super().__init__(config, tool_schema)
        self.boxes = {}

    async def create(self, instance_id=None, code=None, **kwargs):
        instance_id = await super().create(instance_id)
        self.boxes[instance_id] = {"code": code, "opened": False}
        return instance_id

    async def execute(self, instance_id, parameters, **kwargs):
        box = self.boxes[instance_id]
        box["opened"] = True
        return f"code {box['code']}", 0.0, {}

    async def calc_reward(self, instance_id, **kwargs):
        return 1.0 if self.boxes[instance_id]["opened"] else 0.0

    async def release(self, instance_id, **kwargs):
        self.boxes.pop(instance_id, None)


# ----------------------------------------------------------------------------------------------------------------
# The task, the warm-up, the assets

DATA_SOURCE = "minirl/box"
PROMPT = "Open box {box} and report its code as #### code."
TOOL_NAME = "open_box"
TOOL_YAML = {"tools": [{
    "class_name": "demo_tools.BoxTool", "config": {"type": "native", "timeout": 10},
    "tool_schema": {"type": "function", "function": {
        "name": TOOL_NAME, "description": "Open the box and read the code inside.",
        "parameters": {"type": "object", "properties": {}, "required": []}}}}]}
CALL = '<tool_call>{"name": "open_box", "arguments": {}}</tool_call>'


def rows(split, count, seed=0):
    """verl-format rows: a random box number for the prompt and a random code (0-9) only the tool reveals."""
    rng = random.Random(f"box-{split}-{seed}")
    out = []
    for index in range(count):
        code = rng.randrange(10)
        out.append({"data_source": DATA_SOURCE, "ability": "tool",
                    "prompt": [{"role": "user", "content": PROMPT.format(box=rng.randrange(1, 10))}],
                    "reward_model": {"style": "rule", "ground_truth": str(code)},
                    "extra_info": {"split": split, "index": index, "need_tools_kwargs": True,
                                   "tools_kwargs": {TOOL_NAME: {"create_kwargs": {"code": code}}}}})
    return out


class ModelEngine:
    """A greedy, left-padded HF generate over an in-memory model, with the rollout engines' interface (for the
    warm-up's checks through the real agent loop)."""

    def __init__(self, model, tokenizer):
        self.model, self.tokenizer = model, tokenizer

    @torch.no_grad()
    def generate(self, prompt_ids, sampling, seed):
        from data import left_pad
        width = max(len(p) for p in prompt_ids)
        padded = [left_pad(p, width, self.tokenizer.pad_token_id) for p in prompt_ids]
        out = self.model.generate(input_ids=torch.stack([i for i, _ in padded]),
                                  attention_mask=torch.stack([m for _, m in padded]), do_sample=False,
                                  max_new_tokens=sampling.max_tokens, eos_token_id=self.tokenizer.eos_token_id,
                                  pad_token_id=self.tokenizer.pad_token_id)
        tokens = []
        for row in out[:, width:].tolist():
            end = row.index(self.tokenizer.eos_token_id) + 1 if self.tokenizer.eos_token_id in row else len(row)
            tokens.append(row[:end])
        return tokens, None


def agent_loop(tokenizer, tool_map, response_length=48):
    from agent import AgentLoop
    from config import Config, default_tree
    multi_turn = Config.wrap(default_tree()["actor_rollout_ref"]["rollout"]["multi_turn"])
    multi_turn.update(enable=True, max_assistant_turns=3, max_user_turns=2)
    return AgentLoop(tokenizer, tool_map, multi_turn, response_length, eos_ids=[tokenizer.eos_token_id],
                     chat_template=TOOL_CHAT_TEMPLATE)


def evaluate(model, tokenizer, tool_map, eval_rows):
    """Greedy conversations through the agent loop -> (fraction that called the tool, accuracy of '#### code')."""
    from agent import engine_generate
    from data import collate
    from rollout import Sampling
    loop = agent_loop(tokenizer, tool_map)
    batch = collate([{"raw_prompt_ids": _prompt_ids(tokenizer, tool_map, row), "raw_prompt": row["prompt"],
                      "extra_info": row["extra_info"]} for row in eval_rows])
    was_training = model.training
    model.eval()
    conversations = loop.run(batch, engine_generate(ModelEngine(model, tokenizer), Sampling(max_tokens=48), True), 0)
    model.train(was_training)
    called = sum(c.tool_calls > 0 for c in conversations) / len(conversations)
    correct = sum(minirl_add_compute_score(c.messages[-1]["content"], row["reward_model"]["ground_truth"]) == 1.0
                  for c, row in zip(conversations, eval_rows)) / len(conversations)
    return called, correct


def _prompt_ids(tokenizer, tool_map, row):
    schemas = [dict(t.get_openai_tool_schema()) for t in tool_map.values()]
    text = tokenizer.apply_chat_template(row["prompt"], tools=schemas, add_generation_prompt=True, tokenize=False)
    return tokenizer.encode(text, add_special_tokens=False)


def _call_ids(tokenizer, loop, code):
    """The model's call (ended by its eos) and the template's tokens of the tool's answer up to the next turn."""
    eos = tokenizer.eos_token_id
    return (tokenizer.encode(CALL, add_special_tokens=False) + [eos],
            loop.between_turns_ids([{"role": "tool", "content": f"code {code}"}], eos))


def warmup_examples(tokenizer, tool_map, train_rows, call_rate, rng):
    """(ids, labels) of whole conversations as the agent loop lays them out. With probability call_rate: the
    prompt, the call (trained), the tool turn (not trained: label -100), '#### code' (trained); otherwise a guess
    without the tool: the prompt, '#### d' for a random digit d (trained)."""
    loop = agent_loop(tokenizer, tool_map)
    eos = tokenizer.eos_token_id
    examples = []
    for row in train_rows:
        code = row["extra_info"]["tools_kwargs"][TOOL_NAME]["create_kwargs"]["code"]
        prompt = _prompt_ids(tokenizer, tool_map, row)
        if rng.random() < call_rate:
            call, between = _call_ids(tokenizer, loop, code)
            final = tokenizer.encode(f"#### {code}", add_special_tokens=False) + [eos]
            examples.append((prompt + call + between + final,
                             [-100] * len(prompt) + call + [-100] * len(between) + final))
        else:
            guess = tokenizer.encode(f"#### {rng.randrange(10)}", add_special_tokens=False) + [eos]
            examples.append((prompt + guess, [-100] * len(prompt) + guess))
    return examples


@torch.no_grad()
def call_probability(model, tokenizer, tool_map, eval_rows):
    """The mean probability, at temperature 1, that the first token of the answer starts a tool call."""
    from data import left_pad
    prompts = [_prompt_ids(tokenizer, tool_map, row) for row in eval_rows]
    width = max(len(p) for p in prompts)
    padded = [left_pad(p, width, tokenizer.pad_token_id) for p in prompts]
    input_ids = torch.stack([ids for ids, _ in padded])                              # [N, P]
    attention_mask = torch.stack([mask for _, mask in padded])                       # [N, P]
    position_ids = (attention_mask.cumsum(-1) - 1).clamp(min=0)                      # [N, P]
    logits = model(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids).logits[:, -1]
    first = tokenizer.encode(CALL, add_special_tokens=False)[0]
    return logits.float().softmax(-1)[:, first].mean().item()


def copy_accuracy(model, tokenizer, tool_map, eval_rows):
    """Greedy '#### code' after the call and the tool's answer (given): how often the model reads the code."""
    from rollout import Sampling
    loop = agent_loop(tokenizer, tool_map)
    prefixes = []
    for row in eval_rows:
        code = row["extra_info"]["tools_kwargs"][TOOL_NAME]["create_kwargs"]["code"]
        call, between = _call_ids(tokenizer, loop, code)
        prefixes.append(_prompt_ids(tokenizer, tool_map, row) + call + between)
    was_training = model.training
    model.eval()
    answers, _ = ModelEngine(model, tokenizer).generate(prefixes, Sampling(max_tokens=8), 0)
    model.train(was_training)
    return sum(minirl_add_compute_score(tokenizer.decode(answer, skip_special_tokens=True),
                                        row["reward_model"]["ground_truth"]) == 1.0
               for answer, row in zip(answers, eval_rows)) / len(eval_rows)


def warm_up_tool_model(model, tokenizer, tool_map, train_rows, eval_rows, *, seed=0, call_rate=0.3, lr=3e-3,
                       batch_size=32, check_every=10, target_copy_accuracy=0.9, max_steps=600):
    """Supervised warm-up (demo.warm_up) in two phases, each until its check holds or max_steps:
      1. reading: every example calls the tool, until greedy copy_accuracy >= target_copy_accuracy (reading the
         code out of the tool's answer is the slow part, so it gets every example);
      2. choosing: a call_rate share of the examples call the tool, the rest guess, until the model samples the
         call with call_probability <= call_rate + 0.1 and still reads the code.
    RL then starts from a policy that calls the tool on some samples and not others: GRPO's groups hold both.
    Returns {"reading_steps", "steps", "call_probability", "copy_accuracy"} and, greedily through the agent loop
    (what validation measures), "called_tool" and "accuracy"."""
    rng = random.Random(seed)
    phases = [(warmup_examples(tokenizer, tool_map, train_rows, 1.0, rng),
               lambda m: m["copy_accuracy"] >= target_copy_accuracy),
              (warmup_examples(tokenizer, tool_map, train_rows, call_rate, rng),
               lambda m: m["copy_accuracy"] >= target_copy_accuracy and m["call_probability"] <= call_rate + 0.1)]

    def measure():
        return {"call_probability": call_probability(model, tokenizer, tool_map, eval_rows),
                "copy_accuracy": copy_accuracy(model, tokenizer, tool_map, eval_rows)}

    reports = []
    for phase, (examples, until) in enumerate(phases):
        def batches(step, examples=examples):
            return teacher_forcing_batch([examples[(step * batch_size + i) % len(examples)]
                                          for i in range(batch_size)], tokenizer.pad_token_id)
        reports.append(warm_up(model, batches, measure, until, seed=seed + phase, lr=lr, check_every=check_every,
                               max_steps=max_steps))
    called, accuracy = evaluate(model, tokenizer, tool_map, eval_rows)
    return {"reading_steps": reports[0]["steps"], **reports[1], "steps": reports[0]["steps"] + reports[1]["steps"],
            "called_tool": called, "accuracy": accuracy}


def build_tool_tokenizer(out_dir):
    """The demo BPE, trained with the tool conversation's text too, with TOOL_CHAT_TEMPLATE; saved to out_dir."""
    from demo import build_tokenizer, default_tokenizer_corpus
    corpus = default_tokenizer_corpus() + [
        f"<|im_start|>system\nTools: {TOOL_NAME}<|im_end|>\n<|im_start|>user\n{PROMPT.format(box=b)}<|im_end|>\n"
        f"<|im_start|>assistant\n{CALL}<|im_end|>\n<|im_start|>user\n<tool_response>\ncode {b * 11}\n"
        f"</tool_response><|im_end|>\n<|im_start|>assistant\n#### {b * 11}<|im_end|>\n" for b in range(10)]
    return build_tokenizer(out_dir, corpus=corpus, chat_template=TOOL_CHAT_TEMPLATE)


def make_assets(out_dir, **warmup):
    """out_dir/model (tiny Qwen2 warmed up to read the tool's answer and call the tool on some prompts, tokenizer
    with TOOL_CHAT_TEMPLATE), out_dir/data/{train,test}.parquet, out_dir/tools.yaml, out_dir/warmup.json.
    Returns their paths. `warmup`: warm_up_tool_model's settings (tests cut it short)."""
    import pyarrow as pa
    import pyarrow.parquet as pq
    import yaml
    from demo import build_tiny_model
    from tools import load_tools
    out_dir = Path(out_dir)
    model_dir, data_dir = out_dir / "model", out_dir / "data"
    data_dir.mkdir(parents=True, exist_ok=True)
    split_rows = {"train": rows("train", 1000), "test": rows("test", 64)}
    for split, table in split_rows.items():
        pq.write_table(pa.Table.from_pylist(table), data_dir / f"{split}.parquet")
    (out_dir / "tools.yaml").write_text(yaml.safe_dump(TOOL_YAML, sort_keys=False))
    tool_map = load_tools(out_dir / "tools.yaml")
    tokenizer = build_tool_tokenizer(model_dir)
    model = build_tiny_model(tokenizer, kind="causal", seed=0, hidden_size=128)
    warmup = warm_up_tool_model(model, tokenizer, tool_map, split_rows["train"], split_rows["test"][:32], **warmup)
    model.save_pretrained(model_dir)
    (out_dir / "warmup.json").write_text(json.dumps(warmup, indent=1) + "\n")
    return {"model": model_dir, "train": data_dir / "train.parquet", "test": data_dir / "test.parquet",
            "tools": out_dir / "tools.yaml", "warmup": out_dir / "warmup.json"}
