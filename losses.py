"""minirl's RL math: masked statistics, log-probs/entropy, advantage estimators, KL penalties, loss aggregation,
the actor's and the critic's losses, and KL controllers. Pure torch: no distributed calls, no config objects, no
model. Left out: the policy-loss modes verl added after v0.5.0 other than gspo (sapo, geo_mean, cispo, ...) and the
whole-vocabulary KL ("full").

Every function follows verl's semantics (verl v0.5.0, verl/trainer/ppo/core_algos.py and
verl/utils/torch_functional.py); each docstring gives the formula and verl's name.

Shapes: B = responses, R = padded response length, V = vocabulary. `mask` is the response mask [B, R]
(1 on trained tokens, 0 on padding and tool/user tokens).

Usage (what the trainer does each step):
    adv, ret = compute_advantages(name, token_rewards=r, mask=m, group_ids=uids)   # [B, R] each
    tokens, seqs = global_counts(local_mini_batch_mask)    # then all-reduce (sum) over ranks
    loss, metrics = actor_loss(logp, old_logp, ref_logp, adv, entropy, m, use_kl_loss=True,
                               global_tokens=tokens, global_seqs=seqs)   # this micro-batch's share
"""

from __future__ import annotations

import functools
from typing import Callable, Sequence, Union

import numpy as np
import torch
from torch import Tensor

GroupIds = Union[Sequence, np.ndarray, Tensor]

WHITEN_EPS = 1e-8  # verl's epsilon in masked_mean and masked_whiten

# ------------------------------------------------------------------------------------------------------------------
# Masked statistics (verl/utils/torch_functional.py)


def _masked_sum(x: Tensor, mask: Tensor, dim=None) -> Tensor:
    """Σ x·m, with x zeroed where m == 0 first so NaN/inf on padding cannot leak in (verl `masked_sum`)."""
    mask = mask.to(x.dtype)
    kept = torch.where(mask != 0, x, 0.0) * mask
    return kept.sum() if dim is None else kept.sum(dim)


def masked_mean(x: Tensor, mask: Tensor, dim=None) -> Tensor:
    """Σ x·m / (Σ m + 1e-8) over `dim` (all elements when None). An empty mask gives 0, not NaN."""
    return _masked_sum(x, mask, dim) / ((mask.sum() if dim is None else mask.sum(dim)) + WHITEN_EPS)


def masked_var(x: Tensor, mask: Tensor, unbiased: bool = True) -> Tensor:
    """masked_mean((x − μ)²) over the whole tensor, times N/(N−1) when unbiased (N = Σ m)."""
    mean = masked_mean(x, mask)
    var = masked_mean((x - mean) ** 2, mask)
    if unbiased:
        count = float(mask.sum())
        if count == 0:
            raise ValueError("masked_var: the mask is empty (sum 0); at least one element must be 1")
        if count == 1:
            raise ValueError("masked_var: the mask sums to 1, so the unbiased variance divides by zero; "
                             "pass unbiased=False or a mask with at least 2 elements")
        var = var * (count / (count - 1))
    return var


def masked_whiten(x: Tensor, mask: Tensor, shift_mean: bool = True) -> Tensor:
    """(x − μ)·rsqrt(var + 1e-8) with the masked mean and unbiased variance of the whole tensor; when shift_mean
    is False the mean is added back. Positions where mask == 0 are transformed too (callers multiply by the mask)."""
    mean = masked_mean(x, mask)
    whitened = (x - mean) * torch.rsqrt(masked_var(x, mask) + WHITEN_EPS)
    return whitened if shift_mean else whitened + mean


# ------------------------------------------------------------------------------------------------------------------
# Log-probs and entropy


def logprobs_from_logits(logits: Tensor, labels: Tensor) -> Tensor:
    """log softmax(logits)[label] = logit[label] − logsumexp(logits), computed in fp32. [..., V], [...] -> [...] fp32.
    log_softmax subtracts the row max first, so large logits lose no precision (logit − logsumexp would)."""
    return logprobs_and_entropy(logits, labels)[0]


def entropy_from_logits(logits: Tensor, chunk_size: int | None = None) -> Tensor:
    """H = −Σ p·log p per position, with log p = log_softmax(z) in fp32. [..., V] -> [...] fp32. log_softmax
    subtracts the row max first, so large logits neither overflow nor cancel.

    chunk_size bounds the fp32 temporaries to chunk_size rows × V (verl's chunked variant uses 2048); None
    processes all rows at once. Differentiable either way. Logits must be finite (−inf gives 0·−inf = NaN)."""
    _check_chunk_size(chunk_size)
    lead_shape = logits.shape[:-1]
    rows = logits.reshape(-1, logits.shape[-1])  # [N, V]
    step = max(1, rows.shape[0]) if chunk_size is None else int(chunk_size)
    pieces = [entropy_from_log_probs(torch.log_softmax(chunk.float(), dim=-1)) for chunk in rows.split(step)]  # [n]
    entropy = torch.cat(pieces) if pieces else rows.new_zeros(0, dtype=torch.float32)
    return entropy.reshape(lead_shape)


def entropy_from_log_probs(log_p: Tensor, chunk_size: int | None = None) -> Tensor:
    """H = −Σ exp(log p)·log p per position, from log-probabilities over the vocabulary. [..., V] -> [...].
    The sum over V is a product and a row sum: on CPU about 4x faster than the same sum as an einsum, which runs
    it as a batched matmul of [1, V] x [V, 1]. Without autograd the product is taken in place, so the exp's
    [n, V] (n = chunk_size rows, as in entropy_from_logits) is the only temporary."""
    _check_chunk_size(chunk_size)
    rows = log_p.reshape(-1, log_p.shape[-1])  # [N, V]
    step = max(1, rows.shape[0]) if chunk_size is None else int(chunk_size)
    pieces = []
    for chunk in rows.split(step):
        p = chunk.exp()                                                    # [n, V]
        # autograd keeps exp's output for its backward, so there the product needs a tensor of its own
        product = p * chunk if p.requires_grad else p.mul_(chunk)          # [n, V]
        pieces.append(-product.sum(-1))                                    # [n]
    entropy = torch.cat(pieces) if pieces else rows.new_zeros(0)
    return entropy.reshape(log_p.shape[:-1])


