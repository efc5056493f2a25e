"""Models: load a Hugging Face model, shard it with FSDP2, and run the training forward pass.

The forward pass is the one place that turns a batch into per-token log-probs (and entropy, or values):
  * padded:  model(input_ids [b, L], attention_mask, position_ids)
  * packed (use_remove_padding): the micro-batch's valid tokens in one row [1, nnz], with the sequence
    boundaries passed as flash-attention's varlen keywords; the attention (attention.py) costs sum(len^2):
    flash-attention varlen on CUDA, torch_npu's fused attention on NPU, sdpa per sequence on CPU.
Either way position L-R-1+t predicts response token t (verl's slice `[:, -R-1:-1]`), and only those positions
reach the head: the final hidden states are cut to them inside the model's forward, and the LM head and
log-softmax (divided by the sampling temperature) run over them in chunks, so the [tokens, vocab] logits of the
prompt are never computed and those of the response never exist at once in a no-grad pass.

Micro-batching: a fixed number of responses (`*_micro_batch_size_per_gpu`), or `use_dynamic_bsz`: sequences
grouped under a token budget, with the same number of micro-batches on every rank (FSDP needs every rank to run
the same collectives).
"""
from __future__ import annotations

import functools
import math
from dataclasses import dataclass

import torch
import torch.distributed as dist

import lora
import losses
import ulysses
import vision
from attention import attention_backend
from batch import all_reduce_sum, balanced_partitions, batch_size_of, take
from config import ConfigError
from losses import entropy_from_logits, logprobs_from_logits

# ----------------------------------------------------------------------------------------------------------------
# Loading and sharding


def load_model(path, kind="causal", dtype=torch.float32, override_config=None, trust_remote_code=False,
               gradient_checkpointing=False, attn_implementation="sdpa"):
    """A Hugging Face model from a local folder: kind 'causal' (actor/ref; a vision-language checkpoint loads with
    its vision tower), 'token_cls' (critic, 1 label), 'seq_cls' (reward model, 1 label). A causal-LM checkpoint
    loaded as token_cls gets a fresh value head (a vision-language one: vision.with_value_head)."""
    from transformers import AutoConfig, AutoModelForSequenceClassification, AutoModelForTokenClassification
    config = AutoConfig.from_pretrained(path, trust_remote_code=trust_remote_code)
    if kind != "causal":
        # transformers' classification heads default to dropout 0.1, live while the critic trains (train mode);
        # verl's fsdp_workers sets classifier_dropout=0 for its critic too. override_config can still set it.
        config.classifier_dropout = 0.0
    for key, value in (override_config or {}).items():
        setattr(config, key, value)
    vl_critic = kind == "token_cls" and vision.is_vision_language(config)    # no token-classification class
    loader = {"causal": vision.causal_lm_class(config), "token_cls": AutoModelForTokenClassification,
              "seq_cls": AutoModelForSequenceClassification}[kind]
    if vl_critic:                       # the VL model's own class; its LM head becomes a value head below
        loader = vision.causal_lm_class(config)
    if kind != "causal":
        is_classifier = any(a.endswith(("ForSequenceClassification", "ForTokenClassification"))
                            for a in (config.architectures or []))
        if is_classifier and config.num_labels != 1:
            raise ConfigError(f"'{path}' has a {config.num_labels}-output classification head; a critic or reward "
                             f"model needs one output (num_labels=1)")
        config.num_labels = 1          # a causal-LM checkpoint gets a fresh one-output head
    model = loader.from_pretrained(path, config=config, dtype=dtype, trust_remote_code=trust_remote_code,
                                   attn_implementation=attn_implementation)
    if vl_critic:
        model = vision.with_value_head(model)
    elif kind != "causal":              # the saved config.json names the class whose weights it holds (as
        model.config.architectures = [type(model).__name__]     # save_pretrained does): hf_model reloads as it
    if gradient_checkpointing:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    return model


def unwrapped(model):
    """The Hugging Face model under peft's LoRA wrapper (the model itself when it is not wrapped)."""
    return model.get_base_model() if hasattr(model, "get_base_model") else model


def decoder(model):
    """The base model of a Hugging Face model (embeddings, blocks, final norm: what the head reads), under peft's
    LoRA wrapper too."""
    model = unwrapped(model)
    return getattr(model, model.base_model_prefix, model)


