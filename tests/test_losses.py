"""Tests for losses.py: every function against numbers worked out by hand (arithmetic in the comments) or an
independent computation written here (naive loops), never against losses.py's own output.
Run: HF_HUB_OFFLINE=1 .venv/bin/python -m pytest tests/test_losses.py -q
"""

import math
import os
import sys
from collections import defaultdict

import numpy as np
import pytest
import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import losses as L  # noqa: E402

EPS = 1e-6  # GRPO epsilon


def t(x, dtype=torch.float32):
    return torch.tensor(x, dtype=dtype)


def close(actual, expected, atol=1e-5, rtol=1e-5):
    torch.testing.assert_close(torch.as_tensor(actual, dtype=torch.float32),
                               torch.as_tensor(expected, dtype=torch.float32), atol=atol, rtol=rtol)


# ------------------------------------------------------------------------------------------------ masked statistics

def test_masked_mean_all_and_per_row():
    x = t([[1, 2, 3], [4, 5, 6]])
    m = t([[1, 1, 0], [0, 1, 0]])
    close(L.masked_mean(x, m), 8 / 3)  # (1 + 2 + 5) / 3
    close(L.masked_mean(x, m, dim=-1), [1.5, 5.0])  # (1+2)/2, 5/1


def test_masked_mean_empty_mask_is_zero_and_ignores_nan_on_padding():
    x = t([[1.0, float("nan")]])
    assert L.masked_mean(x, t([[0, 0]])).item() == 0.0
    close(L.masked_mean(x, t([[1, 0]])), 1.0)  # the NaN sits under mask 0


def test_masked_var_unbiased_and_biased():
    x = t([1, 2, 3, 40])
    m = t([1, 1, 1, 0])
    # mean 2, squared deviations 1 + 0 + 1 = 2: biased 2/3, unbiased 2/2 = 1
    close(L.masked_var(x, m, unbiased=False), 2 / 3)
    close(L.masked_var(x, m), 1.0)


@pytest.mark.parametrize("mask", [[0, 0, 0], [0, 1, 0]])
def test_masked_var_rejects_count_zero_or_one(mask):
    with pytest.raises(ValueError, match="mask"):
        L.masked_var(t([1, 2, 3]), t(mask))


def test_masked_whiten():
    x = t([1, 2, 3, 10])
    m = t([1, 1, 1, 0])
    # masked mean 2, unbiased var 1 -> (x - 2) / sqrt(1 + 1e-8); the masked 10 is transformed too: 8
    close(L.masked_whiten(x, m), [-1, 0, 1, 8])
    close(L.masked_whiten(x, m, shift_mean=False), [1, 2, 3, 10])  # mean 2 added back


# ------------------------------------------------------------------------------------------------ log-probs, entropy

def test_logprobs_from_logits_any_leading_shape_and_bf16():
    # softmax([0, 0, ln 2]) = [1/4, 1/4, 1/2]
    row = [0.0, 0.0, math.log(2)]
    logits = t([[row], [row]])  # [2, 1, 3]
    labels = torch.tensor([[2], [0]])  # [2, 1]
    out = L.logprobs_from_logits(logits, labels)
    assert out.shape == (2, 1) and out.dtype == torch.float32
    close(out, [[math.log(0.5)], [math.log(0.25)]])
    close(L.logprobs_from_logits(logits.bfloat16(), labels), [[math.log(0.5)], [math.log(0.25)]], atol=1e-2)


def test_logprobs_from_logits_stable_for_huge_logits():
    # softmax([1000, 1000]) = [1/2, 1/2] without overflow
    close(L.logprobs_from_logits(t([[1000.0, 1000.0]]), torch.tensor([1])), [math.log(0.5)])


def test_entropy_from_logits_hand_values_and_chunking():
    # uniform over 4 -> ln 4; [1/4, 1/4, 1/2] -> -(2·¼·ln¼ + ½·ln½) = 1.5·ln 2; [1000, 1000, -1000] -> ln 2
    logits = t([[[0, 0, 0, 0], [0, 0, math.log(2), -1e9]], [[1000, 1000, -1000, -1000], [5, 5, 5, 5]]])
    expected = [[math.log(4), 1.5 * math.log(2)], [math.log(2), math.log(4)]]
    for chunk in (None, 1, 3, 2048):
        out = L.entropy_from_logits(logits, chunk_size=chunk)
        assert out.shape == (2, 2) and out.dtype == torch.float32
        close(out, expected)


