"""One-step-off-policy on split devices: the first T ranks train, the last R ranks generate, and generation of the
next batch runs while the trainer learns from the current one (verl v0.5.0, recipe/one_step_off_policy/:
ray_trainer.py `fit` and `_async_gen_next_batch`, fsdp_workers.py `sync_rollout_weights`).

    torchrun --nproc_per_node (T+R) minirl.py ... trainer.n_gpus_per_node=T rollout.n_gpus_per_node=R

Process groups. Every rank joins torchrun's store, then one of two worlds of its own as torch.distributed's
default group: the trainer world (T ranks: FSDP2, the batch collectives and checkpoints of minirl.py work there
unchanged) or the rollout world (R ranks: vLLM's tensor-parallel groups live there). A third group, the bridge,
spans trainer rank 0 (bridge rank 0) and the rollout ranks (bridge ranks 1..R); every message between the two
sides goes over it as a broadcast, in the same order on both sides.

The pipeline, as trainer step k sees it (w_j: the weights after update j):
    wait for batch k            (timing_s/wait_prev_gen; step 1 primes: batch 1 is launched first, with w_0)
    launch batch k+1 with w_k-1 (timing_s/sync_rollout_weights: the weights go out now, then the prompts)
    rewards, old_log_prob (recomputed by the actor: the PPO ratio is right), ref, advantages, update -> w_k
So the batch trained at step k >= 2 was sampled by w_k-2 while the trainer holds w_k-1: one update behind.
training/rollout_probs_diff_* (vLLM) reports that gap. Validation and checkpoints first take the batch in
flight, so a checkpoint holds it and a resumed run continues with exactly the batch the uninterrupted run had.

Prompts with images travel with their images (vision.rollout_inputs: PIL images for vLLM's processor, the
processor's pixel inputs for the hf engine), and the weights with the vision tower's. With LoRA only the adapter
travels at each sync (peft's format, lora.Adapter), and the frozen base once, with the first request, when the
rollout engine started without it (vLLM's load_format dummy*): the rollout side says so when it starts.
Multi-turn conversations run on the rollout ranks too (agent.AgentLoop with its tools and interactions): the
request carries the rows' messages, the answer the finished conversations.

Left out: a critic (GAE), ReMax (greedy baselines need a second generation), multi-node pools, and releasing the
trainer while the last batch of a run is generated (the final step launches nothing).
"""
from __future__ import annotations

import base64
import dataclasses
import io
import itertools
import os
import pickle
import random
import time
import uuid

import numpy as np
import torch
import torch.distributed as dist

import agent
import failures
import lora
import vision
from batch import batch_size_of, repeat_interleave
from config import multi_turn_on
from rollout import Sampling, build_rollout, folder_eos_token_ids, pad_logprobs, responses_to_batch
from runtime import share_cpu

BUCKET_BYTES = 256 * 2**20     # weights travel in flat buckets of at most this size (or one bigger tensor)


# ----------------------------------------------------------------------------------------------------------------
# Who is who


def rollout_ranks(cfg):
    """R, the number of rollout ranks; 0 when colocated."""
    return cfg.rollout.n_gpus_per_node or 0


def is_rollout_rank(cfg):
    return bool(rollout_ranks(cfg)) and int(os.environ.get("RANK", "0")) >= _trainer_ranks(cfg)


def _trainer_ranks(cfg):
    return int(os.environ.get("WORLD_SIZE", "1")) - rollout_ranks(cfg)


