"""Prompt data for minirl: verl-format parquet datasets, a resumable prompt loader, and the data-preparation
commands (GSM8K preprocessing; the demo's assets, built by demo.py).

Library use (the trainer in minirl.py does this):
    ds = RLHFDataset("train.parquet", tokenizer, max_prompt_length=512)
    loader = PromptLoader(ds, batch_size=32, seed=1)      # state_dict()/load_state_dict() for checkpoints
    for batch in loader: ...                              # one epoch of collated batches

Command line (one subcommand per dataset, see COMMANDS):
    python data.py gsm8k --input path/to/gsm8k --out ~/data/gsm8k   # verl's gsm8k.py, offline
    python data.py gsm8k --multiturn --input DIR --out DIR          # verl's gsm8k_multiturn_w_tool.py (+ tool yaml)
    python data.py gsm8k --interaction --input DIR --out DIR        # ...w_interaction.py (+ interaction yaml)
    python data.py demo --out demo                                  # tiny model + addition task (demo.py)
    python data.py geo3k --input path/to/geometry3k --out ~/data/geo3k   # verl's geo3k.py, images kept
    python data.py geo3k --multiturn --input DIR --out DIR          # verl's geo3k_multiturn_w_tool.py (+ tool yaml)
    python data.py demo-vl --out demo-vl                            # tiny Qwen2.5-VL + colour task (demo_vl.py)
    python data.py demo-tools --out demo-tools                      # tiny model + a task that needs its tool

Semantics follow verl v0.5.0: verl/utils/dataset/rl_dataset.py `RLHFDataset`, verl/utils/model.py
`compute_position_id_with_mask`, verl/utils/torch_functional.py `postprocess_data`, and
examples/data_preprocess/gsm8k.py. No network is used anywhere.
"""

import argparse
import hashlib
import json
import re
import time
import warnings
from pathlib import Path
from typing import Callable, NamedTuple

import pyarrow as pa
import pyarrow.parquet as pq
import torch
from torch.utils.data import RandomSampler

TRUNCATION_MODES = ("error", "left", "right", "middle")
# besides the prompt column (data.prompt_key): what each holds, for the error when one is missing
REQUIRED_COLUMNS = {"data_source": "the dataset's name, which picks the reward function",
                    "reward_model": "a {'ground_truth': ...} struct per row, the answer the reward checks"}

GSM8K_INSTRUCTION = 'Let\'s think step by step and output the final answer after "####".'
# verl examples/data_preprocess/gsm8k_multiturn_w_tool.py: backticks, and a system prompt naming the tool
GSM8K_MULTITURN_INSTRUCTION = "Let's think step by step and output the final answer after `####`."
GSM8K_MULTITURN_SYSTEM = (
    "You are a math expert. You are given a question and you need to solve it step by step. Reasoning step by "
    "step before any tool call. You should use the `calc_gsm8k_reward` tool after step by step solving the "
    "question, before generate final answer at least once and refine your answer if necessary. Put your final "
    "answer in the format of `#### <answer>`.")
# verl examples/data_preprocess/gsm8k_multiturn_w_interaction.py: a system prompt for a user who grades answers
GSM8K_INTERACTION_SYSTEM = (
    "You are a math expert. You are given a question and you need to solve it step by step. You should rethinking "
    "carefully if user point out your answer is wrong. Put your final answer in the format of `#### <answer>`.")
GSM8K_ANSWER_RE = re.compile(r"#### (\-?[0-9\.\,]+)")


def verl_answer_tool(class_name, config, tool_name, dataset, problem):
    """The tool yaml a variant's rows are made for, as verl's examples/sglang_multiturn/config/tool_config/
    {gsm8k,geo3k}_tool_config.yaml (v0.5.0) hold it: one tool that grades the answer it is called with (verl's
    class names; tools.py serves them)."""
    schema = {"name": tool_name,
              "description": f"A tool for calculating the reward of {dataset}. (1.0 if parsed answer is correct, 0.0 "
                             f"if parsed answer is incorrect or not correctly parsed)",
              "parameters": {"type": "object", "required": ["answer"], "properties": {"answer": {
                  "type": "string", "description": f"The model's answer to the {problem} problem, must be a digits"}}}}
    return {"tools": [{"class_name": class_name, "config": config,
                       "tool_schema": {"type": "function", "function": schema}}]}


