"""Attention for packed rows (remove padding) at a cost linear in the sequences: sum of len^2, never
(sum of len)^2.

A packed micro-batch is one row [1, nnz] of several sequences back to back; token_logprobs passes their
boundaries as `cu_seq_lens_q` / `max_length_q` (flash-attention's varlen keywords, which transformers forwards to
the attention function). Which attention runs where (`attention_backend`):
  * CUDA with flash-attn installed: `flash_attention_2`, whose varlen kernel reads those boundaries.
  * Ascend NPU: `flash_attention_2` too; transformers routes it to torch_npu's fused attention
    (`npu_fusion_attention`, layout TND, `actual_seq_qlen` = the boundaries), as verl does on NPU.
  * anything else (CPU): `minirl_varlen` below, causal sdpa over each sequence of the row in turn. transformers'
    own sdpa would build a dense block-diagonal mask over the whole row instead: quadratic in the packed length
    (bench/step.py measures both, and flex attention with a document mask, which is slower on CPU).
Padded batches (an attention mask, no boundaries) take transformers' sdpa path unchanged.

Left out: sliding-window attention in packed rows (an error names it), dropout inside attention on the packed
CPU path (attention_dropout is 0 in the models minirl trains), ring or sequence-parallel attention.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from transformers import AttentionInterface, AttentionMaskInterface
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import sdpa_mask

VARLEN_CPU = "minirl_varlen"
BUCKET_LENGTH_RATIO = 1.5        # sequences of lengths within this ratio share one sdpa call (length_buckets)


def attention_backend(device_type, use_remove_padding, flash_attn_installed=None):
    """The attn_implementation to load a model with. Packed rows need a varlen attention: flash_attention_2 on
    CUDA (when flash-attn is installed) and on NPU (torch_npu's fused attention), minirl_varlen elsewhere.
    Padded batches use sdpa everywhere."""
    if not use_remove_padding:
        return "sdpa"
    if device_type == "npu":
        return "flash_attention_2"
    if device_type == "cuda":
        if flash_attn_installed is None:
            flash_attn_installed = _flash_attn_installed()
        if flash_attn_installed:
            return "flash_attention_2"
    return VARLEN_CPU


def _flash_attn_installed():
    try:
        import flash_attn  # noqa: F401
        return True
    except ImportError:
        return False


def packed_boundaries(position_ids):
    """cu_seqlens [n_seqs + 1] (int32, flash-attention's convention) and the longest length, from the position
    ids [1, nnz] of a packed row: each sequence starts where its position id is 0."""
    flat = position_ids.reshape(-1)
    starts = (flat == 0).nonzero(as_tuple=True)[0]                         # [n_seqs]
    if starts.numel() == 0 or starts[0] != 0:
        starts = torch.cat([starts.new_zeros(1), starts])
    cu_seqlens = torch.cat([starts, starts.new_tensor([flat.numel()])]).to(torch.int32)
    return cu_seqlens, int((cu_seqlens[1:] - cu_seqlens[:-1]).max())


def varlen_cpu_attention(module, query, key, value, attention_mask, scaling=None, dropout=0.0,
                         sliding_window=None, cu_seq_lens_q=None, position_ids=None, **kwargs):
    """Registered as `minirl_varlen`. query [1, Hq, nnz, d], key/value [1, Hkv, nnz, d] -> ([1, nnz, Hq, d], None).

    With a padding mask (the padded path) this is transformers' sdpa. Otherwise the row is cut at the sequence
    boundaries (cu_seq_lens_q, else where the position ids restart) and each sequence gets causal attention on its
    own: sequences of similar length (length_buckets) side by side in one sdpa call.
    """
    if attention_mask is not None or query.shape[0] != 1:
        return sdpa_attention_forward(module, query, key, value, attention_mask, scaling=scaling, dropout=dropout,
                                      sliding_window=sliding_window, position_ids=position_ids, **kwargs)
    if sliding_window is not None:
        raise NotImplementedError("packed rows (use_remove_padding) on CPU do not support sliding-window attention; "
                                  "set use_remove_padding=false for this model")
    if cu_seq_lens_q is None or int(cu_seq_lens_q[-1]) != query.shape[2]:     # none given, or for another row
        cu_seq_lens_q = (packed_boundaries(position_ids)[0] if position_ids is not None
                         else torch.tensor([0, query.shape[2]]))
    bounds = cu_seq_lens_q.tolist()
    lengths = [end - start for start, end in zip(bounds[:-1], bounds[1:])]
    gqa = query.shape[1] != key.shape[1]
    outputs, positions = [], []
    for bucket in length_buckets(lengths):
        # the bucket's sequences side by side, right-padded to its longest: [n_b, L_b] positions in the row
        longest = lengths[bucket[0]]
        offsets = torch.arange(longest, device=query.device)
        starts = torch.tensor([bounds[i] for i in bucket], device=query.device)
        ends = torch.tensor([bounds[i + 1] for i in bucket], device=query.device)
        index = torch.minimum(starts[:, None] + offsets, ends[:, None] - 1)    # padding repeats the last token
        q, k, v = (x[0][:, index.reshape(-1)].unflatten(1, index.shape).transpose(0, 1)
                   for x in (query, key, value))                               # [n_b, H, L_b, d]
        # causal attention never looks right, so the padding at the end changes no real token's output
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scaling, enable_gqa=gqa,
                                             dropout_p=dropout if module.training else 0.0)   # [n_b, Hq, L_b, d]
        real = offsets[None, :] < (ends - starts)[:, None]                     # [n_b, L_b]
        outputs.append(out.transpose(0, 1)[:, real])                           # [Hq, tokens of the bucket, d]
        positions.append(index[real])
    order = torch.cat(positions).argsort()                                     # back to the row's order
    out = torch.cat(outputs, dim=1)[:, order].unsqueeze(0)                     # [1, Hq, nnz, d]
    return out.transpose(1, 2).contiguous(), None


def length_buckets(lengths, ratio=None):
    """Sequence indices grouped for one sdpa call each, longest first: a group's longest is at most `ratio`
    (BUCKET_LENGTH_RATIO) times its shortest, so right-padding a group to its longest costs at most ratio^2 x
    its sum of len^2, in about log_ratio(longest / shortest) calls (one call per sequence is slow on CPU)."""
    ratio = BUCKET_LENGTH_RATIO if ratio is None else ratio
    buckets = []
    for i in sorted(range(len(lengths)), key=lambda i: -lengths[i]):
        if buckets and lengths[i] * ratio >= lengths[buckets[-1][0]]:
            buckets[-1].append(i)
        else:
            buckets.append([i])
    return buckets


def _varlen_cpu_mask(*args, attention_mask=None, **kwargs):
    """No mask for a packed row (the attention cuts it at the boundaries); sdpa's mask for a padded batch."""
    if attention_mask is None:
        return None
    return sdpa_mask(*args, attention_mask=attention_mask, **kwargs)


AttentionInterface.register(VARLEN_CPU, varlen_cpu_attention)
AttentionMaskInterface.register(VARLEN_CPU, _varlen_cpu_mask)