def test_entropy_chunked_is_differentiable():
    logits = torch.randn(5, 7, requires_grad=True)
    L.entropy_from_logits(logits, chunk_size=2).sum().backward()
    # independent reference: H = -Σ p log p, autograd through torch's own softmax
    ref = logits.detach().clone().requires_grad_(True)
    p = torch.softmax(ref, -1)
    (-(p * torch.log(p)).sum()).backward()
    close(logits.grad, ref.grad)


# ------------------------------------------------------------------------------------------------ outcome advantages

GROUPS = ["a", "a", "a", "b", "c", "c"]


def test_grpo_hand_values_singleton_equal_scores_and_masked_row():
    scores = t([1, 2, 3, 5, 0.5, 0.5])
    mask = t([[1, 1], [1, 0], [1, 1], [1, 1], [1, 1], [0, 0]])  # last row fully masked
    adv, ret = L.grpo_advantages(scores, GROUPS, mask)
    # group a: mean 2, unbiased std sqrt((1 + 0 + 1)/2) = 1 -> (s - 2)/(1 + 1e-6)
    # group b: singleton -> mean 0, std 1 -> 5/(1 + 1e-6); group c: equal scores -> 0 (no NaN)
    per_response = [-1 / (1 + EPS), 0, 1 / (1 + EPS), 5 / (1 + EPS), 0, 0]
    expected = t(per_response)[:, None] * mask
    close(adv, expected)
    close(ret, expected)
    assert not torch.isnan(adv).any()
    adv_drgrpo, _ = L.grpo_advantages(scores, GROUPS, mask, norm_by_std=False)
    close(adv_drgrpo, t([-1, 0, 1, 5, 0, 0])[:, None] * mask)  # s - mean only


def test_group_ids_strings_numpy_objects_and_int_tensor_agree():
    scores = t([1, 2, 3, 5, 0.5, 0.5])
    mask = torch.ones(6, 3)
    as_strings, _ = L.grpo_advantages(scores, GROUPS, mask)
    as_objects, _ = L.grpo_advantages(scores, np.array(GROUPS, dtype=object), mask)
    as_ints, _ = L.grpo_advantages(scores, torch.tensor([7, 7, 7, 2, 9, 9]), mask)
    close(as_objects, as_strings)
    close(as_ints, as_strings)


def test_group_ids_length_mismatch_is_a_clear_error():
    with pytest.raises(ValueError, match="one uid per response"):
        L.grpo_advantages(t([1, 2, 3]), ["a", "a"], torch.ones(3, 2))


def naive_grpo(scores, uids, eps=EPS):
    """verl-style per-group dictionary loop, written independently of losses.py."""
    by_uid = defaultdict(list)
    for i, uid in enumerate(uids):
        by_uid[uid].append(float(scores[i]))
    out = []
    for i, uid in enumerate(uids):
        group = by_uid[uid]
        if len(group) == 1:
            mean, std = 0.0, 1.0
        else:
            mean = sum(group) / len(group)
            std = math.sqrt(sum((g - mean) ** 2 for g in group) / (len(group) - 1))
        out.append((float(scores[i]) - mean) / (std + eps))
    return torch.tensor(out)


def test_vectorised_grpo_equals_naive_loop():
    gen = torch.Generator().manual_seed(0)
    sizes = [1, 2, 3, 8, 8, 5, 1, 4]
    uids = [f"prompt-{g}" for g, size in enumerate(sizes) for _ in range(size)]
    order = torch.randperm(len(uids), generator=gen)
    uids = [uids[i] for i in order]  # interleave the groups
    scores = torch.randint(0, 2, (len(uids),), generator=gen).float() + 0.1 * torch.randn(len(uids), generator=gen)
    scores[:4] = 1.0  # some ties
    adv, _ = L.grpo_advantages(scores, uids, torch.ones(len(uids), 3))
    close(adv[:, 0], naive_grpo(scores, uids))


def test_rloo_hand_values():
    scores = t([1, 2, 3, 5])
    mask = t([[1, 1], [1, 1], [1, 0], [1, 1]])
    adv, ret = L.rloo_advantages(scores, ["a", "a", "a", "b"], mask)
    # n = 3, mean 2: 3/2·(s - 2) = [-1.5, 0, 1.5]  (= s - mean(others): 1 - 2.5 = -1.5); singleton -> s = 5
    expected = t([-1.5, 0, 1.5, 5])[:, None] * mask
    close(adv, expected)
    close(ret, expected)