# written beside the rows by `data.py gsm8k|geo3k --multiturn|--interaction`, under verl's file names, so the
# rows come with the yaml that multi_turn.tool_config_path (interaction_config_path) needs
VARIANT_YAMLS = {
    ("gsm8k", "multiturn"): ("gsm8k_tool_config.yaml", verl_answer_tool(
        "verl.tools.gsm8k_tool.Gsm8kTool", {"type": "native"}, "calc_gsm8k_reward", "gsm8k", "GSM8K math")),
    ("gsm8k", "interaction"): ("gsm8k_interaction_config.yaml", {"interaction": [
        {"name": "gsm8k", "class_name": "verl.interactions.gsm8k_interaction.Gsm8kInteraction", "config": {}}]}),
    ("geo3k", "multiturn"): ("geo3k_tool_config.yaml", verl_answer_tool(
        "verl.tools.geo3k_tool.Geo3kTool", {}, "calc_geo3k_reward", "geo3k", "geo3k")),
}


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
def rows_digest(rows):
    """A hash of the rows' columns as parquet gives them (an image the row holds by its bytes' hash, one it names by
    its path string; not the folder a row was read from), so a resume can tell another training file of the same
    length from the checkpointed run's, wherever either file lies (0.1 s for GSM8K's 7473 rows)."""
    def encode(value):
        return hashlib.sha256(value).hexdigest() if isinstance(value, (bytes, bytearray)) else str(value)
    digest = hashlib.sha256()
    for row in rows:
        columns = {key: value for key, value in row.items() if key != "_folder"}
        digest.update(json.dumps(columns, sort_keys=True, default=encode).encode())
    return digest.hexdigest()


