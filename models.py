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

import functools
import heapq
import math

import torch
import torch.distributed as dist

import ulysses
from config import ConfigError
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
        is_classifier = any(a.endswith(("ForSequenceClassification", "ForTokenClassification"))
                            for a in (config.architectures or []))
        if is_classifier and config.num_labels != 1:
            raise ConfigError(f"'{path}' has a {config.num_labels}-output classification head; a critic or reward "
                             f"model needs one output (num_labels=1)")
        config.num_labels = 1          # a causal-LM checkpoint gets a fresh one-output head
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


def token_logprobs(model, batch, temperature=1.0, use_remove_padding=True, calc_entropy=False, kernels=None,
                   sp_group=None):
    """Per-token log-probs of the response (and entropy) under `model`.

    batch: input_ids/attention_mask/position_ids [b, P+R], responses [b, R].
    Returns (log_probs [b, R], entropy [b, R] or None), fp32. Positions outside the attention mask hold values
    that the response mask zeroes out downstream. `kernels`: (logprobs_fn, entropy_fn), e.g. torch.compile'd.
    sp_group (packed only): Ulysses sequence parallel; this rank runs its slice of the packed row and the
    per-token results are gathered over the group (ulysses.py).
    """
    logprobs_fn, entropy_fn = kernels or (logprobs_from_logits, entropy_from_logits)
    input_ids, attention_mask, position_ids = batch["input_ids"], batch["attention_mask"], batch["position_ids"]
    b, length = input_ids.shape
    response_len = batch["responses"].shape[1]
    # labels[t] = the token at t+1: what position t predicts
    labels = torch.roll(input_ids, shifts=-1, dims=1)                    # [b, L]
    if use_remove_padding:
        ids, pos, indices = _pack(input_ids, attention_mask, position_ids)
        packed_labels = labels.reshape(-1)[indices].unsqueeze(0)        # [1, nnz]
        ids, pos, packed_labels, sp_kwargs = _sequence_slice(ids, pos, packed_labels, sp_group)
        logits = model(input_ids=ids, position_ids=pos, use_cache=False, **sp_kwargs).logits[0]   # [nnz(/sp), V]
        logits = logits.float() / temperature
        logp_flat = logits.new_zeros(b * length)
        logp_flat[indices] = _sequence_gather(logprobs_fn(logits, packed_labels[0]), len(indices), sp_group)
        logp = logp_flat.view(b, length)
        entropy = None
        if calc_entropy:
            ent_flat = logits.new_zeros(b * length)
            ent_flat[indices] = _sequence_gather(entropy_fn(logits), len(indices), sp_group)
            entropy = ent_flat.view(b, length)
    else:
        logits = model(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids,
                       use_cache=False).logits                          # [b, L, V]
        logits = logits.float() / temperature
        logp = logprobs_fn(logits, labels)                                # [b, L]
        entropy = entropy_fn(logits) if calc_entropy else None
    response_slice = slice(length - response_len - 1, length - 1)
    return logp[:, response_slice], (entropy[:, response_slice] if entropy is not None else None)


def _sequence_slice(ids, pos, labels, sp_group):
    """Ulysses: this rank's slice of the packed row (ulysses.slice_packed), and the model keyword arguments for
    it; without sequence parallelism the row as it is."""
    if sp_group is None:
        return ids, pos, labels, {}
    return ulysses.slice_packed(ids, pos, labels, sp_group)


def _sequence_gather(values, nnz, sp_group):
    """Per-token results of this rank's slice -> the whole packed row's [nnz] (identity without sp)."""
    return values if sp_group is None else ulysses.gather_packed(values, nnz, sp_group)


def head_outputs(model, batch, use_remove_padding=True, sp_group=None):
    """The one-output head of a critic or reward model (token classification, 1 label) at every position:
    [b, L] fp32, packed or padded like token_logprobs (and sequence parallel like it)."""
    input_ids, attention_mask, position_ids = batch["input_ids"], batch["attention_mask"], batch["position_ids"]
    b, length = input_ids.shape
    if not use_remove_padding:
        return model(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids,
                     use_cache=False).logits[..., 0].float()            # [b, L]
    ids, pos, indices = _pack(input_ids, attention_mask, position_ids)
    ids, pos, _, sp_kwargs = _sequence_slice(ids, pos, ids, sp_group)
    out = model(input_ids=ids, position_ids=pos, use_cache=False, **sp_kwargs).logits[0, :, 0].float()   # [nnz(/sp)]
    per_token = out.new_zeros(b * length)
    per_token[indices] = _sequence_gather(out, len(indices), sp_group)
    return per_token.view(b, length)


def token_values(critic, batch, use_remove_padding=True, sp_group=None):
    """Values [b, R] from a token-classification critic, verl's slice [:, -R-1:-1] (the value of the state
    before each response token)."""
    length, response_len = batch["input_ids"].shape[1], batch["responses"].shape[1]
    return head_outputs(critic, batch, use_remove_padding, sp_group)[:, length - response_len - 1:length - 1]


