"""The tool demo (demo_tools.py): the warm-up's examples are laid out as the chat template writes the conversation;
the warmed-up model leaves GRPO something to learn from (it reads the code out of the tool's answer, and samples
the call on some prompts but not all, so groups of 8 mix tool conversations, reward ~1, with guesses, ~0.19),
measured independently of demo_tools' own evaluators (plain unpadded forwards, HF generate on text the chat
template renders); and the README's RL run raises the validation reward.
Run: HF_HUB_OFFLINE=1 .venv/bin/python -m pytest tests/test_demo_tools.py -q   (about 3 minutes: a real warm-up)"""
import json
import random

import pyarrow.parquet as pq
import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

import demo_tools
from launch import ROOT, torchrun
from tools import load_tools


@pytest.fixture(scope="module")
def tool_tokenizer(tmp_path_factory):
    out = tmp_path_factory.mktemp("tool_tokenizer")
    (out / "tools.yaml").write_text(json.dumps(demo_tools.TOOL_YAML))
    return demo_tools.build_tool_tokenizer(out), load_tools(out / "tools.yaml")


def conversation_text(tokenizer, tool_map, row, code):
    """The whole tool conversation as the chat template renders it."""
    schemas = [dict(t.get_openai_tool_schema()) for t in tool_map.values()]
    messages = row["prompt"] + [{"role": "assistant", "content": demo_tools.CALL},
                                {"role": "tool", "content": f"code {code}"},
                                {"role": "assistant", "content": f"#### {code}"}]
    return tokenizer.apply_chat_template(messages, tools=schemas, tokenize=False)


def test_warmup_examples_follow_the_template_and_train_only_the_model_turns(tool_tokenizer):
    tokenizer, tool_map = tool_tokenizer
    rows = demo_tools.rows("train", 200)
    examples = demo_tools.warmup_examples(tokenizer, tool_map, rows, 0.3, random.Random(0))
    calls = 0
    for row, (ids, labels) in zip(rows, examples):
        code = row["extra_info"]["tools_kwargs"]["open_box"]["create_kwargs"]["code"]
        trained = tokenizer.decode([t for t, lab in zip(ids, labels) if lab != -100])
        text = tokenizer.decode(ids)
        assert len(ids) == len(labels) and all(lab in (-100, t) for t, lab in zip(ids, labels))
        if "<tool_call>" in text:
            calls += 1
            # the conversation as the template renders it, minus the template's newline after the last turn
            assert text == conversation_text(tokenizer, tool_map, row, code).rstrip("\n")
            assert trained == f"{demo_tools.CALL}<|im_end|>#### {code}<|im_end|>"   # not the tool's answer
        else:
            assert trained in {f"#### {d}<|im_end|>" for d in range(10)} and text.endswith(trained)
    assert 40 <= calls <= 80                     # 30% of 200, within about 3 standard deviations


@pytest.fixture(scope="module")
def tools_demo(tmp_path_factory):
    out = tmp_path_factory.mktemp("demo_tools")
    demo_tools.make_assets(out)
    tokenizer = AutoTokenizer.from_pretrained(out / "model")
    model = AutoModelForCausalLM.from_pretrained(out / "model").eval()
    return out, tokenizer, model, load_tools(out / "tools.yaml")


def test_warmed_up_model_reads_the_tool_and_calls_it_on_some_samples(tools_demo):
    out, tokenizer, model, tool_map = tools_demo
    rows = pq.read_table(out / "data" / "test.parquet").to_pylist()
    schemas = [dict(t.get_openai_tool_schema()) for t in tool_map.values()]
    call_start = tokenizer.encode("<tool_call>", add_special_tokens=False)[0]
    call_probs, read = [], 0
    for row in rows:
        prompt = tokenizer.apply_chat_template(row["prompt"], tools=schemas, add_generation_prompt=True,
                                               tokenize=False)
        with torch.no_grad():
            logits = model(torch.tensor([tokenizer.encode(prompt, add_special_tokens=False)])).logits   # [1, P, V]
        call_probs.append(logits[0, -1].softmax(-1)[call_start].item())
        code = row["reward_model"]["ground_truth"]
        before_answer = conversation_text(tokenizer, tool_map, row, code).rsplit("#### ", 1)[0]
        ids = torch.tensor([tokenizer.encode(before_answer, add_special_tokens=False)])                  # [1, T]
        with torch.no_grad():
            answer = model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False, max_new_tokens=6)
        read += tokenizer.decode(answer[0, ids.shape[1]:], skip_special_tokens=True).startswith(f"#### {code}")
    assert read >= 0.75 * len(rows)              # with the tool's answer in front of it, the model reports it (vs 10%)
    # a group of 8 samples holds both calls and guesses unless all 8 agree: expected share of mixed groups
    mixed = sum(1 - p ** 8 - (1 - p) ** 8 for p in call_probs) / len(call_probs)
    assert 0.05 <= sum(call_probs) / len(call_probs) <= 0.6 and mixed >= 0.5
    warmup = json.loads((out / "warmup.json").read_text())
    assert warmup["call_probability"] == pytest.approx(sum(call_probs[:32]) / 32, abs=1e-4)   # its 32 eval rows


def test_grpo_on_the_demo_raises_the_validation_reward(tools_demo, tmp_path):
    """The README's command (hf engine, async, lr 3e-4), cut to 8 steps: greedy validation goes from guessing
    (the model never calls the tool greedily) to reading the tool's answer."""
    out = tools_demo[0]
    torchrun(2, "minirl.py", "--config", ROOT / "config.yaml", f"actor_rollout_ref.model.path={out}/model",
             f"data.train_files={out}/data/train.parquet", f"data.val_files={out}/data/test.parquet",
             "data.return_raw_chat=True", "data.max_response_length=64",
             "actor_rollout_ref.rollout.multi_turn.enable=True", "actor_rollout_ref.rollout.mode=async",
             f"actor_rollout_ref.rollout.multi_turn.tool_config_path={out}/tools.yaml",
             "actor_rollout_ref.actor.optim.lr=3e-4", "trainer.total_training_steps=8", "trainer.test_freq=8",
             f"af_output_dir={tmp_path}", "trainer.logger=[console]")
    rows = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    val = {r["step"]: r["val-core/minirl/box/reward/mean@1"] for r in rows if "val-core/minirl/box/reward/mean@1" in r}
    calls = [r["tool_calls/per_conversation"] for r in rows if "tool_calls/per_conversation" in r]
    assert sorted(val) == [0, 8]
    assert val[0] < 0.35 and val[8] > val[0] + 0.3
    assert calls[-1] > calls[0] + 0.3            # sampled conversations call the tool far more often