def decoder_layers(model):
    """The transformer blocks of a Hugging Face model (the units FSDP2 shards one by one), under peft's LoRA
    wrapper too: the decoder layers, and a vision-language model's vision blocks too."""
    model = unwrapped(model)
    layers = getattr(vision.language_model(model), "layers", None)
    if layers is None:
        raise ValueError(f"cannot find the decoder layers of {type(model).__name__} (expected .{model.base_model_prefix}"
                         ".layers); minirl shards per decoder layer")
    return list(layers) + vision.vision_blocks(model)


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


def full_state_dict_items(model, keep=None):
    """Yield (name, full tensor) for every entry of the model's state dict (or those whose name `keep` accepts),
    one tensor at a time. A collective: every rank must iterate all of it. Tied weights (lm_head = embed_tokens)
    appear under both names, so an inference engine that keeps its own copy of the head gets it too."""
    for name, tensor in model.state_dict().items():
        if keep is not None and not keep(name):
            continue
        if hasattr(tensor, "full_tensor"):
            tensor = tensor.full_tensor()
        yield name, tensor.detach()


# ----------------------------------------------------------------------------------------------------------------
# Forward passes

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


def _model_inputs(model, batch, use_remove_padding):
    """The model's keyword inputs (a vision-language model's images and rope positions too: vision.py), and a map
    from flat positions in [b*L] to positions of the model's output (packed: the index among valid tokens;
    padded: the same position)."""
    input_ids, attention_mask, position_ids = batch["input_ids"], batch["attention_mask"], batch["position_ids"]
    if not use_remove_padding:
        return {"input_ids": input_ids, "attention_mask": attention_mask, "position_ids": position_ids,
                **vision.forward_kwargs(unwrapped(model), batch)}, None   # images: + pixels, rope positions [3, b, L]
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
    inputs, to_output = _model_inputs(model, batch, use_remove_padding)
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
        out = model(**inputs, use_cache=False)
    finally:
        handle.remove()
    return result["head"] if head_fn is not None else out.logits[0]