def logprobs_and_entropy(logits: Tensor, labels: Tensor, with_entropy: bool = False, entropy_grad: bool = True,
                         entropy_chunk_size: int | None = None) -> tuple[Tensor, Tensor | None]:
    """The log-prob of each label (logprobs_from_logits) and, with_entropy, the entropy of each position
    (entropy_from_logits) from ONE log_softmax of the logits: [..., V], [...] -> ([...], [...] or None), fp32.
    entropy_grad=False computes the entropy without autograd (a metric: no graph over the [..., V] temporaries).
    Equal to the two functions above up to fp32 rounding; the log-prob pass of the trainer runs this, so the
    [tokens, V] log_softmax is computed once instead of once for each."""
    log_p = torch.log_softmax(logits.float(), dim=-1)                              # [..., V]
    logp = log_p.gather(-1, labels.long().unsqueeze(-1)).squeeze(-1)               # [...]
    if not with_entropy:
        return logp, None
    with torch.set_grad_enabled(entropy_grad and torch.is_grad_enabled()):
        return logp, entropy_from_log_probs(log_p, entropy_chunk_size)            # [...], [...]


def _check_chunk_size(chunk_size):
    if chunk_size is not None and chunk_size <= 0:
        raise ValueError(f"entropy: chunk_size must be a positive int or None, got {chunk_size}")


# ------------------------------------------------------------------------------------------------------------------
# Advantage estimators. Every one takes the same keyword inputs (those of compute_advantages), uses those its
# formula names and ignores the rest (**_), and returns (advantages [B, R], returns [B, R]) without autograd, as verl:
#     token_rewards [B, R], mask [B, R], group_ids [B] (verl's "uid", one per prompt), values [B, R] (critic),
#     baselines [B] (ReMax's greedy reward), gamma, lam, norm_adv_by_std_in_grpo
# Outcome estimators use the scores s = token_rewards.sum(-1) [B]; responses sharing a group id form a group.
# Group statistics are vectorised with a dense group index and index_add.


def _group_index(group_ids: GroupIds, batch_size: int, device) -> tuple[Tensor, int]:
    """Dense group index [B] in 0..G-1 and G, from uids (list/np.array of str or int) or an integer tensor."""
    if group_ids is None:
        raise ValueError("this adv_estimator compares responses within a group: it needs group_ids (one uid per "
                         "response)")
    if isinstance(group_ids, Tensor):
        if group_ids.dtype.is_floating_point or group_ids.dim() != 1:
            raise ValueError(f"group_ids tensor must be 1-D integer, got dtype {group_ids.dtype} shape "
                             f"{tuple(group_ids.shape)}")
        uniques, index = torch.unique(group_ids, return_inverse=True)
    else:
        ids = np.asarray(group_ids)
        if ids.ndim != 1:
            raise ValueError(f"group_ids must be 1-D (one uid per response), got shape {ids.shape}")
        try:
            uniques, inverse = np.unique(ids, return_inverse=True)
        except TypeError as err:
            raise ValueError(f"group_ids must all be of one sortable type (all str or all int): {err}") from None
        index = torch.from_numpy(inverse.reshape(-1).astype(np.int64))
    if index.numel() != batch_size:
        raise ValueError(f"group_ids has {index.numel()} entries but the batch has {batch_size} responses; "
                         "pass one uid per response")
    return index.to(device), len(uniques)


def _outcome_scores(token_rewards: Tensor, mask: Tensor) -> tuple[Tensor, Tensor]:
    """scores = token_rewards.sum(-1) [B] (as verl), and the mask [B, R] in their dtype."""
    if token_rewards.dim() != 2 or mask.shape != token_rewards.shape:
        raise ValueError(f"token_rewards and mask must both be [B, R]; got {tuple(token_rewards.shape)} and "
                         f"{tuple(mask.shape)}")
    scores = token_rewards.sum(-1)  # [B]
    scores = scores if scores.dtype.is_floating_point else scores.float()
    return scores, mask.to(scores.dtype)


def _group_sum(values: Tensor, index: Tensor, num_groups: int) -> Tensor:
    return values.new_zeros(num_groups).index_add_(0, index, values)  # [G]


def _group_mean_std(scores: Tensor, index: Tensor, num_groups: int) -> tuple[Tensor, Tensor, Tensor]:
    """Per-response group size, mean and UNBIASED std, each [B]. Singleton groups get mean 0, std 1 (verl)."""
    counts = torch.bincount(index, minlength=num_groups).to(scores.dtype)  # [G]
    mean = _group_sum(scores, index, num_groups) / counts  # [G]
    squares = _group_sum((scores - mean[index]) ** 2, index, num_groups)  # [G]
    std = (squares / (counts - 1).clamp(min=1)).sqrt()  # [G]
    singleton = counts == 1
    mean = torch.where(singleton, torch.zeros_like(mean), mean)
    std = torch.where(singleton, torch.ones_like(std), std)
    return counts[index], mean[index], std[index]  # [B] each


def _per_token(per_response: Tensor, mask: Tensor) -> tuple[Tensor, Tensor]:
    advantages = per_response.unsqueeze(-1) * mask  # [B, R]
    return advantages, advantages.clone()


@torch.no_grad()
def grpo_advantages(*, token_rewards: Tensor, mask: Tensor, group_ids: GroupIds,
                    norm_adv_by_std_in_grpo: bool = True, eps: float = 1e-6, **_) -> tuple[Tensor, Tensor]:
    """verl `compute_grpo_outcome_advantage`: A_i = (s_i − mean_g)/(std_g + eps), or s_i − mean_g when
    norm_adv_by_std_in_grpo is False (Dr.GRPO). std is unbiased; singleton groups use mean 0, std 1; no batch whitening.
    advantages = returns = A_i·m."""
    scores, mask = _outcome_scores(token_rewards, mask)
    index, num_groups = _group_index(group_ids, scores.shape[0], scores.device)
    _, mean, std = _group_mean_std(scores, index, num_groups)
    centered = scores - mean  # [B]
    return _per_token(centered / (std + eps) if norm_adv_by_std_in_grpo else centered, mask)


@torch.no_grad()
def rloo_advantages(*, token_rewards: Tensor, mask: Tensor, group_ids: GroupIds, **_) -> tuple[Tensor, Tensor]:
    """verl `compute_rloo_outcome_advantage`: A_i = n/(n−1)·(s_i − mean_g) = s_i − mean(others) for n > 1,
    A_i = s_i for a singleton group. advantages = returns = A_i·m."""
    scores, mask = _outcome_scores(token_rewards, mask)
    index, num_groups = _group_index(group_ids, scores.shape[0], scores.device)
    size, mean, _ = _group_mean_std(scores, index, num_groups)
    leave_one_out = size / (size - 1).clamp(min=1) * (scores - mean)  # [B]
    return _per_token(torch.where(size > 1, leave_one_out, scores), mask)


