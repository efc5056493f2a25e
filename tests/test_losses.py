"""Tests for losses.py: every function against numbers worked out by hand (arithmetic in the comments) or an
independent computation written here (naive loops), never against losses.py's own output. The advantage
estimators are in test_advantages.py.
"""

import math
from pathlib import Path

import pytest
import torch

import losses as L
from conftest import close, t

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


@pytest.mark.parametrize("entropy_chunk_size", [None, 3])
def test_logprobs_and_entropy_from_one_log_softmax_equal_a_float64_softmax(entropy_chunk_size):
    """The trainer's head kernel: log-probs and entropy from one log_softmax, against p = exp(z) / Σ exp(z) in
    float64, values and gradients (through both outputs, and through the log-probs alone when the entropy is a
    metric)."""
    g = torch.Generator().manual_seed(0)
    logits = (torch.randn(7, 11, generator=g) * 3).requires_grad_(True)
    labels = torch.randint(0, 11, (7,), generator=g)
    weights = torch.randn(2, 7, generator=g)                       # a random upstream gradient for each output

    def float64_reference():
        z = logits.detach().double().requires_grad_(True)
        p = z.exp() / z.exp().sum(-1, keepdim=True)                    # [7, 11]
        return z, p.gather(-1, labels[:, None]).squeeze(-1).log(), -(p * p.log()).sum(-1)

    ref, ref_logp, ref_entropy = float64_reference()
    logp, entropy = L.logprobs_and_entropy(logits, labels, with_entropy=True, entropy_chunk_size=entropy_chunk_size)
    close(logp, ref_logp)
    close(entropy, ref_entropy)
    ((logp * weights[0]).sum() + (entropy * weights[1]).sum()).backward()
    ((ref_logp * weights[0]).sum() + (ref_entropy * weights[1]).sum()).backward()
    close(logits.grad, ref.grad)

    logits.grad = None
    ref, ref_logp, ref_entropy = float64_reference()
    logp, entropy = L.logprobs_and_entropy(logits, labels, with_entropy=True, entropy_grad=False,
                                           entropy_chunk_size=entropy_chunk_size)
    assert not entropy.requires_grad
    close(entropy, ref_entropy)
    (logp * weights[0]).sum().backward()
    (ref_logp * weights[0]).sum().backward()
    close(logits.grad, ref.grad)
    assert L.logprobs_and_entropy(logits, labels)[1] is None


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


# ------------------------------------------------------------------------------------------------ actor / critic loss

def _policy_case():
    # token:              0: clip high   1: inside   2: clip low   3: dual clip   4: A<0 inside dual   5: masked
    ratio = t([[1.5, 1.0, 0.5, 4.0, 2.0, 7.0]])
    adv = t([[1.0, 1.0, -1.0, -1.0, -1.0, 1.0]])
    mask = t([[1, 1, 1, 1, 1, 0]])
    old = torch.zeros(1, 6)
    logp = torch.log(ratio).requires_grad_(True)
    return old, logp, adv, mask


def test_actor_loss_ppo_clip_values_metrics_and_gradient():
    old, logp, adv, mask = _policy_case()
    loss, metrics = L.actor_loss(logp, old, None, adv, None, mask)
    # token 0: L1 = -1.5, L2 = -1.2 -> max -1.2 (clipped)        token 1: L1 = L2 = -1
    # token 2: L1 = 0.5, L2 = 0.8 -> 0.8 (clipped); dual min(3, 0.8) = 0.8
    # token 3: L1 = 4, L2 = 1.2 -> 4; dual min(3, 4) = 3 (lower clip)
    # token 4: L1 = 2, L2 = 1.2 -> 2; dual min(3, 2) = 2
    # token-mean = (-1.2 - 1 + 0.8 + 3 + 2)/5 = 0.72
    close(loss, 0.72)
    assert set(metrics) == {"pg_loss", "pg_clipfrac", "ppo_kl", "pg_clipfrac_lower"}
    close(metrics["pg_loss"], 0.72)
    close(metrics["pg_clipfrac"], 2 / 5)  # tokens 0 and 2
    close(metrics["pg_clipfrac_lower"], 1 / 5)  # token 3
    close(metrics["ppo_kl"], -math.log(1.5 * 1.0 * 0.5 * 4.0 * 2.0) / 5)  # mean(-log ratio) = -ln 6 / 5
    assert all(v.dim() == 0 and not v.requires_grad for v in metrics.values())
    loss.backward()
    # d/dlogp of -A·ratio is -A·ratio where not clipped: token 1: -1·1/5, token 4: 2/5; clipped/masked tokens: 0
    close(logp.grad, [[0, -0.2, 0, 0, 0.4, 0]])


