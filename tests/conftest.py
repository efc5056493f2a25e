"""Shared pytest fixtures: tiny local tokenizer/models (built once per session, no hub), the demo assets and
the GSM8K sample in tests/data/gsm8k. Use them by naming them as test arguments, e.g.
`def test_x(tiny_model_dir): AutoModelForCausalLM.from_pretrained(tiny_model_dir)`."""

import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import sys  # noqa: E402
from pathlib import Path  # noqa: E402

import pytest  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))  # the flat modules at the repo root, whatever directory pytest starts in

import demo  # noqa: E402


@pytest.fixture(scope="session")
def tiny_tokenizer_dir(tmp_path_factory):
    """Folder with the tiny byte-level BPE tokenizer (vocab 512, Qwen-style chat template)."""
    out = tmp_path_factory.mktemp("tiny_tokenizer")
    demo.build_tokenizer(out)
    return out


def _save_tiny_model(tokenizer_dir, out, kind):
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(tokenizer_dir)
    demo.build_tiny_model(tokenizer, kind=kind, seed=0).save_pretrained(out)
    tokenizer.save_pretrained(out)
    return out


@pytest.fixture(scope="session")
def tiny_model_dir(tiny_tokenizer_dir, tmp_path_factory):
    """Random-init tiny Qwen2ForCausalLM + tokenizer (no warm-up)."""
    return _save_tiny_model(tiny_tokenizer_dir, tmp_path_factory.mktemp("tiny_model"), "causal")


@pytest.fixture(scope="session")
def tiny_rm_dir(tiny_tokenizer_dir, tmp_path_factory):
    """Random-init tiny Qwen2ForSequenceClassification (num_labels=1) + tokenizer: a reward model."""
    return _save_tiny_model(tiny_tokenizer_dir, tmp_path_factory.mktemp("tiny_rm"), "seq_cls")


@pytest.fixture(scope="session")
def tiny_critic_dir(tiny_tokenizer_dir, tmp_path_factory):
    """Random-init tiny Qwen2ForTokenClassification (num_labels=1) + tokenizer: a critic."""
    return _save_tiny_model(tiny_tokenizer_dir, tmp_path_factory.mktemp("tiny_critic"), "token_cls")


@pytest.fixture(scope="session")
def demo_dir(tmp_path_factory):
    """make_demo_assets output: model/ (warmed-up), data/{train,test}.parquet, warmup.json (~10 s, once)."""
    out = tmp_path_factory.mktemp("demo")
    demo.make_demo_assets(out)
    return out


@pytest.fixture(scope="session")
def gsm8k_dir():
    """64 train and 32 test lines of the real GSM8K jsonl files, shipped with the tests (see its README.md)."""
    return REPO / "tests" / "data" / "gsm8k"