@torch.no_grad()
def opo_advantages(*, token_rewards: Tensor, mask: Tensor, group_ids: GroupIds, **_) -> tuple[Tensor, Tensor]:
    """verl `compute_opo_outcome_advantage`: A_i = s_i − b_g with the length-weighted baseline
    b_g = Σ_j len_j·s_j / Σ_j len_j (len = Σ_t m); singleton groups use b = 0. A group whose responses are all
    empty gets b = 0 here (verl divides 0/0 there). advantages = returns = A_i·m."""
    scores, mask = _outcome_scores(token_rewards, mask)
    index, num_groups = _group_index(group_ids, scores.shape[0], scores.device)
    lengths = mask.sum(-1)  # [B]
    weighted = _group_sum(lengths * scores, index, num_groups)  # [G]
    total_len = _group_sum(lengths, index, num_groups)  # [G]
    counts = torch.bincount(index, minlength=num_groups)  # [G]
    usable = (counts > 1) & (total_len > 0)
    baseline = torch.where(usable, weighted / torch.where(usable, total_len, torch.ones_like(total_len)),
                           torch.zeros_like(weighted))  # [G]
    return _per_token(scores - baseline[index], mask)


@torch.no_grad()
def gpg_advantages(*, token_rewards: Tensor, mask: Tensor, group_ids: GroupIds, **_) -> tuple[Tensor, Tensor]:
    """verl `compute_gpg_outcome_advantage` (f_norm = 1): A_i = α·(s_i − mean_g) with α = B / max(1, #{s ≠ 0});
    singleton groups use mean 0. advantages = returns = A_i·m."""
    scores, mask = _outcome_scores(token_rewards, mask)
    index, num_groups = _group_index(group_ids, scores.shape[0], scores.device)
    _, mean, _ = _group_mean_std(scores, index, num_groups)
    alpha = scores.shape[0] / max(1, int(torch.count_nonzero(scores)))
    return _per_token(alpha * (scores - mean), mask)


@torch.no_grad()
def grpo_passk_advantages(*, token_rewards: Tensor, mask: Tensor, group_ids: GroupIds,
                          norm_adv_by_std_in_grpo: bool = True, eps: float = 1e-6, **_) -> tuple[Tensor, Tensor]:
    """verl `compute_grpo_passk_outcome_advantage`: only each group's best response gets
    (max_g − second_max_g), divided by (unbiased std_g + eps) when
    norm_adv_by_std_in_grpo; everyone else gets 0.
    Every group needs at least 2 responses. With a tie for the best, the advantage is 0 whichever wins.
    advantages = returns = A_i·m."""
    scores, mask = _outcome_scores(token_rewards, mask)
    index, num_groups = _group_index(group_ids, scores.shape[0], scores.device)
    size, _, std = _group_mean_std(scores, index, num_groups)
    if bool((size < 2).any()):
        first_bad = int(torch.nonzero(size < 2)[0])
        raise ValueError(f"grpo_passk needs at least 2 responses per group; response {first_bad} is alone in its "
                         "group (set rollout.n >= 2)")
    group_max = scores.new_full((num_groups,), -torch.inf).scatter_reduce_(0, index, scores, "amax")  # [G]
    is_max = scores == group_max[index]  # [B]
    positions = torch.arange(scores.shape[0], device=scores.device)
    first_max_pos = torch.full((num_groups,), scores.shape[0], device=scores.device).scatter_reduce_(
        0, index, torch.where(is_max, positions, scores.shape[0]), "amin")  # [G] position of each group's winner
    is_winner = positions == first_max_pos[index]  # [B]
    runner_up = scores.new_full((num_groups,), -torch.inf).scatter_reduce_(
        0, index, torch.where(is_winner, -torch.inf, scores), "amax")  # [G]
    gap = group_max[index] - runner_up[index]  # [B]
    if norm_adv_by_std_in_grpo:
        gap = gap / (std + eps)
    return _per_token(torch.where(is_winner, gap, torch.zeros_like(gap)), mask)


@torch.no_grad()
def reinforce_pp_baseline_advantages(*, token_rewards: Tensor, mask: Tensor, group_ids: GroupIds,
                                     **_) -> tuple[Tensor, Tensor]:
    """verl `compute_reinforce_plus_plus_baseline_outcome_advantage`: (s_i − mean_g) (singleton mean 0) tiled over
    R, times m, then masked_whiten over the whole batch, times m. advantages = returns."""
    scores, mask = _outcome_scores(token_rewards, mask)
    index, num_groups = _group_index(group_ids, scores.shape[0], scores.device)
    _, mean, _ = _group_mean_std(scores, index, num_groups)
    tiled = (scores - mean).unsqueeze(-1) * mask  # [B, R]
    advantages = masked_whiten(tiled, mask) * mask
    return advantages, advantages.clone()


def _check_token_inputs(token_rewards: Tensor, mask: Tensor, **others: Tensor) -> Tensor:
    if token_rewards.dim() != 2 or mask.shape != token_rewards.shape:
        raise ValueError(f"token_rewards and mask must both be [B, R]; got {tuple(token_rewards.shape)} and "
                         f"{tuple(mask.shape)}")
    for name, tensor in others.items():
        if tensor is None:
            raise ValueError(f"this adv_estimator needs {name}")
        if tensor.shape != token_rewards.shape:
            raise ValueError(f"{name} must be [B, R] = {tuple(token_rewards.shape)}, got {tuple(tensor.shape)}")
    return mask.to(token_rewards.dtype)


