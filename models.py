"""Models: load a Hugging Face model, shard it with FSDP2, and the workers that hold one on each rank (policy,
critic, reward model): their micro-batching, AdamW, LR schedule and clipping. The forward pass they run (packed or
padded, logits only at the response positions) is forward.py."""
from __future__ import annotations

import contextlib
import functools
import json
import math
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist

import lora
import losses
import ulysses
import vision
from attention import attention_backend
from batch import all_reduce_sum, batch_size_of, take
from batch_plan import fsdp_group_size, micro_per_gpu
from config import ConfigError
from forward import (dynamic_micro_batches, fixed_micro_batches, last_token_scores, shared_prompt_groups,
                     shares_prompts, token_logprobs, token_values, unwrapped)
from losses import logprobs_and_entropy
from runtime import sampling_seed

# ----------------------------------------------------------------------------------------------------------------
# Loading and sharding

WEIGHT_FILES = ("*.safetensors", "*.bin")             # Hugging Face's weights, whole or in shards
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json", "vocab.txt")


def check_model_folders(cfg):
    """Before anything loads: each model folder the run builds holds a config.json that parses and weights, and
    the tokenizer's folder tokenizer files. A broken copy is named by its key here; inside transformers it was a
    traceback or a misleading hint (an empty folder asked for sentencepiece; a folder without tokenizer files
    loaded an empty tokenizer, and every prompt became 0 tokens)."""
    arr = cfg.actor_rollout_ref
    folders = [("actor_rollout_ref.model.path", arr.model.path)]
    if cfg.algorithm.adv_estimator == "gae":
        folders.append(("critic.model.path", cfg.critic.model.path))
    if cfg.reward_model.enable:
        folders.append(("reward_model.model.path", cfg.reward_model.model.path))
    fix = "point it at a complete Hugging Face model folder, or copy the model again"
    for dotted, folder in folders:
        folder = Path(folder)
        try:
            json.loads((folder / "config.json").read_text())
        except FileNotFoundError:
            raise ConfigError(f"config key '{dotted}': {folder} has no config.json; {fix}") from None
        except (OSError, ValueError) as err:
            raise ConfigError(f"config key '{dotted}': {folder / 'config.json'} cannot be read as JSON ({err}); "
                              f"{fix}") from None
        if not any(any(folder.glob(pattern)) for pattern in WEIGHT_FILES):
            raise ConfigError(f"config key '{dotted}': {folder} holds no weights ({', '.join(WEIGHT_FILES)}); {fix}")
        problem = _damaged_safetensors(folder)
        if problem:
            raise ConfigError(f"config key '{dotted}': {problem}; {fix}")
    dotted = "data.tokenizer" if cfg.data.tokenizer else "actor_rollout_ref.model.path"
    folder = Path(cfg.data.tokenizer or arr.model.path)
    if folder.is_dir() and not any((folder / name).is_file() for name in TOKENIZER_FILES):
        raise ConfigError(f"config key '{dotted}': {folder} has no tokenizer files ({', '.join(TOKENIZER_FILES)}); "
                          f"{fix}")


def _damaged_safetensors(folder):
    """What is wrong with the folder's safetensors weights, or None: a shard its index names that is missing, or a
    file whose header does not parse or does not cover the file (a copy cut short). safe_open reads only the
    header, so this costs nothing on a large model; inside transformers both were tracebacks."""
    from safetensors import SafetensorError, safe_open
    index = folder / "model.safetensors.index.json"
    if index.is_file():
        try:
            shards = set(json.loads(index.read_text())["weight_map"].values())
        except (OSError, ValueError, KeyError, AttributeError) as err:
            return f"{index} cannot be read as a weights index ({type(err).__name__}: {err})"
        missing = sorted(name for name in shards if not (folder / name).is_file())
        if missing:
            return f"{index} names shards the folder lacks: {', '.join(missing)}"
    for path in sorted(folder.glob("*.safetensors")):
        try:
            with safe_open(path, framework="pt"):
                pass
        except (SafetensorError, OSError) as err:
            return f"{path} is not a complete safetensors file ({err})"
    return None


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