def test_opo_length_weighted_baseline():
    scores = t([1, 0, 4])
    mask = t([[1, 0, 0], [1, 1, 1], [1, 1, 0]])  # lengths 1, 3, 2
    adv, _ = L.opo_advantages(scores, ["a", "a", "b"], mask)
    # group a baseline (1·1 + 3·0)/(1 + 3) = 0.25 -> [0.75, -0.25]; singleton b: baseline 0 -> 4
    close(adv, t([0.75, -0.25, 4])[:, None] * mask)


def test_opo_group_of_empty_rows_gives_zero_not_nan():
    adv, _ = L.opo_advantages(t([1, 0]), ["a", "a"], torch.zeros(2, 3))
    close(adv, torch.zeros(2, 3))


def test_gpg_hand_values():
    scores = t([1, 0, 0, 0, 3])
    mask = torch.ones(5, 2)
    adv, _ = L.gpg_advantages(scores, ["a", "a", "b", "b", "c"], mask)
    # α = B / #nonzero = 5/2; a: mean 0.5 -> 2.5·(±0.5) = ±1.25; b: 0; c singleton (mean 0): 2.5·3 = 7.5
    close(adv[:, 0], [1.25, -1.25, 0, 0, 7.5])


def test_grpo_passk_best_of_group_only():
    scores = t([1, 3, 2, 4, 4])
    mask = t([[1, 1], [1, 0], [1, 1], [1, 1], [1, 1]])
    adv, _ = L.grpo_passk_advantages(scores, ["a", "a", "a", "b", "b"], mask)
    # a: best 3, second 2 -> gap 1; unbiased std of [1, 3, 2] = 1 -> 1/(1 + 1e-6) for response 1 only
    # b: a tie for best -> gap 0 for both
    close(adv, t([0, 1 / (1 + EPS), 0, 0, 0])[:, None] * mask)
    adv_raw, _ = L.grpo_passk_advantages(scores, ["a", "a", "a", "b", "b"], mask, norm_by_std=False)
    close(adv_raw[:, 0], [0, 1, 0, 0, 0])


def test_grpo_passk_rejects_singleton_groups():
    with pytest.raises(ValueError, match="at least 2"):
        L.grpo_passk_advantages(t([1, 2, 3]), ["a", "a", "b"], torch.ones(3, 2))


def test_reinforce_pp_baseline_whitens_over_batch():
    scores = t([1, 3, 2])
    mask = t([[1, 1], [1, 0], [1, 1]])
    adv, ret = L.reinforce_pp_baseline_advantages(scores, ["a", "a", "b"], mask)
    # centered: a mean 2 -> [-1, 1]; b singleton mean 0 -> 2. Tiled × m: [[-1,-1],[1,0],[2,2]]
    # masked values -1,-1,1,2,2: mean 0.6; squared deviations 2.56+2.56+0.16+1.96+1.96 = 9.2; unbiased var 2.3
    expected = t([[-1.6, -1.6], [0.4, 0.0], [1.4, 1.4]]) / math.sqrt(2.3)
    close(adv, expected)
    close(ret, expected)


# ----------------------------------------------------------------------------------------------- token-level advantages

def test_gae_single_row_gamma_lambda():
    r = t([[0, 0, 1]])
    v = t([[0.5, 0.25, 0.5]])
    m = torch.ones(1, 3)
    _, ret = L.gae_advantages(r, v, m, gamma=0.5, lam=0.5)
    # t=2: δ = 1 - 0.5 = 0.5, A = 0.5
    # t=1: δ = 0 + 0.5·0.5 - 0.25 = 0, A = 0 + 0.25·0.5 = 0.125
    # t=0: δ = 0 + 0.5·0.25 - 0.5 = -0.375, A = -0.375 + 0.25·0.125 = -0.34375
    # returns = A + V = [0.15625, 0.375, 1.0]
    close(ret, [[0.15625, 0.375, 1.0]])


