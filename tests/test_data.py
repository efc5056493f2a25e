"""Tests for data.py: prompt padding/truncation as verl does it, bad-input errors, the resumable loader, GSM8K
preprocessing on real rows, and the data commands' dispatch. (The tiny models and the demo: test_demo.py.)
Run: HF_HUB_OFFLINE=1 .venv/bin/python -m pytest tests/test_data.py -q"""

import re
import subprocess
import sys
import warnings
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch
from torch.utils.data import DataLoader, RandomSampler
from transformers import AutoTokenizer

from data import PromptLoader, RLHFDataset, check_dataset_sizes, collate, preprocess_gsm8k

REPO = Path(__file__).resolve().parents[1]

# The Qwen-style template, written out by hand: user turn, then the generation prompt.
PREFIX = "<|im_start|>user\n"
SUFFIX = "<|im_end|>\n<|im_start|>assistant\n"


@pytest.fixture(scope="module")
def tokenizer(tiny_tokenizer_dir):
    return AutoTokenizer.from_pretrained(tiny_tokenizer_dir)


def write_rows(path, contents, **columns):
    """A verl-format parquet with one user message per content; `columns` override/add whole columns."""
    table = {
        "data_source": [f"src{i}" for i in range(len(contents))],
        "prompt": [[{"role": "user", "content": c}] for c in contents],
        "ability": ["math"] * len(contents),
        "reward_model": [{"style": "rule", "ground_truth": str(i)} for i in range(len(contents))],
    }
    table.update(columns)
    pq.write_table(pa.table({k: v for k, v in table.items() if v is not None}), path)
    return path


def digit_prompt_ids(tokenizer, digits):
    """Expected ids of a templated all-digit prompt, built piece by piece: the tokenizer splits every digit
    into its own token, so the prompt is len(prefix) + len(digits) + len(suffix) tokens whatever BPE merged."""
    prefix = tokenizer.encode(PREFIX, add_special_tokens=False)
    suffix = tokenizer.encode(SUFFIX, add_special_tokens=False)
    return prefix + tokenizer.convert_tokens_to_ids(list(digits)) + suffix


# ------------------------------------------------------------------------------------------------------------
# Padding, truncation, filtering
# ------------------------------------------------------------------------------------------------------------
def test_left_padding_and_position_ids(tokenizer, tmp_path):
    path = write_rows(tmp_path / "p.parquet", ["0123456789"])
    expected = digit_prompt_ids(tokenizer, "0123456789")
    n = len(expected)
    item = RLHFDataset(path, tokenizer, max_prompt_length=n + 3)[0]
    pad = tokenizer.convert_tokens_to_ids("<|endoftext|>")
    assert item["input_ids"].tolist() == [pad] * 3 + expected
    assert item["attention_mask"].tolist() == [0, 0, 0] + [1] * n
    # cumsum(mask) - 1 = [-1, -1, -1, 0, 1, ...], clipped at 0
    assert item["position_ids"].tolist() == [0, 0, 0] + list(range(n))
    assert item["raw_prompt_ids"] == expected
    assert item["input_ids"].dtype == torch.long and item["input_ids"].shape == (n + 3,)


@pytest.mark.parametrize("truncation", ["left", "right", "middle"])
def test_truncation_modes(tokenizer, tmp_path, truncation):
    path = write_rows(tmp_path / "p.parquet", ["0123456789" * 2])
    full = digit_prompt_ids(tokenizer, "0123456789" * 2)
    max_length = 9  # odd, so middle keeps 9 // 2 = 4 head tokens and 9 - 4 = 5 tail tokens
    expected = {"left": full[-9:], "right": full[:9], "middle": full[:4] + full[-5:]}[truncation]
    item = RLHFDataset(path, tokenizer, max_prompt_length=max_length, truncation=truncation)[0]
    assert item["raw_prompt_ids"] == expected
    assert item["input_ids"].tolist() == expected  # no room left for padding
    assert item["attention_mask"].tolist() == [1] * 9
    assert item["position_ids"].tolist() == list(range(9))


def test_truncation_error_names_file_row_and_length(tokenizer, tmp_path):
    path = write_rows(tmp_path / "long.parquet", ["1", "0123456789"])
    max_length = len(digit_prompt_ids(tokenizer, "12"))  # row 0 fits, row 1 is 8 tokens longer
    ds = RLHFDataset(path, tokenizer, max_prompt_length=max_length)
    ds[0]
    with pytest.raises(ValueError) as error:
        ds[1]
    message = str(error.value)
    assert str(path) in message and "row 1" in message
    assert f"{max_length + 8} tokens" in message
    assert "truncation=left" in message and "filter_overlong_prompts" in message