class RLHFDataset:
    """verl-format prompt parquet(s) -> left-padded prompt tensors plus the row's reward metadata.

    Required columns: data_source, reward_model and the prompt column; ability and extra_info may be absent.
    Rows are read eagerly (prompt datasets are small) and checked once at load, so a bad file fails at start-up
    with the file, row and column named. `truncation="error"` raises lazily in `__getitem__`, as verl does.
    `index` is extra_info["index"] when present, else the row's position in the concatenated files.
    With a vision-language `processor` (vision.py), rows may carry images under image_key: they are checked and
    decoded at load, prompt lengths count the expanded image tokens, and items gain multi_modal_data (PIL images,
    for vLLM) and multi_modal_inputs (pixel_values, image_grid_thw). A text model refuses rows with images.
    """

    def __init__(self, files, tokenizer, *, max_prompt_length, truncation="error", filter_overlong_prompts=False,
                 prompt_key="prompt", image_key="images", video_key="videos", return_raw_chat=False,
                 chat_template=None, processor=None, reward_fn_key="data_source", tools=None):
        if truncation not in TRUNCATION_MODES:
            raise ValueError(f"data.truncation must be one of {TRUNCATION_MODES}, got {truncation!r}")
        if tokenizer.pad_token_id is None:
            raise ValueError("the tokenizer has no pad token; set tokenizer.pad_token (prompts are left-padded)")
        self.tokenizer = tokenizer
        self.max_prompt_length = max_prompt_length
        self.truncation = truncation
        self.prompt_key = prompt_key
        self.image_key, self.video_key, self.processor = image_key, video_key, processor
        self.return_raw_chat = return_raw_chat
        self.chat_template = chat_template
        self.reward_fn_key = reward_fn_key
        self.tools = tools              # tool schemas for the chat template (multi-turn rollouts)
        # origins[i] = (file, row number in that file, position in the concatenated files before filtering)
        self.rows, self.origins = [], []
        self.dropped_overlong = 0       # rows filter_overlong_prompts took out
        for path in _as_path_list(files):
            for row_number, row in enumerate(self._read_file(path)):
                row["extra_info"] = row.get("extra_info") or {}
                self.origins.append((path, row_number, len(self.rows)))
                self.rows.append(row)
        if filter_overlong_prompts:
            self._drop_overlong_prompts()
        self.rows_digest = rows_digest(self.rows)    # taken now: a reward function may change a row's dicts later

    def _read_file(self, path):
        if not path.exists():
            raise FileNotFoundError(f"data file {path} does not exist")
        if not path.is_file():
            raise ValueError(f"data file {path} is not a regular file; point the config at a .parquet file")
        try:
            names = pq.read_schema(path).names
        except Exception as err:      # whatever the parquet reader trips on: a damaged or non-parquet file
            raise _unreadable(path, err) from err
        duplicated = sorted({name for name in names if names.count(name) > 1})
        if duplicated:                # a valid file that pyarrow cannot turn into rows: not "damaged"
            raise ValueError(f"data file {path} has the column(s) {duplicated} more than once; rename or drop the "
                             f"copies")
        try:
            table = pq.read_table(path)
            rows = table.to_pylist()
        except Exception as err:      # a string that is not UTF-8 is one column's values, not a damaged file
            column = _failing_column(path, names) if isinstance(err, UnicodeDecodeError) else None
            raise _unreadable(path, err, column) from err
        for column in (self.prompt_key, *REQUIRED_COLUMNS):
            if column not in table.column_names:
                verl_format = "preprocess the data into verl format (see `python data.py gsm8k`)"
                fix = (f"add it ({REQUIRED_COLUMNS[column]}) or {verl_format}" if column in REQUIRED_COLUMNS
                       else f"{verl_format} or set data.prompt_key to the column holding the chat messages")
                raise ValueError(f"{path}: column {column!r} is missing (columns: {table.column_names}); {fix}")
        for row_number, row in enumerate(rows):
            self._check_row(row, path, row_number)
            row["_folder"] = path.parent          # image paths in the row are relative to its parquet
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
        tools_kwargs = (row.get("extra_info") or {}).get("tools_kwargs")
        if not _tools_kwargs_shape(tools_kwargs):
            raise ValueError(f"{where}, column 'extra_info', key 'tools_kwargs': expected verl's {{tool name: "
                             f"{{create_kwargs: {{...}}, execute_kwargs: {{...}}, ...}}}}, got {tools_kwargs!r:.200}")
        if self.processor is not None:
            import vision
            vision.check_row(row, self.prompt_key, self.image_key, self.video_key, path.parent, where)
        elif row.get(self.image_key) or row.get(self.video_key):
            raise ValueError(f"{where}: the row has images or videos (columns {self.image_key!r}/{self.video_key!r}) "
                             f"but the model is text-only, so it would never see them; use a vision-language "
                             f"model (e.g. Qwen2.5-VL) or drop the column")

    def _drop_overlong_prompts(self):
        lengths = [len(self._prompt_ids(i)) for i in range(len(self.rows))]
        keep = [i for i, n in enumerate(lengths) if n <= self.max_prompt_length]
        self.dropped_overlong = len(self.rows) - len(keep)
        self.rows = [self.rows[i] for i in keep]
        self.origins = [self.origins[i] for i in keep]

    def filter_summary(self):
        """What filter_overlong_prompts took out ('' when nothing), for the run's log and the size errors."""
        if not self.dropped_overlong:
            return ""
        return (f"filter_overlong_prompts dropped {self.dropped_overlong} of {len(self) + self.dropped_overlong} "
                f"prompts longer than max_prompt_length={self.max_prompt_length}")

    def _messages(self, row):
        return row[self.prompt_key]

    def _encode(self, i):
        """Row i's (templated prompt ids (image tokens expanded), raw ids for the rollout, multi_modal_data,
        multi_modal_inputs); the last two are None for a text model."""
        row = self.rows[i]
        if self.processor is not None:
            import vision
            images = vision.row_images(row, self.image_key, row["_folder"], self.where(i))
            try:
                ids, raw_ids, inputs = vision.encode_prompt(self.processor, self._messages(row), images,
                                                            self.chat_template, self.tools)
            except ValueError as err:        # the processor's own refusal, named by the row it came from
                raise vision.ImageError(f"{self.where(i)}: the processor cannot take the row's prompt and images "
                                        f"({err}); fix or drop the row") from err
            return ids, raw_ids, {"image": images}, inputs
        text = self.tokenizer.apply_chat_template(self._messages(row), chat_template=self.chat_template,
                                                  tools=self.tools, add_generation_prompt=True, tokenize=False)
        ids = self.tokenizer.encode(text, add_special_tokens=False)
        return ids, ids, None, None

    def template_ignores_tools(self):
        """Whether the chat template leaves the tool schemas out of the prompt (it renders a conversation the same
        with and without them; Qwen2.5-VL's own template does): the model is then never shown the tools."""
        if not self.tools:
            return False
        render = (self.processor or self.tokenizer).apply_chat_template
        conversation = [{"role": "user", "content": "U"}]
        return render(conversation, chat_template=self.chat_template, tools=self.tools, tokenize=False) == \
            render(conversation, chat_template=self.chat_template, tokenize=False)

    def _prompt_ids(self, i):
        return self._encode(i)[0]

    def __len__(self):
        return len(self.rows)

    def where(self, i):
        """"file, row N": where row i came from, for error messages (carried through the batch as `origin`)."""
        path, row_number, _ = self.origins[i]
        return f"{path}, row {row_number}"

    def check_prompt_lengths(self):
        """Fail now rather than in the middle of training: the first row must template to some tokens (a chat
        template or tokenizer that renders nothing shows there), and with truncation=error no row may be longer
        than max_prompt_length."""
        if self.rows and not self._prompt_ids(0):
            raise self._empty_prompt_error(0)
        if self.truncation != "error":
            return
        for i in range(len(self.rows)):
            length = len(self._prompt_ids(i))
            if length > self.max_prompt_length:
                raise self._overlong_error(i, length)

    def _empty_prompt_error(self, i):
        return ValueError(f"{self.where(i)}: the templated prompt is 0 tokens: the chat template "
                          f"(actor_rollout_ref.model.custom_chat_template, else the tokenizer's) renders nothing for "
                          f"it, or the tokenizer encodes nothing (a model folder without its tokenizer files)")

    def _overlong_error(self, i, length):
        path, row_number, _ = self.origins[i]
        return ValueError(f"{path}, row {row_number}: the templated prompt is {length} tokens, longer than "
                          f"max_prompt_length={self.max_prompt_length}; raise data.max_prompt_length, set "
                          f"data.truncation=left (or right/middle), or set data.filter_overlong_prompts=True")

    def __getitem__(self, i):
        row = self.rows[i]
        ids, raw_ids, multi_modal_data, multi_modal_inputs = self._encode(i)
        if not ids:
            raise self._empty_prompt_error(i)
        if len(ids) > self.max_prompt_length and (self.truncation == "error" or multi_modal_inputs):
            raise self._overlong_error(i, len(ids))       # cutting a prompt with images would cut image tokens
        ids = truncate_ids(ids, self.max_prompt_length, self.truncation)
        raw_prompt_ids = truncate_ids(raw_ids, self.max_prompt_length, self.truncation)
        input_ids, attention_mask = left_pad(ids, self.max_prompt_length, self.tokenizer.pad_token_id)
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
            "origin": self.where(i),
        }
        if self.reward_fn_key in row:              # a data.reward_fn_key other than data_source travels too
            item[self.reward_fn_key] = row[self.reward_fn_key]
        item["agent_name"] = row.get("agent_name")     # verl's agent loop for the row (multi-turn rollouts)
        if self.return_raw_chat:
            item["raw_prompt"] = self._messages(row)
        if multi_modal_inputs:
            item["multi_modal_data"], item["multi_modal_inputs"] = multi_modal_data, multi_modal_inputs
        return item