def logprob_head(model, labels, temperature, calc_entropy, kernels, entropy_grad=True):
    """head_fn for forward_kept: hidden [n, H] -> (log-probs [n], entropy [n] or None), fp32, the LM head and
    log-softmax run HEAD_CHUNK_ELEMENTS logits at a time so the [n, V] logits never exist at once (only the
    chunks autograd keeps for backward). entropy_grad=False computes entropy without autograd (a metric)."""
    logprobs_fn, entropy_fn = kernels
    head = model.get_output_embeddings()
    if getattr(model.config, "final_logit_softcapping", None) or getattr(model.config, "logit_scale", None):
        raise NotImplementedError(f"{type(model).__name__} post-processes its logits (soft-capping or scaling); "
                                  f"minirl's log-prob head applies the output embedding alone")

    def run(hidden):
        chunk = max(1, HEAD_CHUNK_ELEMENTS // head.weight.shape[0])
        logps, entropies = [], []
        for h, y in zip(hidden.split(chunk), labels.split(chunk)):
            logits = head(h).float().div_(temperature)                    # [c, V] (in place: mm keeps no output)
            logps.append(logprobs_fn(logits, y))                          # [c]
            if calc_entropy:
                with torch.set_grad_enabled(entropy_grad and torch.is_grad_enabled()):
                    entropies.append(entropy_fn(logits))                  # [c]
        return torch.cat(logps), (torch.cat(entropies) if calc_entropy else None)

    return run


def token_logprobs(model, batch, temperature=1.0, use_remove_padding=True, calc_entropy=False, kernels=None,
                   entropy_grad=True, sp_group=None):
    """Per-token log-probs of the response (and entropy) under `model`.

    batch: input_ids/attention_mask/position_ids [b, P+R], responses [b, R].
    Returns (log_probs [b, R], entropy [b, R] or None), fp32, zero where the response is padding. Only the
    positions that predict a response token reach the LM head. `kernels`: (logprobs_fn, entropy_fn), e.g.
    torch.compile'd. sp_group: Ulysses sequence parallel (ulysses.py); each rank runs the head on the kept
    positions of its slice of the packed row, and the results are gathered over the group.
    """
    input_ids, attention_mask = batch["input_ids"], batch["attention_mask"]
    shape = (input_ids.shape, batch["responses"].shape[1])
    keep = response_predicting_positions(attention_mask, shape[1])        # [n] flat positions in [b*L]
    labels = input_ids.reshape(-1)[keep + 1]                              # [n] the response token each predicts
    inputs, kept, mine, gather = _kept_inputs(model, batch, keep, use_remove_padding, sp_group)
    head_fn = logprob_head(model, labels[mine], temperature, calc_entropy,
                           kernels or (logprobs_from_logits, entropy_from_logits), entropy_grad)
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


# ----------------------------------------------------------------------------------------------------------------
# Workers: an FSDP2 model on this rank with its micro-batching; trained ones add AdamW, the LR schedule, clipping


ENTROPY_CHUNK_ROWS = 2048


def lr_lambda(optim_cfg, total_steps):
    """verl's schedule: linear warmup, then constant or cosine (down to min_lr_ratio)."""
    warmup = (optim_cfg.lr_warmup_steps if optim_cfg.lr_warmup_steps >= 0
              else int(optim_cfg.lr_warmup_steps_ratio * total_steps))
    min_ratio, cycles = optim_cfg.min_lr_ratio, optim_cfg.num_cycles

    def constant(step):
        return min(1.0, step / warmup) if warmup > 0 else 1.0

    def cosine(step):
        if step < warmup:
            return min_ratio + (1 - min_ratio) * step / max(1, warmup)
        progress = (step - warmup) / max(1, total_steps - warmup)
        return max(min_ratio, (1 - min_ratio) * 0.5 * (1 + math.cos(math.pi * cycles * 2 * progress)) + min_ratio)

    return constant if optim_cfg.warmup_style == "constant" else cosine


@dataclass(frozen=True)
class MiniBatchPlan:
    """How an update walks this rank's rows: `epochs` passes x mini-batches of `mini_batch_rows` rows (one
    optimizer step each) x micro-batches of `micro_batch_rows` rows, or under `max_tokens` tokens when `dynamic`."""
    epochs: int
    mini_batch_rows: int
    micro_batch_rows: int
    dynamic: bool
    max_tokens: int
    grad_clip: float
    dp_size: int

    @classmethod
    def of(cls, section, rollout_n, dp_size):
        """From an actor or critic config section (verl's keys): ppo_mini_batch_size prompts x n responses / dp."""
        return cls(section.ppo_epochs, section.ppo_mini_batch_size * rollout_n // dp_size,
                   section.ppo_micro_batch_size_per_gpu, section.use_dynamic_bsz, section.ppo_max_token_len_per_gpu,
                   section.grad_clip, dp_size)


class Worker:
    """An FSDP2-sharded model on this rank. `optim_cfg` makes it trainable (AdamW + verl's LR schedule);
    without it the model is frozen in eval mode.

    sp > 1 (Ulysses, ulysses.py; `sp_key` names its config key): each group of sp consecutive ranks works on the
    rows all its ranks brought (`group_rows`), each rank on a slice of every packed row; token budgets scale by
    sp and global counts are summed over the dp group (each row once). FSDP still shards over all ranks."""

    skipped_steps = 0            # optimizer steps skipped for a non-finite loss or gradient norm (checkpointed)

    def __init__(self, model, device, use_remove_padding, optim_cfg=None, total_steps=1, sp=1, sp_key=None):
        self.device, self.use_remove_padding, self.sp = device, use_remove_padding, sp
        self.sp_group = self.dp_group = None
        if sp > 1:
            if vision.is_vision_language(model.config):
                raise ConfigError(f"'{sp_key}'={sp}: Ulysses sequence parallel is built for text models; a "
                                  f"vision-language model's image positions are not split yet: set it to 1")
            self.sp_group, self.dp_group = ulysses.device_groups(device.type, sp)
            ulysses.enable(model, sp, self.sp_group, sp_key)
        model.to(device)
        self.model = shard_fsdp2(model, mixed_precision=device.type != "cpu")
        if optim_cfg is None:
            self.model.eval()
            for p in self.model.parameters():
                p.requires_grad_(False)
            return
        trainable = [p for p in self.model.parameters() if p.requires_grad]     # with LoRA: the adapter only
        self.optimizer = torch.optim.AdamW(trainable, lr=optim_cfg.lr, betas=tuple(optim_cfg.betas),
                                           weight_decay=optim_cfg.weight_decay)
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(self.optimizer, lr_lambda(optim_cfg, total_steps))

    def to_device(self, batch):
        return {k: (v.to(self.device) if isinstance(v, torch.Tensor) else v) for k, v in batch.items()}

    def group_rows(self, batch):
        """The rows this rank works on: its own, or with sp > 1 those of its whole sp group (tensors only)."""
        return batch if self.sp_group is None else ulysses.gather_group_rows(batch, self.sp_group, self.device)

    def own_rows(self, tensor):
        """This rank's rows of a result over group_rows."""
        return tensor if self.sp_group is None else ulysses.own_rows(tensor, self.sp_group)

    def row_numbers(self, b):
        """The numbers of this rank's b rows among the rows group_rows gives [b]."""
        return torch.arange(b) + (0 if self.sp_group is None else dist.get_rank(self.sp_group) * b)

    def micro_batches(self, batch, micro_size, dynamic, max_tokens):
        """Row indices of each micro-batch: fixed size, or under a token budget (use_dynamic_bsz; the budget is
        per device, so a micro-batch split over sp devices may hold sp times as many tokens, as in verl)."""
        if dynamic:
            return dynamic_micro_batches(batch["attention_mask"].sum(-1).tolist(), max_tokens * self.sp,
                                         device=self.device)
        return fixed_micro_batches(batch["attention_mask"].shape[0], micro_size)

    def global_counts(self, mini):
        """losses.agg_loss's global counts for a mini-batch: its tokens and non-empty sequences on ALL ranks."""
        tokens, seqs = losses.global_counts(mini["response_mask"])
        tokens, seqs = all_reduce_sum([float(tokens), float(seqs)], self.device, self.dp_group)
        return dict(global_tokens=tokens, global_seqs=seqs, norm_len=mini["responses"].shape[1])

    def optimize(self, batch, plan, loss_fn, prefix):
        """verl's update_policy / update_critic loop, shared by the actor and the critic: plan.epochs passes x
        mini-batches of this rank's rows (one optimizer step each) x micro-batches.

        loss_fn(micro, counts) -> (loss, metrics) is losses.actor_loss or losses.critic_loss on one micro-batch,
        with `counts` the mini-batch's global counts: the loss is the micro-batch's share of the mini-batch loss,
        backpropagated x dp (the global normalisation, explained once above losses.agg_loss). Metrics named in
        losses.LOSS_SHARES are summed over micro-batches and ranks (the mini-batch's value); the others are
        averaged. A non-finite loss or gradient norm skips the optimizer step (clip_and_step). The LR scheduler
        steps once per call. Returns `prefix`-named metrics averaged over the optimizer steps, with grad_norm, lr.
        With sp > 1 the rows are the sp group's, dp is world/sp, sums run over the dp group (each row once), and
        ulysses.GatherRows scales the gradient by sp (FSDP averages over all dp x sp ranks)."""
        batch = self.group_rows(batch)
        metrics = {}

        def record(name, value):
            metrics.setdefault(prefix + name, []).append(float(value))

        self.model.train()          # transformers recomputes activations (gradient checkpointing) in train mode only
        try:
            self._optimize_epochs(batch, plan, loss_fn, record)
        finally:
            self.model.eval()       # log-prob passes run in eval mode, as verl's compute_log_prob
        record("lr", self.scheduler.get_last_lr()[0])
        self.scheduler.step()
        return {name: float(sum(values) / len(values)) for name, values in metrics.items()}

    def _optimize_epochs(self, batch, plan, loss_fn, record):
        """optimize's loop: epochs x mini-batches (one optimizer step each) x micro-batches."""
        size = batch_size_of(batch)
        for _ in range(plan.epochs):
            for start in range(0, size, plan.mini_batch_rows):
                mini = take(batch, list(range(start, min(start + plan.mini_batch_rows, size))))
                counts = self.global_counts(mini)
                self.optimizer.zero_grad(set_to_none=True)
                shares = {}
                for index in self.micro_batches(mini, plan.micro_batch_rows, plan.dynamic, plan.max_tokens):
                    loss, micro_metrics = loss_fn(self.to_device(take(mini, index)), counts)
                    (loss * plan.dp_size).backward()          # FSDP averages gradients over the dp ranks
                    for name, value in micro_metrics.items():
                        if name in losses.LOSS_SHARES:
                            shares[name] = shares.get(name, 0.0) + value.item()
                        else:
                            record(name, value)
                totals = dict(zip(shares, all_reduce_sum(list(shares.values()), self.device, self.dp_group)))
                for name, value in totals.items():
                    record(name, value)
                record("grad_norm", self.clip_and_step(plan.grad_clip, loss=sum(totals.values())))

    def clip_and_step(self, max_norm, loss=0.0):
        """Clip the gradient norm and step. A non-finite gradient norm or `loss` (the same on every rank: both
        are all-reduced) skips the optimizer step instead, counted in skipped_steps."""
        norm = torch.nn.utils.clip_grad_norm_(self.model.parameters(), max_norm)
        norm = float(norm.full_tensor() if hasattr(norm, "full_tensor") else norm)
        if math.isfinite(norm) and math.isfinite(loss):
            self.optimizer.step()
        else:
            self.optimizer.zero_grad(set_to_none=True)
            self.skipped_steps += 1
        return norm

    def checkpoint_counters(self):
        """What a checkpoint keeps besides the model, optimizer and LR scheduler (checkpoint.py)."""
        return {"skipped_steps": self.skipped_steps}

    def load_checkpoint_counters(self, counters):
        self.skipped_steps = counters["skipped_steps"]


class Policy(Worker):
    """A causal LM: the actor (trainable, with optimizer) or the reference (frozen). With model.lora_rank > 0 the
    actor is the base model wrapped with peft LoRA adapters (lora.py): only the adapters train."""

    def __init__(self, cfg, device, trainable, total_steps=1):
        arr = cfg.actor_rollout_ref
        self.lora = trainable and lora.enabled(arr.model)
        if self.lora:
            lora.check_target_modules(arr.model)             # before loading any weights
        model = load_model(arr.model.path, override_config=arr.model.override_config,
                           trust_remote_code=arr.model.trust_remote_code,
                           gradient_checkpointing=trainable and arr.model.enable_gradient_checkpointing,
                           attn_implementation=attention_backend(device.type, arr.model.use_remove_padding))
        if self.lora:
            model = lora.wrap(model, arr.model)
            lora.log_parameter_counts(model, arr.model)
        role = "actor" if trainable else "ref"
        super().__init__(model, device, arr.model.use_remove_padding, arr.actor.optim if trainable else None,
                         total_steps, sp=arr[role].ulysses_sequence_parallel_size,
                         sp_key=f"actor_rollout_ref.{role}.ulysses_sequence_parallel_size")
        self.cfg = cfg
        entropy = entropy_from_logits
        if arr.actor.entropy_from_logits_with_chunking:     # verl's chunk: 2048 rows at a time, in fp32
            entropy = functools.partial(entropy_from_logits, chunk_size=ENTROPY_CHUNK_ROWS)
        self.kernels = (logprobs_from_logits, entropy)
        if arr.actor.use_torch_compile:         # verl compiles the log-prob/entropy kernels, not the model
            self.kernels = tuple(torch.compile(kernel) for kernel in self.kernels)

    def forward(self, micro, temperature, calc_entropy=False, entropy_grad=True):
        return token_logprobs(self.model, micro, temperature=temperature, use_remove_padding=self.use_remove_padding,
                              calc_entropy=calc_entropy, kernels=self.kernels, entropy_grad=entropy_grad,
                              sp_group=self.sp_group)

    def adapter(self):
        """The LoRA adapter's full tensors in peft's format (lora.Adapter). A collective."""
        return lora.adapter_from_full_state(self.model, dict(full_state_dict_items(self.model, lora.is_adapter_name)))

    def base_weights(self):
        """(Hugging Face name, full tensor) of the frozen base model under the LoRA wrapper: adapter tensors
        dropped, names as in model.path. A collective."""
        for name, tensor in full_state_dict_items(self.model, keep=lambda n: not lora.is_adapter_name(n)):
            yield lora.base_weight_name(name), tensor

    def compute_log_prob(self, batch, micro_size, dynamic, max_tokens, temperature, calc_entropy=False):
        """No-grad log-probs [b, R] (and entropy [b, R]) of this rank's rows in micro-batches; rows keep their
        order."""
        batch = self.group_rows(batch)
        b, response_len = batch["responses"].shape
        logp = torch.zeros(b, response_len)
        entropy = torch.zeros(b, response_len) if calc_entropy else None
        with torch.no_grad():
            for index in self.micro_batches(batch, micro_size, dynamic, max_tokens):
                lp, ent = self.forward(self.to_device(take(batch, index)), temperature, calc_entropy)
                logp[index] = lp.cpu()
                if calc_entropy:
                    entropy[index] = ent.cpu()
        return self.own_rows(logp), (self.own_rows(entropy) if calc_entropy else None)

    def update(self, batch, dp_size, on_policy=False):
        """verl's update_policy: Worker.optimize with losses.actor_loss on each micro-batch.

        on_policy (the trainer's minirl.update_is_on_policy: one epoch, one mini-batch): the batch has no
        old_log_probs; each micro-batch's own log-probs, detached, stand in for them (the weights that sampled are
        the weights of this forward), and they and the entropy are kept in self.on_policy_outputs [b, R] each."""
        arr = self.cfg.actor_rollout_ref
        actor = arr.actor
        if on_policy:          # row numbers ride along with the rows, so each micro-batch knows where it writes
            b, response_len = batch["responses"].shape
            batch = {**batch, "row": self.row_numbers(b)}
            self.on_policy_outputs = (torch.zeros(b * self.sp, response_len), torch.zeros(b * self.sp, response_len))

        def loss_fn(micro, counts):
            logp, entropy = self.forward(micro, arr.rollout.temperature,
                                         calc_entropy=actor.entropy_coeff != 0 or on_policy,
                                         entropy_grad=actor.entropy_coeff != 0)
            if on_policy:      # this forward is the sampling policy's: keep what it gives
                rows = micro["row"].cpu()
                self.on_policy_outputs[0][rows] = logp.detach().cpu()
                self.on_policy_outputs[1][rows] = entropy.detach().cpu()
            return losses.actor_loss(
                logp, logp.detach() if on_policy else micro["old_log_probs"], micro.get("ref_log_prob"),
                micro["advantages"], entropy, micro["response_mask"], clip_ratio_low=actor.clip_ratio_low,
                clip_ratio_high=actor.clip_ratio_high, clip_ratio_c=actor.clip_ratio_c,
                entropy_coeff=actor.entropy_coeff, use_kl_loss=actor.use_kl_loss, kl_loss_coef=actor.kl_loss_coef,
                kl_loss_type=actor.kl_loss_type, loss_agg_mode=actor.loss_agg_mode, **counts)

        metrics = self.optimize(batch, MiniBatchPlan.of(actor, arr.rollout.n, dp_size), loss_fn, "actor/")
        if on_policy:
            self.on_policy_outputs = tuple(self.own_rows(t) for t in self.on_policy_outputs)
        if actor.use_kl_loss:
            metrics["actor/kl_coef"] = actor.kl_loss_coef
        return metrics


class AdapterDisabled:
    """The reference policy of a LoRA actor: the actor's own module with its adapter switched off, i.e. the base
    model, without a second copy of its weights (verl's ref under LoRA)."""

    def __init__(self, actor):
        self.actor = actor

    def compute_log_prob(self, *args, **kwargs):
        with self.actor.model.disable_adapter():
            return self.actor.compute_log_prob(*args, **kwargs)


class Critic(Worker):
    """The PPO critic: a token-level value model (one-output head on the backbone), trained on the value loss."""

    def __init__(self, cfg, device, total_steps, tokenizer_len):
        critic = cfg.critic
        model = load_model(critic.model.path, kind="token_cls", override_config=critic.model.override_config,
                           trust_remote_code=critic.model.trust_remote_code,
                           gradient_checkpointing=critic.model.enable_gradient_checkpointing,
                           attn_implementation=attention_backend(device.type, critic.model.use_remove_padding))
        check_fits(model, tokenizer_len, "critic.model.path")
        super().__init__(model, device, critic.model.use_remove_padding, critic.optim, total_steps,
                         sp=critic.ulysses_sequence_parallel_size, sp_key="critic.ulysses_sequence_parallel_size")
        self.cfg = critic

    def compute_values(self, batch, micro_size):
        """No-grad values [b, R] of this rank's rows, zero outside the response mask (verl's compute_values)."""
        batch = self.group_rows(batch)
        b, response_len = batch["responses"].shape
        values = torch.zeros(b, response_len)
        with torch.no_grad():
            for index in self.micro_batches(batch, micro_size, self.cfg.use_dynamic_bsz,
                                            self.cfg.forward_max_token_len_per_gpu):
                values[index] = token_values(self.model, self.to_device(take(batch, index)),
                                             self.use_remove_padding, self.sp_group).cpu()
        return self.own_rows(values * batch["response_mask"])

    def update(self, batch, dp_size):
        """verl's update_critic: Worker.optimize with losses.critic_loss on each micro-batch."""
        critic = self.cfg

        def loss_fn(micro, counts):
            vpreds = token_values(self.model, micro, self.use_remove_padding, self.sp_group)
            return losses.critic_loss(vpreds, micro["values"], micro["returns"], micro["response_mask"],
                                      cliprange_value=critic.cliprange_value, loss_agg_mode=critic.loss_agg_mode,
                                      **counts)

        return self.optimize(batch, MiniBatchPlan.of(critic, critic.rollout_n, dp_size), loss_fn, "critic/")


class RewardModel(Worker):
    """A frozen reward model: one score per response, read at its last token. When the RM's tokenizer or chat
    template differs from the actor's, each conversation (the raw prompt messages + the response text) is
    re-templated and re-tokenised with the RM's own."""

    def __init__(self, cfg, device, actor_tokenizer):
        from transformers import AutoTokenizer
        rm = cfg.reward_model
        vision.check_reward_model_is_text(rm.model.path)   # validation checked local paths; this, hdfs copies
        model = load_model(rm.model.path, kind="token_cls", trust_remote_code=rm.model.trust_remote_code,
                           attn_implementation=attention_backend(device.type, rm.model.use_remove_padding))
        self.tokenizer = AutoTokenizer.from_pretrained(rm.model.path, trust_remote_code=rm.model.trust_remote_code)
        self.retokenize = (self.tokenizer.get_vocab() != actor_tokenizer.get_vocab()
                           or self.tokenizer.chat_template != actor_tokenizer.chat_template)
        check_fits(model, len(self.tokenizer if self.retokenize else actor_tokenizer), "reward_model.model.path")
        super().__init__(model, device, rm.model.use_remove_padding)
        self.cfg, self.actor_tokenizer = rm, actor_tokenizer

    def rm_inputs(self, batch):
        """The RM's view of each row: the actor's tokens, or the conversation re-tokenised with the RM's template
        (right-padded; the score is read at the last valid token either way)."""
        if not self.retokenize:
            return batch
        texts = self.actor_tokenizer.batch_decode(
            [r[m.bool()].tolist() for r, m in zip(batch["responses"], batch["response_mask"])], skip_special_tokens=True)
        conversations = [list(prompt) + [{"role": "assistant", "content": text}]
                         for prompt, text in zip(batch["raw_prompt"], texts)]
        texts = [self.tokenizer.apply_chat_template(c, tokenize=False, add_generation_prompt=False)
                 for c in conversations]
        ids = [self.tokenizer.encode(text, add_special_tokens=False) for text in texts]
        max_len = self.cfg.max_length or max(len(x) for x in ids)
        ids = [x[-max_len:] for x in ids]                                # keep the end: the score is read there
        width = max(len(x) for x in ids)
        input_ids = torch.full((len(ids), width), self.tokenizer.pad_token_id or 0, dtype=torch.long)
        attention_mask = torch.zeros_like(input_ids)
        for i, x in enumerate(ids):
            input_ids[i, :len(x)] = torch.tensor(x)
            attention_mask[i, :len(x)] = 1
        position_ids = torch.clamp(attention_mask.cumsum(-1) - 1, min=0)
        return {"input_ids": input_ids, "attention_mask": attention_mask, "position_ids": position_ids}

    def score(self, batch, micro_size):
        """Scores [b] for this rank's rows, micro-batched."""
        inputs = self.rm_inputs(batch)
        scores = torch.zeros(inputs["input_ids"].shape[0])
        with torch.no_grad():
            for index in self.micro_batches(inputs, micro_size, self.cfg.use_dynamic_bsz,
                                            self.cfg.forward_max_token_len_per_gpu):
                micro = self.to_device(take(inputs, index))
                scores[index] = last_token_scores(self.model, micro, self.use_remove_padding).cpu()
        return scores


def check_fits(model, tokenizer_len, key):
    """A critic or reward model must embed every token id it will be fed."""
    vocab = model.get_input_embeddings().weight.shape[0]
    if vocab < tokenizer_len:
        raise ConfigError(f"'{key}': the model's vocabulary has {vocab} rows but the tokenizer it is fed has "
                         f"{tokenizer_len} tokens; use a model trained with the same tokenizer")