def test_filter_overlong_prompts(tokenizer, tmp_path):
    # token counts are overhead + digits; max_length = overhead + 3: "123" fits exactly, "1234" does not
    path = write_rows(tmp_path / "f.parquet", ["1", "1234", "123"])
    max_length = len(digit_prompt_ids(tokenizer, "123"))
    ds = RLHFDataset(path, tokenizer, max_prompt_length=max_length, filter_overlong_prompts=True)
    assert len(ds) == 2
    assert [ds[i]["data_source"] for i in range(2)] == ["src0", "src2"]
    assert [ds[i]["index"] for i in range(2)] == [0, 2]  # no extra_info: the row's position before filtering
    assert ds.filter_summary() == (f"filter_overlong_prompts dropped 1 of 3 prompts longer than "
                                   f"max_prompt_length={max_length}")
    assert RLHFDataset(path, tokenizer, max_prompt_length=max_length + 1,
                       filter_overlong_prompts=True).filter_summary() == ""


def test_too_few_prompts_name_the_files_key_and_what_the_filter_dropped(tokenizer, tmp_path):
    """A training set short of one batch and an empty validation set stop the run before any model loads (verl
    stops on both), and the error says whether filter_overlong_prompts emptied it and what to change."""
    short, long = write_rows(tmp_path / "s.parquet", ["1", "2", "3"]), write_rows(tmp_path / "l.parquet", ["1234"])
    max_length = len(digit_prompt_ids(tokenizer, "123"))
    dataset = lambda path: RLHFDataset(path, tokenizer, max_prompt_length=max_length, filter_overlong_prompts=True)
    check_dataset_sizes(dataset(short), None, 3)
    check_dataset_sizes(dataset(short), dataset(short), 3)
    with pytest.raises(ValueError, match=re.escape("data.train_files hold 3 prompts, fewer than one batch "
                                                   "(data.train_batch_size=4); lower data.train_batch_size")):
        check_dataset_sizes(dataset(short), None, 4)
    with pytest.raises(ValueError, match=re.escape(
            f"data.train_files hold 0 prompts (filter_overlong_prompts dropped 1 of 1 prompts longer than "
            f"max_prompt_length={max_length}), fewer than one batch (data.train_batch_size=1); raise "
            f"data.max_prompt_length")):
        check_dataset_sizes(dataset(long), None, 1)
    with pytest.raises(ValueError, match=re.escape(
            f"data.val_files hold 0 prompts (filter_overlong_prompts dropped 1 of 1 prompts longer than "
            f"max_prompt_length={max_length}); raise data.max_prompt_length")):
        check_dataset_sizes(dataset(short), dataset(long), 3)
    empty = write_rows(tmp_path / "e.parquet", [])
    with pytest.raises(ValueError, match=re.escape("data.val_files hold 0 prompts; point data.val_files at rows to "
                                                   "validate on, or set data.val_files=null")):
        check_dataset_sizes(dataset(short), dataset(empty), 3)


def test_rows_from_several_files_keep_their_origin(tokenizer, tmp_path):
    first = write_rows(tmp_path / "a.parquet", ["1", "2"])
    second = write_rows(tmp_path / "b.parquet", ["0123456789"])
    max_length = len(digit_prompt_ids(tokenizer, "1"))
    ds = RLHFDataset([first, second], tokenizer, max_prompt_length=max_length)
    assert len(ds) == 3 and [ds[i]["index"] for i in range(2)] == [0, 1]
    with pytest.raises(ValueError, match=rf"{re.escape(str(second))}, row 0"):
        ds[2]


def test_check_prompt_lengths_names_the_first_overlong_row_up_front(tmp_path, tokenizer):
    """truncation=error is checked for the whole dataset at start-up (the trainer calls it before loading models)."""
    path = write_rows(tmp_path / "lengths.parquet", ["1", "1 2 3 4 5 6 7 8 9"])
    text = tokenizer.apply_chat_template([{"role": "user", "content": "1"}], add_generation_prompt=True,
                                         tokenize=False)
    short = len(tokenizer.encode(text, add_special_tokens=False))      # row 0 fits exactly, row 1 does not
    ds = RLHFDataset(path, tokenizer, max_prompt_length=short)
    with pytest.raises(ValueError, match=r"lengths.parquet, row 1: the templated prompt is \d+ tokens"):
        ds.check_prompt_lengths()
    RLHFDataset(path, tokenizer, max_prompt_length=short, truncation="left").check_prompt_lengths()   # no error