def check_dataset_sizes(train_set, val_set, train_batch_size):
    """Refuse, before any model loads, a training set without one whole batch and an empty validation set (verl
    stops on both: 'Train dataloader is empty!', 'Validation dataloader is empty!'), saying whether
    filter_overlong_prompts emptied it."""
    def held(dataset):
        summary = dataset.filter_summary()
        return f"{len(dataset)} prompts" + (f" ({summary})" if summary else "")

    shorter_fix = "raise data.max_prompt_length, or cut prompts with data.truncation=left|right|middle instead"
    if len(train_set) < train_batch_size:
        fix = shorter_fix if train_set.dropped_overlong else "lower data.train_batch_size or add data"
        raise ValueError(f"data.train_files hold {held(train_set)}, fewer than one batch "
                         f"(data.train_batch_size={train_batch_size}); {fix}")
    if val_set is not None and len(val_set) == 0:
        fix = shorter_fix if val_set.dropped_overlong else "point data.val_files at rows to validate on"
        raise ValueError(f"data.val_files hold {held(val_set)}; {fix}, or set data.val_files=null to train "
                         f"without validation")


def _unreadable(path, err, column=None):
    detail = (str(err).splitlines() or [""])[0][:200]
    if column is not None:            # the file's structure is sound: one column's values are not
        return ValueError(f"data file {path} holds text that is not UTF-8 in column {column!r} ({detail}); "
                          f"re-create the file with the strings encoded as UTF-8")
    return ValueError(f"data file {path} cannot be read as parquet ({type(err).__name__}: {detail}); it is "
                      f"damaged, unreadable or not a parquet file: re-create or re-download it")


