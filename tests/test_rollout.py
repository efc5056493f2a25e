"""The HF-generate rollout engine samples from the actor's distribution under the rollout config, and nothing else.

Checked against the model's own logits: a greedy loop written out by hand, and sampling frequencies against the
softmax (with temperature, top-k and top-p applied by hand), with a checkpoint whose generation_config.json would
change both if `generate` read it."""
import json
import shutil

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from rollout import HFRollout, InverseCDFSampler, Sampling

PROMPT = [5, 17, 42, 99, 7, 23]


def next_token_logits(model, ids):
    with torch.no_grad():
        return model(torch.tensor([ids])).logits[0, -1].double()


@pytest.fixture
def engine_with_a_loaded_generation_config(tiny_model_dir, tmp_path):
    """The tiny model, its generation_config.json suppressing the most likely next token of PROMPT and penalising
    repeats (Qwen2.5's instruct models ship repetition_penalty=1.05): settings the rollout config does not have."""
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir).eval()
    top = int(next_token_logits(model, PROMPT).argmax())
    folder = tmp_path / "model"
    shutil.copytree(tiny_model_dir, folder)
    path = folder / "generation_config.json"
    config = json.loads(path.read_text()) if path.exists() else {}
    config.update(suppress_tokens=[top], repetition_penalty=5.0, no_repeat_ngram_size=1)
    path.write_text(json.dumps(config))
    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    return HFRollout(str(folder), tokenizer, torch.device("cpu")), model


def test_greedy_generation_is_the_argmax_of_the_models_logits(engine_with_a_loaded_generation_config):
    engine, model = engine_with_a_loaded_generation_config
    expected = []
    while len(expected) < 10 and (not expected or expected[-1] not in engine.eos_ids):
        expected.append(int(next_token_logits(model, PROMPT + expected).argmax()))
    tokens, _ = engine.generate([PROMPT], Sampling(max_tokens=10, do_sample=False), seed=0)
    assert tokens == [expected]


def nucleus_probabilities(logits, temperature, top_k, top_p):
    """softmax(logits / temperature) over the top_k tokens, then the most likely of those while the mass before
    each is under top_p, renormalised."""
    probs = torch.zeros_like(logits)
    kept = logits.topk(top_k).indices
    probs[kept] = torch.softmax(logits[kept] / temperature, -1)
    order = probs.argsort(descending=True)
    mass_before = probs[order].cumsum(0) - probs[order]
    probs[order[mass_before >= top_p]] = 0
    return probs / probs.sum()


def test_sampled_tokens_follow_the_policy_under_temperature_top_k_and_top_p(engine_with_a_loaded_generation_config):
    engine, model = engine_with_a_loaded_generation_config
    draws = 20000
    expected = nucleus_probabilities(next_token_logits(model, PROMPT), temperature=0.7, top_k=40, top_p=0.9)
    tokens, _ = engine.generate([PROMPT] * draws, Sampling(max_tokens=1, temperature=0.7, top_k=40, top_p=0.9),
                                seed=3)
    counts = torch.bincount(torch.tensor([row[0] for row in tokens]), minlength=len(expected)).double()
    assert counts[expected == 0].sum() == 0
    assert (expected > 0).sum() > 10                       # a spread distribution, so the check below has teeth
    frequency = counts / draws
    sigma = (expected * (1 - expected) / draws).sqrt()
    assert ((frequency - expected).abs() <= 5 * sigma + 1e-9).all(), (frequency - expected).abs().max()


def test_sampled_log_probs_are_those_of_the_distribution_each_token_was_drawn_from(tiny_model_dir):
    """The hf engine's log-probs of its sampled tokens (vLLM's processed log-probs), against a plain forward of each
    prompt + response (one sequence, no padding, no KV cache): log_softmax(logits / temperature) at each token,
    and with top-k/top-p the log of the truncated, renormalised probability written out by hand above. Prompts of
    different lengths (left padding); responses past an EOS cut there, but with ignore_eos, where the EOS is drawn
    from the model's distribution like any token (vLLM's meaning) and generation goes on."""
    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    engine = HFRollout(str(tiny_model_dir), tokenizer, torch.device("cpu"))
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir).eval()
    prompts = [PROMPT, PROMPT[:2], [9, 8, 7, 6, 5, 4, 3, 2, 1]]
    for top_k, top_p, ignore_eos in ((-1, 1.0, False), (0, 1.0, False), (20, 0.8, False), (-1, 1.0, True)):
        sampling = Sampling(max_tokens=12, temperature=0.7, top_k=top_k, top_p=top_p, ignore_eos=ignore_eos)
        tokens, log_probs = engine.generate(prompts, sampling, seed=5)
        for prompt, response, got in zip(prompts, tokens, log_probs):
            assert len(got) == len(response) and (len(response) == 12 or not ignore_eos)
            ended = [i for i, t in enumerate(response) if t in engine.eos_ids]
            kept = response[:ended[0] + 1] if ended and not ignore_eos else response
            expected = []
            for i, token in enumerate(kept):
                logits = next_token_logits(model, prompt + kept[:i])
                kept_k = top_k if top_k > 0 else logits.numel()
                expected.append(nucleus_probabilities(logits, 0.7, kept_k, top_p)[token].log())
            gap = (torch.tensor(got[:len(kept)], dtype=torch.double) - torch.stack(expected)).abs().max()
            assert gap < 1e-5, gap
    assert engine.generate(prompts, Sampling(max_tokens=4, do_sample=False), seed=0)[1] is None      # greedy


def test_the_draw_matches_its_distribution_and_never_lands_on_a_masked_token(monkeypatch):
    """Scores with masked tokens at both ends and between: 200k draws against the softmax. Then the uniform number
    at its largest (1 - 2**-24), on rows whose probabilities sum to just under or over 1 after rounding: the draw is
    the last token with mass, not a masked one after it."""
    scores = torch.tensor([-torch.inf, 0.5, -torch.inf, 2.0, 1.0, 0.0, -torch.inf, -torch.inf])
    probs = torch.softmax(scores.double(), -1)
    rows = 200000
    torch.manual_seed(0)
    out = InverseCDFSampler()(None, scores.repeat(rows, 1))
    assert ((out == 0).sum(-1) == 1).all() and (out.isinf().sum(-1) == len(scores) - 1).all()
    frequency = torch.bincount(out.argmax(-1), minlength=len(scores)).double() / rows
    assert ((frequency - probs).abs() <= 5 * (probs * (1 - probs) / rows).sqrt() + 1e-12).all()

    many = torch.randn(500, 8, generator=torch.Generator().manual_seed(1))
    many[:, [0, 2, 6, 7]] = -torch.inf
    totals = many.softmax(-1).cumsum(-1)[:, -1]
    assert (totals < 1).any() and (totals > 1).any()
    largest_below_one = torch.nextafter(torch.tensor(1.0), torch.tensor(0.0)).item()
    monkeypatch.setattr(torch, "rand", lambda shape, **kw: torch.full(shape, largest_below_one, **kw))
    assert (InverseCDFSampler()(None, many).argmax(-1) == 5).all()