@torch.no_grad()
def gae_advantages(*, token_rewards: Tensor, mask: Tensor, values: Tensor, gamma: float = 1.0, lam: float = 1.0,
                   **_) -> tuple[Tensor, Tensor]:
    """verl `compute_gae_advantage_return`. Backward over t with next_value = last = 0:
        delta = r_t + γ·next_value − V_t;   gae_t = delta + γλ·last
        where m_t == 0 (padding, tool tokens) next_value and last carry over unchanged, so those tokens are skipped;
        A_t = last (after the update).
    returns = A + V (before whitening); advantages = masked_whiten(A, m) over the whole batch.
    `values` should be the critic's values × m, as verl's critic returns them; values on masked tokens only affect
    `returns` there."""
    mask = _check_token_inputs(token_rewards, mask, values=values)
    # time-major contiguous copies so each step reads one contiguous row of B numbers
    reward_minus_value = (token_rewards - values).t().contiguous()  # [R, B]
    values_t, mask_t = values.t().contiguous(), mask.t().contiguous()  # [R, B]
    raw_t = torch.empty_like(reward_minus_value)  # [R, B]
    next_value = torch.zeros_like(reward_minus_value[0])  # [B]
    last = torch.zeros_like(reward_minus_value[0])  # [B]
    for t in range(raw_t.shape[0] - 1, -1, -1):
        gae_t = torch.add(reward_minus_value[t], next_value, alpha=gamma).add_(last, alpha=gamma * lam)
        # lerp(a, b, m) = b where m = 1 and a where m = 0 (exact at both ends): verl's b·m + (1 − m)·a
        next_value = torch.lerp(next_value, values_t[t], mask_t[t])
        last = torch.lerp(last, gae_t, mask_t[t], out=raw_t[t])
    raw = raw_t.t().contiguous()  # [B, R]
    return masked_whiten(raw, mask), raw + values


@torch.no_grad()
def reinforce_pp_advantages(*, token_rewards: Tensor, mask: Tensor, gamma: float = 1.0,
                            **_) -> tuple[Tensor, Tensor]:
    """verl `compute_reinforce_plus_plus_outcome_advantage`: backward G_t = r_t + γ·G_{t+1}, and after storing
    G_t the running return is multiplied by m_t (reset at masked tokens). returns = G (not masked);
    advantages = masked_whiten(G, m)·m over the whole batch."""
    mask = _check_token_inputs(token_rewards, mask)
    rewards_t, mask_t = token_rewards.t().contiguous(), mask.t().contiguous()  # [R, B]
    returns_t = torch.empty_like(rewards_t)  # [R, B]
    running = torch.zeros_like(rewards_t[0])  # [B]
    for t in range(rewards_t.shape[0] - 1, -1, -1):
        torch.add(rewards_t[t], running, alpha=gamma, out=returns_t[t])
        running = returns_t[t] * mask_t[t]
    returns = returns_t.t().contiguous()  # [B, R]
    return masked_whiten(returns, mask) * mask, returns


@torch.no_grad()
def remax_advantages(*, token_rewards: Tensor, mask: Tensor, baselines: Tensor, **_) -> tuple[Tensor, Tensor]:
    """verl `compute_remax_outcome_advantage`: returns_t = Σ_{t' ≥ t} r_t'·m_t' (reverse cumsum);
    advantages = returns − b_i·m, with b_i [B] the reward of the greedy rollout for response i."""
    mask = _check_token_inputs(token_rewards, mask)
    if baselines is None:
        raise ValueError("adv_estimator 'remax' needs baselines (the greedy responses' rewards [B])")
    if baselines.shape != token_rewards.shape[:1]:
        raise ValueError(f"baselines must be [B] = ({token_rewards.shape[0]},), got {tuple(baselines.shape)}")
    returns = (token_rewards * mask).flip(-1).cumsum(-1).flip(-1)  # [B, R]
    return returns - baselines.unsqueeze(-1).to(returns.dtype) * mask, returns


ADVANTAGE_ESTIMATORS: dict[str, Callable] = {
    "gae": gae_advantages,
    "grpo": grpo_advantages,
    "reinforce_plus_plus": reinforce_pp_advantages,
    "reinforce_plus_plus_baseline": reinforce_pp_baseline_advantages,
    "remax": remax_advantages,
    "rloo": rloo_advantages,
    "opo": opo_advantages,
    "grpo_passk": grpo_passk_advantages,
    "gpg": gpg_advantages,
}
CRITIC_FREE_ESTIMATORS = tuple(name for name in ADVANTAGE_ESTIMATORS if name != "gae")  # verl: use_critic iff gae


def compute_advantages(name: str, *, token_rewards: Tensor, mask: Tensor, group_ids: GroupIds | None = None,
                       values: Tensor | None = None, baselines: Tensor | None = None, gamma: float = 1.0,
                       lam: float = 1.0, norm_adv_by_std_in_grpo: bool = True) -> tuple[Tensor, Tensor]:
    """Run the estimator `name` (algorithm.adv_estimator) on the inputs; an estimator that needs an input passed
    as None raises naming it. Returns (advantages [B, R], returns [B, R])."""
    if name not in ADVANTAGE_ESTIMATORS:
        raise ValueError(f"unknown adv_estimator '{name}'; valid: {', '.join(ADVANTAGE_ESTIMATORS)}")
    return ADVANTAGE_ESTIMATORS[name](token_rewards=token_rewards, mask=mask, group_ids=group_ids, values=values,
                                      baselines=baselines, gamma=gamma, lam=lam,
                                      norm_adv_by_std_in_grpo=norm_adv_by_std_in_grpo)


# ------------------------------------------------------------------------------------------------------------------
# PF-PPO: resample the batch by its scores (algorithm.use_pf_ppo; verl `compute_pf_ppo_reweight_data`)

PF_PPO_METHODS = ("pow", "max_min", "max_random")
PF_PPO_WEIGHT_FLOOR = 1e-8   # verl adds it to every weight (and clamps there), so no row's chance is exactly 0


@torch.no_grad()
def pf_ppo_weights(scores: Tensor, method: str, weight_pow: float = 2.0) -> Tensor:
    """The resampling weight of each response from its score s_i (the sum of its token-level scores, before any
    KL penalty) [B]:
        pow:        w_i = |s_i|^weight_pow
        max_min:    w_i = 1 if s_i is the batch's max or min score, else 0
        max_random: w_i = 0.4 if s_i is the batch's max score, else 0.1
    then w_i = max(w_i + 1e-8, 1e-8)."""
    if method == "pow":
        weights = scores.abs().pow(weight_pow)
    elif method == "max_min":
        weights = ((scores == scores.max()) | (scores == scores.min())).to(scores.dtype)
    elif method == "max_random":
        weights = torch.where(scores == scores.max(), 0.4, 0.1).to(scores.dtype)
    else:
        raise ValueError(f"unknown PF-PPO reweight_method {method!r}; valid: {', '.join(PF_PPO_METHODS)}")
    return (weights + PF_PPO_WEIGHT_FLOOR).clamp(min=PF_PPO_WEIGHT_FLOOR)