def _failing_column(path, names):
    """The one column that cannot be read on its own, when the others can (else None)."""
    failing = []
    for name in names:
        try:
            pq.read_table(path, columns=[name]).to_pylist()
        except Exception:
            failing.append(name)
    return failing[0] if len(failing) == 1 else None


def _tools_kwargs_shape(tools_kwargs):
    """Whether a row's extra_info.tools_kwargs has verl's shape: a mapping of tool names to mappings of
    `<method>_kwargs` mappings (a parquet struct holds None for what a row leaves out)."""
    if tools_kwargs is None:
        return True
    return isinstance(tools_kwargs, dict) and all(
        per_tool is None or (isinstance(per_tool, dict) and all(v is None or isinstance(v, dict)
                                                                 for v in per_tool.values()))
        for per_tool in tools_kwargs.values())


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
        self._order = (None, [])                 # (epoch, its dataset indices), computed once per epoch
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
        yield self.next_batch()
        while self.batches_done_in_epoch < len(self):
            yield self.next_batch()

    def next_batch(self):
        """The batch after the last one handed out; after an epoch's last batch, the next epoch's first. Dynamic
        sampling (minirl.Trainer.sample_varied_groups) draws several in one step, beside the loop's iterator."""
        if self.batches_done_in_epoch >= len(self):
            self.epoch += 1
            self.batches_done_in_epoch = 0
        if self._order[0] != self.epoch:
            self._order = (self.epoch, self.epoch_order(self.epoch))
        start = self.batches_done_in_epoch * self.batch_size
        self.batches_done_in_epoch += 1     # counted before it is handed out: a checkpoint now resumes after it
        return collate([self.dataset[i] for i in self._order[1][start:start + self.batch_size]])

    def data_left(self, epochs):
        """Whether a batch remains within the first `epochs` epochs (trainer.total_epochs)."""
        return self.epoch + 1 < epochs or self.batches_done_in_epoch < len(self)

    def state_dict(self):
        return {"epoch": self.epoch, "batches_done_in_epoch": self.batches_done_in_epoch, "seed": self.seed,
                "shuffle": self.shuffle, "batch_size": self.batch_size, "num_prompts": len(self.dataset),
                "rows_digest": getattr(self.dataset, "rows_digest", None)}

    def load_state_dict(self, state):
        for key in ("seed", "shuffle", "batch_size", "num_prompts"):
            now = len(self.dataset) if key == "num_prompts" else getattr(self, key)
            if state[key] != now:
                raise ValueError(f"cannot resume the prompt loader: the checkpoint has {key}={state[key]!r} but "
                                 f"this run has {now!r}, so the batch order would differ; use the same data "
                                 f"settings as the checkpointed run or start fresh")
        saved_digest, digest = state.get("rows_digest"), getattr(self.dataset, "rows_digest", None)
        if None not in (saved_digest, digest) and saved_digest != digest:     # older checkpoints have none
            warnings.warn(f"the training rows differ from those of the checkpointed run (as many rows, other "
                          f"contents: another data.train_files, or the file was rewritten): the run goes on from "
                          f"the checkpoint's place in the batch order (data epoch {state['epoch']}, "
                          f"{state['batches_done_in_epoch']} batches of it done) over these rows, so it does not "
                          f"continue the checkpointed run's sequence of batches")
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


