"""Tests for losses.py's advantage estimators and compute_advantages: every one against numbers worked out by hand
(arithmetic in the comments) or an independent Python loop written here, never against losses.py's own output.
"""

import math
from collections import defaultdict

import numpy as np
import pytest
import torch

import losses as L
from conftest import close, t

EPS = 1e-6  # GRPO epsilon


# ------------------------------------------------------------------------------------------------ outcome advantages

GROUPS = ["a", "a", "a", "b", "c", "c"]


def outcome(estimator, scores, group_ids, mask, **kwargs):
    """An outcome estimator on per-response scores [B]: they go in as token rewards [B, R] on the first token
    (outcome estimators sum the token rewards of each response, masked or not, as verl)."""
    rewards = torch.zeros(mask.shape)
    rewards[:, 0] = torch.as_tensor(scores, dtype=torch.float32)
    return estimator(token_rewards=rewards, mask=mask, group_ids=group_ids, **kwargs)


def test_grpo_hand_values_singleton_equal_scores_and_masked_row():
    scores = t([1, 2, 3, 5, 0.5, 0.5])
    mask = t([[1, 1], [1, 0], [1, 1], [1, 1], [1, 1], [0, 0]])  # last row fully masked
    adv, ret = outcome(L.grpo_advantages, scores, GROUPS, mask)
    # group a: mean 2, unbiased std sqrt((1 + 0 + 1)/2) = 1 -> (s - 2)/(1 + 1e-6)
    # group b: singleton -> mean 0, std 1 -> 5/(1 + 1e-6); group c: equal scores -> 0 (no NaN)
    per_response = [-1 / (1 + EPS), 0, 1 / (1 + EPS), 5 / (1 + EPS), 0, 0]
    expected = t(per_response)[:, None] * mask
    close(adv, expected)
    close(ret, expected)
    assert not torch.isnan(adv).any()
    adv_drgrpo, _ = outcome(L.grpo_advantages, scores, GROUPS, mask, norm_adv_by_std_in_grpo=False)
    close(adv_drgrpo, t([-1, 0, 1, 5, 0, 0])[:, None] * mask)  # s - mean only


def test_group_ids_strings_numpy_objects_and_int_tensor_agree():
    scores = t([1, 2, 3, 5, 0.5, 0.5])
    mask = torch.ones(6, 3)
    as_strings, _ = outcome(L.grpo_advantages, scores, GROUPS, mask)
    as_objects, _ = outcome(L.grpo_advantages, scores, np.array(GROUPS, dtype=object), mask)
    as_ints, _ = outcome(L.grpo_advantages, scores, torch.tensor([7, 7, 7, 2, 9, 9]), mask)
    close(as_objects, as_strings)
    close(as_ints, as_strings)


def test_group_ids_length_mismatch_is_a_clear_error():
    with pytest.raises(ValueError, match="one uid per response"):
        outcome(L.grpo_advantages, t([1, 2, 3]), ["a", "a"], torch.ones(3, 2))


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
    adv, _ = outcome(L.grpo_advantages, scores, uids, torch.ones(len(uids), 3))
    close(adv[:, 0], naive_grpo(scores, uids))


def test_rloo_hand_values():
    scores = t([1, 2, 3, 5])
    mask = t([[1, 1], [1, 1], [1, 0], [1, 1]])
    adv, ret = outcome(L.rloo_advantages, scores, ["a", "a", "a", "b"], mask)
    # n = 3, mean 2: 3/2·(s - 2) = [-1.5, 0, 1.5]  (= s - mean(others): 1 - 2.5 = -1.5); singleton -> s = 5
    expected = t([-1.5, 0, 1.5, 5])[:, None] * mask
    close(adv, expected)
    close(ret, expected)


def test_opo_length_weighted_baseline():
    scores = t([1, 0, 4])
    mask = t([[1, 0, 0], [1, 1, 1], [1, 1, 0]])  # lengths 1, 3, 2
    adv, _ = outcome(L.opo_advantages, scores, ["a", "a", "b"], mask)
    # group a baseline (1·1 + 3·0)/(1 + 3) = 0.25 -> [0.75, -0.25]; singleton b: baseline 0 -> 4
    close(adv, t([0.75, -0.25, 4])[:, None] * mask)


def test_opo_group_of_empty_rows_gives_zero_not_nan():
    adv, _ = outcome(L.opo_advantages, t([1, 0]), ["a", "a"], torch.zeros(2, 3))
    close(adv, torch.zeros(2, 3))


def test_gpg_hand_values():
    scores = t([1, 0, 0, 0, 3])
    mask = torch.ones(5, 2)
    adv, _ = outcome(L.gpg_advantages, scores, ["a", "a", "b", "b", "c"], mask)
    # α = B / #nonzero = 5/2; a: mean 0.5 -> 2.5·(±0.5) = ±1.25; b: 0; c singleton (mean 0): 2.5·3 = 7.5
    close(adv[:, 0], [1.25, -1.25, 0, 0, 7.5])