@torch.no_grad()
def pf_ppo_resample(scores: Tensor, method: str, weight_pow: float, generator: torch.Generator) -> Tensor:
    """Policy filtration (PF-PPO): the rows of a new batch of the same size B, drawn with replacement with
    probability w_i / Σ_j w_j (pf_ppo_weights), so high-|score| (pow) or extreme (max_min) responses are trained on
    more often and others may drop out. Returns the drawn row indices [B], in draw order."""
    weights = pf_ppo_weights(scores, method, weight_pow)  # [B]
    return torch.multinomial(weights, scores.shape[0], replacement=True, generator=generator)  # [B]


# ------------------------------------------------------------------------------------------------------------------
# KL penalty estimators (verl `kl_penalty`), d = logprob − ref_logprob per token

_KL_ESTIMATORS = ("kl", "k1", "abs", "mse", "k2", "low_var_kl", "k3")
KL_PENALTY_KINDS = _KL_ESTIMATORS + tuple(kind + "+" for kind in _KL_ESTIMATORS)


def _kl_estimate(logprob: Tensor, ref_logprob: Tensor, kind: str) -> Tensor:
    if kind in ("kl", "k1"):
        return logprob - ref_logprob
    if kind == "abs":
        return (logprob - ref_logprob).abs()
    if kind in ("mse", "k2"):
        return 0.5 * (logprob - ref_logprob).square()
    # low_var_kl / k3: exp(x) − x − 1 with x = ref − logp clamped to ±20, result clamped to ±10 (verl's guards)
    log_ratio = torch.clamp(ref_logprob - logprob, min=-20.0, max=20.0)
    return torch.clamp(torch.exp(log_ratio) - log_ratio - 1, min=-10.0, max=10.0)


def kl_penalty(logprob: Tensor, ref_logprob: Tensor, kind: str) -> Tensor:
    """Per-token KL estimate [B, R]: kl/k1 = d, abs = |d|, mse/k2 = ½d², low_var_kl/k3 = clamp(e^x − x − 1, ±10)
    with x = clamp(−d, ±20). A trailing '+' (verl HEAD) is straight-through: the forward value is the estimator's,
    the gradient is k2's (d/dlogp = d); k2+/mse+ equal k2."""
    if kind == "full":
        raise NotImplementedError("kl_penalty 'full' (KL over the whole vocabulary) is not implemented, as in verl; "
                                  f"use one of {KL_PENALTY_KINDS}")
    if kind not in KL_PENALTY_KINDS:
        raise ValueError(f"unknown kl_penalty kind '{kind}'; valid: {', '.join(KL_PENALTY_KINDS)}")
    estimate = _kl_estimate(logprob, ref_logprob, kind.rstrip("+"))
    if not kind.endswith("+"):
        return estimate
    k2 = 0.5 * (logprob - ref_logprob).square()
    return k2 - k2.detach() + estimate.detach()


# ------------------------------------------------------------------------------------------------------------------
# Loss aggregation, and minirl's one deliberate difference from verl: global normalisation.
#
# verl v0.5.0 normalises each micro-batch's loss by that micro-batch's own tokens (or sequences) and divides by the
# number of micro-batches, so the gradient changes with the micro-batch size, dynamic batching and the world size.
# minirl normalises over the whole mini-batch: the trainer counts its tokens and non-empty sequences on all ranks
# (global_counts, all-reduced: the `global_tokens`/`global_seqs` arguments below) and each micro-batch's loss is
# its SHARE of the mini-batch loss (the shares over micro-batches and ranks sum to the loss written over the whole
# mini-batch at once). Each rank backpropagates share × dp because FSDP averages gradients over the dp ranks, so
# the gradient is exactly that of the mini-batch loss. Without global counts: verl v0.5.0's per-batch formula.

LOSS_AGG_MODES = ("token-mean", "seq-mean-token-sum", "seq-mean-token-mean", "seq-mean-token-sum-norm")


def global_counts(mask: Tensor) -> tuple[Tensor, Tensor]:
    """(tokens, seqs) of a 0/1 mask as int64 0-dim tensors: entries ≠ 0, and rows with at least one. Summed over
    a mini-batch's micro-batches and ranks they are agg_loss's global_tokens / global_seqs."""
    nonzero = mask != 0  # [B, R]
    return nonzero.sum(), nonzero.any(-1).sum()


def _as_count(value, name: str) -> float:
    count = float(value)
    if count < 0:
        raise ValueError(f"agg_loss: {name} must be >= 0, got {count}")
    return count


def _divide_or_zero(total: Tensor, count: float) -> Tensor:
    """total / count; 0 when the whole mini-batch has nothing to train on (count 0) instead of NaN."""
    return total / count if count > 0 else total * 0.0


def agg_loss(loss_mat: Tensor, mask: Tensor, mode: str, global_tokens=None, global_seqs=None,
             norm_len: int | None = None) -> Tensor:
    """Reduce a per-token loss [B, R] to a scalar (verl `agg_loss`).

    Without global counts: verl v0.5.0's per-micro-batch formula, quirks included:
        token-mean               Σ L·m / (Σ m + 1e-8)
        seq-mean-token-sum       mean_i Σ_t L·m
        seq-mean-token-mean      mean_i (Σ_t L·m / Σ_t m)          (a fully masked row gives NaN)
        seq-mean-token-sum-norm  Σ_i Σ_t L·m / (norm_len or R)     (SUMS over rows, R = mask.shape[-1])
    With global counts (global_counts of the whole mini-batch, all micro-batches and ranks): this micro-batch's
    SHARE of the mini-batch loss (the shares sum to exactly the full-batch loss):
        token-mean               Σ L·m / global_tokens
        seq-mean-token-sum       Σ_i Σ_t L·m / global_seqs
        seq-mean-token-mean      Σ_{i non-empty} (Σ_t L·m / Σ_t m) / global_seqs   (empty rows contribute 0)
        seq-mean-token-sum-norm  Σ_i Σ_t L·m / (norm_len or R) / global_seqs
    The global -norm mode is a MEAN over sequences (Dr.GRPO as written, verl HEAD's fix), deliberately unlike the
    v0.5.0 per-batch sum. A global count of 0 gives a share of 0. norm_len is used by the -norm mode only
    (verl HEAD's actor.loss_scale_factor). Why global counts: the section comment above."""
    if mode not in LOSS_AGG_MODES:
        raise ValueError(f"unknown loss_agg_mode '{mode}'; valid: {', '.join(LOSS_AGG_MODES)}")
    if loss_mat.shape != mask.shape:
        raise ValueError(f"agg_loss: loss_mat {tuple(loss_mat.shape)} and mask {tuple(mask.shape)} differ in shape")
    use_global = global_tokens is not None or global_seqs is not None
    needed_name, needed_count = ("global_tokens", global_tokens) if mode == "token-mean" else ("global_seqs",
                                                                                                global_seqs)
    if use_global and needed_count is None:
        raise ValueError(f"agg_loss: mode '{mode}' with global normalisation needs {needed_name}; pass both counts "
                         "from global_counts (all-reduced) or neither for the per-batch formula")
    if mode == "token-mean":
        if not use_global:
            return masked_mean(loss_mat, mask)
        return _divide_or_zero(_masked_sum(loss_mat, mask), _as_count(global_tokens, "global_tokens"))
    row_sums = _masked_sum(loss_mat, mask, dim=-1)  # [B]
    if mode == "seq-mean-token-mean":
        row_tokens = mask.to(row_sums.dtype).sum(-1)  # [B]
        if not use_global:
            return (row_sums / row_tokens).mean()
        nonempty = row_tokens != 0
        safe_tokens = torch.where(nonempty, row_tokens, torch.ones_like(row_tokens))
        row_means = torch.where(nonempty, row_sums / safe_tokens, torch.zeros_like(row_sums))  # [B]
        return _divide_or_zero(row_means.sum(), _as_count(global_seqs, "global_seqs"))
    if mode == "seq-mean-token-sum-norm":
        row_sums = row_sums / (norm_len or mask.shape[-1])
        if not use_global:
            return row_sums.sum()
    elif not use_global:  # seq-mean-token-sum
        return row_sums.mean()
    return _divide_or_zero(row_sums.sum(), _as_count(global_seqs, "global_seqs"))