def gsm8k_row(example, split, index, multiturn=False, interaction=False):
    """One verl-format row from a GSM8K {question, answer} example; multiturn: verl's gsm8k_multiturn_w_tool.py
    row (system prompt, backtick instruction, the ground truth in tools_kwargs for the calc_gsm8k_reward tool);
    interaction: verl's gsm8k_multiturn_w_interaction.py row (the ground truth for the gsm8k interaction)."""
    question, answer = example["question"], example["answer"]
    if multiturn or interaction:
        row = gsm8k_row(example, split, index)
        truth, asked = row["reward_model"]["ground_truth"], question + " " + GSM8K_MULTITURN_INSTRUCTION
        system = GSM8K_INTERACTION_SYSTEM if interaction else GSM8K_MULTITURN_SYSTEM
        row["prompt"] = [{"role": "system", "content": system}, {"role": "user", "content": asked}]
        if interaction:
            row["extra_info"]["interaction_kwargs"] = {"name": "gsm8k", "query": asked, "ground_truth": truth}
        else:          # verl's tool rows carry interaction_kwargs too, without a name
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


def read_split(input_dir, split, name="GSM8K", hub_name="openai/gsm8k"):
    """Examples of `split` from DIR/split.jsonl, DIR/split.parquet or an HF layout DIR/**/split-*.parquet."""
    input_dir = Path(input_dir)
    jsonl = input_dir / f"{split}.jsonl"
    if jsonl.is_file():
        with open(jsonl) as f:
            return [json.loads(line) for line in f if line.strip()]
    parquets = [input_dir / f"{split}.parquet"] if (input_dir / f"{split}.parquet").is_file() else sorted(
        input_dir.rglob(f"{split}-*.parquet"))
    if not parquets:
        raise FileNotFoundError(f"no {name} {split} split in {input_dir}: expected {split}.jsonl, {split}.parquet "
                                f"or {split}-*.parquet (the HF {hub_name} layout)")
    return [row for path in parquets for row in pq.read_table(path).to_pylist()]


def preprocess_gsm8k(input_dir, out_dir, multiturn=False, interaction=False):
    """Write verl-format train.parquet and test.parquet (multiturn: the tool-calling variant, with verl's tool yaml
    for it; interaction: the variant for the gsm8k interaction, with verl's interaction yaml); returns {split or
    "tools"/"interaction": path}."""
    if multiturn and interaction:
        raise ValueError("gsm8k: --multiturn and --interaction are two variants of the rows; pick one")
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    paths = {}
    for split in ("train", "test"):
        examples = read_split(input_dir, split)
        for i, example in enumerate(examples):
            if not {"question", "answer"} <= example.keys():
                raise ValueError(f"GSM8K {split} example {i} in {input_dir} lacks 'question'/'answer': "
                                 f"{sorted(example)}")
        rows = [gsm8k_row(example, split, i, multiturn, interaction) for i, example in enumerate(examples)]
        paths[split] = out_dir / f"{split}.parquet"
        pq.write_table(pa.Table.from_pylist(rows), paths[split])
        print(f"wrote {len(rows)} rows to {paths[split]}")
    return write_variant_yaml(paths, out_dir, "gsm8k", "multiturn" if multiturn else "interaction" if interaction
                              else None)


def write_variant_yaml(paths, out_dir, dataset, variant):
    """Add the variant's tool or interaction yaml (VARIANT_YAMLS) to `paths` (under its key "tools" or
    "interaction") and to `out_dir`."""
    if (dataset, variant) not in VARIANT_YAMLS:
        return paths
    import yaml
    name, content = VARIANT_YAMLS[dataset, variant]
    key = next(iter(content))
    paths[key] = out_dir / name
    paths[key].write_text(yaml.safe_dump(content, sort_keys=False))
    print(f"wrote {paths[key]} (verl's yaml for these rows)")
    return paths


