"""Shared pytest fixtures: tiny local tokenizer/models (built once per session, no hub), the demo assets and
the GSM8K sample in tests/data/gsm8k. Use them by naming them as test arguments, e.g.
`def test_x(tiny_model_dir): AutoModelForCausalLM.from_pretrained(tiny_model_dir)`. Plain helpers shared by test
files (`from conftest import ...`): padded_batch (a rollout-shaped batch), t and close (tensors, comparisons),
OFFLOAD_SWITCHES (every verl offload switch minirl reads, on)."""

import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import sys  # noqa: E402
from pathlib import Path  # noqa: E402

import pytest  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))  # the flat modules at the repo root, whatever directory pytest starts in

import demo  # noqa: E402


@pytest.fixture(scope="session", autouse=True)
def shared_vllm_cache(tmp_path_factory):
    """One vLLM cache (VLLM_CACHE_ROOT) for the whole session, inherited by every run the tests launch, as a
    user's runs share vLLM's default one; never the developer's own ~/.cache/vllm."""
    previous = os.environ.get("VLLM_CACHE_ROOT")
    os.environ["VLLM_CACHE_ROOT"] = str(tmp_path_factory.mktemp("vllm_cache"))
    yield Path(os.environ["VLLM_CACHE_ROOT"])
    if previous is None:
        del os.environ["VLLM_CACHE_ROOT"]
    else:
        os.environ["VLLM_CACHE_ROOT"] = previous


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
def fixed_batch(tiny_model_dir, tmp_path_factory):
    """The oracle tests' batch (tests/oracle_step.py), saved to a file: 8 responses (4 prompts x n=2) with
    left-padded prompts (P=6), right-padded responses (R=5), so packed rows of odd and even lengths, old log-probs
    near the model's (so some ratios clip), random advantages and reference log-probs."""
    import torch
    from transformers import AutoModelForCausalLM

    from forward import token_logprobs
    g = torch.Generator().manual_seed(1)
    batch = padded_batch([6, 3, 1, 4, 5, 2, 6, 3], [5, 2, 4, 1, 3, 5, 2, 4])
    b, R = batch["responses"].shape
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32)
    with torch.no_grad():
        logp, _ = token_logprobs(model, batch, temperature=0.9, use_remove_padding=False)
    batch["old_log_probs"] = logp + 0.3 * torch.randn(b, R, generator=g)
    batch["ref_log_prob"] = logp + 0.5 * torch.randn(b, R, generator=g)
    batch["advantages"] = torch.randn(b, R, generator=g) * batch["response_mask"]
    batch["uid"] = [str(i // 2) for i in range(b)]
    path = tmp_path_factory.mktemp("oracle") / "batch.pt"
    torch.save(batch, path)
    return path


@pytest.fixture(scope="session")
def tiny_vl_dir(tmp_path_factory):
    """Random-init tiny Qwen2.5-VL + its locally built processor (no warm-up)."""
    import demo_vl
    out = tmp_path_factory.mktemp("tiny_vl")
    demo_vl.build_tiny_vl_model(demo_vl.build_vl_processor(out)).save_pretrained(out)
    return out


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


def padded_batch(prompt_lens, response_lens, P=6, R=5, vocab=300, seed=0):
    """A rollout-shaped batch with left-padded prompts (P) and right-padded responses (R), pad id 0:
    input_ids/attention_mask/position_ids [b, P+R], prompts [b, P], responses and response_mask [b, R]."""
    import torch
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(10, vocab, (len(prompt_lens), P + R), generator=g)
    mask = torch.zeros_like(ids)
    for i, (p, r) in enumerate(zip(prompt_lens, response_lens)):
        mask[i, P - p:P] = 1
        mask[i, P:P + r] = 1
    ids = ids * mask
    return {"input_ids": ids, "attention_mask": mask, "position_ids": torch.clamp(mask.cumsum(-1) - 1, min=0),
            "prompts": ids[:, :P], "responses": ids[:, P:], "response_mask": mask[:, P:]}


def t(x, dtype=None):
    """A float32 (or `dtype`) tensor from nested lists."""
    import torch
    return torch.tensor(x, dtype=dtype or torch.float32)


def close(actual, expected, atol=1e-5, rtol=1e-5):
    """assert_close in float32 (tensors, lists or numbers on either side)."""
    import torch
    torch.testing.assert_close(torch.as_tensor(actual, dtype=torch.float32),
                               torch.as_tensor(expected, dtype=torch.float32), atol=atol, rtol=rtol)


# verl's offload switches, on, for every worker that has them: the optimizer's only where there is an optimizer
OFFLOAD_SWITCHES = [f"{role}.fsdp_config.{key}=true" for role, keys in (
    ("actor_rollout_ref.actor", ("param_offload", "optimizer_offload")),
    ("actor_rollout_ref.ref", ("param_offload",)),
    ("critic.model", ("param_offload", "optimizer_offload")),
    ("reward_model.model", ("param_offload",))) for key in keys]
