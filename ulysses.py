"""Ulysses sequence parallelism (DeepSpeed-Ulysses, as verl's verl/utils/ulysses.py and its transformers patch at
v0.5.0): sp consecutive ranks share the rows of one data-parallel group and split every packed row along the
sequence. Everything but attention is per token, so it runs on this rank's slice; attention needs the whole
sequence, so around it an all-to-all trades the sequence split for a head split (each rank then sees the whole
sequence for 1/sp of the heads), runs the normal attention function, and trades back.

    ranks:        groups of sp consecutive ranks; data parallel over world/sp groups (`device_groups`)
    rows:         each rank brings its own rows, the group works on all of them (`gather_group_rows`, `own_rows`)
    packed row:   [1, nnz] -> right-padded to a multiple of sp -> this rank's [1, nnz_pad/sp] (`shard_packed`)
    attention:    q/k/v [1, H, S/sp, D] -all-to-all-> [1, H/sp, S, D] -attention-> -all-to-all-> [1, S/sp, H, D]
    outputs:      the head runs on this rank's kept positions (those predicting a response token) and the
                  results are all-gathered over the group (`shard_packed`'s gather, `GatherRows`)
    vision-language models: the image features go into the input embeddings at their placeholders, which may
                  fall in any rank's slice, so the model gets the whole padded row and every rank of the group
                  runs the vision tower on all its images (as verl); the decoder's input embeddings and rope
                  positions (mrope: [4, 1, nnz]) are sliced where the decoder starts (`_slice_decoder_inputs`)

Leaves out: the padded (non-packed) path (verl requires use_remove_padding too), sequence parallel generation,
splitting the vision tower's own work, and sp groups spanning hosts.
"""
from __future__ import annotations

import functools

import torch
import torch.distributed as dist

from config import ConfigError

FULL_POSITIONS_KWARG = "ulysses_position_ids"   # the whole packed row's position ids, passed to every attention call
VARLEN_KWARGS = ("cu_seq_lens_q", "cu_seq_lens_k", "max_length_q", "max_length_k")   # flash-attention's varlen keys
GROUP_LIST_FIELDS = ("multi_modal_inputs",)     # the list fields of a batch the workers read (vision.forward_kwargs)

# ----------------------------------------------------------------------------------------------------------------
# Process groups and rows