# ------------------------------------------------------------------------------------------------------------
# geometry3k preprocessing (verl examples/data_preprocess/geo3k.py, reading local files)
# ------------------------------------------------------------------------------------------------------------
GEO3K_INSTRUCTION = (r"You FIRST think about the reasoning process as an internal monologue and then provide the "
                     r"final answer. The reasoning process MUST BE enclosed within <think> </think> tags. The final "
                     r"answer MUST BE put in \boxed{}.")
# verl examples/data_preprocess/geo3k_multiturn_w_tool.py: a system prompt naming the tool
GEO3K_MULTITURN_SYSTEM = (
    "You are a math expert. You are given a question and you need to solve it step by step. Reasoning step by step "
    "before any tool call. You should use the `calc_geo3k_reward` tool after step by step solving the question, "
    "before generate final answer at least once and refine your answer if necessary. ")


def geo3k_image(value, input_dir):
    """An image as the {bytes, path} struct Hugging Face datasets writes; a path (relative to the input folder)
    is read in, so the output parquet stands alone."""
    if isinstance(value, dict) and value.get("bytes") is not None:
        return {"bytes": value["bytes"], "path": value.get("path")}
    if isinstance(value, (bytes, bytearray)):
        return {"bytes": bytes(value), "path": None}
    path = value.get("path") if isinstance(value, dict) else value
    if not isinstance(path, str) or not (Path(input_dir) / path).is_file():
        raise ValueError(f"geometry3k image {value!r:.80}: expected image bytes, a {{bytes, path}} struct or a path "
                         f"to a file under {input_dir}")
    return {"bytes": (Path(input_dir) / path).read_bytes(), "path": path}


def geo3k_row(example, split, index, input_dir, multiturn=False):
    """One verl-format row from a geometry3k {problem (with <image>), answer, images} example; multiturn: verl's
    geo3k_multiturn_w_tool.py row (system prompt, the ground truth in tools_kwargs for the calc_geo3k_reward
    tool)."""
    problem, answer = example["problem"], example["answer"]
    row = {
        "data_source": "hiyouga/geometry3k",
        "prompt": [{"role": "user", "content": problem + " " + GEO3K_INSTRUCTION}],
        "images": [geo3k_image(image, input_dir) for image in example["images"]],
        "ability": "math",
        "reward_model": {"style": "rule", "ground_truth": answer},
        "extra_info": {"split": split, "index": index, "answer": answer, "question": problem},
    }
    if multiturn:
        row["prompt"].insert(0, {"role": "system", "content": GEO3K_MULTITURN_SYSTEM})
        row["agent_name"] = "tool_agent"
        row["extra_info"].update(need_tools_kwargs=True,
                                 tools_kwargs={"calc_geo3k_reward": {"create_kwargs": {"ground_truth": answer}}})
    return row


def preprocess_geo3k(input_dir, out_dir, multiturn=False):
    """Write verl-format train.parquet and test.parquet (images kept; multiturn: the tool-calling variant, with
    verl's tool yaml for it); returns {split or "tools": path}."""
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    paths = {}
    for split in ("train", "test"):
        examples = read_split(input_dir, split, "geometry3k", "hiyouga/geometry3k")
        rows = []
        for i, example in enumerate(examples):
            if not {"problem", "answer", "images"} <= example.keys():
                raise ValueError(f"geometry3k {split} example {i} in {input_dir} lacks 'problem'/'answer'/'images': "
                                 f"{sorted(example)}")
            rows.append(geo3k_row(example, split, i, input_dir, multiturn))
        paths[split] = out_dir / f"{split}.parquet"
        pq.write_table(pa.Table.from_pylist(rows), paths[split])
        print(f"wrote {len(rows)} rows to {paths[split]}")
    return write_variant_yaml(paths, out_dir, "geo3k", "multiturn" if multiturn else None)


# ------------------------------------------------------------------------------------------------------------
# Command line: one subcommand per dataset. A new one is a run function and a row in COMMANDS.
# ------------------------------------------------------------------------------------------------------------
class Command(NamedTuple):
    help: str
    out: str  # what the --out folder receives
    run: Callable  # run(args), args holding out and the options
    options: tuple = ()  # required options besides --out: (flag, help) pairs
    flags: tuple = ()  # optional on/off switches: (flag, help) pairs