def test_a_template_that_renders_nothing_is_named_up_front(tmp_path, tokenizer):
    """A custom chat template that renders nothing (or a tokenizer without its files) made 0-token prompts, which
    crashed inside HF generate after the models loaded: the first row is checked at start-up, every row when
    taken."""
    path = write_rows(tmp_path / "rows.parquet", ["1", "2"])
    ds = RLHFDataset(path, tokenizer, max_prompt_length=64, chat_template="{% if false %}x{% endif %}")
    with pytest.raises(ValueError, match=r"rows.parquet, row 0: the templated prompt is 0 tokens: the chat template"):
        ds.check_prompt_lengths()
    with pytest.raises(ValueError, match=r"rows.parquet, row 1: the templated prompt is 0 tokens"):
        ds[1]


# ------------------------------------------------------------------------------------------------------------
# Item fields, collate, bad input
# ------------------------------------------------------------------------------------------------------------
def test_item_fields_raw_chat_and_collate(tokenizer, tmp_path):
    messages = [[{"role": "system", "content": "7"}, {"role": "user", "content": "12"}],
                [{"role": "user", "content": "345"}]]
    extra = [{"split": "train", "index": 41}, {"split": "train", "index": 42}]
    path = write_rows(tmp_path / "m.parquet", ["", ""], prompt=messages, extra_info=extra)
    ds = RLHFDataset(path, tokenizer, max_prompt_length=32, return_raw_chat=True)
    first = ds[0]
    assert first["raw_prompt_ids"] == (tokenizer.encode("<|im_start|>system\n", add_special_tokens=False)
                                       + tokenizer.convert_tokens_to_ids(["7"])
                                       + tokenizer.encode("<|im_end|>\n", add_special_tokens=False)
                                       + digit_prompt_ids(tokenizer, "12"))
    assert first["raw_prompt"] == messages[0]
    assert first["index"] == 41 and first["extra_info"] == extra[0]
    assert first["reward_model"] == {"style": "rule", "ground_truth": "0"}
    assert first["ability"] == "math" and first["data_source"] == "src0"
    assert "multi_modal_data" not in first          # images: tests/test_vision.py

    batch = collate([ds[0], ds[1]])
    assert batch["input_ids"].shape == (2, 32) and batch["position_ids"].shape == (2, 32)
    assert batch["index"] == [41, 42] and batch["data_source"] == ["src0", "src1"]
    assert isinstance(batch["raw_prompt_ids"], list) and len(batch["raw_prompt_ids"]) == 2
    assert batch["agent_name"] == [None, None]          # no column: the multi-turn loop's default
    named = RLHFDataset(write_rows(tmp_path / "a.parquet", ["1", "2"], agent_name=["single_turn_agent", None]),
                        tokenizer, max_prompt_length=32)
    assert collate([named[0], named[1]])["agent_name"] == ["single_turn_agent", None]   # verl's agent loop column


def test_custom_chat_template_overrides_the_tokenizers(tokenizer, tmp_path):
    path = write_rows(tmp_path / "t.parquet", ["0123"])
    template = "{% for m in messages %}{{ m['content'] }}{% endfor %}"
    item = RLHFDataset(path, tokenizer, max_prompt_length=8, chat_template=template)[0]
    assert item["raw_prompt_ids"] == tokenizer.convert_tokens_to_ids(list("0123"))


def test_missing_column_is_named(tokenizer, tmp_path):
    path = write_rows(tmp_path / "no_rm.parquet", ["1"], reward_model=None)
    with pytest.raises(ValueError, match=rf"{re.escape(str(path))}: column 'reward_model' is missing .*; add it "
                                         r"\(a \{'ground_truth': \.\.\.\} struct per row"):
        RLHFDataset(path, tokenizer, max_prompt_length=32)
    with pytest.raises(ValueError, match="column 'messages' is missing .* or set data.prompt_key to the column"):
        RLHFDataset(write_rows(tmp_path / "ok.parquet", ["1"]), tokenizer, max_prompt_length=32,
                    prompt_key="messages")