class Bridge:
    """The group of trainer rank 0 (bridge rank 0) and the rollout ranks (1..R), made from torchrun's store
    directly (the two sides have different default groups). Gloo on CPU and NPU, NCCL on CUDA.

    Ending it takes care (`close`): gloo's worker thread lets go of a finished broadcast's tensor a moment after
    `wait()` returns, and if that was the last reference to a tensor made in Python, it needs the GIL; should the
    interpreter be shutting down by then, the thread is killed inside C++ and the process aborts ("terminate
    called without an active exception"). So the group has one worker thread (it frees each broadcast before it
    takes the next), and `close` ends with a broadcast whose tensor it holds until that thread is joined."""

    def __init__(self, store, rank, size, backend, device):
        store = dist.PrefixStore("minirl/bridge", store)
        if backend == "nccl":
            options = dist.ProcessGroupNCCL.Options()
            options._timeout = failures.COLLECTIVE_TIMEOUT
            self.group, self.device = dist.ProcessGroupNCCL(store, rank, size, options), device
        else:
            options = dist.ProcessGroupGloo._Options()
            interfaces = os.environ.get("GLOO_SOCKET_IFNAME")     # torch's own rule for its gloo groups
            options._devices = [dist.ProcessGroupGloo.create_device(interface=name) for name in interfaces.split(",")
                                ] if interfaces else [dist.ProcessGroupGloo.create_default_device()]
            options._threads, options._timeout = 1, failures.COLLECTIVE_TIMEOUT
            self.group, self.device = dist.ProcessGroupGloo(store, rank, size, options), "cpu"
        self.rank = rank

    def broadcast(self, tensor, src):
        """In place on every member; returns the tensor (on the bridge's device)."""
        tensor = tensor.to(self.device)
        opts = dist.BroadcastOptions()
        opts.rootRank = src
        self.group.broadcast([tensor], opts).wait()
        return tensor

    def close(self):
        """After the last message, on every member: one more broadcast, so that the worker has freed every
        earlier one; then the group is shut down and freed (gloo joins its worker here) while this broadcast's
        tensor is still held, and only then is that tensor freed."""
        last = self.broadcast(torch.zeros(1), src=0)
        self.group.shutdown()
        self.group = None
        del last

    def broadcast_object(self, obj, src):
        """`obj` from bridge rank `src` to every member (pickled; its length first)."""
        payload = pickle.dumps(obj) if self.rank == src else b""
        length = self.broadcast(torch.tensor([len(payload)], dtype=torch.int64), src)
        data = torch.frombuffer(bytearray(payload), dtype=torch.uint8) if self.rank == src else \
            torch.empty(int(length), dtype=torch.uint8)
        data = self.broadcast(data, src)
        return obj if self.rank == src else pickle.loads(data.cpu().numpy().tobytes())


def init_process_groups(cfg, backend):
    """Join torchrun's store; make this rank's default group (trainer or rollout world) and the bridge. On a
    rollout rank RANK/WORLD_SIZE become the rollout world's (vLLM's external launcher reads them)."""
    failures.watch_parent()          # first: the rendezvous waits on torchrun's store (no-op once started)
    store, rank, world = next(dist.rendezvous("env://"))
    store.set_timeout(failures.COLLECTIVE_TIMEOUT)
    failures.use_job_store(store, world)
    trainers = world - rollout_ranks(cfg)
    role, local, size = ("trainer", rank, trainers) if rank < trainers else ("rollout", rank - trainers,
                                                                                world - trainers)
    dist.init_process_group(backend, store=dist.PrefixStore(f"minirl/{role}", store), rank=local, world_size=size,
                            timeout=failures.COLLECTIVE_TIMEOUT)
    if role == "rollout":
        os.environ.update(RANK=str(local), WORLD_SIZE=str(size))
    device = _local_device({"nccl": "cuda", "hccl": "npu"}.get(backend, "cpu"))
    if rank == 0 or role == "rollout":
        return Bridge(store, 0 if rank == 0 else rank - trainers + 1, world - trainers + 1, backend, device)
    return None


def _local_device(device_type):
    return torch.device("cpu") if device_type == "cpu" else torch.device(device_type, int(os.environ["LOCAL_RANK"]))


# ----------------------------------------------------------------------------------------------------------------
# Weights: trainer rank 0 -> rollout ranks, in buckets, in the state dict's fixed name order


def send_weights(bridge, named_tensors):
    """Trainer side; every trainer rank calls it (the full tensors are an FSDP all-gather), rank 0 (the one with
    a bridge) broadcasts. Tensors are packed into flat byte buckets of at most BUCKET_BYTES."""
    bucket, size = [], 0
    for _, tensor in named_tensors:
        if bridge is None:
            continue
        raw = tensor.detach().contiguous().reshape(-1).view(torch.uint8)
        if bucket and size + raw.numel() > BUCKET_BYTES:
            bridge.broadcast(torch.cat(bucket), src=0)
            bucket, size = [], 0
        bucket.append(raw.to(bridge.device))
        size += raw.numel()
    if bucket:
        bridge.broadcast(torch.cat(bucket), src=0)