def test_actor_loss_adds_entropy_bonus_and_kl_loss():
    old, logp, adv, mask = _policy_case()
    entropy = t([[1.0, 2.0, 3.0, 4.0, 5.0, 100.0]])
    ref = logp.detach() - 0.5  # k1 = logp - ref = 0.5 on every token
    loss, metrics = L.actor_loss(logp, old, ref, adv, entropy, mask, entropy_coeff=0.1, use_kl_loss=True,
                                 kl_loss_coef=0.2, kl_loss_type="k1")
    # pg 0.72 (above); entropy token-mean (1+2+3+4+5)/5 = 3; k1 token-mean 0.5: 0.72 - 0.1·3 + 0.2·0.5 = 0.52
    close(loss, 0.52)
    close(metrics["entropy_loss"], 3.0)
    close(metrics["kl_loss"], 0.5)
    loss.backward()
    # the PPO gradient above plus d/dlogp 0.2·(logp - ref)/5 = 0.04 on each of the 5 unmasked tokens
    close(logp.grad, [[0.04, -0.16, 0.04, 0.04, 0.44, 0]])


def test_actor_loss_asymmetric_clip():
    old, logp, adv, mask = _policy_case()
    loss, _ = L.actor_loss(logp, old, None, adv, None, mask, clip_ratio_low=0.1, clip_ratio_high=0.3)
    # token 0: max(-1.5, -1.3) = -1.3; token 2: max(0.5, 0.9) = 0.9; others as before: (-1.3 - 1 + 0.9 + 3 + 2)/5
    close(loss, 3.6 / 5)


def test_actor_loss_clamps_huge_log_ratio():
    old = torch.zeros(1, 3)
    logp = t([[50.0, 50.0, -50.0]]).requires_grad_(True)
    adv = t([[1.0, -1.0, -1.0]])
    loss, metrics = L.actor_loss(logp, old, None, adv, None, torch.ones(1, 3))
    # ratio = e^20 / e^20 / e^-20: token 0 -> max(-e^20, -1.2) = -1.2; token 1 -> dual clip 3;
    # token 2 -> max(e^-20, 0.8) = 0.8
    close(loss, (-1.2 + 3 + 0.8) / 3)
    close(metrics["ppo_kl"], (-20 - 20 + 20) / 3)
    loss.backward()
    assert torch.isfinite(logp.grad).all() and (logp.grad == 0).all()


def test_actor_loss_rejects_bad_clip_ratio_c():
    old, logp, adv, mask = _policy_case()
    with pytest.raises(ValueError, match="clip_ratio_c"):
        L.actor_loss(logp, old, None, adv, None, mask, clip_ratio_c=1.0)


def test_actor_loss_forwards_agg_mode_and_global_counts():
    old, logp, adv, mask = _policy_case()
    loss, _ = L.actor_loss(logp, old, None, adv, None, mask, loss_agg_mode="seq-mean-token-sum", global_tokens=10,
                           global_seqs=2)
    close(loss, 3.6 / 2)  # one row summing to 3.6, over 2 sequences in the mini-batch