def test_malformed_prompt_names_file_row_and_column(tokenizer, tmp_path):
    prompts = [[{"role": "user", "content": "1"}], [{"role": "user", "content": None}]]  # row 1: no content
    path = write_rows(tmp_path / "bad.parquet", ["", ""], prompt=prompts)
    with pytest.raises(ValueError, match=rf"{re.escape(str(path))}, row 1, column 'prompt'"):
        RLHFDataset(path, tokenizer, max_prompt_length=32)


@pytest.mark.parametrize("tools_kwargs", ["calc", {"calc": "x"}, {"calc": {"create_kwargs": "x"}}])
def test_malformed_tools_kwargs_names_file_row_and_key(tokenizer, tmp_path, tools_kwargs):
    """A string where verl's multi-turn rows hold mappings would otherwise fail mid-rollout, in the agent loop
    (agent._kwargs calls .get on it), after the models had loaded."""
    good = {"tools_kwargs": {"calc": {"create_kwargs": {"ground_truth": "1"}, "execute_kwargs": None}}}
    RLHFDataset(write_rows(tmp_path / "ok.parquet", ["1"], extra_info=[good]), tokenizer, max_prompt_length=32)
    path = write_rows(tmp_path / "bad.parquet", ["1", "2"], extra_info=[{"tools_kwargs": tools_kwargs}] * 2)
    with pytest.raises(ValueError, match=rf"{re.escape(str(path))}, row 0, column 'extra_info', key 'tools_kwargs'"):
        RLHFDataset(path, tokenizer, max_prompt_length=32)


def test_bad_truncation_mode_and_missing_file(tokenizer, tmp_path):
    path = write_rows(tmp_path / "p.parquet", ["1"])
    with pytest.raises(ValueError, match="truncation must be one of"):
        RLHFDataset(path, tokenizer, max_prompt_length=32, truncation="both")
    with pytest.raises(FileNotFoundError, match="nope.parquet"):
        RLHFDataset(tmp_path / "nope.parquet", tokenizer, max_prompt_length=32)


# ------------------------------------------------------------------------------------------------------------
# PromptLoader
# ------------------------------------------------------------------------------------------------------------
class RangeDataset:
    """Item i is {"x": tensor([i]), "index": i}: enough to see which rows a batch holds."""

    def __init__(self, n):
        self.n = n

    def __len__(self):
        return self.n

    def __getitem__(self, i):
        return {"x": torch.tensor([i]), "index": i}


def batches(loader):
    return [batch["index"] for batch in loader]


def test_loader_matches_verls_random_sampler_order():
    loader = PromptLoader(RangeDataset(10), 3, seed=1)
    assert len(loader) == 3 and len(PromptLoader(RangeDataset(10), 3, drop_last=False)) == 4
    # torch's DataLoader(sampler=RandomSampler(generator seeded 1), batch_size=3, drop_last=True), as verl builds
    # it, visits these rows in its first two epochs (recorded once from torch 2.13; torch's CPU RNG is stable):
    assert batches(loader) == [[5, 6, 1], [2, 0, 8], [9, 3, 7]]
    assert batches(loader) == [[2, 8, 1], [5, 6, 9], [3, 7, 0]]
    generator = torch.Generator()
    generator.manual_seed(1)
    reference = DataLoader(RangeDataset(10), batch_size=3, drop_last=True, collate_fn=collate,
                           sampler=RandomSampler(RangeDataset(10), generator=generator))
    fresh = PromptLoader(RangeDataset(10), 3, seed=1)
    for _ in range(3):
        assert batches(fresh) == batches(reference)
    batch = next(iter(PromptLoader(RangeDataset(10), 3, seed=1)))
    assert batch["x"].tolist() == [[5], [6], [1]]  # tensors stacked to [B, 1]


def test_loader_is_deterministic_and_seed_dependent():
    def two_epochs(seed):
        loader = PromptLoader(RangeDataset(20), 4, seed=seed)
        return batches(loader) + batches(loader)

    assert two_epochs(7) == two_epochs(7)
    assert two_epochs(7) != two_epochs(8)
    first, second = two_epochs(7)[:5], two_epochs(7)[5:]
    assert first != second  # a new permutation every epoch
    assert sorted(sum(first, [])) == list(range(20))
    assert batches(PromptLoader(RangeDataset(7), 3, shuffle=False, drop_last=False)) == [[0, 1, 2], [3, 4, 5],
                                                                                          [6]]