def test_gae_skips_masked_middle_token_and_whitens():
    r = t([[0, 0, 0, 1]])
    v = t([[0.5, 9.0, 0.25, 0.5]])
    m = t([[1, 0, 1, 1]])  # token 1 is a tool/observation token
    adv, ret = L.gae_advantages(r, v, m, gamma=1.0, lam=1.0)
    # t=3: δ = 1 - 0.5 = 0.5, A = 0.5, next V = 0.5
    # t=2: δ = 0.5 - 0.25 = 0.25, A = 0.75, next V = 0.25
    # t=1: masked -> next V and A carry over: A = 0.75 (V = 9 ignored)
    # t=0: δ = 0.25 - 0.5 = -0.25, A = -0.25 + 0.75 = 0.5
    close(ret, [[0.5 + 0.5, 0.75 + 9.0, 0.75 + 0.25, 0.5 + 0.5]])
    # whiten over masked A = [0.5, 0.75, 0.5]: mean 7/12, deviations [-1/12, 1/6, -1/12], Σ sq = 6/144,
    # unbiased var 1/48 -> (A - 7/12)·sqrt(48); the masked token (A = 0.75) is transformed too
    s48 = math.sqrt(48)
    close(adv, [[-s48 / 12, s48 / 6, s48 / 6, -s48 / 12]], atol=1e-4)


def test_gae_trailing_padding_has_zero_raw_advantage():
    r = t([[0, 1, 0], [0, 0, 2]])
    v = t([[0.5, 0.5, 0.0], [0.0, 0.0, 0.0]])
    m = t([[1, 1, 0], [1, 1, 1]])
    _, ret = L.gae_advantages(r, v, m, gamma=1.0, lam=1.0)
    # row 0: t=2 padding -> A = 0; t=1: δ = 1 - 0.5 = 0.5; t=0: δ = 0.5 - 0.5 = 0, A = 0.5 -> returns A + V
    # row 1: V = 0 so A = reward-to-go = [2, 2, 2]
    close(ret, [[1.0, 1.0, 0.0], [2.0, 2.0, 2.0]])


def test_reinforce_pp_returns_and_whitening():
    r = t([[0, 0, 1], [0, 2, 0]])
    m = t([[1, 1, 1], [1, 1, 0]])
    adv, ret = L.reinforce_pp_advantages(r, m, gamma=0.5)
    # row 0: G = [0.25, 0.5, 1]; row 1: t=2 G = 0 then reset, G_1 = 2, G_0 = 1 -> [1, 2, 0]
    close(ret, [[0.25, 0.5, 1.0], [1.0, 2.0, 0.0]])
    # masked G: 0.25, 0.5, 1, 1, 2 -> mean 0.95; Σ sq dev = .49 + .2025 + .0025 + .0025 + 1.1025 = 1.8; var 0.45
    expected = (t([[0.25, 0.5, 1.0], [1.0, 2.0, 0.0]]) - 0.95) / math.sqrt(0.45) * m
    close(adv, expected)


def test_reinforce_pp_resets_running_return_at_masked_token():
    _, ret = L.reinforce_pp_advantages(t([[0, 0, 1], [1, 0, 0]]), t([[1, 0, 1], [1, 1, 1]]), gamma=1.0)
    # row 0: t=2 G = 1; t=1 G = 0 + 1 = 1 stored, then reset (m = 0); t=0 G = 0
    close(ret[0], [0.0, 1.0, 1.0])


def test_remax():
    r = t([[0, 1, 2], [3, 0, 0]])
    m = t([[1, 1, 0], [1, 1, 1]])
    adv, ret = L.remax_advantages(r, t([0.5, 1.0]), m)
    # row 0: r·m = [0, 1, 0] -> reverse cumsum [1, 1, 0]; minus 0.5·m -> [0.5, 0.5, 0]
    # row 1: reverse cumsum of [3, 0, 0] = [3, 0, 0]; minus 1·m -> [2, -1, -1]
    close(ret, [[1, 1, 0], [3, 0, 0]])
    close(adv, [[0.5, 0.5, 0], [2, -1, -1]])


# ------------------------------------------------------------------------------------------------ registry, dispatch

def test_registry_and_critic_free_names():
    expected = {"gae", "grpo", "reinforce_plus_plus", "reinforce_plus_plus_baseline", "remax", "rloo", "opo",
                "grpo_passk", "gpg"}
    assert set(L.ADVANTAGE_ESTIMATORS) == expected
    assert set(L.CRITIC_FREE_ESTIMATORS) == expected - {"gae"}