@pytest.mark.parametrize("mode", L.LOSS_AGG_MODES)
def test_actor_loss_micro_batch_shares_sum_to_the_mini_batch_loss(mode):
    """actor_loss on 4 micro-batches with the mini-batch's global counts: the losses, the loss shares in the
    metrics and the gradients add up to actor_loss on the whole mini-batch at once."""
    gen = torch.Generator().manual_seed(4)
    _, mask = _random_batch(seed=5)  # [16, 7], two empty rows
    logp = (-torch.rand(16, 7, generator=gen) * 3).requires_grad_(True)
    entropy = torch.rand(16, 7, generator=gen).requires_grad_(True)
    old, ref = logp.detach() + 0.3 * torch.randn(16, 7, generator=gen), logp.detach() - torch.rand(16, 7, generator=gen)
    adv = torch.randn(16, 7, generator=gen) * mask
    tokens, seqs = L.global_counts(mask)
    config = dict(entropy_coeff=0.01, use_kl_loss=True, kl_loss_coef=0.1, kl_loss_type="low_var_kl",
                  loss_agg_mode=mode, global_tokens=tokens, global_seqs=seqs, norm_len=7)

    def run(rows):
        logp.grad = entropy.grad = None
        loss, metrics = L.actor_loss(logp[rows], old[rows], ref[rows], adv[rows], entropy[rows], mask[rows], **config)
        loss.backward()
        return loss.detach(), metrics, logp.grad.clone(), entropy.grad.clone()

    whole = run(slice(0, 16))
    pieces = [run(slice(start, start + 4)) for start in range(0, 16, 4)]
    close(sum(p[0] for p in pieces), whole[0])
    for name in ("pg_loss", "entropy_loss", "kl_loss"):
        close(sum(p[1][name] for p in pieces), whole[1][name])
    close(sum(p[2] for p in pieces), whole[2])
    close(sum(p[3] for p in pieces), whole[3])


# The other policy losses (actor.policy_loss.loss_mode), on _policy_case: ratio [1.5, 1, 0.5, 4, 2 | 7 masked],
# A [1, 1, -1, -1, -1 | 1]. Over the 5 response tokens: A − mean(A) = [1.2, 1.2, −0.8, −0.8, −0.8] (mean −0.2),
# logp = ln ratio = [0.405, 0, −0.693, 1.386, 0.693], logp − mean(logp) = logp − ln6/5 = [0.047, −0.358, −1.052,
# 1.028, 0.335], so cov = [0.057, −0.430, 0.841, −0.822, −0.268].


def test_gpg_is_the_plain_policy_gradient():
    old, logp, adv, mask = _policy_case()
    loss, metrics = L.actor_loss(logp, old, None, adv, None, mask, policy_loss={"loss_mode": "gpg"})
    # −logp·A = [−ln1.5, 0, ln0.5, ln4, ln2]: token-mean ln(0.5·4·2/1.5)/5 = ln(8/3)/5
    close(loss, math.log(8 / 3) / 5)
    close([metrics[k] for k in ("pg_clipfrac", "ppo_kl", "pg_clipfrac_lower")], [0.0, 0.0, 0.0])
    loss.backward()
    close(logp.grad, [[-0.2, -0.2, 0.2, 0.2, 0.2, 0]])          # −A/5 on each response token


def test_gspo_clips_one_ratio_per_sequence_and_keeps_each_tokens_gradient():
    old, logp, adv, mask = _policy_case()
    loss, metrics = L.actor_loss(logp, old, None, adv, None, mask, policy_loss={"loss_mode": "gspo"})
    # s = (1.5·1·0.5·4·2)^(1/5) = 6^0.2 ≈ 1.431 on every token. A = 1: max(−s, −1.2) = −1.2 (clipped);
    # A = −1: max(s, 1.2) = s. token-mean (−2.4 + 3s)/5
    s = 6 ** 0.2
    close(loss, (-2.4 + 3 * s) / 5)
    close(metrics["pg_clipfrac"], 2 / 5)
    close(metrics["ppo_kl"], -math.log(6) / 5)
    loss.backward()
    # each unclipped token's loss −A·s_t has d/dlogp_t = −A·s (its own token only): s/5 on tokens 2-4
    close(logp.grad, [[0, 0, s / 5, s / 5, s / 5, 0]])
    # two sequences get their own ratios: row 2 at ratio 2 on both tokens, A = 1: clipped to 1.2
    clip = dict(clip_ratio_low=0.2, clip_ratio_high=0.2)
    two_rows = L.gspo_policy_losses(torch.log(t([[1.5, 1.0], [2.0, 2.0]])), torch.zeros(2, 2), torch.ones(2, 2),
                                    torch.ones(2, 2), **clip)[0]
    close(two_rows, [[-1.2, -1.2], [-1.2, -1.2]])
    close(L.gspo_policy_losses(torch.log(t([[1.1, 1.0]])), torch.zeros(1, 2), torch.ones(1, 2), torch.ones(1, 2),
                               **clip)[0], [[-1.1 ** 0.5] * 2])