def receive_weights(bridge, layout):
    """Rollout side: yield (name, tensor) in the layout's order as the buckets arrive (the same bucketing rule)."""
    def flush(entries, size):
        flat = bridge.broadcast(torch.empty(size, dtype=torch.uint8), src=0)
        offset = 0
        for name, shape, dtype, nbytes in entries:
            yield name, flat[offset:offset + nbytes].view(dtype).view(shape)
            offset += nbytes

    entries, size = [], 0
    for name, shape, dtype in layout:
        nbytes = int(np.prod(shape, dtype=np.int64)) * torch.empty((), dtype=dtype).element_size()
        if entries and size + nbytes > BUCKET_BYTES:
            yield from flush(entries, size)
            entries, size = [], 0
        entries.append((name, shape, dtype, nbytes))
        size += nbytes
    if entries:
        yield from flush(entries, size)


def weight_layout(model):
    """[(name, shape, dtype)] in the state dict's order: what every weight sync sends, in that order."""
    return [(name, tuple(t.shape), t.dtype) for name, t in model.state_dict().items()]


def sync_layout(actor):
    """What the weight syncs send, for both sides: {"weights": the layout every sync sends, "lora_config": None,
    or with LoRA the adapter's LoraConfig; then "weights" is the adapter's tensors (peft's names) and "base" the
    frozen base's (Hugging Face names), sent once when the engine needs it}."""
    if not actor.lora:
        return {"weights": weight_layout(actor.model), "lora_config": None}
    sharded = {name: t for name, t in actor.model.state_dict().items() if lora.is_adapter_name(name)}
    adapter = lora.adapter_from_full_state(actor.model, sharded)         # names and global shapes, no gather
    base = [(lora.base_weight_name(name), tuple(t.shape), t.dtype) for name, t in actor.model.state_dict().items()
            if not lora.is_adapter_name(name)]
    return {"weights": [(name, tuple(t.shape), t.dtype) for name, t in adapter.state.items()],
            "lora_config": adapter.config, "base": base}


# ----------------------------------------------------------------------------------------------------------------
# The rollout ranks