def test_loader_resumes_mid_epoch():
    reference = PromptLoader(RangeDataset(10), 3, seed=1)
    epoch0, epoch1 = batches(reference), batches(reference)
    running = PromptLoader(RangeDataset(10), 3, seed=1)
    iterator = iter(running)
    next(iterator)  # one batch trained, then a checkpoint
    state = running.state_dict()
    assert state["epoch"] == 0 and state["batches_done_in_epoch"] == 1
    resumed = PromptLoader(RangeDataset(10), 3, seed=1)
    resumed.load_state_dict(state)
    assert batches(resumed) == epoch0[1:]
    assert batches(resumed) == epoch1


def test_loader_resumes_at_epoch_boundary():
    reference = PromptLoader(RangeDataset(10), 3, seed=1)
    batches(reference)
    epoch1, epoch2 = batches(reference), batches(reference)
    running = PromptLoader(RangeDataset(10), 3, seed=1)
    batches(running)  # the whole of epoch 0; the checkpoint is taken after its last batch
    state = running.state_dict()
    assert state["epoch"] == 0 and state["batches_done_in_epoch"] == 3
    resumed = PromptLoader(RangeDataset(10), 3, seed=1)
    resumed.load_state_dict(state)
    assert batches(resumed) == epoch1
    assert resumed.state_dict()["epoch"] == 1
    assert batches(resumed) == epoch2


def test_loader_rejects_mismatched_resume_and_tiny_dataset():
    state = PromptLoader(RangeDataset(10), 3, seed=1).state_dict()
    with pytest.raises(ValueError, match="batch_size=3"):
        PromptLoader(RangeDataset(10), 2, seed=1).load_state_dict(state)
    with pytest.raises(ValueError, match="fewer than one batch"):
        PromptLoader(RangeDataset(2), 3)


def test_a_resume_over_other_rows_of_the_same_count_is_warned_about(tokenizer, tmp_path):
    """The same rows from another folder resume silently; one changed answer or prompt among as many rows is warned
    about (the order and count checks cannot see it), and the run goes on where the checkpoint left off."""
    contents = ["12", "345", "6789", "0"]
    trained = write_rows(tmp_path / "train.parquet", contents)
    (tmp_path / "moved").mkdir()
    moved = write_rows(tmp_path / "moved" / "train.parquet", contents)
    answers = [{"style": "rule", "ground_truth": g} for g in ("0", "1", "2", "33")]
    other_answer = write_rows(tmp_path / "answer.parquet", contents, reward_model=answers)
    other_prompt = write_rows(tmp_path / "prompt.parquet", contents[:3] + ["1"])

    def loader(path):
        return PromptLoader(RLHFDataset(path, tokenizer, max_prompt_length=64), 2, seed=1)

    running = loader(trained)
    next(iter(running))
    state = running.state_dict()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        loader(moved).load_state_dict(state)
    for path in (other_answer, other_prompt):
        resumed = loader(path)
        with pytest.warns(UserWarning, match=r"the training rows differ from those of the checkpointed run \(as "
                                             r"many rows.*data epoch 0, 1 batches of it done"):
            resumed.load_state_dict(state)
        assert resumed.state_dict()["batches_done_in_epoch"] == 1

# ------------------------------------------------------------------------------------------------------------
# GSM8K preprocessing on real rows (the sample in tests/data/gsm8k)
# ------------------------------------------------------------------------------------------------------------
INSTRUCTION = ' Let\'s think step by step and output the final answer after "####".'