def test_grpo_passk_best_of_group_only():
    scores = t([1, 3, 2, 4, 4])
    mask = t([[1, 1], [1, 0], [1, 1], [1, 1], [1, 1]])
    adv, _ = outcome(L.grpo_passk_advantages, scores, ["a", "a", "a", "b", "b"], mask)
    # a: best 3, second 2 -> gap 1; unbiased std of [1, 3, 2] = 1 -> 1/(1 + 1e-6) for response 1 only
    # b: a tie for best -> gap 0 for both
    close(adv, t([0, 1 / (1 + EPS), 0, 0, 0])[:, None] * mask)
    adv_raw, _ = outcome(L.grpo_passk_advantages, scores, ["a", "a", "a", "b", "b"], mask,
                         norm_adv_by_std_in_grpo=False)
    close(adv_raw[:, 0], [0, 1, 0, 0, 0])


def test_grpo_passk_rejects_singleton_groups():
    with pytest.raises(ValueError, match="at least 2"):
        outcome(L.grpo_passk_advantages, t([1, 2, 3]), ["a", "a", "b"], torch.ones(3, 2))


def test_reinforce_pp_baseline_whitens_over_batch():
    scores = t([1, 3, 2])
    mask = t([[1, 1], [1, 0], [1, 1]])
    adv, ret = outcome(L.reinforce_pp_baseline_advantages, scores, ["a", "a", "b"], mask)
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
    _, ret = L.gae_advantages(token_rewards=r, values=v, mask=m, gamma=0.5, lam=0.5)
    # t=2: δ = 1 - 0.5 = 0.5, A = 0.5
    # t=1: δ = 0 + 0.5·0.5 - 0.25 = 0, A = 0 + 0.25·0.5 = 0.125
    # t=0: δ = 0 + 0.5·0.25 - 0.5 = -0.375, A = -0.375 + 0.25·0.125 = -0.34375
    # returns = A + V = [0.15625, 0.375, 1.0]
    close(ret, [[0.15625, 0.375, 1.0]])


def test_gae_skips_masked_middle_token_and_whitens():
    r = t([[0, 0, 0, 1]])
    v = t([[0.5, 9.0, 0.25, 0.5]])
    m = t([[1, 0, 1, 1]])  # token 1 is a tool/observation token
    adv, ret = L.gae_advantages(token_rewards=r, values=v, mask=m, gamma=1.0, lam=1.0)
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
    _, ret = L.gae_advantages(token_rewards=r, values=v, mask=m, gamma=1.0, lam=1.0)
    # row 0: t=2 padding -> A = 0; t=1: δ = 1 - 0.5 = 0.5; t=0: δ = 0.5 - 0.5 = 0, A = 0.5 -> returns A + V
    # row 1: V = 0 so A = reward-to-go = [2, 2, 2]
    close(ret, [[1.0, 1.0, 0.0], [2.0, 2.0, 2.0]])


def test_reinforce_pp_returns_and_whitening():
    r = t([[0, 0, 1], [0, 2, 0]])
    m = t([[1, 1, 1], [1, 1, 0]])
    adv, ret = L.reinforce_pp_advantages(token_rewards=r, mask=m, gamma=0.5)
    # row 0: G = [0.25, 0.5, 1]; row 1: t=2 G = 0 then reset, G_1 = 2, G_0 = 1 -> [1, 2, 0]
    close(ret, [[0.25, 0.5, 1.0], [1.0, 2.0, 0.0]])
    # masked G: 0.25, 0.5, 1, 1, 2 -> mean 0.95; Σ sq dev = .49 + .2025 + .0025 + .0025 + 1.1025 = 1.8; var 0.45
    expected = (t([[0.25, 0.5, 1.0], [1.0, 2.0, 0.0]]) - 0.95) / math.sqrt(0.45) * m
    close(adv, expected)


def test_reinforce_pp_resets_running_return_at_masked_token():
    _, ret = L.reinforce_pp_advantages(token_rewards=t([[0, 0, 1], [1, 0, 0]]), mask=t([[1, 0, 1], [1, 1, 1]]),
                                     gamma=1.0)
    # row 0: t=2 G = 1; t=1 G = 0 + 1 = 1 stored, then reset (m = 0); t=0 G = 0
    close(ret[0], [0.0, 1.0, 1.0])


def test_remax():
    r = t([[0, 1, 2], [3, 0, 0]])
    m = t([[1, 1, 0], [1, 1, 1]])
    adv, ret = L.remax_advantages(token_rewards=r, baselines=t([0.5, 1.0]), mask=m)
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


def naive_whiten(values):
    """(x - mean) / sqrt(unbiased var + 1e-8) over a list of floats."""
    mean = sum(values) / len(values)
    var = sum((v - mean) ** 2 for v in values) / (len(values) - 1)
    return [(v - mean) / math.sqrt(var + 1e-8) for v in values]