# ------------------------------------------------------------------------------------------------------------------
# The actor's and the critic's losses

# Metrics of actor_loss/critic_loss that are shares of a mini-batch value (summed over micro-batches and ranks);
# their other metrics are statistics of one micro-batch (averaged).
LOSS_SHARES = ("pg_loss", "entropy_loss", "kl_loss", "vf_loss")


def actor_loss(logp: Tensor, old_logp: Tensor, ref_logp: Tensor | None, advantages: Tensor, entropy: Tensor | None,
               mask: Tensor, *, clip_ratio_low: float = 0.2, clip_ratio_high: float = 0.2, clip_ratio_c: float = 3.0,
               entropy_coeff: float = 0.0, use_kl_loss: bool = False, kl_loss_coef: float = 0.001,
               kl_loss_type: str = "low_var_kl", loss_agg_mode: str = "token-mean", policy_loss: dict | None = None,
               global_tokens=None, global_seqs=None, norm_len: int | None = None) -> tuple[Tensor, dict[str, Tensor]]:
    """The actor's whole objective on one micro-batch (verl dp_actor `update_policy`: the policy loss of
    `policy_loss.loss_mode`, `agg_loss`, `kl_penalty`). Inputs [B, R]; the keyword names are verl's actor config
    keys. With loss_mode "vanilla" (the default; the other modes: POLICY_LOSSES):
        log_ratio = clamp(logp − old_logp, ±20);  ratio = e^log_ratio
        L1 = −A·ratio;  L2 = −A·clamp(ratio, 1 − clip_ratio_low, 1 + clip_ratio_high);  Lc = max(L1, L2)
        L3 = −A·clip_ratio_c;  L_pg = min(L3, Lc) where A < 0 else Lc                       (dual-clip PPO)
        loss = agg(L_pg) − entropy_coeff·agg(entropy) + kl_loss_coef·agg(kl_penalty(logp, ref_logp, kl_loss_type))
    agg = agg_loss(·, mask, loss_agg_mode, global counts): with global counts the loss is this micro-batch's share
    of the mini-batch loss (see the section comment above agg_loss). The entropy term is there when
    entropy_coeff ≠ 0 (`entropy` needed), the KL term when use_kl_loss (`ref_logp` needed).
    Returns (loss, metrics), metrics detached: pg_loss, entropy_loss, kl_loss (the agg(·) terms: shares, see
    LOSS_SHARES) and this micro-batch's masked means pg_clipfrac = mean(L2 > L1), ppo_kl = mean(−log_ratio),
    pg_clipfrac_lower = mean((Lc > L3) & (A < 0)). clip_ratio_low/high must be resolved (verl falls back to
    clip_ratio when they are null). policy_loss: verl's actor.policy_loss (loss_mode and its options)."""
    if clip_ratio_low is None or clip_ratio_high is None:
        raise ValueError("actor_loss: clip_ratio_low/high are None; resolve them to clip_ratio (verl's fallback)")
    if not clip_ratio_c > 1.0:
        raise ValueError(f"actor_loss: clip_ratio_c must be > 1.0 for the dual clip, got {clip_ratio_c}")
    options = dict(policy_loss or {})
    mode = options.pop("loss_mode", "vanilla")
    mask = mask.to(logp.dtype)  # [B, R]
    agg = functools.partial(agg_loss, mask=mask, mode=loss_agg_mode, global_tokens=global_tokens,
                            global_seqs=global_seqs, norm_len=norm_len)  # [B, R] -> scalar
    if mode == "vanilla":
        log_ratio = torch.clamp(logp - old_logp, min=-20.0, max=20.0)  # [B, R]
        ratio = torch.exp(log_ratio)  # [B, R]
        unclipped = -advantages * ratio  # [B, R]
        clipped = -advantages * torch.clamp(ratio, 1 - clip_ratio_low, 1 + clip_ratio_high)  # [B, R]
        clip_max = torch.maximum(unclipped, clipped)  # [B, R]
        dual_bound = -advantages * clip_ratio_c  # [B, R]
        negative = advantages < 0  # [B, R]
        pg_losses = torch.where(negative, torch.minimum(dual_bound, clip_max), clip_max)  # [B, R]
        pg_metrics = dict(pg_clipfrac=masked_mean((clipped > unclipped).float(), mask),
                          ppo_kl=masked_mean(-log_ratio, mask),
                          pg_clipfrac_lower=masked_mean(((clip_max > dual_bound) & negative).float(), mask))
    elif mode in POLICY_LOSSES:
        pg_losses, pg_metrics = POLICY_LOSSES[mode](logp, old_logp, advantages, mask, clip_ratio_low=clip_ratio_low,
                                                    clip_ratio_high=clip_ratio_high, **options)
    else:
        raise ValueError(f"unknown policy_loss.loss_mode '{mode}'; valid: vanilla, {', '.join(POLICY_LOSSES)}")
    metrics = {"pg_loss": agg(pg_losses)}  # scalar
    loss = metrics["pg_loss"]
    if entropy_coeff != 0:
        metrics["entropy_loss"] = agg(entropy)  # scalar
        loss = loss - entropy_coeff * metrics["entropy_loss"]
    if use_kl_loss:
        metrics["kl_loss"] = agg(kl_penalty(logp, ref_logp, kl_loss_type))  # scalar
        loss = loss + kl_loss_coef * metrics["kl_loss"]
    metrics.update(pg_metrics)
    return loss, {name: value.detach() for name, value in metrics.items()}


