"""The training forward pass: a batch in, per-token log-probs (and entropy, or values) of the response out.

This is the one place that turns a batch into them, for the actor, the reference and the critic (models.py's
workers call it; the loading and sharding live there):
  * padded:  model(input_ids [b, L], attention_mask, position_ids)
  * packed (use_remove_padding): the micro-batch's valid tokens in one row [1, nnz], with the sequence
    boundaries passed as flash-attention's varlen keywords; the attention (attention.py) costs sum(len^2):
    flash-attention varlen on CUDA, torch_npu's fused attention on NPU, sdpa per sequence on CPU. With the CPU
    attention, rows with the same prompt (a GRPO group's n responses) hold it once: [prompt + response 1,
    response 2, ...], each later response attending to that one copy (_pack_shared). The prompt's hidden states
    are the same in every row of the group, so the log-probs are the same (to rounding) and its gradient is the
    sum of the rows' (autograd sums over the copy's uses); the layers do the prompt's work once instead of n times.
Either way position L-R-1+t predicts response token t (verl's slice `[:, -R-1:-1]`), and only those positions
reach the head: the final hidden states are cut to them inside the model's forward, and the LM head and
log-softmax (divided by the sampling temperature) run over them in chunks, so the [tokens, vocab] logits of the
prompt are never computed and those of the response never exist at once in a no-grad pass.

Micro-batching: a fixed number of responses (`*_micro_batch_size_per_gpu`), or `use_dynamic_bsz`: sequences
grouped under a token budget, with the same number of micro-batches on every rank (FSDP needs every rank to run
the same collectives).
"""
from __future__ import annotations

import math
import warnings

import torch
import torch.distributed as dist

import ulysses
import vision
from attention import VARLEN_CPU
from batch import balanced_partitions
from losses import logprobs_and_entropy


def unwrapped(model):
    """The Hugging Face model under peft's LoRA wrapper (the model itself when it is not wrapped)."""
    return model.get_base_model() if hasattr(model, "get_base_model") else model


def decoder(model):
    """The base model of a Hugging Face model (embeddings, blocks, final norm: what the head reads), under peft's
    LoRA wrapper too."""
    model = unwrapped(model)
    return getattr(model, model.base_model_prefix, model)


HEAD_CHUNK_ELEMENTS = 2 ** 25    # logits computed at a time by the LM head ([tokens, V] fp32: 128 MiB)


def _pack(input_ids, attention_mask, position_ids):
    """Valid tokens of every row, concatenated: ids/pos [1, nnz], their flat indices in [b*L], and the sequence
    boundaries in flash-attention's varlen keywords (cu_seq_lens [n_rows + 1], max_length), which the packed
    attention reads (attention.py)."""
    flat_valid = attention_mask.reshape(-1).bool()                       # [b*L]
    indices = flat_valid.nonzero(as_tuple=True)[0]                       # [nnz]
    ids = input_ids.reshape(-1)[indices].unsqueeze(0)                    # [1, nnz]
    pos = position_ids.reshape(-1)[indices].unsqueeze(0)                 # [1, nnz]
    lengths = attention_mask.sum(-1)
    lengths = lengths[lengths > 0]                                       # [rows with tokens]
    cu_seqlens = torch.nn.functional.pad(lengths.cumsum(0), (1, 0)).to(torch.int32)    # [rows + 1]
    max_length = int(lengths.max()) if lengths.numel() else 0
    varlen = {"cu_seq_lens_q": cu_seqlens, "cu_seq_lens_k": cu_seqlens, "max_length_q": max_length,
              "max_length_k": max_length}
    return ids, pos, indices, varlen