def test_compute_advantages_sums_token_rewards_for_outcome_estimators():
    r = t([[0, 1, 0], [0, 0, 3], [0, 0, 2]])  # scores 1, 3, 2
    m = t([[1, 1, 0], [1, 1, 1], [1, 1, 1]])
    adv, _ = L.compute_advantages("grpo", token_rewards=r, mask=m, group_ids=["a", "a", "a"])
    # mean 2, unbiased std 1 -> [-1, 1, 0]/(1 + 1e-6)
    close(adv, t([-1, 1, 0])[:, None] / (1 + EPS) * m)
    adv, _ = L.compute_advantages("grpo", token_rewards=r, mask=m, group_ids=["a", "a", "a"],
                                  norm_adv_by_std_in_grpo=False)
    close(adv, t([-1, 1, 0])[:, None] * m)


def test_compute_advantages_runs_every_estimator():
    gen = torch.Generator().manual_seed(1)
    r = torch.zeros(4, 5)
    r[:, -1] = torch.rand(4, generator=gen)
    m = torch.ones(4, 5)
    inputs = dict(token_rewards=r, mask=m, group_ids=[0, 0, 1, 1], values=torch.rand(4, 5, generator=gen),
                  baselines=torch.rand(4, generator=gen), gamma=0.9, lam=0.95)
    for name in L.ADVANTAGE_ESTIMATORS:
        adv, ret = L.compute_advantages(name, **inputs)
        assert adv.shape == ret.shape == (4, 5) and torch.isfinite(adv).all(), name


def test_compute_advantages_missing_inputs_and_unknown_name():
    r, m = torch.zeros(2, 3), torch.ones(2, 3)
    with pytest.raises(ValueError, match="values"):
        L.compute_advantages("gae", token_rewards=r, mask=m)
    with pytest.raises(ValueError, match="group_ids"):
        L.compute_advantages("grpo", token_rewards=r, mask=m)
    with pytest.raises(ValueError, match="baselines"):
        L.compute_advantages("remax", token_rewards=r, mask=m)
    with pytest.raises(ValueError, match="valid: gae"):
        L.compute_advantages("ppo", token_rewards=r, mask=m)


# ------------------------------------------------------------------------------------------------ KL penalties

LOGP = [-1.0, -2.0, 0.0, -30.0]
REF = [-1.5, -1.0, -30.0, 0.0]
# d = logp - ref = [0.5, -1, 30, -30]; x = ref - logp = [-0.5, 1, -30, 30] (clamped to ±20 for k3)
K3 = [math.exp(-0.5) + 0.5 - 1,  # 0.1065307
      math.e - 1 - 1,            # 0.7182818
      10.0,                      # e^-20 + 20 - 1 = 19.0000 -> clamped to 10
      10.0]                      # e^20 - 21 -> clamped to 10
EXPECTED_KL = {
    "kl": [0.5, -1, 30, -30], "k1": [0.5, -1, 30, -30],
    "abs": [0.5, 1, 30, 30],
    "mse": [0.125, 0.5, 450, 450], "k2": [0.125, 0.5, 450, 450],  # ½d²
    "low_var_kl": K3, "k3": K3,
}


@pytest.mark.parametrize("kind", list(EXPECTED_KL))
def test_kl_penalty_forward_values(kind):
    close(L.kl_penalty(t(LOGP), t(REF), kind), EXPECTED_KL[kind])
    close(L.kl_penalty(t(LOGP), t(REF), kind + "+"), EXPECTED_KL[kind])  # straight-through keeps the value


@pytest.mark.parametrize("kind", ["k1+", "kl+", "k3+", "low_var_kl+", "abs+", "k2+", "mse+"])
def test_kl_plus_variants_have_k2_gradient(kind):
    logp = t(LOGP).requires_grad_(True)
    L.kl_penalty(logp, t(REF), kind).sum().backward()
    close(logp.grad, t(LOGP) - t(REF))  # d/dlogp ½(logp - ref)² = logp - ref


def test_plain_k3_gradient_is_not_k2s():
    logp = t([-1.0]).requires_grad_(True)
    L.kl_penalty(logp, t([-1.5]), "k3").sum().backward()
    # d/dlogp (e^x - x - 1) with x = ref - logp: -e^x + 1 = 1 - e^-0.5 = 0.393469 (k2 would give 0.5)
    close(logp.grad, [1 - math.exp(-0.5)])