def naive_token_advantages(name, rewards, values, baselines, lengths, gamma, lam):
    """GAE, REINFORCE++ and ReMax with Python loops over right-padded rows: per-row lists of (advantage, return)
    on the valid tokens (whitened over all valid tokens of the batch where the estimator whitens)."""
    advs, rets = [], []
    for i, length in enumerate(lengths):
        r, v = rewards[i][:length], values[i][:length]
        if name == "gae":
            a, last = [0.0] * length, 0.0
            for t_ in reversed(range(length)):
                next_v = v[t_ + 1] if t_ + 1 < length else 0.0
                last = r[t_] + gamma * next_v - v[t_] + gamma * lam * last
                a[t_] = last
            advs.append(a)
            rets.append([a_ + v_ for a_, v_ in zip(a, v)])
        else:
            g, running = [0.0] * length, 0.0
            for t_ in reversed(range(length)):
                running = r[t_] + (gamma if name == "reinforce_plus_plus" else 1.0) * running
                g[t_] = running
            rets.append(g)
            advs.append([x - baselines[i] for x in g] if name == "remax" else g)
    if name in ("gae", "reinforce_plus_plus"):
        flat = naive_whiten([x for row in advs for x in row])
        advs = [flat[sum(lengths[:i]):sum(lengths[:i]) + n] for i, n in enumerate(lengths)]
    return advs, rets


def test_compute_advantages_gives_each_estimators_values():
    """compute_advantages(name) against hand-worked outcome advantages and Python-loop token advantages."""
    lengths, scores, groups = [3, 1, 2, 3, 2, 1], [1.0, 0.0, 2.0, 4.0, 1.0, 1.0], [0, 0, 0, 1, 1, 1]
    mask = (torch.arange(3)[None, :] < torch.tensor(lengths)[:, None]).float()        # [6, 3]
    rewards = torch.zeros(6, 3)
    rewards[torch.arange(6), torch.tensor(lengths) - 1] = torch.tensor(scores)       # the score on the last token
    values = torch.tensor([[0.5, 0.2, 0.1], [0.3, 0, 0], [0.4, 0.6, 0], [0.1, 0.9, 0.7], [0.2, 0.8, 0], [0.5, 0, 0]])
    baselines = t([0.5, 0.5, 0.5, 2.0, 2.0, 2.0])
    inputs = dict(token_rewards=rewards, mask=mask, group_ids=groups, values=values, baselines=baselines,
                  gamma=0.9, lam=0.8)
    s3 = math.sqrt(3)
    # group 0: scores 1, 0, 2 (mean 1, unbiased std 1, deviations 0, -1, 1);
    # group 1: scores 4, 1, 1 (mean 2, unbiased std sqrt(6/2) = sqrt 3, deviations 2, -1, -1)
    per_response = {
        "grpo": [0, -1 / (1 + EPS), 1 / (1 + EPS), 2 / (s3 + EPS), -1 / (s3 + EPS), -1 / (s3 + EPS)],
        "rloo": [0, -1.5, 1.5, 3, -1.5, -1.5],                  # n/(n-1) = 3/2 times the deviation
        "gpg": [0, -1.2, 1.2, 2.4, -1.2, -1.2],                 # B / #nonzero = 6/5 times the deviation
        # length-weighted baselines (3·1 + 1·0 + 2·2)/6 = 7/6 and (3·4 + 2·1 + 1·1)/6 = 2.5
        "opo": [1 - 7 / 6, -7 / 6, 2 - 7 / 6, 1.5, -1.5, -1.5],
        # winners: response 2 (2 - 1 over std 1) and response 3 (4 - 1 over std sqrt 3)
        "grpo_passk": [0, 0, 1 / (1 + EPS), 3 / (s3 + EPS), 0, 0],
    }
    for name, expected in per_response.items():
        adv, ret = L.compute_advantages(name, **inputs)
        close(adv, t(expected)[:, None] * mask)
        close(ret, adv)
    # REINFORCE++ with baseline: the deviations tiled over each response's tokens, whitened over all 12 tokens
    deviations = [0, -1, 1, 2, -1, -1]
    flat = naive_whiten([d for d, n in zip(deviations, lengths) for _ in range(n)])
    expected = torch.zeros(6, 3)
    expected[mask.bool()] = t(flat)
    close(L.compute_advantages("reinforce_plus_plus_baseline", **inputs)[0], expected)
    for name in ("gae", "reinforce_plus_plus", "remax"):
        advs, rets = naive_token_advantages(name, rewards.tolist(), values.tolist(), baselines.tolist(), lengths,
                                            gamma=0.9, lam=0.8)
        adv, ret = L.compute_advantages(name, **inputs)
        for i, n in enumerate(lengths):
            close(adv[i, :n], advs[i])
            close(ret[i, :n], rets[i])


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