def prompt_groups(input_ids, attention_mask, prompt_len):
    """Rows [b] grouped by their prompt (its valid tokens), groups in order of first appearance: [[rows], ...].
    GRPO's n responses to one prompt form a group; so does any other repeat of a prompt."""
    prompts = input_ids[:, :prompt_len].masked_fill(attention_mask[:, :prompt_len] == 0, -1)   # [b, P]
    groups = {}
    for row, tokens in enumerate(map(tuple, prompts.tolist())):
        groups.setdefault(tokens, []).append(row)
    return list(groups.values())


def _pack_shared(input_ids, attention_mask, position_ids, response_len):
    """Like _pack, with each prompt once: the rows of a group with the same prompt pack as [prompt + response 1,
    response 2, response 3, ...], each response keeping its own position ids (they continue the prompt's).
    Returns the packed ids/pos [1, nnz], the varlen keywords over these segments plus `shared_prefixes`
    [(start, length) per segment]: the prompt a response segment continues ((0, 0): none), which the attention
    reads, and the map from flat positions [b*L] to packed positions, where every row of a group reads the one
    copy of its prompt."""
    b, length = attention_mask.shape
    prompt_len = length - response_len
    valid = attention_mask.bool()                                                    # [b, L]
    device = input_ids.device
    groups = prompt_groups(input_ids, attention_mask, prompt_len)
    order = torch.tensor([row for rows in groups for row in rows], device=device)   # [b] a group's rows together
    leader = torch.empty(b, dtype=torch.long, device=device)                         # [b] the first row of its group
    leader[order] = torch.tensor([rows[0] for rows in groups for _ in rows], device=device)
    first = leader == torch.arange(b, device=device)                                 # [b]
    prompt_valid = valid[:, :prompt_len]                                             # [b, P]
    held = valid.clone()                                                             # [b, L] what each segment holds:
    held[:, :prompt_len] &= first.unsqueeze(1)                                       # the prompt in its leader's only
    held = held[order]                                                               # [b, L] in packing order
    rows, cols = held.nonzero(as_tuple=True)                                         # [nnz] segment by segment
    indices = order[rows] * length + cols                                            # [nnz] flat positions in [b*L]
    to_output = torch.zeros(b * length, dtype=torch.long, device=device)
    to_output[indices] = torch.arange(indices.numel(), device=device)
    f_rows, f_cols = (prompt_valid & ~first.unsqueeze(1)).nonzero(as_tuple=True)    # other rows' prompts read
    to_output[f_rows * length + f_cols] = to_output[leader[f_rows] * length + f_cols]   # the leader's copy
    sizes = held.sum(1)                                                              # [b] segment sizes, packing order
    starts = torch.empty_like(sizes)
    starts[order] = sizes.cumsum(0) - sizes                                          # [b] each row's segment start
    prefix_start = torch.where(first, 0, starts[leader])[order]                      # [b] packing order
    prefix_len = torch.where(first, 0, prompt_valid.sum(1)[leader])[order]
    nonempty = sizes > 0
    sizes = sizes[nonempty]
    cu_seqlens = torch.nn.functional.pad(sizes.cumsum(0), (1, 0)).to(torch.int32)
    prefixes = list(zip(prefix_start[nonempty].tolist(), prefix_len[nonempty].tolist()))
    varlen = {"cu_seq_lens_q": cu_seqlens, "cu_seq_lens_k": cu_seqlens, "max_length_q": int(sizes.max()),
              "max_length_k": int(sizes.max()), "shared_prefixes": prefixes}
    return (input_ids.reshape(-1)[indices].unsqueeze(0), position_ids.reshape(-1)[indices].unsqueeze(0), varlen,
            to_output)


def shares_prompts(model, use_remove_padding):
    """Whether packed rows hold each prompt once (_pack_shared): packed text models whose attention is
    minirl's varlen sdpa (attention.py; flash-attention's varlen kernels take no shared prefixes)."""
    model = unwrapped(model)
    return (use_remove_padding and model.config._attn_implementation == VARLEN_CPU
            and not vision.is_vision_language(model.config))