def test_kl_penalty_full_and_unknown_kinds():
    with pytest.raises(NotImplementedError, match="full"):
        L.kl_penalty(t(LOGP), t(REF), "full")
    with pytest.raises(ValueError, match="low_var_kl"):
        L.kl_penalty(t(LOGP), t(REF), "k4")
    assert "full" not in L.KL_PENALTY_KINDS and {"k1+", "k3+", "low_var_kl+", "k2+"} <= set(L.KL_PENALTY_KINDS)


# ------------------------------------------------------------------------------------------------ agg_loss

LOSS = t([[1, 2, 3], [4, 5, 6]])
MASK = t([[1, 1, 0], [1, 0, 0]])  # row sums 3 and 4, row lengths 2 and 1, R = 3


def test_agg_loss_v050_per_batch_formulas():
    close(L.agg_loss(LOSS, MASK, "token-mean"), 7 / 3)  # (1 + 2 + 4)/3
    close(L.agg_loss(LOSS, MASK, "seq-mean-token-sum"), 3.5)  # mean(3, 4)
    close(L.agg_loss(LOSS, MASK, "seq-mean-token-mean"), 2.75)  # mean(3/2, 4/1)
    close(L.agg_loss(LOSS, MASK, "seq-mean-token-sum-norm"), 7 / 3)  # (3 + 4)/R, a SUM over rows
    close(L.agg_loss(LOSS, MASK, "seq-mean-token-sum-norm", norm_len=2), 3.5)  # (3 + 4)/2


def test_agg_loss_v050_quirk_nan_on_empty_row():
    mask = t([[1, 1, 0], [0, 0, 0]])
    assert torch.isnan(L.agg_loss(LOSS, mask, "seq-mean-token-mean"))


def test_agg_loss_global_counts_hand_values():
    # pretend the mini-batch has 6 tokens in 4 non-empty rows overall
    kw = dict(global_tokens=6, global_seqs=4)
    close(L.agg_loss(LOSS, MASK, "token-mean", **kw), 7 / 6)
    close(L.agg_loss(LOSS, MASK, "seq-mean-token-sum", **kw), 7 / 4)
    close(L.agg_loss(LOSS, MASK, "seq-mean-token-mean", **kw), (1.5 + 4) / 4)
    close(L.agg_loss(LOSS, MASK, "seq-mean-token-sum-norm", **kw), 7 / 3 / 4)  # a MEAN over sequences
    close(L.agg_loss(LOSS, MASK, "seq-mean-token-sum-norm", norm_len=2, **kw), 7 / 2 / 4)


def test_agg_loss_global_empty_row_contributes_zero():
    mask = t([[1, 1, 0], [0, 0, 0]])
    close(L.agg_loss(LOSS, mask, "seq-mean-token-mean", global_tokens=2, global_seqs=1), 1.5)
    close(L.agg_loss(LOSS, torch.zeros(2, 3), "token-mean", global_tokens=0, global_seqs=0), 0.0)


def test_global_counts():
    tokens, seqs = L.global_counts(t([[1, 1, 0], [0, 0, 0], [1, 0, 0]]))
    assert (int(tokens), int(seqs)) == (3, 2)


def test_agg_loss_bad_mode_and_missing_count():
    with pytest.raises(ValueError, match="token-mean"):
        L.agg_loss(LOSS, MASK, "sum")
    with pytest.raises(ValueError, match="global_seqs"):
        L.agg_loss(LOSS, MASK, "seq-mean-token-sum", global_tokens=3)


def _random_batch(seed, rows=16, length=7, empty_rows=True):
    gen = torch.Generator().manual_seed(seed)
    loss = torch.randn(rows, length, generator=gen)
    lengths = torch.randint(1, length + 1, (rows,), generator=gen)
    if empty_rows:
        lengths[[3, 10]] = 0
    mask = (torch.arange(length)[None, :] < lengths[:, None]).float()
    return loss, mask


def _shares(loss, mask, mode):
    """Split into 2 fake ranks × 2 micro-batches, all-reduce the counts by summing, and sum the shares."""
    pieces = [(loss[i:i + 4], mask[i:i + 4]) for i in range(0, loss.shape[0], 4)]  # rank r owns pieces 2r, 2r+1
    counts = [L.global_counts(piece_mask) for _, piece_mask in pieces]
    tokens = sum(c[0] for c in counts)
    seqs = sum(c[1] for c in counts)
    total = sum(L.agg_loss(pl, pm, mode, global_tokens=tokens, global_seqs=seqs) for pl, pm in pieces)
    return total, tokens, seqs