def test_kl_cov_penalises_the_tokens_of_largest_covariance():
    old, logp, adv, mask = _policy_case()
    options = {"loss_mode": "kl_cov", "kl_cov_ratio": 2e-4, "ppo_kl_coef": 1.0}
    loss, metrics = L.actor_loss(logp, old, None, adv, None, mask, policy_loss=options)
    # no clip: −A·ratio = [−1.5, −1, 0.5, 4, 2]; k = max(1, ⌊5·2e-4⌋) = 1: token 2 (cov 0.841) gets + 1·|ln 0.5|
    close(loss, (4 + math.log(2)) / 5)
    close(metrics["ppo_kl"], (math.log(1.5) + 4 * math.log(2)) / 5)      # mean |log ratio|
    close(metrics["pg_clipfrac"], 0.0)
    # kl_cov_ratio 0.5: k = ⌊2.5⌋ = 2: tokens 2 and 0 (cov 0.057, the next largest)
    loss, _ = L.actor_loss(logp, old, None, adv, None, mask, policy_loss={**options, "kl_cov_ratio": 0.5})
    close(loss, (4 + math.log(2) + math.log(1.5)) / 5)


def test_clip_cov_cuts_the_gradient_at_unclipped_tokens_in_the_covariance_band():
    old, logp, adv, mask = _policy_case()
    options = {"loss_mode": "clip_cov", "clip_cov_ratio": 2e-4, "clip_cov_lb": 1.0, "clip_cov_ub": 5.0}
    loss, metrics = L.actor_loss(logp, old, None, adv, None, mask, policy_loss=options)
    # no token has cov in (1, 5): PPO-clip without the dual clip: [−1.2, −1, 0.8, 4, 2] -> 4.6/5
    close(loss, 4.6 / 5)
    close([metrics["pg_clipfrac"], metrics["ppo_kl"]], [0.0, -math.log(6) / 5])
    # band (−1, 0.5): tokens 1, 3, 4 (0 and 2 are PPO-clipped, so never cut); ratio 1: k = 5 ≥ 3, all three cut
    band = {**options, "clip_cov_lb": -1.0, "clip_cov_ub": 0.5}
    logp.grad = None
    loss, metrics = L.actor_loss(logp, old, None, adv, None, mask, policy_loss={**band, "clip_cov_ratio": 1.0})
    close(loss, (-1.2 + 0.8) / 5)
    close(metrics["pg_clipfrac"], 3 / 5)
    loss.backward()
    close(logp.grad, [[0.0] * 6])                   # clipped or cut: no token passes a gradient
    # ratio 0.5: k = ⌊2.5⌋ = 2 of the 3 candidates, drawn at random: every draw cuts two of tokens 1, 3, 4
    for seed in range(6):
        losses, metrics = L.clip_cov_policy_losses(logp, old, adv, mask, clip_ratio_low=0.2, clip_ratio_high=0.2,
                                                   **{**band, "clip_cov_ratio": 0.5},
                                                   generator=torch.Generator().manual_seed(seed))
        cut = [i for i in range(5) if losses[0, i] == 0]
        assert len(cut) == 2 and set(cut) <= {1, 3, 4} and metrics["pg_clipfrac"] == pytest.approx(2 / 5)


def test_an_unknown_policy_loss_mode_is_named():
    old, logp, adv, mask = _policy_case()
    with pytest.raises(ValueError, match="unknown policy_loss.loss_mode 'ppo'; valid: vanilla, gpg, clip_cov"):
        L.actor_loss(logp, old, None, adv, None, mask, policy_loss={"loss_mode": "ppo"})