def _model_inputs(model, batch, use_remove_padding, share_prompts=False):
    """The model's keyword inputs (a vision-language model's images and rope positions too: vision.py), and a map
    from flat positions in [b*L] to positions of the model's output (packed: the index among valid tokens;
    padded: the same position). share_prompts: each prompt once in the packed row (_pack_shared)."""
    input_ids, attention_mask, position_ids = batch["input_ids"], batch["attention_mask"], batch["position_ids"]
    if not use_remove_padding:
        return {"input_ids": input_ids, "attention_mask": attention_mask, "position_ids": position_ids,
                **vision.forward_kwargs(unwrapped(model), batch)}, None   # images: + pixels, rope positions [3, b, L]
    if share_prompts and shares_prompts(model, use_remove_padding):
        ids, pos, varlen, packed_index = _pack_shared(input_ids, attention_mask, position_ids,
                                                      batch["responses"].shape[1])
        return {"input_ids": ids, "position_ids": pos, **varlen}, packed_index
    ids, pos, indices, varlen = _pack(input_ids, attention_mask, position_ids)
    packed_index = attention_mask.reshape(-1).long().cumsum(0) - 1      # [b*L]: flat position -> packed position
    return {"input_ids": ids, "position_ids": pos, **varlen,           # images: + pixels, rope positions [4, 1, nnz]
            **vision.forward_kwargs(unwrapped(model), batch, indices, pos)}, packed_index


def response_predicting_positions(attention_mask, response_len):
    """Flat indices [n] into [b*L] of the positions whose next token is a valid response token: position
    L-R-1+t predicts response token t (verl's slice [:, -R-1:-1]). Only these need the head."""
    length = attention_mask.shape[1]
    predicts = torch.zeros_like(attention_mask, dtype=torch.bool)          # [b, L]
    predicts[:, length - response_len - 1:length - 1] = attention_mask[:, length - response_len:].bool()
    return predicts.reshape(-1).nonzero(as_tuple=True)[0]