@pytest.mark.parametrize("mode", L.LOSS_AGG_MODES)
def test_micro_batch_shares_sum_to_full_batch_loss(mode):
    loss, mask = _random_batch(seed=2)
    total, tokens, seqs = _shares(loss, mask, mode)
    close(total, L.agg_loss(loss, mask, mode, global_tokens=tokens, global_seqs=seqs))
    # and the full-batch value itself, computed independently
    row_sums, row_len = (loss * mask).sum(-1), mask.sum(-1)
    nonempty = row_len > 0
    independent = {
        "token-mean": row_sums.sum() / row_len.sum(),
        "seq-mean-token-sum": row_sums.sum() / nonempty.sum(),
        "seq-mean-token-mean": (row_sums[nonempty] / row_len[nonempty]).mean(),
        "seq-mean-token-sum-norm": (row_sums / loss.shape[1]).sum() / nonempty.sum(),
    }[mode]
    close(total, independent)


@pytest.mark.parametrize("mode", ["token-mean", "seq-mean-token-sum", "seq-mean-token-mean"])
def test_shares_equal_v050_formula_on_full_batch_without_empty_rows(mode):
    loss, mask = _random_batch(seed=3, empty_rows=False)
    total, _, _ = _shares(loss, mask, mode)
    close(total, L.agg_loss(loss, mask, mode))


# ------------------------------------------------------------------------------------------------ policy / value loss

def _policy_case():
    # token:              0: clip high   1: inside   2: clip low   3: dual clip   4: A<0 inside dual   5: masked
    ratio = t([[1.5, 1.0, 0.5, 4.0, 2.0, 7.0]])
    adv = t([[1.0, 1.0, -1.0, -1.0, -1.0, 1.0]])
    mask = t([[1, 1, 1, 1, 1, 0]])
    old = torch.zeros(1, 6)
    logp = torch.log(ratio).requires_grad_(True)
    return old, logp, adv, mask


def test_policy_loss_values_metrics_and_gradient():
    old, logp, adv, mask = _policy_case()
    loss, metrics = L.policy_loss(old, logp, adv, mask)
    # token 0: L1 = -1.5, L2 = -1.2 -> max -1.2 (clipped)        token 1: L1 = L2 = -1
    # token 2: L1 = 0.5, L2 = 0.8 -> 0.8 (clipped); dual min(3, 0.8) = 0.8
    # token 3: L1 = 4, L2 = 1.2 -> 4; dual min(3, 4) = 3 (lower clip)
    # token 4: L1 = 2, L2 = 1.2 -> 2; dual min(3, 2) = 2
    # token-mean = (-1.2 - 1 + 0.8 + 3 + 2)/5 = 0.72
    close(loss, 0.72)
    close(metrics["pg_clipfrac"], 2 / 5)  # tokens 0 and 2
    close(metrics["pg_clipfrac_lower"], 1 / 5)  # token 3
    close(metrics["ppo_kl"], -math.log(1.5 * 1.0 * 0.5 * 4.0 * 2.0) / 5)  # mean(-log ratio) = -ln 6 / 5
    assert all(v.dim() == 0 and not v.requires_grad for v in metrics.values())
    loss.backward()
    # d/dlogp of -A·ratio is -A·ratio where not clipped: token 1: -1·1/5, token 4: 2/5; clipped/masked tokens: 0
    close(logp.grad, [[0, -0.2, 0, 0, 0.4, 0]])


def test_policy_loss_asymmetric_clip():
    old, logp, adv, mask = _policy_case()
    loss, _ = L.policy_loss(old, logp, adv, mask, clip_low=0.1, clip_high=0.3)
    # token 0: max(-1.5, -1.3) = -1.3; token 2: max(0.5, 0.9) = 0.9; others as before: (-1.3 - 1 + 0.9 + 3 + 2)/5
    close(loss, 3.6 / 5)


def test_policy_loss_clamps_huge_log_ratio():
    old = torch.zeros(1, 3)
    logp = t([[50.0, 50.0, -50.0]]).requires_grad_(True)
    adv = t([[1.0, -1.0, -1.0]])
    loss, metrics = L.policy_loss(old, logp, adv, torch.ones(1, 3))
    # ratio = e^20 / e^20 / e^-20: token 0 -> max(-e^20, -1.2) = -1.2; token 1 -> dual clip 3;
    # token 2 -> max(e^-20, 0.8) = 0.8
    close(loss, (-1.2 + 3 + 0.8) / 3)
    close(metrics["ppo_kl"], (-20 - 20 + 20) / 3)
    loss.backward()
    assert torch.isfinite(logp.grad).all() and (logp.grad == 0).all()


