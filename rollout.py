"""Rollout: generate responses with the actor's current weights.

Every engine has the same small interface, so the trainer does not care which one runs:
    engine.sync_weights(named_tensors)     # (name, full tensor) pairs from the FSDP actor, before generating
    engine.generate(prompt_ids, sampling, seed) -> list of response token lists (one per prompt)
    engine.sleep() / engine.wake_up()      # free / restore accelerator memory around training (no-op here)

Engines:
    hf    HFRollout: a plain Hugging Face model on this rank, `model.generate`. Slow and obviously correct: the
          reference the vLLM engine is checked against.
    vllm  (issue 4/6) the real vLLM engine colocated on the trainer's devices.

`responses_to_batch` turns the engine's token lists into verl's rollout batch (right-padded responses, the
response mask up to and including the first EOS, input_ids/attention_mask/position_ids of prompt + response).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class Sampling:
    """What one generate call samples with; `n` repeats are done by the trainer (prompts arrive repeated)."""
    max_tokens: int
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    do_sample: bool = True

    @property
    def greedy(self):
        return not self.do_sample or self.temperature == 0

    @classmethod
    def from_config(cls, rollout_cfg, validate=False):
        """Training sampling from actor_rollout_ref.rollout, or validation sampling from its val_kwargs."""
        src = rollout_cfg.val_kwargs if validate else rollout_cfg
        return cls(max_tokens=rollout_cfg.response_length, temperature=float(src.temperature),
                   top_p=float(src.top_p), top_k=int(src.top_k), do_sample=bool(src.do_sample))


def eos_token_ids(tokenizer, generation_config=None):
    """All ids that end a response: the tokenizer's eos plus the model's generation_config eos (maybe a list)."""
    ids = {tokenizer.eos_token_id} if tokenizer.eos_token_id is not None else set()
    extra = getattr(generation_config, "eos_token_id", None)
    if extra is not None:
        ids.update(extra if isinstance(extra, (list, tuple)) else [extra])
    return sorted(ids)


class HFRollout:
    """Generation with a plain Hugging Face copy of the actor on this rank (weights synced before each call)."""

    def __init__(self, model_path, tokenizer, device, dtype=torch.float32, trust_remote_code=False):
        from transformers import AutoModelForCausalLM
        self.model = AutoModelForCausalLM.from_pretrained(model_path, dtype=dtype, trust_remote_code=trust_remote_code)
        self.model.to(device).eval()
        self.tokenizer = tokenizer
        self.device = device
        self.eos_ids = eos_token_ids(tokenizer, self.model.generation_config)

    @torch.no_grad()
    def sync_weights(self, named_tensors):
        params = dict(self.model.named_parameters())
        params.update(dict(self.model.named_buffers()))
        for name, tensor in named_tensors:
            if name in params:
                params[name].copy_(tensor.to(params[name].device, params[name].dtype))

    def sleep(self):
        pass

    def wake_up(self):
        pass

    @torch.no_grad()
    def generate(self, prompt_ids, sampling, seed):
        """prompt_ids: list of token lists (unpadded). Returns one response token list per prompt."""
        pad = self.tokenizer.pad_token_id
        width = max(len(p) for p in prompt_ids)
        input_ids = torch.full((len(prompt_ids), width), pad, dtype=torch.long)
        attention_mask = torch.zeros_like(input_ids)
        for i, ids in enumerate(prompt_ids):                           # left padding
            input_ids[i, width - len(ids):] = torch.tensor(ids)
            attention_mask[i, width - len(ids):] = 1
        kwargs = dict(max_new_tokens=sampling.max_tokens, eos_token_id=self.eos_ids, pad_token_id=pad,
                      do_sample=not sampling.greedy)
        if not sampling.greedy:
            kwargs.update(temperature=sampling.temperature, top_p=sampling.top_p,
                          top_k=sampling.top_k if sampling.top_k > 0 else 0)
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(seed)
            out = self.model.generate(input_ids=input_ids.to(self.device),
                                      attention_mask=attention_mask.to(self.device), **kwargs)
        return [row[width:].tolist() for row in out.cpu()]


def build_rollout(cfg, tokenizer, device):
    name = cfg.actor_rollout_ref.rollout.name
    if name == "hf":
        return HFRollout(cfg.actor_rollout_ref.model.path, tokenizer, device,
                         trust_remote_code=cfg.actor_rollout_ref.model.trust_remote_code)
    raise NotImplementedError(f"actor_rollout_ref.rollout.name={name!r} is not available yet; use 'hf'")


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