def _scatter_to_responses(values, keep, shape):
    """values [n] at flat positions `keep` (from response_predicting_positions) -> [b, R], zero elsewhere."""
    (b, length), response_len = shape
    out = values.new_zeros(b, response_len)
    out[keep // length, keep % length - (length - response_len - 1)] = values
    return out


def _kept_inputs(model, batch, keep, use_remove_padding, sp_group):
    """The model's inputs and the positions of its output whose head values are wanted (`keep` [n], flat
    positions in [b*L]), for this rank. With sp_group (Ulysses, packed rows only; ulysses.shard_packed): this
    rank's slice of the packed row and its kept positions in it. Also returns which of `keep` are this rank's,
    and `gather`, which puts every rank's per-position outputs back together in keep's order."""
    inputs, to_output = _model_inputs(model, batch, use_remove_padding,
                                       share_prompts=sp_group is None and "responses" in batch)
    kept = keep if to_output is None else to_output[keep]
    if sp_group is None:
        return inputs, kept, slice(None), lambda values: values
    return ulysses.shard_packed(inputs, kept, sp_group)


def forward_kept(model, inputs, keep, head_fn=None):
    """Run `model` on `inputs` with its final hidden states cut to positions `keep` [n] (of its flattened
    output) before the head, so the head runs on those alone.

    With head_fn, head_fn(hidden [n, H]) replaces the model's head and its result is returned. It runs inside
    the model's forward (a hook on the decoder's output), where FSDP2 has the head's weights gathered and
    autograd reaches them. Without it the model's own head runs on the kept positions: output [n, ...]."""
    result = {}

    def cut(module, args, output):
        hidden = output.last_hidden_state.flatten(0, 1)[keep]           # [n, H]
        if head_fn is None:
            output.last_hidden_state = hidden.unsqueeze(0)                 # [1, n, H]
        else:
            result["head"] = head_fn(hidden)
            output.last_hidden_state = hidden[:0].unsqueeze(0)             # the model's own head has nothing to do
        return output

    handle = decoder(model).register_forward_hook(cut)
    try:
        with warnings.catch_warnings():
            # a head on [1, n, H] returns a view (nn.Linear on 3-d input), and FSDP2 warns that an in-place op on
            # the root's output would skip its backward hook; the output here is only read
            warnings.filterwarnings("ignore", message=r"FSDP2-wrapped module .* returned a view tensor")
            out = model(**inputs, use_cache=False)
    finally:
        handle.remove()
    return result["head"] if head_fn is not None else out.logits[0]


def logprob_head(model, labels, temperature, calc_entropy, kernel, entropy_grad=True):
    """head_fn for forward_kept: hidden [n, H] -> (log-probs [n], entropy [n] or None), fp32, the LM head and
    log-softmax run HEAD_CHUNK_ELEMENTS logits at a time so the [n, V] logits never exist at once (only the
    chunks autograd keeps for backward). kernel: losses.logprobs_and_entropy or a variant of it (compiled,
    chunked entropy). entropy_grad=False computes entropy without autograd (a metric)."""
    head = model.get_output_embeddings()
    if getattr(model.config, "final_logit_softcapping", None) or getattr(model.config, "logit_scale", None):
        raise NotImplementedError(f"{type(model).__name__} post-processes its logits (soft-capping or scaling); "
                                  f"minirl's log-prob head applies the output embedding alone")

    def run(hidden):
        chunk = max(1, HEAD_CHUNK_ELEMENTS // head.weight.shape[0])
        logps, entropies = [], []
        for h, y in zip(hidden.split(chunk), labels.split(chunk)):
            logits = head(h).float()                                      # [c, V]
            if temperature != 1.0:   # x / 1 == x exactly: skipping it saves a [c, V] pass and one in backward
                logits = logits.div_(temperature)                         # in place: mm keeps no output
            logp, entropy = kernel(logits, y, calc_entropy, entropy_grad)  # [c], [c] or None
            logps.append(logp)
            entropies.append(entropy)
        return torch.cat(logps), (torch.cat(entropies) if calc_entropy else None)

    return run


def token_logprobs(model, batch, temperature=1.0, use_remove_padding=True, calc_entropy=False, kernel=None,
                   entropy_grad=True, sp_group=None):
    """Per-token log-probs of the response (and entropy) under `model`.

    batch: input_ids/attention_mask/position_ids [b, P+R], responses [b, R].
    Returns (log_probs [b, R], entropy [b, R] or None), fp32, zero where the response is padding. Only the
    positions that predict a response token reach the LM head. `kernel`: logprob_head's (default
    losses.logprobs_and_entropy). sp_group: Ulysses sequence parallel (ulysses.py); each rank runs the head on
    the kept positions of its slice of the packed row, and the results are gathered over the group.
    """
    input_ids, attention_mask = batch["input_ids"], batch["attention_mask"]
    shape = (input_ids.shape, batch["responses"].shape[1])
    keep = response_predicting_positions(attention_mask, shape[1])        # [n] flat positions in [b*L]
    labels = input_ids.reshape(-1)[keep + 1]                              # [n] the response token each predicts
    inputs, kept, mine, gather = _kept_inputs(model, batch, keep, use_remove_padding, sp_group)
    head_fn = logprob_head(model, labels[mine], temperature, calc_entropy, kernel or logprobs_and_entropy,
                           entropy_grad)
    logp, entropy = forward_kept(model, inputs, kept, head_fn)
    return (_scatter_to_responses(gather(logp), keep, shape),
            _scatter_to_responses(gather(entropy), keep, shape) if entropy is not None else None)


def head_outputs(model, batch, keep, use_remove_padding=True, sp_group=None):
    """The one-output head of a critic or reward model (token classification, 1 label) at flat positions
    `keep` [n] of [b*L]: [n] fp32, packed or padded (and sequence parallel) like token_logprobs."""
    inputs, kept, _, gather = _kept_inputs(model, batch, keep, use_remove_padding, sp_group)
    return gather(forward_kept(model, inputs, kept)[:, 0].float())


def token_values(critic, batch, use_remove_padding=True, sp_group=None):
    """Values [b, R] from a token-classification critic, verl's slice [:, -R-1:-1] (the value of the state
    before each response token); zero where the response is padding."""
    shape = (batch["input_ids"].shape, batch["responses"].shape[1])
    keep = response_predicting_positions(batch["attention_mask"], shape[1])
    return _scatter_to_responses(head_outputs(critic, batch, keep, use_remove_padding, sp_group), keep, shape)


def last_token_scores(model, batch, use_remove_padding=True):
    """A reward model's score per row [b]: its head at the last valid token (verl's reward model worker reads a
    token-classification output there; a sequence-classification checkpoint loads as one)."""
    mask = batch["attention_mask"]
    b, length = mask.shape
    positions = torch.arange(length, device=mask.device)
    last = (positions.unsqueeze(0) * mask).argmax(-1)                     # [b]
    return head_outputs(model, batch, torch.arange(b, device=mask.device) * length + last, use_remove_padding)


# ----------------------------------------------------------------------------------------------------------------
# Micro-batches


def fixed_micro_batches(size, micro_batch_size):
    """[[0..m-1], [m..2m-1], ...] over `size` rows."""
    return [list(range(start, min(start + micro_batch_size, size))) for start in range(0, size, micro_batch_size)]


def dynamic_micro_batches(lengths, max_tokens, device="cpu", groups=None):
    """Partition rows so each micro-batch holds at most `max_tokens` tokens, using as many micro-batches as the
    rank that needs most (all-reduced, so every rank runs the same number of forward passes). Every rank holds
    the same number of rows, so no micro-batch is empty. groups: [(rows, packed tokens)] that should share a
    micro-batch (a prompt's rows, packed with the prompt once: shared_prompt_groups); one over the budget is
    split into its rows."""
    if max(lengths, default=0) > max_tokens:
        raise ValueError(f"a sequence of {max(lengths)} tokens exceeds the token budget {max_tokens} "
                         f"(ppo_max_token_len_per_gpu / log_prob_max_token_len_per_gpu): raise it to at least "
                         f"max_prompt_length + max_response_length")
    units = []                                                             # [(rows, tokens)]
    for rows, tokens in groups or [([row], length) for row, length in enumerate(lengths)]:
        units += [(rows, tokens)] if tokens <= max_tokens else [([row], lengths[row]) for row in rows]
    costs = [tokens for _, tokens in units]
    k = max(1, min(len(costs), math.ceil(sum(costs) / max_tokens)))
    while any(sum(costs[i] for i in part) > max_tokens for part in balanced_partitions(costs, k)):
        k += 1
    if dist.is_initialized():
        count = torch.tensor([k], dtype=torch.long, device=device)
        dist.all_reduce(count, op=dist.ReduceOp.MAX)
        k = int(count.item())
    if k > len(units):                  # another rank needs more micro-batches than this one has groups: rows
        units, costs = [([row], length) for row, length in enumerate(lengths)], lengths
    return [sorted(row for i in part for row in units[i][0]) for part in balanced_partitions(costs, k)]


def shared_prompt_groups(batch):
    """[(rows, packed tokens)] of the prompt groups of a batch with responses: the rows' tokens with the prompt
    counted once, as _pack_shared packs them."""
    mask = batch["attention_mask"]
    prompt_len = mask.shape[1] - batch["responses"].shape[1]
    lengths, prompt_lengths = mask.sum(-1).tolist(), mask[:, :prompt_len].sum(-1).tolist()
    return [(rows, sum(lengths[row] for row in rows) - (len(rows) - 1) * prompt_lengths[rows[0]])
            for rows in prompt_groups(batch["input_ids"], mask, prompt_len)]