@functools.lru_cache(maxsize=None)
def device_groups(device_type, sp):
    """(sp group, dp group) of this rank for a dp x sp mesh: the sp group is sp consecutive ranks (one
    data-parallel group's replicas of the same rows), the dp group holds one rank per sp group (the ranks with
    the same position in their group: each row appears in it once). Cached: every worker with the same sp
    shares the groups (every rank must create them in the same order)."""
    from torch.distributed.device_mesh import init_device_mesh
    world = dist.get_world_size()
    mesh = init_device_mesh(device_type, (world // sp, sp), mesh_dim_names=("dp", "sp"))
    return mesh.get_group("sp"), mesh.get_group("dp")


def gather_group_rows(batch, group, device):
    """The rows of every rank of the sp group, concatenated in rank order: each rank brings its own share of the
    batch, and the group works on all of them (verl dispatches one dp group's rows to each of its sp ranks).
    Tensor fields, and of the list fields only what the workers read (GROUP_LIST_FIELDS, pickled across)."""
    gathered, size = {}, dist.get_world_size(group)
    for key, value in batch.items():
        if isinstance(value, torch.Tensor):
            parts = [torch.empty_like(value, device=device) for _ in range(size)]
            dist.all_gather(parts, value.to(device).contiguous(), group=group)
            gathered[key] = torch.cat(parts).to(value.device)
        elif key in GROUP_LIST_FIELDS:
            parts = [None] * size
            dist.all_gather_object(parts, value, group=group)
            gathered[key] = [row for part in parts for row in part]
    return gathered


def own_rows(tensor, group):
    """This rank's share of the group's rows (the inverse of gather_group_rows)."""
    return tensor.chunk(dist.get_world_size(group))[dist.get_rank(group)]


# ----------------------------------------------------------------------------------------------------------------
# Collectives with gradients


def _all_to_all(x, scatter_dim, gather_dim, group):
    """Split x into sp chunks along scatter_dim, send chunk i to rank i, concatenate what arrives along gather_dim."""
    inputs = [chunk.contiguous() for chunk in x.chunk(dist.get_world_size(group), dim=scatter_dim)]
    outputs = [torch.empty_like(inputs[0]) for _ in inputs]
    dist.all_to_all(outputs, inputs, group=group)
    return torch.cat(outputs, dim=gather_dim)


class AllToAll(torch.autograd.Function):
    """All-to-all whose gradient is the reverse all-to-all (the map is a permutation of the group's elements)."""

    @staticmethod
    def forward(ctx, x, scatter_dim, gather_dim, group):
        ctx.dims, ctx.group = (scatter_dim, gather_dim), group
        return _all_to_all(x, scatter_dim, gather_dim, group)

    @staticmethod
    def backward(ctx, grad):
        scatter_dim, gather_dim = ctx.dims
        return _all_to_all(grad, gather_dim, scatter_dim, ctx.group), None, None, None


class GatherRows(torch.autograd.Function):
    """All-gather along dim 0 of counts[i] rows from rank i, concatenated in rank order. Backward keeps this
    rank's rows of the gradient, times sp: every rank of the group computes the same loss from the gathered
    outputs, and FSDP averages gradients over all world ranks (dp x sp), so each rank's part must count sp times
    for the average to be the sum over dp groups (verl's grad_scaler)."""

    @staticmethod
    def forward(ctx, x, counts, group):
        ctx.counts, ctx.group = counts, group
        padded = x.new_zeros((max(counts), *x.shape[1:]))             # all_gather needs equal shapes
        padded[:x.shape[0]] = x
        parts = [torch.empty_like(padded) for _ in counts]
        dist.all_gather(parts, padded, group=group)
        return torch.cat([part[:count] for part, count in zip(parts, counts)])

    @staticmethod
    def backward(ctx, grad):
        rank = dist.get_rank(ctx.group)
        start = sum(ctx.counts[:rank])
        return grad[start:start + ctx.counts[rank]] * len(ctx.counts), None, None


# ----------------------------------------------------------------------------------------------------------------
# Packed rows: split along the sequence, and back


def shard_packed(inputs, kept, group):
    """A packed row's model inputs (input_ids [1, nnz], position_ids [1, nnz] or a vision-language model's
    [4, 1, nnz], ...) and the sorted positions kept for the head [n] -> (this rank's inputs, its kept positions
    within its slice, which of `kept` are its [n] bool, and `gather`: every rank's outputs at its kept positions
    [n_rank, ...] -> [n, ...] in kept's order).

    The row is right-padded to a multiple of sp and each rank keeps a contiguous 1/sp of it; the inputs also
    carry the full (1-D) position ids to the attention all-to-all. A vision-language model gets the whole padded
    row, and its decoder's inputs are sliced the same way once the image features are in place
    (_slice_decoder_inputs). The pad (token 0) continues the last sequence's positions, where verl starts a new
    sequence 0..k-1: causal attention keeps every real token from seeing it either way (and no output of it is
    kept), and a row holding one long sequence then needs no mask."""
    sp, rank = dist.get_world_size(group), dist.get_rank(group)
    ids, positions = inputs["input_ids"], inputs["position_ids"]
    pad = -ids.shape[1] % sp
    if pad:
        ids = torch.cat([ids, ids.new_zeros(1, pad)], 1)
        steps = torch.arange(1, pad + 1, device=positions.device)
        positions = torch.cat([positions, positions[..., -1:] + steps], -1)    # [1, S] or [4, 1, S]
    chunk = ids.shape[1] // sp
    mine = slice(rank * chunk, (rank + 1) * chunk)
    if positions.dim() == 3:               # mrope's rows: the 1-D text positions first (vision.forward_kwargs)
        local = {**inputs, "input_ids": ids, "position_ids": positions, FULL_POSITIONS_KWARG: positions[0]}
    else:
        local = {**inputs, "input_ids": ids[:, mine], "position_ids": positions[:, mine],
                 FULL_POSITIONS_KWARG: positions}
    owner = kept // chunk                                                   # [n] the rank holding each position
    counts = torch.bincount(owner, minlength=sp).tolist()
    return (local, kept[owner == rank] - rank * chunk, owner == rank,
            lambda values: GatherRows.apply(values, counts, group))


def _slice_decoder_inputs(module, args, kwargs, group):
    """Forward pre-hook of a vision-language model's text decoder under sequence parallel: it is called with the
    whole padded row's input embeddings [1, S, H], the image features already at their placeholders, and rope
    positions [4, 1, S]; this rank keeps its contiguous 1/sp of both (the slice shard_packed takes of a text
    model's ids), so everything after the embeddings runs as in a text model."""
    sp, rank = dist.get_world_size(group), dist.get_rank(group)
    embeds, positions = kwargs["inputs_embeds"], kwargs["position_ids"]
    chunk = embeds.shape[1] // sp
    mine = slice(rank * chunk, (rank + 1) * chunk)
    return args, {**kwargs, "inputs_embeds": embeds[:, mine], "position_ids": positions[..., mine]}


# ----------------------------------------------------------------------------------------------------------------
# Attention: registered with transformers' AttentionInterface, wrapping the model's own attention function


def kv_repeats(num_heads, num_kv_heads, sp, key):
    """How many times to repeat each KV head before the all-to-all (verl: when sp > KV heads, each KV head is
    repeated sp/KV times so every rank gets one). Raises ConfigError naming the numbers when the heads cannot be
    split sp ways."""
    if num_heads % sp:
        raise ConfigError(f"'{key}'={sp} must divide the model's {num_heads} attention heads (each rank attends "
                          f"with heads/sp of them); choose a divisor of {num_heads}")
    if num_kv_heads % sp == 0:
        return 1
    if sp % num_kv_heads:
        raise ConfigError(f"'{key}'={sp} and the model's {num_kv_heads} key/value heads: one must divide the other "
                          f"(KV heads are split sp ways, or repeated sp/KV times when fewer)")
    return sp // num_kv_heads


def check_models(cfg):
    """Before any weights load: every model that runs with sp > 1 can be split sp ways (read from its
    config.json alone): its decoder's attention heads and KV heads as kv_repeats requires."""
    from transformers import AutoConfig
    arr = cfg.actor_rollout_ref
    roles = [(f"actor_rollout_ref.{role}.ulysses_sequence_parallel_size", arr[role].ulysses_sequence_parallel_size,
              arr.model) for role in ("actor", "ref")]
    if cfg.algorithm.adv_estimator == "gae":
        roles.append(("critic.ulysses_sequence_parallel_size", cfg.critic.ulysses_sequence_parallel_size,
                      cfg.critic.model))
    for key, sp, model_cfg in roles:
        if (sp or 1) <= 1:
            continue
        config = AutoConfig.from_pretrained(model_cfg.path, trust_remote_code=model_cfg.trust_remote_code)
        _decoder_kv_repeats(config, sp, key)


def _decoder_kv_repeats(config, sp, key):
    """kv_repeats for the heads of a model's text decoder (a vision-language config nests them in text_config)."""
    text = config.get_text_config()
    return kv_repeats(text.num_attention_heads, getattr(text, "num_key_value_heads", None)
                      or text.num_attention_heads, sp, key)


class _LocalHeads:
    """The attention module as the inner attention function sees it on this rank: the same module, with the
    query/KV grouping of the local heads (after KV repetition the local ratio is smaller than the model's)."""

    def __init__(self, module, num_key_value_groups):
        self._module, self.num_key_value_groups = module, num_key_value_groups

    def __getattr__(self, name):
        return getattr(self._module, name)


def _packed_causal_mask(positions, inner):
    """For sdpa: the block-diagonal causal mask over the whole packed row [1, 1, S, S] (a sequence starts where
    the position id is 0), what transformers builds for packed rows, built here because the model only sees this
    rank's slice; None where the row is one sequence (plain causal attention). The other attention functions
    (flash attention, packed-row kernels) read the sequence boundaries from the position ids."""
    if inner != "sdpa" or int((positions == 0).sum()) <= 1:
        return None
    sequence = (positions[0] == 0).cumsum(0)                                           # [S]
    index = torch.arange(sequence.shape[0], device=positions.device)
    allowed = (sequence[:, None] == sequence[None, :]) & (index[:, None] >= index[None, :])   # [S, S]
    return allowed[None, None]


_mask_cache = {}      # one entry: the full positions of the current forward and their mask (every layer reuses it)


def _cached_mask(positions, inner):
    if _mask_cache.get("positions") is not positions or _mask_cache.get("inner") != inner:
        _mask_cache.update(positions=positions, inner=inner, mask=_packed_causal_mask(positions, inner))
    return _mask_cache["mask"]


def ulysses_attention(module, query, key, value, attention_mask, *, inner, group, kv_repeat, **kwargs):
    """query [1, H, S/sp, D], key/value [1, KV, S/sp, D] -> attention output [1, S/sp, H, D], via the whole
    sequence for H/sp heads on this rank. `inner` is the attention function the model was loaded with."""
    from transformers.integrations.sdpa_attention import repeat_kv
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS
    positions = kwargs.pop(FULL_POSITIONS_KWARG)                                          # [1, S]
    key, value = repeat_kv(key, kv_repeat), repeat_kv(value, kv_repeat)                   # [1, KV*rep, S/sp, D]
    query = AllToAll.apply(query, 1, 2, group)                                            # [1, H/sp, S, D]
    key = AllToAll.apply(key, 1, 2, group)                                                # [1, KV*rep/sp, S, D]
    value = AllToAll.apply(value, 1, 2, group)
    local = _LocalHeads(module, query.shape[1] // key.shape[1])
    mask = _cached_mask(positions, inner)
    kwargs["position_ids"] = positions          # flash attention (and packed-row kernels) find sequences here
    for name in VARLEN_KWARGS:                  # boundaries of the caller's unpadded row: derived again from positions
        kwargs.pop(name, None)
    attend = ALL_ATTENTION_FUNCTIONS[inner]
    out, weights = attend(local, query, key, value, mask, **kwargs)                      # [1, S, H/sp, D]
    return AllToAll.apply(out, 1, 2, group), weights                                      # [1, S/sp, H, D]


def enable(model, sp, group, key):
    """Route the attention of `model`'s text decoder through the all-to-all (registered as
    'ulysses_sp<sp>+<inner>' with transformers' AttentionInterface; no model code is forked); a vision-language
    model's vision tower keeps its own attention, and its decoder slices its inputs (_slice_decoder_inputs).
    `model` is the Hugging Face model itself (a LoRA-wrapped one's base model); it then expects inputs from
    shard_packed."""
    from transformers import AttentionInterface
    import vision
    repeat = _decoder_kv_repeats(model.config, sp, key)
    text_decoder = vision.language_model(model)
    inner = text_decoder.config._attn_implementation
    if inner not in AttentionInterface._global_mapping:
        raise ConfigError(f"'{key}'={sp} needs a registered attention function (sdpa, flash_attention_2, ...); the "
                          f"model was loaded with '{inner}'")
    name = f"ulysses_sp{sp}+{inner}"
    # not registered as a mask function: transformers then builds no mask for the local slice (it would be wrong)
    AttentionInterface.register(name, functools.partial(ulysses_attention, inner=inner, group=group,
                                                        kv_repeat=repeat))
    if vision.is_vision_language(model.config):
        text_decoder.set_attn_implementation(name)
        text_decoder.register_forward_pre_hook(functools.partial(_slice_decoder_inputs, group=group),
                                               with_kwargs=True)
    else:
        model.set_attn_implementation(name)
    return model
