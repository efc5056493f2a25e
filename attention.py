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
    boundaries (cu_seq_lens_q, else where the position ids restart) and each sequence gets causal sdpa on its own.
    """
    if attention_mask is not None or query.shape[0] != 1:
        return sdpa_attention_forward(module, query, key, value, attention_mask, scaling=scaling, dropout=dropout,
                                      sliding_window=sliding_window, position_ids=position_ids, **kwargs)
    if sliding_window is not None:
        raise NotImplementedError("packed rows (use_remove_padding) on CPU do not support sliding-window attention; "
                                  "set use_remove_padding=false for this model")
    if cu_seq_lens_q is None:
        cu_seq_lens_q = (packed_boundaries(position_ids)[0] if position_ids is not None
                         else torch.tensor([0, query.shape[2]]))
    gqa = query.shape[1] != key.shape[1]
    segments = []
    bounds = cu_seq_lens_q.tolist()
    for start, end in zip(bounds[:-1], bounds[1:]):
        segments.append(F.scaled_dot_product_attention(
            query[:, :, start:end], key[:, :, start:end], value[:, :, start:end], is_causal=True, scale=scaling,
            dropout_p=dropout if module.training else 0.0, enable_gqa=gqa))               # [1, Hq, len, d]
    out = torch.cat(segments, dim=2)                                                     # [1, Hq, nnz, d]
    return out.transpose(1, 2).contiguous(), None


def _varlen_cpu_mask(*args, attention_mask=None, **kwargs):
    """No mask for a packed row (the attention cuts it at the boundaries); sdpa's mask for a padded batch."""
    if attention_mask is None:
        return None
    return sdpa_mask(*args, attention_mask=attention_mask, **kwargs)


AttentionInterface.register(VARLEN_CPU, varlen_cpu_attention)
AttentionMaskInterface.register(VARLEN_CPU, _varlen_cpu_mask)