def run_gsm8k(args):
    preprocess_gsm8k(args.input, args.out, multiturn=args.multiturn, interaction=args.interaction)


def run_geo3k(args):
    preprocess_geo3k(args.input, args.out, multiturn=args.multiturn)


def build_demo(name, make_assets, out):
    """Build a demo's assets with make_assets(out) -> paths (warmup.json among them) and say what was written."""
    start = time.time()
    paths = make_assets(out)
    warmup = json.loads(paths.pop("warmup").read_text())
    print(f"{name} written to {out} in {time.time() - start:.0f}s: "
          + ", ".join(f"{kind} {path}" for kind, path in paths.items()))
    print("after the warm-up, on the test prompts: "
          + ", ".join(f"{key} {value:.0%}" if isinstance(value, float) else f"{key} {value}"
                      for key, value in warmup.items()))


# The demo builders are imported in their commands: they build on this module (left_pad), on rewards.py and on
# Pillow / transformers' processors, none of which the dataset code needs.
def run_demo(args):
    from demo import make_demo_assets
    build_demo("demo", make_demo_assets, args.out)


def run_demo_vl(args):
    from demo_vl import make_vl_demo_assets
    build_demo("VL demo", make_vl_demo_assets, args.out)


def run_demo_tools(args):
    from demo_tools import make_assets
    build_demo("tool demo", make_assets, args.out)


COMMANDS = {
    "gsm8k": Command("GSM8K jsonl/parquet -> verl-format train/test.parquet",
                     "folder for train.parquet and test.parquet", run_gsm8k,
                     (("--input", "folder with train/test .jsonl or .parquet"),),
                     (("--multiturn", "verl's multi-turn variant: system prompt, tools_kwargs for calc_gsm8k_reward; "
                                      "and verl's gsm8k_tool_config.yaml"),
                      ("--interaction", "verl's variant for its gsm8k interaction: system prompt, "
                                        "interaction_kwargs; and verl's gsm8k_interaction_config.yaml"))),
    "geo3k": Command("geometry3k jsonl/parquet (problem, answer, images) -> verl-format train/test.parquet",
                     "folder for train.parquet and test.parquet", run_geo3k,
                     (("--input", "folder with train/test .jsonl or .parquet"),),
                     (("--multiturn", "verl's multi-turn variant: system prompt, tools_kwargs for the geo3k tool; "
                                      "and verl's geo3k_tool_config.yaml"),)),
    "demo": Command("tiny warmed-up model + addition task parquet", "folder for model/ and data/", run_demo),
    "demo-vl": Command("tiny warmed-up Qwen2.5-VL + colour-of-the-square task parquet (images)",
                       "folder for model/ and data/", run_demo_vl),
    "demo-tools": Command("tiny model warmed up to call a tool + a task that needs it",
                          "folder for model/, data/ and tools.yaml", run_demo_tools),
}


# the names verl's examples/data_preprocess scripts give the same folders (v0.5.0 and later), so their command
# lines work here with the script swapped for `python data.py gsm8k|geo3k`
VERL_FLAGS = {"--input": ("--local_dataset_path",), "--out": ("--local_save_dir", "--local_dir")}


def folder(text):
    return str(Path(text).expanduser())    # verl's scripts expand ~ themselves: `--local_dir=~/data/gsm8k` works


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    subparsers = parser.add_subparsers(dest="command", required=True)
    for name, command in COMMANDS.items():
        subparser = subparsers.add_parser(name, help=command.help)
        for flag, option_help in command.options:
            subparser.add_argument(flag, *VERL_FLAGS.get(flag, ()), required=True, type=folder, help=option_help)
        variants = subparser.add_mutually_exclusive_group()    # a command's switches pick one variant of its rows
        for flag, flag_help in command.flags:
            variants.add_argument(flag, action="store_true", help=flag_help)
        subparser.add_argument("--out", *VERL_FLAGS["--out"], required=True, type=folder, help=command.out)
    args = parser.parse_args(argv)
    COMMANDS[args.command].run(args)


if __name__ == "__main__":
    main()