# verl's other policy losses (actor.policy_loss.loss_mode; core_algos.py compute_policy_loss_<mode>, v0.5.0, and gspo
# from the release after it). Each takes [B, R] inputs and returns (per-token losses [B, R], this micro-batch's
# pg_clipfrac / ppo_kl / pg_clipfrac_lower, as verl reports them: 0 where a mode has none). clip_cov and kl_cov pick
# tokens by statistics of the micro-batch they see, as verl's do: unlike the rest of the loss, their result depends on
# how the mini-batch is cut into micro-batches.


def _zero(like: Tensor) -> Tensor:
    return torch.zeros((), dtype=like.dtype, device=like.device)


def gpg_policy_losses(logp: Tensor, old_logp: Tensor, advantages: Tensor, mask: Tensor, **_) -> tuple[Tensor, dict]:
    """GPG (loss_mode gpg): the plain policy gradient, no ratio and no clip:  L = −logp·A."""
    zero = _zero(logp)
    return -logp * advantages, dict(pg_clipfrac=zero, ppo_kl=zero, pg_clipfrac_lower=zero)  # [B, R]


def clip_cov_policy_losses(logp: Tensor, old_logp: Tensor, advantages: Tensor, mask: Tensor, *, clip_ratio_low: float,
                           clip_ratio_high: float, clip_cov_ratio: float = 2e-4, clip_cov_lb: float = 1.0,
                           clip_cov_ub: float = 5.0, generator: torch.Generator | None = None,
                           **_) -> tuple[Tensor, dict]:
    """Clip-Cov (loss_mode clip_cov, "The Entropy Mechanism of RL for Reasoning LMs"): PPO-clip without the dual
    clip, and the gradient cut off at a few tokens whose advantage and log-prob covary strongly:
        ratio = e^(logp − old_logp) (no clamp);  L1, L2 as vanilla;  Lc = max(L1, L2)
        cov = (A − mean_m(A))·(logp − mean_m(logp))            over this micro-batch's response tokens
        candidates: tokens with clip_cov_lb < cov < clip_cov_ub that PPO did not clip (L2 ≤ L1)
        k = max(1, ⌊clip_cov_ratio · Σm⌋) candidates drawn at random (torch.randperm): their loss × 0
    pg_clipfrac = mean_m(cut), ppo_kl = mean_m(−(logp − old_logp))."""
    log_ratio = logp - old_logp  # [B, R]
    ratio = torch.exp(log_ratio)  # [B, R]
    unclipped = -advantages * ratio  # [B, R]
    clipped = -advantages * torch.clamp(ratio, 1 - clip_ratio_low, 1 + clip_ratio_high)  # [B, R]
    valid = mask > 0  # [B, R]
    cov = ((advantages - masked_mean(advantages, mask))
           * (logp.detach() - masked_mean(logp.detach(), mask)))  # [B, R]
    candidates = torch.nonzero(valid & ~(clipped > unclipped) & (cov > clip_cov_lb) & (cov < clip_cov_ub))  # [n, 2]
    keep = torch.ones_like(advantages)  # [B, R]
    if len(candidates):          # verl draws only then: the same random numbers are used
        count = max(int(clip_cov_ratio * mask.sum().item()), 1)
        order = torch.randperm(len(candidates), generator=generator).to(candidates.device)  # [n]
        chosen = candidates[order[:count]]  # [k, 2]
        keep[chosen[:, 0], chosen[:, 1]] = 0
    return torch.maximum(unclipped, clipped) * keep, dict(  # [B, R]
        pg_clipfrac=masked_mean((keep == 0).float(), mask), ppo_kl=masked_mean(-log_ratio, mask),
        pg_clipfrac_lower=_zero(logp))


def kl_cov_policy_losses(logp: Tensor, old_logp: Tensor, advantages: Tensor, mask: Tensor, *,
                         kl_cov_ratio: float = 2e-4, ppo_kl_coef: float = 0.1, **_) -> tuple[Tensor, dict]:
    """KL-Cov (loss_mode kl_cov, the same paper): no clip at all, and a KL penalty on the tokens whose advantage
    and log-prob covary most:
        ratio = e^(logp − old_logp);  L = −A·ratio
        cov = (A − mean_m(A))·(logp − mean_m(logp))            over this micro-batch's response tokens
        the k = max(1, ⌊kl_cov_ratio · Σm⌋) tokens of largest cov (torch.topk):
            L = −A·ratio + ppo_kl_coef·|logp − old_logp|
    ppo_kl = mean_m(|logp − old_logp|) (verl reports the absolute value here), pg_clipfrac = 0."""
    log_ratio = logp - old_logp  # [B, R]
    ratio = torch.exp(log_ratio)  # [B, R]
    losses = -advantages * ratio  # [B, R]
    valid = torch.nonzero(mask.reshape(-1) > 0, as_tuple=True)[0]  # [n] flat indices, row-major
    if len(valid):
        adv, lp = advantages.reshape(-1)[valid].detach(), logp.reshape(-1)[valid].detach()  # [n] each
        cov = (adv - adv.mean()) * (lp - lp.mean())  # [n]
        top = valid[torch.topk(cov, max(1, int(len(valid) * kl_cov_ratio))).indices]  # [k]
        penalised = losses.reshape(-1).clone()  # [B·R]
        penalised[top] = penalised[top] + ppo_kl_coef * log_ratio.abs().reshape(-1)[top]
        losses = penalised.reshape(losses.shape)  # [B, R]
    return losses, dict(pg_clipfrac=_zero(logp), ppo_kl=masked_mean(log_ratio.abs(), mask),
                        pg_clipfrac_lower=_zero(logp))