def test_critic_loss():
    values = t([[1.0, 2.0, 5.0]]).requires_grad_(True)
    old = t([[0.0, 1.0, 0.0]])
    returns = t([[0.0, 3.0, 0.0]])
    mask = t([[1, 1, 0]])
    loss, metrics = L.critic_loss(values, old, returns, mask, cliprange_value=0.5)
    # token 0: v_clip = clamp(1, -0.5, 0.5) = 0.5: errors 1 and 0.25 -> 1 (not clipped)
    # token 1: v_clip = clamp(2, 0.5, 1.5) = 1.5: errors 1 and 2.25 -> 2.25 (clipped)
    # loss = 0.5·(1 + 2.25)/2 = 0.8125; clipfrac = 1/2; mean prediction (1 + 2)/2
    close(loss, 0.8125)
    close(metrics["vf_loss"], 0.8125)
    close(metrics["vf_clipfrac"], 0.5)
    close(metrics["vpred_mean"], 1.5)
    loss.backward()
    # token 0: d/dv 0.5·(v - ret)²/2 = (1 - 0)/2 = 0.5; token 1: clipped branch -> 0
    close(values.grad, [[0.5, 0.0, 0.0]])


# ------------------------------------------------------------------------------------------------ PF-PPO

def test_pf_ppo_weights_by_method():
    scores = t([1.0, -2.0, 0.5, 0.0])
    close(L.pf_ppo_weights(scores, "pow", 2.0), [1.0, 4.0, 0.25, 1e-8], rtol=1e-6)   # |s|^2, + 1e-8
    close(L.pf_ppo_weights(scores, "pow", 1.0), [1.0, 2.0, 0.5, 1e-8], rtol=1e-6)
    close(L.pf_ppo_weights(scores, "max_min", 2.0), [1.0, 1.0, 1e-8, 1e-8], rtol=1e-6)  # max 1 and min -2
    close(L.pf_ppo_weights(scores, "max_random", 2.0), [0.4, 0.1, 0.1, 0.1], rtol=1e-6)  # max 1 only
    close(L.pf_ppo_weights(t([0.0, 0.0]), "pow", 2.0), [1e-8, 1e-8], rtol=1e-6)   # all zero: drawn uniformly
    with pytest.raises(ValueError, match="unknown PF-PPO reweight_method 'top'; valid: pow, max_min, max_random"):
        L.pf_ppo_weights(scores, "top", 2.0)


def test_pf_ppo_resample_draws_rows_in_proportion_to_their_weights():
    # 1000 rows scored -2, 2000 scored 1, 1000 scored 0; pow 2 weighs them 4, 1 and ~0: a draw lands on a -2 row
    # with probability 4000 / (4000 + 2000) = 2/3, on a 1 row with 1/3, on a 0 row with ~1e-8 · 1000 / 6000
    scores = torch.cat([torch.full((1000,), -2.0), torch.ones(2000), torch.zeros(1000)])
    drawn = L.pf_ppo_resample(scores, "pow", 2.0, torch.Generator().manual_seed(0))
    assert drawn.shape == (4000,) and drawn.dtype == torch.long
    picked = scores[drawn]
    assert (picked == 0).sum() == 0
    assert abs(float((picked == -2).float().mean()) - 2 / 3) < 0.03     # 4000 draws: std of the share 0.0075
    same = L.pf_ppo_resample(scores, "pow", 2.0, torch.Generator().manual_seed(0))
    assert torch.equal(drawn, same)                                      # the generator decides the draw


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


def test_readme_oracle_example():
    """The README's "losses.py as an oracle" example runs as written; its asserts hold hand-worked numbers."""
    readme = (Path(__file__).resolve().parents[1] / "README.md").read_text()
    section = readme[readme.index("## losses.py as an oracle"):]
    code = section[section.index("```python\n") + len("```python\n"):section.index("```\n", section.index("```python"))]
    assert "losses.actor_loss(" in code
    exec(compile(code, "README.md", "exec"), {})
