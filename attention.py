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
    (bench/step.py measures both, and flex attention with a document mask, which is slower on CPU). It also
    takes rows that hold a GRPO group's prompt once (forward._pack_shared): a response segment then attends to
    its group's prompt segment as well as causally to itself (`shared_prefixes`).
Padded batches (an attention mask, no boundaries) take transformers' sdpa path unchanged, and so does attention
that is not causal: a vision tower (Qwen2-VL, Qwen2.5-VL) calls the model's attention function once per window of
image patches, with no mask, and those patches attend to each other both ways.

Left out: sliding-window attention in packed rows (an error names it), dropout inside attention on the packed
CPU path (attention_dropout is 0 in the models minirl trains), ring or sequence-parallel attention.
"""
from __future__ import annotations

import functools

import torch
import torch.nn.functional as F
from transformers import AttentionInterface, AttentionMaskInterface
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import sdpa_mask

VARLEN_CPU = "minirl_varlen"
BUCKET_LENGTH_RATIO = 1.5        # sequences of lengths within this ratio share one sdpa call (length_buckets)
MASK_ELEMENTS = 2 ** 24          # the largest mask one call of shared-prefix attention builds (64 MiB in fp32)


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
                         sliding_window=None, cu_seq_lens_q=None, position_ids=None, shared_prefixes=None, **kwargs):
    """Registered as `minirl_varlen`. query [1, Hq, nnz, d], key/value [1, Hkv, nnz, d] -> ([1, nnz, Hq, d], None).

    With a padding mask (the padded path), and for attention that is not causal (a vision tower's, which calls this
    once per window with no mask), this is transformers' sdpa. Otherwise the row is cut at the segment
    boundaries (cu_seq_lens_q, else where the position ids restart) and each segment gets causal attention on its
    own: segments of similar length (length_buckets) side by side in one sdpa call. shared_prefixes [(start,
    length) per segment] (forward._pack_shared): a response segment also sees all of the prompt segment it
    continues, which the row holds once for the responses of a group; (0, 0) for none.
    """
    causal = kwargs.get("is_causal", getattr(module, "is_causal", True))
    if attention_mask is not None or query.shape[0] != 1 or not causal:
        return sdpa_attention_forward(module, query, key, value, attention_mask, scaling=scaling, dropout=dropout,
                                      sliding_window=sliding_window, position_ids=position_ids, **kwargs)
    if sliding_window is not None:
        raise NotImplementedError("packed rows (use_remove_padding) on CPU do not support sliding-window attention; "
                                  "set use_remove_padding=false for this model")
    if cu_seq_lens_q is None or int(cu_seq_lens_q[-1]) != query.shape[2]:     # none given, or for another row
        cu_seq_lens_q, shared_prefixes = (packed_boundaries(position_ids)[0] if position_ids is not None
                                          else torch.tensor([0, query.shape[2]])), None
    gqa = query.shape[1] != key.shape[1]
    buckets, order = row_layout(tuple(cu_seq_lens_q.tolist()), tuple(shared_prefixes or ()), query.device,
                                query.dtype)
    outputs = []
    for q_index, k_index, mask, real in buckets:
        q = query[0][:, q_index.reshape(-1)].unflatten(1, q_index.shape).transpose(0, 1)   # [n_b, Hq, Lq, d]
        k, v = (x[0][:, k_index.reshape(-1)].unflatten(1, k_index.shape).transpose(0, 1)
                for x in (key, value))                                                   # [n_b, Hkv, Lk, d]
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=mask is None, scale=scaling,
                                             enable_gqa=gqa, dropout_p=dropout if module.training else 0.0)
        outputs.append(out.transpose(0, 1)[:, real])                           # [Hq, tokens of the bucket, d]
    out = torch.cat(outputs, dim=1)[:, order].unsqueeze(0)                     # [1, Hq, nnz, d]
    return out.transpose(1, 2).contiguous(), None


@functools.lru_cache(maxsize=1)      # every layer of a forward (and its recompute in backward) cuts the same row
def row_layout(bounds, prefixes, device, dtype):
    """How varlen_cpu_attention cuts a packed row with segment boundaries `bounds` (and shared `prefixes`, () for
    none) into sdpa calls: [(q_index, k_index, mask, real)] (_bucket_layout) and `order`, which puts the calls'
    kept outputs back in the row's order. Segments without a prefix are bucketed by length, those with one by
    their key length (prefix + itself) apart from them, so a short response is not padded to a long prompt."""
    segments = list(zip(bounds[:-1], bounds[1:]))
    prefixes = prefixes or ((0, 0),) * len(segments)
    buckets, positions = [], []
    for has_prefix in (False, True):
        members = [i for i, (_, length) in enumerate(prefixes) if (length > 0) == has_prefix]
        key_lengths = [prefixes[i][1] + segments[i][1] - segments[i][0] for i in members]
        for bucket in length_buckets(key_lengths):
            chosen = [members[j] for j in bucket]
            layout = _bucket_layout([segments[i] for i in chosen], [prefixes[i] for i in chosen], device, dtype)
            buckets.append(layout)
            positions.append(layout[0][layout[3]])
    return buckets, torch.cat(positions).argsort()


def _bucket_layout(segments, prefixes, device, dtype):
    """One sdpa call: (q_index [n_b, Lq], k_index [n_b, Lk], mask, real [n_b, Lq]): the row positions of each
    segment's queries and keys, right-padded by repeating the last token, and which query slots are kept.

    Without prefixes: keys = queries = the segment, mask None (sdpa's is_causal). With them, query t of a
    segment with a prefix of p tokens must see keys 0..p+t (the whole prefix, itself causally). Two ways:
      * queries = the segment only, keys = [prefix, segment], an additive mask (0 / -inf in `dtype`)
        [n_b, 1, Lq, Lk]: the least work (the prefix is never a query), used while the mask has at most
        MASK_ELEMENTS elements;
      * otherwise queries = keys = [prefix, segment] with is_causal, the prefix's query slots dropped: no mask
        in memory, at the price of attending from the prefix again (attention only: projections and MLPs ran
        once).
    No real query ever sees the padding (at the end of its keys, past itself)."""
    starts = torch.tensor([start for start, _ in segments], device=device)
    lengths = torch.tensor([end - start for start, end in segments], device=device)
    prefix_starts = torch.tensor([start for start, _ in prefixes], device=device)
    prefix_lengths = torch.tensor([length for _, length in prefixes], device=device)
    k_offsets = torch.arange(int((prefix_lengths + lengths).max()), device=device)
    own = torch.minimum(k_offsets - prefix_lengths[:, None], lengths[:, None] - 1)     # [n_b, Lk] into the segment
    k_index = torch.where(own < 0, prefix_starts[:, None] + k_offsets, starts[:, None] + own)
    if not prefix_lengths.any() or len(segments) * int(lengths.max()) * len(k_offsets) > MASK_ELEMENTS:
        real = (k_offsets >= prefix_lengths[:, None]) & (k_offsets < (prefix_lengths + lengths)[:, None])
        return k_index, k_index, None, real
    q_offsets = torch.arange(int(lengths.max()), device=device)
    q_index = starts[:, None] + torch.minimum(q_offsets, lengths[:, None] - 1)          # [n_b, Lq]
    visible = k_offsets[None, None, :] <= prefix_lengths[:, None, None] + q_offsets[None, :, None]   # [n_b, Lq, Lk]
    mask = torch.zeros(visible.shape, dtype=dtype, device=device).masked_fill_(~visible, float("-inf"))
    return q_index, k_index, mask.unsqueeze(1), q_offsets[None, :] < lengths[:, None]


def length_buckets(lengths, ratio=None):
    """Sequence (segment) indices grouped for one sdpa call each, longest first: a group's longest is at most `ratio`
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