def gspo_policy_losses(logp: Tensor, old_logp: Tensor, advantages: Tensor, mask: Tensor, *, clip_ratio_low: float,
                       clip_ratio_high: float, **_) -> tuple[Tensor, dict]:
    """GSPO (loss_mode gspo, "Group Sequence Policy Optimization"): PPO-clip on one ratio per sequence, the
    geometric mean of its tokens' ratios, carrying each token's own gradient:
        s_i = exp(Σ_t m·(logp − old_logp) / max(Σ_t m, 1))
        log s_i,t = min(sg[log s_i] + logp − sg[logp], 10)     (sg: no gradient; its value is log s_i)
        L1 = −A·s_i,t;  L2 = −A·clamp(s_i,t, 1 − low, 1 + high);  L = max(L1, L2)
    (verl recommends loss_agg_mode=seq-mean-token-mean for it)
    pg_clipfrac = mean_m(L2 > L1), ppo_kl = mean_m(−(logp − old_logp))."""
    log_ratio = logp - old_logp  # [B, R]
    seq_log_ratio = (log_ratio * mask).sum(-1) / mask.sum(-1).clamp(min=1)  # [B]
    log_seq_ratio = torch.clamp(logp - logp.detach() + seq_log_ratio.detach().unsqueeze(-1), max=10.0)  # [B, R]
    ratio = torch.exp(log_seq_ratio)  # [B, R]
    unclipped = -advantages * ratio  # [B, R]
    clipped = -advantages * torch.clamp(ratio, 1 - clip_ratio_low, 1 + clip_ratio_high)  # [B, R]
    return torch.maximum(unclipped, clipped), dict(  # [B, R]
        pg_clipfrac=masked_mean((clipped > unclipped).float(), mask), ppo_kl=masked_mean(-log_ratio, mask),
        pg_clipfrac_lower=_zero(logp))


POLICY_LOSSES: dict[str, Callable[..., tuple[Tensor, dict]]] = {
    "gpg": gpg_policy_losses, "clip_cov": clip_cov_policy_losses, "kl_cov": kl_cov_policy_losses,
    "gspo": gspo_policy_losses}
POLICY_LOSS_MODES = ("vanilla", *POLICY_LOSSES)


def critic_loss(values: Tensor, old_values: Tensor, returns: Tensor, mask: Tensor, *, cliprange_value: float = 0.5,
                loss_agg_mode: str = "token-mean", global_tokens=None, global_seqs=None,
                norm_len: int | None = None) -> tuple[Tensor, dict[str, Tensor]]:
    """The critic's clipped value loss on one micro-batch (verl `compute_value_loss`), all inputs [B, R]:
        v_clip = clamp(v, old_v − c, old_v + c);  L = 0.5·agg(max((v − ret)², (v_clip − ret)²))
    with c = cliprange_value and agg as in actor_loss (with global counts, this micro-batch's share).
    Returns (loss, metrics): vf_loss (the share), vf_clipfrac = masked_mean((v_clip − ret)² > (v − ret)²) and
    vpred_mean = masked_mean(v), all detached 0-dim tensors."""
    mask = mask.to(values.dtype)  # [B, R]
    clipped_values = torch.clamp(values, old_values - cliprange_value, old_values + cliprange_value)  # [B, R]
    unclipped_err = (values - returns) ** 2  # [B, R]
    clipped_err = (clipped_values - returns) ** 2  # [B, R]
    loss = 0.5 * agg_loss(torch.maximum(unclipped_err, clipped_err), mask, loss_agg_mode,
                          global_tokens=global_tokens, global_seqs=global_seqs, norm_len=norm_len)  # scalar
    return loss, {"vf_loss": loss.detach(),
                  "vf_clipfrac": masked_mean((clipped_err > unclipped_err).float(), mask).detach(),
                  "vpred_mean": masked_mean(values.detach(), mask)}


# ------------------------------------------------------------------------------------------------------------------
# In-reward KL (algorithm.use_kl_in_reward) and its coefficient controllers


class FixedKLController:
    """algorithm.kl_ctrl.type = fixed: the coefficient stays kl_coef; update does nothing."""

    def __init__(self, kl_coef: float):
        self.value = float(kl_coef)

    def update(self, current_kl: float, n_steps: int) -> None:
        pass

    def state_dict(self) -> dict:
        return {"value": self.value}

    def load_state_dict(self, state: dict) -> None:
        self.value = float(state["value"])


class AdaptiveKLController:
    """algorithm.kl_ctrl.type = adaptive (Ziegler et al.):
    value *= 1 + clip(kl/target − 1, ±0.2)·n_steps/horizon."""

    def __init__(self, init_kl_coef: float, target_kl: float, horizon: float):
        if not horizon > 0:
            raise ValueError(f"AdaptiveKLController: algorithm.kl_ctrl.horizon must be > 0, got {horizon}")
        if not target_kl > 0:
            raise ValueError(f"AdaptiveKLController: algorithm.kl_ctrl.target_kl must be > 0, got {target_kl}")
        self.value = float(init_kl_coef)
        self.target = float(target_kl)
        self.horizon = float(horizon)

    def update(self, current_kl: float, n_steps: int) -> None:
        error = min(max(float(current_kl) / self.target - 1.0, -0.2), 0.2)
        self.value *= 1.0 + error * n_steps / self.horizon

    def state_dict(self) -> dict:
        return {"value": self.value}

    def load_state_dict(self, state: dict) -> None:
        self.value = float(state["value"])


@torch.no_grad()
def apply_kl_penalty(token_scores: Tensor, logprob: Tensor, ref_logprob: Tensor, mask: Tensor,
                     controller: FixedKLController | AdaptiveKLController,
                     kind: str = "kl") -> tuple[Tensor, dict[str, float]]:
    """verl `apply_kl_penalty` (ray_trainer.py); logprob is the recomputed old policy's log-prob.
        kld = kl_penalty(logprob, ref_logprob, kind)·m;  token_rewards = token_scores − β·kld     [B, R]
        current_kl = mean_i masked_mean(kld_i, m_i);  controller.update(current_kl, n_steps=B)
    metrics: actor/reward_kl_penalty = current_kl, actor/reward_kl_penalty_coeff = β, the coefficient USED for
    this batch (read before the update, as verl)."""
    kld = kl_penalty(logprob, ref_logprob, kind) * mask  # [B, R]
    beta = controller.value
    token_rewards = token_scores - beta * kld
    current_kl = float(masked_mean(kld, mask, dim=-1).mean())
    controller.update(current_kl, n_steps=token_scores.shape[0])
    return token_rewards, {"actor/reward_kl_penalty": current_kl, "actor/reward_kl_penalty_coeff": beta}
