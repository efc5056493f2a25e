"""Tests for demo.py: the tiny local tokenizer and models, and the demo's assets (model, data, warm-up).
Run: HF_HUB_OFFLINE=1 .venv/bin/python -m pytest tests/test_demo.py -q"""

import re

import pyarrow.parquet as pq
import pytest
import torch
from transformers import (AutoModelForCausalLM, AutoModelForSequenceClassification, AutoModelForTokenClassification,
                          AutoTokenizer)

from data import PromptLoader, RLHFDataset


@pytest.fixture(scope="module")
def tokenizer(tiny_tokenizer_dir):
    return AutoTokenizer.from_pretrained(tiny_tokenizer_dir)


def test_special_tokens_are_single_ids(tokenizer):
    ids = tokenizer.encode("<|im_start|>user<|im_end|><|endoftext|>", add_special_tokens=False)
    assert len(ids) == 4
    assert tokenizer.convert_ids_to_tokens([ids[0], ids[2], ids[3]]) == ["<|im_start|>", "<|im_end|>",
                                                                         "<|endoftext|>"]
    assert tokenizer.eos_token == "<|im_end|>" and tokenizer.pad_token == "<|endoftext|>"
    assert tokenizer.eos_token_id == ids[2] and tokenizer.pad_token_id == ids[3]
    assert len(tokenizer) == 512
    assert tokenizer.decode(tokenizer.encode("#### 18 apples", add_special_tokens=False)) == "#### 18 apples"


def test_tiny_models_shapes_and_head_dim(tiny_model_dir, tiny_rm_dir, tiny_critic_dir):
    input_ids = torch.tensor([[5, 6, 7, 8], [9, 10, 11, 12]])  # [B=2, T=4]
    causal = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    assert causal.model.layers[0].self_attn.head_dim == 32  # hidden 64 / 2 heads: vLLM-CPU's minimum
    assert causal.config.num_key_value_heads == 1 and causal.config.num_hidden_layers == 2
    assert causal.lm_head.weight.data_ptr() == causal.model.embed_tokens.weight.data_ptr()  # tied
    assert causal(input_ids).logits.shape == (2, 4, 512)
    reward_model = AutoModelForSequenceClassification.from_pretrained(tiny_rm_dir)
    assert reward_model.config.pad_token_id == AutoTokenizer.from_pretrained(tiny_rm_dir).pad_token_id
    assert reward_model(input_ids).logits.shape == (2, 1)
    critic = AutoModelForTokenClassification.from_pretrained(tiny_critic_dir)
    assert critic(input_ids).logits.shape == (2, 4, 1)
    assert critic.dtype == torch.float32


def test_demo_assets_reload_and_template(demo_dir):
    model_dir = demo_dir / "model"
    assert (model_dir / "model.safetensors").is_file()
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir)
    assert model.config.vocab_size == len(tokenizer) == 512 and model.config.hidden_size == 64
    assert model.config.intermediate_size == 128 and model.config.max_position_embeddings == 512
    assert model.model.layers[0].self_attn.head_dim == 32 and model.dtype == torch.float32
    text = tokenizer.apply_chat_template([{"role": "user", "content": "What is 3 + 5?"}],
                                         add_generation_prompt=True, tokenize=False)
    assert text == "<|im_start|>user\nWhat is 3 + 5?<|im_end|>\n<|im_start|>assistant\n"

    train = pq.read_table(demo_dir / "data" / "train.parquet").to_pylist()
    test = pq.read_table(demo_dir / "data" / "test.parquet").to_pylist()
    assert len(train) == 1000 and len(test) == 100
    assert sorted((r["extra_info"]["a"], r["extra_info"]["b"]) for r in test) == [(a, b) for a in range(10)
                                                                                 for b in range(10)]
    row = test[0]
    a, b = row["extra_info"]["a"], row["extra_info"]["b"]
    assert row["prompt"] == [{"role": "user", "content": f"What is {a} + {b}? Answer with #### and the number."}]
    assert row["reward_model"] == {"style": "rule", "ground_truth": str(a + b)}
    assert (row["data_source"], row["ability"], row["extra_info"]["split"]) == ("minirl/add", "math", "test")


def test_demo_model_is_warmed_up_to_partial_accuracy(demo_dir):
    """Greedy answers of the saved model, scored here independently: in format, right on roughly 15-40%."""
    tokenizer = AutoTokenizer.from_pretrained(demo_dir / "model")
    model = AutoModelForCausalLM.from_pretrained(demo_dir / "model")
    rows = pq.read_table(demo_dir / "data" / "test.parquet").to_pylist()
    prompts = [f"<|im_start|>user\n{r['prompt'][0]['content']}<|im_end|>\n<|im_start|>assistant\n" for r in rows]
    input_ids = torch.tensor([tokenizer.encode(p, add_special_tokens=False) for p in prompts])  # [100, P]
    with torch.no_grad():
        output = model.generate(input_ids, attention_mask=torch.ones_like(input_ids), do_sample=False,
                                max_new_tokens=8)  # [100, P + 8]
    answers = [re.findall(r"#### (\d+)", t) for t in tokenizer.batch_decode(output[:, input_ids.shape[1]:])]
    in_format = sum(bool(found) for found in answers)
    correct = sum(bool(found) and found[-1] == r["reward_model"]["ground_truth"] for found, r in zip(answers, rows))
    assert in_format >= 90
    assert 15 <= correct <= 45


def test_demo_parquet_through_dataset_and_loader(demo_dir):
    model_tokenizer = AutoTokenizer.from_pretrained(demo_dir / "model")
    ds = RLHFDataset(demo_dir / "data" / "train.parquet", model_tokenizer, max_prompt_length=32)
    loader = PromptLoader(ds, batch_size=64, seed=1)
    assert len(loader) == 1000 // 64
    batch = next(iter(loader))
    assert batch["input_ids"].shape == (64, 32) and batch["attention_mask"].shape == (64, 32)
    assert batch["index"] == [extra["index"] for extra in batch["extra_info"]]
    assert set(batch["data_source"]) == {"minirl/add"}