def test_gsm8k_preprocessing_on_real_rows(gsm8k_dir, tmp_path):
    preprocess_gsm8k(gsm8k_dir, tmp_path)
    train = pq.read_table(tmp_path / "train.parquet").to_pylist()
    test = pq.read_table(tmp_path / "test.parquet").to_pylist()
    assert (len(train), len(test)) == (64, 32)

    natalia = ("Natalia sold clips to 48 of her friends in April, and then she sold half as many clips in May. "
               "How many clips did Natalia sell altogether in April and May?")
    natalia_answer = ("Natalia sold 48/2 = <<48/2=24>>24 clips in May.\n"
                      "Natalia sold 48+24 = <<48+24=72>>72 clips altogether in April and May.\n#### 72")
    assert train[0] == {
        "data_source": "openai/gsm8k",
        "prompt": [{"role": "user", "content": natalia + INSTRUCTION}],
        "ability": "math",
        "reward_model": {"style": "rule", "ground_truth": "72"},
        "extra_info": {"split": "train", "index": 0, "answer": natalia_answer, "question": natalia},
    }
    # sample line 31 (line 147 of GSM8K's test split): "... #### 2,125" -> commas removed
    assert test[30]["reward_model"]["ground_truth"] == "2125"
    assert test[30]["prompt"][0]["content"].startswith("Johnny is picking up the toys on the floor of his room.")
    assert test[30]["extra_info"]["index"] == 30 and test[30]["extra_info"]["split"] == "test"
    # sample line 32 (line 490 of the test split): "... #### -10" keeps the sign
    assert test[31]["reward_model"]["ground_truth"] == "-10"
    assert test[31]["prompt"][0]["content"].endswith("What is the average highest temperature of these 3 "
                                                      "countries?" + INSTRUCTION)


def test_gsm8k_reads_hf_parquet_layout(tmp_path):
    source = tmp_path / "hf" / "main"
    source.mkdir(parents=True)
    example = {"question": "Q?", "answer": "1,000 + 234\n#### 1,234"}
    for split in ("train", "test"):
        pq.write_table(pa.Table.from_pylist([example]), source / f"{split}-00000-of-00001.parquet")
    preprocess_gsm8k(tmp_path / "hf", tmp_path / "out")
    row = pq.read_table(tmp_path / "out" / "test.parquet").to_pylist()[0]
    assert row["prompt"][0]["content"] == "Q?" + INSTRUCTION
    assert row["reward_model"]["ground_truth"] == "1234"
    with pytest.raises(FileNotFoundError, match="no GSM8K train split"):
        preprocess_gsm8k(tmp_path / "out" / "missing", tmp_path / "x")


# ------------------------------------------------------------------------------------------------------------
# The command line
# ------------------------------------------------------------------------------------------------------------
def test_gsm8k_command_writes_the_preprocessed_splits(gsm8k_dir, tmp_path):
    out = subprocess.run([sys.executable, str(REPO / "data.py"), "gsm8k", "--input", str(gsm8k_dir),
                          "--out", str(tmp_path / "cli")], capture_output=True, text=True, cwd=REPO)
    assert out.returncode == 0, out.stderr
    assert f"wrote 64 rows to {tmp_path / 'cli' / 'train.parquet'}" in out.stdout
    preprocess_gsm8k(gsm8k_dir, tmp_path / "lib")
    for split in ("train", "test"):
        assert pq.read_table(tmp_path / "cli" / f"{split}.parquet").equals(
            pq.read_table(tmp_path / "lib" / f"{split}.parquet"))
    missing = subprocess.run([sys.executable, str(REPO / "data.py"), "gsm8k", "--out", str(tmp_path)],
                             capture_output=True, text=True, cwd=REPO)
    assert missing.returncode == 2 and "the following arguments are required: --input" in missing.stderr


def test_gsm8k_command_takes_verls_flag_names(gsm8k_dir, tmp_path, monkeypatch):
    """verl's examples/data_preprocess/gsm8k.py line (--local_dataset_path, --local_save_dir or the older
    --local_dir, `~` expanded by the script) writes what --input/--out write."""
    monkeypatch.setenv("HOME", str(tmp_path))
    for flag in ("--local_save_dir", "--local_dir"):
        out = subprocess.run([sys.executable, str(REPO / "data.py"), "gsm8k", f"--local_dataset_path={gsm8k_dir}",
                              f"{flag}=~/data/{flag}"], capture_output=True, text=True, cwd=REPO)
        assert out.returncode == 0, out.stderr
    preprocess_gsm8k(gsm8k_dir, tmp_path / "lib")
    for split in ("train", "test"):
        expected = pq.read_table(tmp_path / "lib" / f"{split}.parquet")
        for flag in ("--local_save_dir", "--local_dir"):
            assert pq.read_table(tmp_path / "data" / flag / f"{split}.parquet").equals(expected)


def test_the_dataset_code_needs_neither_rewards_nor_the_demo():
    """data.py is imported by the trainer; the demo's tiny models and the reward functions are not its business."""
    code = "import sys, data; print(sorted({'rewards', 'demo'} & set(sys.modules)))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=REPO)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[]"