def decoder_layers(model):
    """The transformer blocks of a Hugging Face model (the units FSDP2 shards one by one), under peft's LoRA
    wrapper too: the decoder layers, and a vision-language model's vision blocks too."""
    model = unwrapped(model)
    layers = getattr(vision.language_model(model), "layers", None)
    if layers is None:
        raise ValueError(f"cannot find the decoder layers of {type(model).__name__} (expected .{model.base_model_prefix}"
                         ".layers); minirl shards per decoder layer")
    return list(layers) + vision.vision_blocks(model)


def fsdp_mesh(device_type, fsdp_size):
    """verl's create_device_mesh for fsdp_config.fsdp_size. -1 (or the world size or more): every rank holds a
    shard of the one copy of the model (None: FSDP2's default mesh, all ranks). Otherwise HSDP: groups of fsdp_size
    consecutive ranks each shard a copy, and the copies are replicated across the groups (a 2-D mesh (ddp, fsdp):
    parameters are all-gathered and gradients reduce-scattered within a group, then all-reduced across groups), so
    on several nodes the frequent gathers can stay inside a node. A collective: every rank builds it."""
    world = dist.get_world_size() if dist.is_initialized() else 1
    group = fsdp_group_size(fsdp_size, world)
    if group == world:
        return None
    from torch.distributed.device_mesh import init_device_mesh
    return init_device_mesh(device_type, (world // group, group), mesh_dim_names=("ddp", "fsdp"))


def shard_fsdp2(model, mixed_precision=False, reshard_after_forward=True, mesh=None):
    """FSDP2: fully_shard each decoder layer, then the root, over `mesh` (fsdp_mesh; None: all ranks). Parameters
    stay fp32 (master weights); with mixed_precision the forward/backward run in bf16 and gradients are reduced in
    fp32.

    reshard_after_forward (verl's fsdp_config key): true frees each layer's gathered parameters after its forward
    and gathers them again for backward (torch's default, which keeps the root's for the backward that follows);
    false keeps every layer's from forward to backward, for the memory of the whole unsharded model meanwhile.
    Since that memory is then taken anyway, minirl keeps them for the rest of the mini-batch too (Worker.optimize:
    one all-gather per layer and mini-batch; verl gathers again for each micro-batch) and for the rest of a no-grad
    pass (frozen_pass). Gradients are reduce-scattered after each micro-batch's backward (verl), except on CPU with
    reshard_after_forward=false: there they add up unsharded until the mini-batch's last backward
    (Worker.optimize)."""
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
    policy = (MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32) if mixed_precision
              else MixedPrecisionPolicy())
    reshard = None if reshard_after_forward else False          # None: torch's default, described above
    for layer in decoder_layers(model):
        fully_shard(layer, mesh=mesh, mp_policy=policy, reshard_after_forward=reshard)
    fully_shard(model, mesh=mesh, mp_policy=policy, reshard_after_forward=reshard)
    return model


@contextlib.contextmanager
def frozen_pass(model):
    """A no-grad pass over micro-batches that hands back every gathered parameter at its end. Without a backward
    to free them, FSDP2 keeps whatever forward left gathered: the root's (embeddings and LM head) always, and with
    reshard_after_forward=false every layer's, which the pass's later micro-batches then reuse without gathering
    again. Freeing them here keeps a reference model from holding them through generation."""
    try:
        with torch.no_grad():
            yield
    finally:
        reshard_all(model)


def reshard_all(model):
    """Free every parameter FSDP2 holds gathered, leaving each module with its shards only."""
    from torch.distributed.fsdp import FSDPModule
    for module in model.modules():
        if isinstance(module, FSDPModule):
            module.reshard()


def full_state_dict_items(model, keep=None, bucket_bytes=0):
    """Yield (name, full tensor) for every entry of the model's state dict (or those whose name `keep` accepts),
    in the state dict's order. A collective: every rank must iterate all of it. Tied weights (lm_head =
    embed_tokens) appear under both names, so an inference engine that keeps its own copy of the head gets it too.

    bucket_bytes=0 gathers one tensor at a time (DTensor.full_tensor). Otherwise the FSDP shards of consecutive
    tensors travel in one all-gather per bucket of at most bucket_bytes full bytes (verl's
    rollout.update_weights_bucket_megabytes): the same tensors, far fewer collectives, at the price of one bucket
    of gathered weights on the device at a time (HSDP: within a rank's group, which holds every shard). Tensors
    not sharded on dim 0 over one mesh dimension are gathered alone."""
    bucket, size = [], 0
    for name, tensor in model.state_dict().items():
        if keep is not None and not keep(name):
            continue
        bytes_ = tensor.numel() * tensor.element_size()
        if bucket and (size + bytes_ > bucket_bytes or not _same_shard_group(bucket[0][1], tensor)):
            yield from _gather_bucket(bucket)
            bucket, size = [], 0
        if bucket_bytes and _row_sharded(tensor):
            bucket.append((name, tensor))
            size += bytes_
        elif hasattr(tensor, "full_tensor"):
            yield name, tensor.full_tensor().detach()
        else:
            yield name, tensor.detach()
    yield from _gather_bucket(bucket)


def _row_sharded(tensor):
    """A DTensor split by rows (FSDP's Shard(0)) over the last mesh dimension and replicated over any other (HSDP's
    (Replicate(), Shard(0)))."""
    from torch.distributed.tensor import DTensor, Replicate, Shard
    return (isinstance(tensor, DTensor) and tensor.dim() > 0 and tensor.placements[-1] == Shard(0)
            and all(p == Replicate() for p in tensor.placements[:-1]))


def _same_shard_group(first, tensor):
    return _row_sharded(tensor) and tensor.device_mesh == first.device_mesh


def _gather_bucket(bucket):
    """All-gather the row shards of `bucket` [(name, DTensor)] in one collective; yield (name, full tensor).
    Each rank holds rows [r*c, (r+1)*c) of a tensor with c = ceil(rows / ranks) (torch.chunk's split; the last
    ranks may hold fewer or none), so every shard is padded to c rows, the shards are sent as one flat byte
    buffer, and each tensor is cut from every rank's part and trimmed to its rows."""
    if not bucket:
        return
    mesh = bucket[0][1].device_mesh
    shard_dim = mesh.ndim - 1                          # the mesh dimension the rows are split over (_row_sharded)
    ranks, me = mesh.size(shard_dim), mesh.get_local_rank(shard_dim)
    parts, layout = [], []                 # layout: (name, dtype, full shape, bytes per rank)
    for name, tensor in bucket:
        shape = tuple(tensor.shape)
        chunk_rows = -(-shape[0] // ranks)
        local = tensor.to_local().detach()
        expected = max(0, min(shape[0] - me * chunk_rows, chunk_rows))
        assert local.shape[0] == expected, f"{name}: shard of {local.shape[0]} rows, expected {expected}"
        padded = local.new_zeros((chunk_rows, *shape[1:]))
        padded[:expected] = local
        parts.append(padded.reshape(-1).view(torch.uint8))
        layout.append((name, tensor.dtype, shape, parts[-1].numel()))
    sent = torch.cat(parts)                                                    # [bytes per rank]
    received = sent.new_empty(ranks * sent.numel())                            # [ranks * bytes per rank]
    # all_gather_single: torch 2.13's name for all_gather_into_tensor (which now warns); older torch lacks it
    gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
    gather(received, sent, group=mesh.get_group(shard_dim))
    received = received.view(ranks, sent.numel())
    offset = 0
    for name, dtype, shape, nbytes in layout:
        rows = received[:, offset:offset + nbytes].contiguous().view(dtype)   # [ranks, c * rest]
        yield name, rows.view(-1, *shape[1:])[:shape[0]]
        offset += nbytes


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
        """From an actor or critic config section (verl's keys): ppo_mini_batch_size prompts x n responses / dp,
        in micro-batches of ppo_micro_batch_size_per_gpu (or the deprecated ppo_micro_batch_size / dp)."""
        micro = micro_per_gpu(section.ppo_micro_batch_size_per_gpu, section.ppo_micro_batch_size, dp_size)
        return cls(section.ppo_epochs, section.ppo_mini_batch_size * rollout_n // dp_size, micro,
                   section.use_dynamic_bsz, section.ppo_max_token_len_per_gpu, section.grad_clip, dp_size)


OFFLOAD_DEVICE = torch.device("cpu")      # where param_offload / optimizer_offload keep a worker between phases


class Worker:
    """An FSDP2-sharded model on this rank (`fsdp_cfg`: its role's fsdp_config). `optim_cfg` makes it trainable
    (AdamW + verl's LR schedule); without it the model is frozen in eval mode.

    fsdp_config.param_offload (and, trained, optimizer_offload) keep the parameter shards (gradients with them)
    and the optimizer state in host memory between phases: each phase that uses them (a log-prob pass, an update,
    the weights handed to the rollout engine, a checkpoint) runs under `on_device`, which brings them in and sends
    them back after (verl's load_fsdp_model_to_gpu / offload_fsdp_model_to_cpu and its optimizer pair, around the
    same phases). It trades a host-device copy of the shards per phase for the device memory the engine and the
    other models get meanwhile. On CPU the copies are no-ops.

    sp > 1 (Ulysses, ulysses.py; `sp_key` names its config key): each group of sp consecutive ranks works on the
    rows all its ranks brought (`group_rows`), each rank on a slice of every packed row; token budgets scale by
    sp and global counts are summed over the dp group (each row once). FSDP still shards over all ranks (or over
    groups of fsdp_size: fsdp_mesh)."""

    skipped_steps = 0            # optimizer steps skipped for a non-finite loss or gradient norm (checkpointed)
    lora = False                 # LoRA adapters on a frozen base (lora.py): a checkpoint then keeps the adapter too

    def __init__(self, model, device, use_remove_padding, fsdp_cfg, optim_cfg=None, total_steps=1, sp=1,
                 sp_key=None, fsdp_size=-1):
        self.device, self.use_remove_padding, self.sp = device, use_remove_padding, sp
        self.sp_group = self.dp_group = None
        self.shares_prompts = sp == 1 and shares_prompts(model, use_remove_padding)   # each prompt once per row
        if sp > 1:
            self.sp_group, self.dp_group = ulysses.device_groups(device.type, sp)
            ulysses.enable(unwrapped(model), sp, self.sp_group, sp_key)
        model.to(device)
        self.model = shard_fsdp2(model, mixed_precision=device.type != "cpu",
                                 reshard_after_forward=fsdp_cfg.reshard_after_forward,
                                 mesh=fsdp_mesh(device.type, fsdp_size))
        self.keep_gathered = not fsdp_cfg.reshard_after_forward
        self.gather_bucket_bytes = 0     # full_weights: one tensor at a time unless a subclass sets a bucket
        # On CPU each gloo collective blocks its rank until the other ranks arrive (no communication stream runs
        # it beside the backward, as NCCL's and HCCL's do), so every reduce-scatter is a barrier where a rank the
        # host paused holds all the others up. With the whole model gathered through the mini-batch anyway, the
        # gradients add up unsharded on each rank and are reduce-scattered once, in the mini-batch's last
        # backward: one reduce per FSDP module and mini-batch instead of one per micro-batch, the same sum, at
        # the memory of one unsharded fp32 gradient copy (what DDP holds). Accelerators keep verl's reduce-scatter
        # after every micro-batch: it overlaps with the backward there, and the gradients stay sharded.
        self.reduce_once = self.keep_gathered and device.type == "cpu"
        self.offload_params = fsdp_cfg.param_offload
        self.offload_optimizer = optim_cfg is not None and fsdp_cfg.optimizer_offload
        self.offloaded_state = []        # (optimizer state dict, key) of each tensor offload_optimizer moved out
        self.phases_open = 0             # on_device nesting: only the outermost one moves anything
        if optim_cfg is None:
            self.model.eval()
            for p in self.model.parameters():
                p.requires_grad_(False)
        else:
            trainable = [p for p in self.model.parameters() if p.requires_grad]     # with LoRA: the adapter only
            # on CPU torch steps one tensor at a time unless asked; foreach is the same arithmetic, bit for bit, in
            # fewer ops (bench/vs_trl.py's model on 2 ranks: 4.0 -> 1.1 ms a step). Accelerators keep torch's.
            self.optimizer = torch.optim.AdamW(trainable, lr=optim_cfg.lr, betas=tuple(optim_cfg.betas),
                                               weight_decay=optim_cfg.weight_decay,
                                               foreach=True if device.type == "cpu" else None)
            self.scheduler = torch.optim.lr_scheduler.LambdaLR(self.optimizer, lr_lambda(optim_cfg, total_steps))
        self.offload()

    @contextlib.contextmanager
    def on_device(self):
        """One phase's use of the model (and optimizer): what param_offload / optimizer_offload keep in host
        memory comes to the device for it and goes back after. Nested uses move once, at the outermost."""
        outermost = self.phases_open == 0
        if outermost:
            self.load()
        self.phases_open += 1
        try:
            yield
        finally:
            self.phases_open -= 1
            if outermost:
                self.offload()

    def load(self):
        """Bring back what offload moved out."""
        if self.offload_params:
            self.model.to(self.device)           # FSDP2's own .to: the shards (and gradients) move, still sharded
        for state, key in self.offloaded_state:
            state[key] = state[key].to(self.device)
        self.offloaded_state = []

    def offload(self):
        """Move what the offload switches name to OFFLOAD_DEVICE. Only optimizer state on the device moves (and
        comes back): AdamW keeps its step counts in host memory, where they stay."""
        if self.offload_params:
            # only the shards move, never a gathered copy
            reshard_all(self.model)
            self.model.to(OFFLOAD_DEVICE)
        if self.offload_optimizer:
            for state in self.optimizer.state.values():
                for key, value in state.items():
                    if torch.is_tensor(value) and value.device.type == self.device.type:
                        state[key] = value.to(OFFLOAD_DEVICE)
                        self.offloaded_state.append((state, key))
        if (self.offload_params or self.offload_optimizer) and self.device.type != "cpu":
            getattr(torch, self.device.type).empty_cache()     # the freed blocks back to the engine and others

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
            groups = shared_prompt_groups(batch) if self.shares_prompts and "responses" in batch else None
            return dynamic_micro_batches(batch["attention_mask"].sum(-1).tolist(), max_tokens * self.sp,
                                         device=self.device, groups=groups)
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
            with self.on_device():
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
                micro_batches = self.micro_batches(mini, plan.micro_batch_rows, plan.dynamic, plan.max_tokens)
                for k, index in enumerate(micro_batches):
                    last = k == len(micro_batches) - 1
                    if self.keep_gathered:     # the weights do not change before the optimizer step: gather once
                        self.model.set_reshard_after_backward(last)
                        if self.reduce_once:
                            self.model.set_requires_gradient_sync(last)
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

    def full_weights(self, keep=None):
        """(name, full tensor) of the model's state dict (those `keep` accepts), gathered in buckets of
        gather_bucket_bytes (0: one tensor at a time; full_state_dict_items). A collective."""
        with self.on_device():           # offloaded: back in host memory once the last tensor is taken
            yield from full_state_dict_items(self.model, keep, self.gather_bucket_bytes)

    def adapter(self):
        """The LoRA adapter's full tensors in peft's format (lora.Adapter). A collective."""
        return lora.adapter_from_full_state(self.model, dict(self.full_weights(lora.is_adapter_name)))

    def checkpoint_counters(self):
        """What a checkpoint keeps besides the model, optimizer and LR scheduler (checkpoint.py)."""
        return {"skipped_steps": self.skipped_steps}

    def load_checkpoint_counters(self, counters):
        self.skipped_steps = counters["skipped_steps"]

    def resume_schedule(self, scheduler_state):
        """Take the checkpoint's place in the LR schedule, keeping this run's schedule (optim.lr, warmup,
        total_training_steps). LambdaLR's state alone (what verl's checkpoint manager loads; minirl differs on
        purpose) restores the checkpoint's base lr, and the optimizer's state the lr its last step left, so a
        resume with another optim.lr kept the old one and a cosine schedule lengthened by more total steps trained
        a step at the old schedule's end (lr 0). With the same settings the lr is the checkpoint's, bit for bit.
        Returns (the checkpoint's lr, this run's lr) of the first group."""
        base_lrs = list(self.scheduler.base_lrs)                 # this run's optim.lr
        self.scheduler.load_state_dict(scheduler_state)         # its place: last_epoch
        saved_lr = self.scheduler.get_last_lr()[0]
        self.scheduler.base_lrs = base_lrs
        lrs = [base * lmbda(self.scheduler.last_epoch) for base, lmbda in zip(base_lrs, self.scheduler.lr_lambdas)]
        for group, lr in zip(self.optimizer.param_groups, lrs):
            group["lr"] = lr
        self.scheduler._last_lr = lrs                            # get_last_lr() is what actor/lr logs
        return saved_lr, lrs[0]


class Policy(Worker):
    """A causal LM: the actor (trainable, with optimizer) or the reference (frozen). With model.lora_rank > 0 the
    actor is the base model wrapped with peft LoRA adapters (lora.py): only the adapters train."""

    def __init__(self, cfg, device, trainable, total_steps=1):
        arr = cfg.actor_rollout_ref
        self.lora = trainable and lora.enabled(arr.model)
        model = load_model(arr.model.path, override_config=arr.model.override_config,
                           trust_remote_code=arr.model.trust_remote_code,
                           gradient_checkpointing=trainable and arr.model.enable_gradient_checkpointing,
                           attn_implementation=attention_backend(device.type, arr.model.use_remove_padding))
        if self.lora:
            model = lora.wrap(model, arr.model)
            lora.log_parameter_counts(model, arr.model)
        role = "actor" if trainable else "ref"
        super().__init__(model, device, arr.model.use_remove_padding, arr[role].fsdp_config,
                         arr.actor.optim if trainable else None, total_steps,
                         sp=arr[role].ulysses_sequence_parallel_size,
                         sp_key=f"actor_rollout_ref.{role}.ulysses_sequence_parallel_size",
                         fsdp_size=arr.actor.fsdp_config.fsdp_size)     # verl's ref shares the actor's mesh
        self.cfg = cfg
        # what the rollout engine's weight sync gathers in one collective (full_weights)
        self.gather_bucket_bytes = arr.rollout.update_weights_bucket_megabytes * 2**20
        self.kernel = logprobs_and_entropy
        if arr.actor.entropy_from_logits_with_chunking:     # verl's chunk: 2048 rows at a time, in fp32
            self.kernel = functools.partial(logprobs_and_entropy, entropy_chunk_size=ENTROPY_CHUNK_ROWS)
        if arr.actor.use_torch_compile:         # verl compiles the log-prob/entropy kernels, not the model
            self.kernel = torch.compile(self.kernel)

    def forward(self, micro, temperature, calc_entropy=False, entropy_grad=True):
        return token_logprobs(self.model, micro, temperature=temperature, use_remove_padding=self.use_remove_padding,
                              calc_entropy=calc_entropy, kernel=self.kernel, entropy_grad=entropy_grad,
                              sp_group=self.sp_group)

    def base_weights(self):
        """(Hugging Face name, full tensor) of the frozen base model under the LoRA wrapper: adapter tensors
        dropped, names as in model.path. A collective."""
        for name, tensor in self.full_weights(keep=lambda n: not lora.is_adapter_name(n)):
            yield lora.base_weight_name(name), tensor

    def compute_log_prob(self, batch, micro_size, dynamic, max_tokens, temperature, calc_entropy=False):
        """No-grad log-probs [b, R] (and entropy [b, R]) of this rank's rows in micro-batches; rows keep their
        order."""
        batch = self.group_rows(batch)
        b, response_len = batch["responses"].shape
        logp = torch.zeros(b, response_len)
        entropy = torch.zeros(b, response_len) if calc_entropy else None
        with self.on_device(), frozen_pass(self.model):
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

        policy_loss = dict(actor.policy_loss)
        if policy_loss["loss_mode"] == "clip_cov":
            # its random pick of tokens, from a generator seeded per update: the same on the ranks of a Ulysses
            # group (they compute one loss on the same rows) and again after a resume (verl: torch's global RNG)
            dp_index = dist.get_rank() // self.sp if dist.is_initialized() else 0
            seed = sampling_seed(self.cfg.trainer.seed, self.scheduler.last_epoch, dp_index, "clip_cov")
            policy_loss["generator"] = torch.Generator().manual_seed(seed)

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
                kl_loss_type=actor.kl_loss_type, loss_agg_mode=actor.loss_agg_mode,
                policy_loss=policy_loss, **counts)

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


def value_head_name(model):
    """The module name of a critic's one-output head: a token-classification model's `score` (or `classifier`), a
    vision-language critic's swapped-in output layer (vision.with_value_head)."""
    head = (model.get_output_embeddings() if vision.is_vision_language(model.config)
            else getattr(model, "score", None) or getattr(model, "classifier"))
    return next(name for name, module in model.named_modules() if module is head)


class Critic(Worker):
    """The PPO critic: a token-level value model (one-output head on the backbone), trained on the value loss;
    with critic.model.lora_rank > 0, LoRA adapters on the backbone and the head train (lora.py)."""

    def __init__(self, cfg, device, total_steps, tokenizer_len):
        critic = cfg.critic
        self.lora = lora.enabled(critic.model)
        model = load_model(critic.model.path, kind="token_cls", override_config=critic.model.override_config,
                           trust_remote_code=critic.model.trust_remote_code,
                           gradient_checkpointing=critic.model.enable_gradient_checkpointing,
                           attn_implementation=attention_backend(device.type, critic.model.use_remove_padding))
        check_fits(model, tokenizer_len, "critic.model.path")
        if self.lora:           # adapters on the backbone; the value head trains whole (lora.py)
            model = lora.wrap(model, critic.model, value_head=value_head_name(model))
            lora.log_parameter_counts(model, critic.model, role="critic")
        super().__init__(model, device, critic.model.use_remove_padding, critic.model.fsdp_config, critic.optim,
                         total_steps, sp=critic.ulysses_sequence_parallel_size,
                         sp_key="critic.ulysses_sequence_parallel_size", fsdp_size=critic.model.fsdp_config.fsdp_size)
        self.cfg = critic

    def compute_values(self, batch, micro_size):
        """No-grad values [b, R] of this rank's rows, zero outside the response mask (verl's compute_values)."""
        batch = self.group_rows(batch)
        b, response_len = batch["responses"].shape
        values = torch.zeros(b, response_len)
        with self.on_device(), frozen_pass(self.model):
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
        super().__init__(model, device, rm.model.use_remove_padding, rm.model.fsdp_config,
                         fsdp_size=rm.model.fsdp_config.fsdp_size)
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
        with self.on_device(), frozen_pass(self.model):
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
