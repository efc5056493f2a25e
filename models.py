"""Models: load a Hugging Face model, shard it with FSDP2, and run the training forward pass.

The forward pass is the one place that turns a batch into per-token log-probs (and entropy, or values):
  * padded:  model(input_ids [b, L], attention_mask, position_ids) -> logits [b, L, V]
  * packed (use_remove_padding): the micro-batch's valid tokens in one row [1, nnz]; position ids restart at 0 for
    each sequence, which transformers reads as sequence boundaries (block-diagonal attention: varlen flash
    attention where available, a packed-sequence mask on sdpa/eager); the result is scattered back to [b, L].
Either way logits are divided by the sampling temperature and the response slice [:, P-1 : P+R-1] predicts the
response tokens [:, P : P+R] (verl's `[:, -R-1:-1]`).

Micro-batching: a fixed number of responses (`*_micro_batch_size_per_gpu`), or `use_dynamic_bsz`: sequences
grouped under a token budget, with the same number of micro-batches on every rank (FSDP needs every rank to run
the same collectives).
"""
from __future__ import annotations

import heapq
import math

import torch
import torch.distributed as dist

from losses import entropy_from_logits, logprobs_from_logits

# ----------------------------------------------------------------------------------------------------------------
# Loading and sharding


def attention_backend(device_type, use_remove_padding):
    """flash_attention_2 (varlen kernels: packed sequences cost nothing extra) where installed on CUDA, else sdpa.
    On sdpa, transformers turns restarting position ids into a block-diagonal mask over the packed row, which is
    quadratic in the packed length: on CPU, packing long micro-batches is slower than padding (bench/step.py)."""
    if device_type == "cuda" and use_remove_padding:
        try:
            import flash_attn  # noqa: F401
            return "flash_attention_2"
        except ImportError:
            pass
    return "sdpa"


def load_model(path, kind="causal", dtype=torch.float32, override_config=None, trust_remote_code=False,
               gradient_checkpointing=False, attn_implementation="sdpa"):
    """A Hugging Face model from a local folder: kind 'causal' (actor/ref), 'token_cls' (critic, 1 label),
    'seq_cls' (reward model, 1 label). A causal-LM checkpoint loaded as token_cls gets a fresh value head."""
    from transformers import (AutoConfig, AutoModelForCausalLM, AutoModelForSequenceClassification,
                              AutoModelForTokenClassification)
    config = AutoConfig.from_pretrained(path, trust_remote_code=trust_remote_code)
    for key, value in (override_config or {}).items():
        setattr(config, key, value)
    loader = {"causal": AutoModelForCausalLM, "token_cls": AutoModelForTokenClassification,
              "seq_cls": AutoModelForSequenceClassification}[kind]
    if kind != "causal":
        config.num_labels = 1
    model = loader.from_pretrained(path, config=config, dtype=dtype, trust_remote_code=trust_remote_code,
                                   attn_implementation=attn_implementation)
    if gradient_checkpointing:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    return model


def decoder_layers(model):
    """The transformer blocks of a Hugging Face model (the units FSDP2 shards one by one)."""
    base = getattr(model, model.base_model_prefix, model)
    layers = getattr(base, "layers", None)
    if layers is None:
        raise ValueError(f"cannot find the decoder layers of {type(model).__name__} (expected .{model.base_model_prefix}"
                         ".layers); minirl shards per decoder layer")
    return list(layers)


def shard_fsdp2(model, mixed_precision=False):
    """FSDP2: fully_shard each decoder layer, then the root. Parameters stay fp32 (master weights); with
    mixed_precision the forward/backward run in bf16 and gradients are reduced in fp32."""
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
    policy = (MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32) if mixed_precision
              else MixedPrecisionPolicy())
    for layer in decoder_layers(model):
        fully_shard(layer, mp_policy=policy)
    fully_shard(model, mp_policy=policy)
    return model


def full_state_dict_items(model):
    """Yield (name, full tensor) for every entry of the model's state dict, one tensor at a time. A collective:
    every rank must iterate all of it. Tied weights (lm_head = embed_tokens) appear under both names, so an
    inference engine that keeps its own copy of the head gets it too."""
    for name, tensor in model.state_dict().items():
        if hasattr(tensor, "full_tensor"):
            tensor = tensor.full_tensor()
        yield name, tensor.detach()


# ----------------------------------------------------------------------------------------------------------------
# Forward passes


def _pack(input_ids, attention_mask, position_ids):
    """Valid tokens of every row, concatenated: ids/pos [1, nnz], plus their flat indices in [b*L]."""
    flat_valid = attention_mask.reshape(-1).bool()                       # [b*L]
    indices = flat_valid.nonzero(as_tuple=True)[0]                       # [nnz]
    ids = input_ids.reshape(-1)[indices].unsqueeze(0)                    # [1, nnz]
    pos = position_ids.reshape(-1)[indices].unsqueeze(0)                 # [1, nnz]
    return ids, pos, indices