class RolloutServer:
    """A rollout rank's whole life: receive a request (weights, then prompts), generate its share, send the
    responses back; until the trainer says stop. Shares: the engine's TP groups (tp consecutive rollout ranks)
    split each request's prompts as evenly as they go; rollout rank 0 answers for all."""

    def __init__(self, cfg, device_type, backend):
        from transformers import AutoTokenizer
        self.cfg = cfg
        self.rank = failures.TORCHRUN_RANK                  # torchrun's rank (failure reports name it)
        self.bridge = init_process_groups(cfg, backend)
        self.local_rank, self.world_size = dist.get_rank(), dist.get_world_size()      # in the rollout world
        device = _local_device(device_type)
        if device.type == "cpu":          # share the cores between all processes of the node
            share_cpu(int(os.environ.get("LOCAL_WORLD_SIZE", "1")))
        else:
            getattr(torch, device.type).set_device(device)
        model = cfg.actor_rollout_ref.model
        tokenizer = AutoTokenizer.from_pretrained(cfg.data.tokenizer or model.path,
                                                  trust_remote_code=model.trust_remote_code)
        self.rollout = build_rollout(cfg, tokenizer, device)
        # multi-turn: the conversations run here, beside the engine (tools and interactions too)
        self.agent = agent.loop_for(cfg, tokenizer, self.rollout, self.local_rank, *agent.load_plugins(cfg)) \
            if multi_turn_on(cfg) else None
        self.layout = self.bridge.broadcast_object(None, src=0)
        self.bridge.broadcast_object(not self.rollout.base_loaded, src=1)     # LoRA: whether to send the base

    def sync_weights(self):
        """Receive one sync (the order Pipeline._send sends it in) into the engine."""
        weights = receive_weights(self.bridge, self.layout["weights"])
        if self.layout["lora_config"] is None:
            self.rollout.sync_weights(weights)
            return
        adapter = lora.Adapter(dict(weights), self.layout["lora_config"])
        base = () if self.rollout.base_loaded else receive_weights(self.bridge, self.layout["base"])
        self.rollout.sync_weights(base, adapter=adapter)

    def fit(self):
        tp = self.rollout.tp_size
        groups = self.world_size // tp
        while (request := self.bridge.broadcast_object(None, src=0)) is not None:
            self.sync_weights()
            share = np.array_split(np.arange(len(request["prompts"])), groups)[self.local_rank // tp]
            seed = request["seeds"][self.local_rank // tp]
            work = self.converse if self.agent is not None else self.generate     # multi-turn, or one response
            answer = work(request, share, seed)
            parts = [None] * self.world_size
            dist.all_gather_object(parts, answer)
            answers = parts[::tp]                        # one copy per TP group, in group order
            reply = None
            if self.local_rank == 0 and self.agent is not None:
                reply = {"conversations": [c for part in answers for c in part]}
            elif self.local_rank == 0:                   # vLLM also returns log-probs (hf: None)
                with_logprobs = any(part is not None for _, part in answers)
                reply = {"tokens": [t for part, _ in answers for t in part],
                         "logprobs": [lp for _, part in answers for lp in part or []] if with_logprobs else None}
            self.bridge.broadcast_object(reply, src=1)

    def generate(self, request, share, seed):
        """One response per prompt of this rank's share: (token lists, log-prob lists or None)."""
        images = {"multi_modal": [request["multi_modal"][i] for i in share]} if request["multi_modal"] else {}
        if not len(share):
            return [], None
        return self.rollout.generate([request["prompts"][i] for i in share], request["sampling"], seed, **images)

    def converse(self, request, share, seed):
        """Multi-turn: this rank's share of the rows as whole conversations (agent.AgentLoop, as colocated), each
        without what does not travel (its interaction object, its images)."""
        rows = {"raw_prompt_ids": [request["prompts"][i] for i in share],
                **{key: [column[i] for i in share] for key, column in request["conversation_rows"].items()}}
        multi_modal = [request["multi_modal"][i] for i in share] if request["multi_modal"] else None
        vllm = self.cfg.actor_rollout_ref.rollout.name == "vllm"
        engine = agent.engine_generate(self.rollout, request["sampling"], batched=vllm)
        conversations = self.agent.run(rows, engine, seed, multi_modal) if len(share) else []
        return [dataclasses.replace(c, interaction=None, multi_modal=None) for c in conversations]

    def close(self):
        self.bridge.close()                              # the trainer's stop message was its last use
        dist.barrier()
        self.rollout.shutdown()
        if dist.is_initialized():
            dist.destroy_process_group()


# ----------------------------------------------------------------------------------------------------------------
# The trainer side


class Pipeline:
    """The trainer ranks' half of the pipeline. Stands in for the rollout engine (`eos_ids`, `shutdown`) and is
    checkpointed (state_dict: the batch in flight, once taken). `seed_of(step, group, purpose)`: the sampling seed
    of rollout TP group `group`."""

    def __init__(self, trainer, bridge, seed_of):
        cfg = trainer.cfg
        self.trainer, self.bridge, self.seed_of = trainer, bridge, seed_of
        self.eos_ids = folder_eos_token_ids(trainer.tokenizer, cfg.actor_rollout_ref.model)
        rollout = cfg.actor_rollout_ref.rollout
        self.groups = rollout_ranks(cfg) // (rollout.tensor_model_parallel_size if rollout.name == "vllm" else 1)
        self.in_flight = None          # (prompt batch (repeated, with uids), its data epoch) being generated
        self.ready = None              # (generated batch, its data epoch), taken early (validation, checkpoint)
        self.epoch = trainer.loader.epoch    # the data epoch of the batch trained now (training/epoch)
        self.prompts = (prompts for _ in itertools.count() for prompts in trainer.loader)   # across epochs
        layout = sync_layout(trainer.actor)
        needs_base = [None]                 # LoRA: whether the rollout engine waits for the base weights
        if bridge is not None:
            bridge.broadcast_object(layout, src=0)
            needs_base = [bridge.broadcast_object(None, src=1)]
        if trainer.world_size > 1:          # every trainer rank takes part in gathering the base
            dist.broadcast_object_list(needs_base, src=0)
        self.send_base = trainer.actor.lora and needs_base[0]

    # -- one request: weights, then prompts; and the answer ---------------------------------------------------
    def _send(self, batch, sampling, step, purpose):
        request = {"prompts": batch["raw_prompt_ids"], "sampling": sampling, "step": step, "purpose": purpose,
                   "seeds": [self.seed_of(step, g, purpose) for g in range(self.groups)],
                   "multi_modal": vision.rollout_inputs(batch, range(batch_size_of(batch))),   # None: no images
                   # multi-turn: what the agent loop reads of each row besides its prompt ids
                   "conversation_rows": {key: batch[key] for key in agent.ROW_COLUMNS if key in batch}
                   if multi_turn_on(self.trainer.cfg) else None}
        if self.bridge is not None:
            self.bridge.broadcast_object(request, src=0)
        actor = self.trainer.actor
        if not actor.lora:
            send_weights(self.bridge, actor.full_weights())
            return
        send_weights(self.bridge, actor.adapter().state.items())     # first: the engine takes it with the base
        if self.send_base:
            send_weights(self.bridge, actor.base_weights())
            self.send_base = False

    def _receive(self, batch, max_tokens, greedy=False):
        """The answer to the last request, on every trainer rank, as a full rollout batch."""
        reply = [self.bridge.broadcast_object(None, src=1) if self.bridge is not None else None]
        if self.trainer.world_size > 1:
            dist.broadcast_object_list(reply, src=0)
        reply = reply[0]
        pad = self.trainer.tokenizer.pad_token_id
        if "conversations" in reply:                 # multi-turn: whole conversations, tool tokens masked out
            rows = agent.conversations_to_batch(batch, reply["conversations"], max_tokens, pad, batch["extra_info"])
            if greedy:              # greedy turns come without log-probs (validation; nothing checks them)
                del rows["rollout_log_probs"]
            return {**batch, **rows}
        full = responses_to_batch(batch, reply["tokens"], max_tokens, pad, self.eos_ids)
        if reply["logprobs"] is not None:
            full["rollout_log_probs"] = pad_logprobs(reply["logprobs"], max_tokens)              # [B, R]
        return {**batch, **full}

    def generate(self, batch, sampling, purpose):
        """Generate now with the current weights (validation): the batch in flight is taken first."""
        self.settle()
        self._send(batch, sampling, self.trainer.global_step, purpose)
        return self._receive(batch, sampling.max_tokens, sampling.greedy)

    # -- the training pipeline ------------------------------------------------------------------------------
    def _launch(self, step):
        """Send the current weights and the next prompts (repeated n times, one uid per prompt)."""
        rollout = self.trainer.cfg.actor_rollout_ref.rollout
        prompts = next(self.prompts)
        prompts["uid"] = [str(uuid.UUID(int=random.getrandbits(128))) for _ in range(batch_size_of(prompts))]
        batch = repeat_interleave(prompts, rollout.n)
        self._send(batch, Sampling.from_config(rollout), step, "train")
        self.in_flight = batch, self.trainer.loader.epoch

    def settle(self):
        """Take the batch in flight now (before validation or a checkpoint)."""
        if self.in_flight is not None:
            (batch, epoch), self.in_flight = self.in_flight, None
            self.ready = self._receive(batch, self.trainer.cfg.actor_rollout_ref.rollout.response_length), epoch

    def next_batch(self, timings):
        """The batch to train on at this step, generated one update ago; the next one is launched at once."""
        step = self.trainer.global_step
        if self.in_flight is None and self.ready is None:
            self._launch(step)                                # prime: the first step (or after a resume)
        start = time.perf_counter()
        self.settle()
        (batch, self.epoch), self.ready = self.ready, None
        timings["wait_prev_gen"] = time.perf_counter() - start
        if step < self.trainer.total_steps:
            start = time.perf_counter()
            self._launch(step + 1)
            timings["sync_rollout_weights"] = time.perf_counter() - start
        return batch

    # -- checkpoint and shutdown ----------------------------------------------------------------------------
    def state_dict(self):
        """JSON-safe: the batch taken before the checkpoint, pickled and base64-encoded (None when there is none)."""
        if self.ready is None:
            return {"ready": None}
        buffer = io.BytesIO()
        torch.save(self.ready, buffer)
        return {"ready": base64.b64encode(buffer.getvalue()).decode("ascii")}

    def load_state_dict(self, state):
        self.in_flight = None
        self.ready = None if state["ready"] is None else torch.load(
            io.BytesIO(base64.b64decode(state["ready"])), weights_only=False)

    def shutdown(self):
        """Tell the rollout ranks to stop (after the trainer's last collective) and close the bridge."""
        self.settle()
        if self.bridge is not None:
            self.bridge.broadcast_object(None, src=0)
            self.bridge.close()