def test_policy_loss_rejects_bad_clip_c():
    old, logp, adv, mask = _policy_case()
    with pytest.raises(ValueError, match="clip_c"):
        L.policy_loss(old, logp, adv, mask, clip_c=1.0)


def test_policy_loss_forwards_agg_mode_and_global_counts():
    old, logp, adv, mask = _policy_case()
    loss, _ = L.policy_loss(old, logp, adv, mask, agg_mode="seq-mean-token-sum", global_tokens=10, global_seqs=2)
    close(loss, 3.6 / 2)  # one row summing to 3.6, over 2 sequences in the mini-batch


def test_value_loss():
    values = t([[1.0, 2.0, 5.0]]).requires_grad_(True)
    old = t([[0.0, 1.0, 0.0]])
    returns = t([[0.0, 3.0, 0.0]])
    mask = t([[1, 1, 0]])
    loss, clipfrac = L.value_loss(values, returns, old, mask, cliprange_value=0.5)
    # token 0: v_clip = clamp(1, -0.5, 0.5) = 0.5: errors 1 and 0.25 -> 1 (not clipped)
    # token 1: v_clip = clamp(2, 0.5, 1.5) = 1.5: errors 1 and 2.25 -> 2.25 (clipped)
    # loss = 0.5·(1 + 2.25)/2 = 0.8125; clipfrac = 1/2
    close(loss, 0.8125)
    close(clipfrac, 0.5)
    loss.backward()
    # token 0: d/dv 0.5·(v - ret)²/2 = (1 - 0)/2 = 0.5; token 1: clipped branch -> 0
    close(values.grad, [[0.5, 0.0, 0.0]])


# ------------------------------------------------------------------------------------------------ KL controllers

def test_fixed_kl_controller():
    ctrl = L.FixedKLController(0.05)
    ctrl.update(current_kl=10.0, n_steps=100)
    assert ctrl.value == 0.05


def test_adaptive_kl_controller_and_state_dict():
    ctrl = L.AdaptiveKLController(init_kl_coef=0.1, target_kl=0.1, horizon=100)
    ctrl.update(current_kl=0.2, n_steps=10)  # error 0.2/0.1 - 1 = 1 -> clipped 0.2: 0.1·(1 + 0.2·10/100) = 0.102
    close(ctrl.value, 0.102, rtol=1e-9)
    ctrl.update(current_kl=0.09, n_steps=10)  # error -0.1: 0.102·(1 - 0.1·10/100) = 0.10098
    close(ctrl.value, 0.10098, rtol=1e-9)
    restored = L.AdaptiveKLController(init_kl_coef=0.5, target_kl=0.1, horizon=100)
    restored.load_state_dict(ctrl.state_dict())
    assert restored.value == ctrl.value
    with pytest.raises(ValueError, match="horizon"):
        L.AdaptiveKLController(0.1, 0.1, horizon=0)


def test_apply_kl_penalty_rewards_metrics_and_update():
    scores = t([[0, 1], [0, 2]])
    logp = t([[-1, -1], [-2, 0]])
    ref = t([[-1.5, -1], [-1, 0]])
    mask = t([[1, 1], [1, 0]])
    ctrl = L.AdaptiveKLController(init_kl_coef=0.5, target_kl=1.0, horizon=10)
    rewards, metrics = L.apply_kl_penalty(scores, logp, ref, mask, ctrl, "kl")
    # kld = d·m = [[0.5, 0], [-1, 0]]; rewards = scores - 0.5·kld = [[-0.25, 1], [0.5, 2]]
    close(rewards, [[-0.25, 1], [0.5, 2]])
    # per-row masked means: 0.5/2 = 0.25 and -1/1 = -1 -> batch mean -0.375
    assert metrics["actor/reward_kl_penalty"] == pytest.approx(-0.375, abs=1e-6)
    assert metrics["actor/reward_kl_penalty_coeff"] == 0.5  # β used for this batch (before the update)
    # update with n_steps = B = 2: error clip(-0.375 - 1) = -0.2 -> 0.5·(1 - 0.2·2/10) = 0.48
    assert ctrl.value == pytest.approx(0.48)