def token_logprobs(model, batch, temperature=1.0, use_remove_padding=True, calc_entropy=False, kernels=None):
    """Per-token log-probs of the response (and entropy) under `model`.

    batch: input_ids/attention_mask/position_ids [b, P+R], responses [b, R].
    Returns (log_probs [b, R], entropy [b, R] or None), fp32. Positions outside the attention mask hold values
    that the response mask zeroes out downstream. `kernels`: (logprobs_fn, entropy_fn), e.g. torch.compile'd.
    """
    logprobs_fn, entropy_fn = kernels or (logprobs_from_logits, entropy_from_logits)
    input_ids, attention_mask, position_ids = batch["input_ids"], batch["attention_mask"], batch["position_ids"]
    b, length = input_ids.shape
    response_len = batch["responses"].shape[1]
    # labels[t] = the token at t+1: what position t predicts
    labels = torch.roll(input_ids, shifts=-1, dims=1)                    # [b, L]
    if use_remove_padding:
        ids, pos, indices = _pack(input_ids, attention_mask, position_ids)
        logits = model(input_ids=ids, position_ids=pos, use_cache=False).logits[0]   # [nnz, V]
        logits = logits.float() / temperature
        packed_labels = labels.reshape(-1)[indices]                      # [nnz]
        logp_flat = logits.new_zeros(b * length)
        logp_flat[indices] = logprobs_fn(logits, packed_labels)
        logp = logp_flat.view(b, length)
        entropy = None
        if calc_entropy:
            ent_flat = logits.new_zeros(b * length)
            ent_flat[indices] = entropy_fn(logits)
            entropy = ent_flat.view(b, length)
    else:
        logits = model(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids,
                       use_cache=False).logits                          # [b, L, V]
        logits = logits.float() / temperature
        logp = logprobs_fn(logits, labels)                                # [b, L]
        entropy = entropy_fn(logits) if calc_entropy else None
    response_slice = slice(length - response_len - 1, length - 1)
    return logp[:, response_slice], (entropy[:, response_slice] if entropy is not None else None)


def token_values(critic, batch, use_remove_padding=True):
    """Values [b, R] from a token-classification critic (one output per token), verl's slice [:, -R-1:-1]."""
    input_ids, attention_mask, position_ids = batch["input_ids"], batch["attention_mask"], batch["position_ids"]
    b, length = input_ids.shape
    response_len = batch["responses"].shape[1]
    if use_remove_padding:
        ids, pos, indices = _pack(input_ids, attention_mask, position_ids)
        out = critic(input_ids=ids, position_ids=pos, use_cache=False).logits[0, :, 0].float()   # [nnz]
        values = out.new_zeros(b * length)
        values[indices] = out
        values = values.view(b, length)
    else:
        values = critic(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids,
                        use_cache=False).logits[..., 0].float()          # [b, L]
    return values[:, length - response_len - 1:length - 1]


# ----------------------------------------------------------------------------------------------------------------
# Micro-batches


def fixed_micro_batches(size, micro_batch_size):
    """[[0..m-1], [m..2m-1], ...] over `size` rows."""
    return [list(range(start, min(start + micro_batch_size, size))) for start in range(0, size, micro_batch_size)]


def balanced_partitions(lengths, k, equal_size=False):
    """Split row indices into k groups with near-equal total length (longest-first greedy: each row goes to the
    lightest group; with equal_size, only to groups that still have room). Groups keep ascending row order.
    verl uses Karmarkar-Karp here; the partition differs, the loss does not (it is normalised over the whole
    mini-batch)."""
    n = len(lengths)
    capacity = math.ceil(n / k) if equal_size else n
    heap = [(0, g) for g in range(k)]
    groups = [[] for _ in range(k)]
    order = sorted(range(n), key=lambda i: (-lengths[i], i))
    for i in order:
        skipped = []
        total, g = heapq.heappop(heap)
        while len(groups[g]) >= capacity:
            skipped.append((total, g))
            total, g = heapq.heappop(heap)
        groups[g].append(i)
        heapq.heappush(heap, (total + lengths[i], g))
        for item in skipped:
            heapq.heappush(heap, item)
    return [sorted(group) for group in groups]


def dynamic_micro_batches(lengths, max_tokens, device="cpu"):
    """Partition rows so each micro-batch holds at most `max_tokens` tokens, using as many micro-batches as the
    rank that needs most (all-reduced, so every rank runs the same number of forward passes). Every rank holds
    the same number of rows, so no micro-batch is empty."""
    if max(lengths, default=0) > max_tokens:
        raise ValueError(f"a sequence of {max(lengths)} tokens exceeds the token budget {max_tokens} "
                         f"(ppo_max_token_len_per_gpu / log_prob_max_token_len_per_gpu): raise it to at least "
                         f"max_prompt_length + max_response_length")
    k = max(1, min(len(lengths), math.ceil(sum(lengths) / max_tokens)))
    while any(sum(lengths[i] for i in part) > max_tokens for part in balanced_partitions(lengths, k)):
        k += 1
    if dist.is_initialized():
        count = torch.tensor([k], dtype=torch.long, device=device)
        dist.all_reduce(count, op=dist.ReduceOp.MAX)
        k = int(count.item())
    return balanced_partitions(lengths, k)