def last_token_scores(model, batch, use_remove_padding=True):
    """A reward model's score per row [b]: its head at the last valid token (verl's reward model worker reads a
    token-classification output there; a sequence-classification checkpoint loads as one)."""
    per_token = head_outputs(model, batch, use_remove_padding)                         # [b, L]
    length = per_token.shape[1]
    last = (torch.arange(length).unsqueeze(0) * batch["attention_mask"].cpu()).argmax(-1)   # [b]
    return per_token.gather(1, last.unsqueeze(1).to(per_token.device)).squeeze(1)


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


def take(batch, index):
    """Rows `index` of every field of a batch dict (tensors indexed, lists picked)."""
    index_tensor = torch.as_tensor(index, dtype=torch.long)
    return {k: (v[index_tensor] if isinstance(v, torch.Tensor) else [v[i] for i in index]) for k, v in batch.items()}


def all_reduce_sum(values, device, group=None):
    """Sum a list of floats over the ranks of `group` (default: all; one collective); the same list when not
    distributed."""
    tensor = torch.tensor(values, dtype=torch.float64, device=device)
    if dist.is_initialized() and dist.get_world_size() > 1:
        dist.all_reduce(tensor, group=group)
    return tensor.tolist()


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
            self.sp_group, self.dp_group = ulysses.device_groups(device.type, sp)
            ulysses.enable(model, sp, self.sp_group, sp_key)
        model.to(device)
        self.model = shard_fsdp2(model, mixed_precision=device.type != "cpu")
        if optim_cfg is None:
            self.model.eval()
            for p in self.model.parameters():
                p.requires_grad_(False)
            return
        self.optimizer = torch.optim.AdamW(self.model.parameters(), lr=optim_cfg.lr, betas=tuple(optim_cfg.betas),
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

    def micro_batches(self, batch, micro_size, dynamic, max_tokens):
        """Row indices of each micro-batch: fixed size, or under a token budget (use_dynamic_bsz; the budget is
        per device, so a micro-batch split over sp devices may hold sp times as many tokens, as in verl)."""
        if dynamic:
            return dynamic_micro_batches(batch["attention_mask"].sum(-1).tolist(), max_tokens * self.sp,
                                         device=self.device)
        return fixed_micro_batches(batch["attention_mask"].shape[0], micro_size)

    def global_agg_kwargs(self, mini, agg_mode):
        """losses.agg_loss's global counts for a mini-batch: tokens and non-empty sequences on ALL ranks."""
        from losses import global_counts
        tokens, seqs = global_counts(mini["response_mask"])
        tokens, seqs = all_reduce_sum([float(tokens), float(seqs)], self.device, self.dp_group)
        return dict(agg_mode=agg_mode, global_tokens=tokens, global_seqs=seqs, norm_len=mini["responses"].shape[1])

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
    """A causal LM: the actor (trainable, with optimizer) or the reference (frozen)."""

    def __init__(self, cfg, device, trainable, total_steps=1):
        arr = cfg.actor_rollout_ref
        model = load_model(arr.model.path, override_config=arr.model.override_config,
                           trust_remote_code=arr.model.trust_remote_code,
                           gradient_checkpointing=trainable and arr.model.enable_gradient_checkpointing,
                           attn_implementation=attention_backend(device.type, arr.model.use_remove_padding))
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

    def forward(self, micro, temperature, calc_entropy=False):
        return token_logprobs(self.model, micro, temperature=temperature, use_remove_padding=self.use_remove_padding,
                              calc_entropy=calc_entropy, kernels=self.kernels, sp_group=self.sp_group)

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

    def update(self, batch, dp_size):
        """verl's update_policy: ppo_epochs x mini-batches (one optimizer step each) x micro-batches.

        Each micro-batch's loss is its share of the mini-batch loss normalised over ALL ranks' tokens/sequences
        (losses.agg_loss with global counts), multiplied by dp_size because FSDP averages gradients over ranks;
        so the gradient is that of the full mini-batch loss whatever the micro-batching. With sp > 1, dp_size
        is world/sp and the rows are the sp group's; ulysses.GatherSequence scales the gradient by sp.
        """
        from losses import agg_loss, kl_penalty, policy_loss
        actor = self.cfg.actor_rollout_ref.actor
        temperature = self.cfg.actor_rollout_ref.rollout.temperature
        mini_size = actor.ppo_mini_batch_size * self.cfg.actor_rollout_ref.rollout.n // dp_size
        batch = self.group_rows(batch)
        b = batch["responses"].shape[0]
        metrics = {}

        def record(name, value):
            metrics.setdefault(name, []).append(float(value))

        for _ in range(actor.ppo_epochs):
            for start in range(0, b, mini_size):
                mini = take(batch, list(range(start, min(start + mini_size, b))))
                agg = self.global_agg_kwargs(mini, actor.loss_agg_mode)
                counts = {k: v for k, v in agg.items() if k != "agg_mode"}
                self.optimizer.zero_grad(set_to_none=True)
                sums = {"pg_loss": 0.0, "kl_loss": 0.0, "entropy": 0.0}
                for index in self.micro_batches(mini, actor.ppo_micro_batch_size_per_gpu, actor.use_dynamic_bsz,
                                                actor.ppo_max_token_len_per_gpu):
                    micro = self.to_device(take(mini, index))
                    mask = micro["response_mask"].float()
                    logp, entropy = self.forward(micro, temperature, calc_entropy=actor.entropy_coeff != 0)
                    pg_loss, pg_metrics = policy_loss(micro["old_log_probs"], logp, micro["advantages"], mask,
                                                      clip_low=actor.clip_ratio_low, clip_high=actor.clip_ratio_high,
                                                      clip_c=actor.clip_ratio_c, **agg)
                    loss = pg_loss
                    sums["pg_loss"] += pg_loss.item()
                    if actor.entropy_coeff != 0:
                        entropy_share = agg_loss(entropy, mask, mode=actor.loss_agg_mode, **counts)
                        loss = loss - actor.entropy_coeff * entropy_share
                        sums["entropy"] += entropy_share.item()
                    if actor.use_kl_loss:
                        kl_share = agg_loss(kl_penalty(logp, micro["ref_log_prob"], actor.kl_loss_type), mask,
                                            mode=actor.loss_agg_mode, **counts)
                        loss = loss + actor.kl_loss_coef * kl_share
                        sums["kl_loss"] += kl_share.item()
                    (loss * dp_size).backward()
                    for name, value in pg_metrics.items():
                        record(f"actor/{name}", value)
                pg, kl, ent = all_reduce_sum([sums["pg_loss"], sums["kl_loss"], sums["entropy"]], self.device,
                                             self.dp_group)
                record("actor/pg_loss", pg)
                if actor.use_kl_loss:
                    record("actor/kl_loss", kl)
                    record("actor/kl_coef", actor.kl_loss_coef)
                if actor.entropy_coeff != 0:
                    record("actor/entropy_loss", ent)
                record("actor/grad_norm", self.clip_and_step(actor.grad_clip, loss=pg + kl + ent))
        record("actor/lr", self.scheduler.get_last_lr()[0])
        self.scheduler.step()
        return _mean_metrics(metrics)


def _mean_metrics(metrics):
    return {name: float(sum(values) / len(values)) for name, values in metrics.items()}


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
        """verl's update_critic: ppo_epochs x mini-batches x micro-batches of the clipped value loss, normalised
        over the global mini-batch as the actor's loss is."""
        from losses import masked_mean, value_loss
        critic = self.cfg
        mini_size = critic.ppo_mini_batch_size * critic.rollout_n // dp_size
        batch = self.group_rows(batch)
        b = batch["responses"].shape[0]
        metrics = {}
        for _ in range(critic.ppo_epochs):
            for start in range(0, b, mini_size):
                mini = take(batch, list(range(start, min(start + mini_size, b))))
                agg = self.global_agg_kwargs(mini, critic.loss_agg_mode)
                self.optimizer.zero_grad(set_to_none=True)
                loss_sum = 0.0
                for index in self.micro_batches(mini, critic.ppo_micro_batch_size_per_gpu, critic.use_dynamic_bsz,
                                                critic.ppo_max_token_len_per_gpu):
                    micro = self.to_device(take(mini, index))
                    mask = micro["response_mask"].float()
                    vpreds = token_values(self.model, micro, self.use_remove_padding, self.sp_group)
                    loss, clipfrac = value_loss(vpreds, micro["returns"], micro["values"], mask,
                                                cliprange_value=critic.cliprange_value, **agg)
                    (loss * dp_size).backward()
                    loss_sum += loss.item()
                    metrics.setdefault("critic/vf_clipfrac", []).append(float(clipfrac))
                    metrics.setdefault("critic/vpred_mean", []).append(float(masked_mean(vpreds.detach(), mask)))
                (vf_loss,) = all_reduce_sum([loss_sum], self.device, self.dp_group)
                metrics.setdefault("critic/vf_loss", []).append(vf_loss)
                metrics.setdefault("critic/grad_norm", []).append(self.clip_and_step(critic.grad_clip, vf_loss))
        metrics["critic/lr"] = [self.scheduler.get_last_lr()[0]]
        self.scheduler.step()
        return _mean_metrics(metrics)


class RewardModel(Worker):
    """A frozen reward model: one score per response, read at its last token. When the RM's tokenizer or chat
    template differs from the actor's, each conversation (the raw prompt messages + the response text) is
    re-templated and re-tokenised with the RM's own."""

    def __init__(self, cfg, device, actor_tokenizer):
        from transformers import AutoTokenizer
        rm = cfg.reward_model
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
