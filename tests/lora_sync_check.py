"""A LoRA actor (rank 8) against its rollout engines and its base model, for tests/test_lora.py:

    torchrun --nproc_per_node 2 tests/lora_sync_check.py MODEL_DIR OUT.pt LOAD_FORMAT TP RUN_DIR

Every rank builds the LoRA actor, a plain frozen FSDP2 copy of model.path (what a non-LoRA reference would be), the
vLLM engine (LOAD_FORMAT, TP) and an hf engine. Then: sync, sample 8 responses; one optimizer step (the adapter
moves); sample again WITHOUT a sync (a stale adapter); sync, sample again. For each generation it records vLLM's
log-probs and the actor's on the same tokens; after the step also the hf engine's (synced and stale), the
reference's (actor with the adapter disabled) and the frozen copy's, whether every base tensor still equals
model.path's bit for bit, and which adapter tensors changed. Rank 0 saves every rank's record in OUT.pt.
"""
import sys
from pathlib import Path

import torch
from safetensors.torch import load_file
from transformers import AutoTokenizer

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import failures  # noqa: E402
from minirl import sync_rollout  # noqa: E402
from runtime import init_distributed, seed_everything  # noqa: E402
from forward import token_logprobs  # noqa: E402
from models import AdapterDisabled, Policy  # noqa: E402
from rollout import HFRollout, Sampling, build_rollout, pad_logprobs, responses_to_batch  # noqa: E402
from vllm_sync_check import PROMPTS, config, prompt_batch, save_records_and_shut_down  # noqa: E402

TEMPERATURE, RESPONSE_LEN = 0.7, 8


def generate(engine, actor, prompts, seed, pad_id):
    """vLLM's and the actor's log-probs [b, R] of one sampled batch."""
    tokens, logprobs = engine.generate(prompts, Sampling(max_tokens=RESPONSE_LEN, temperature=TEMPERATURE), seed)
    batch = responses_to_batch(prompt_batch(prompts, pad_id), tokens, RESPONSE_LEN, pad_id, engine.eos_ids)
    actor_logp, _ = actor.compute_log_prob(batch, 8, False, 4096, TEMPERATURE)
    return batch, {"vllm": pad_logprobs(logprobs, RESPONSE_LEN), "actor": actor_logp, "mask": batch["response_mask"]}


def hf_logprobs(engine, batch):
    with torch.no_grad():
        return token_logprobs(engine.model, batch, temperature=TEMPERATURE, use_remove_padding=False)[0]


def main(model_dir, out_path, load_format, tp, run_dir):
    rank, world, device = init_distributed("cpu", "gloo")
    cfg = config(model_dir, int(tp), run_dir, world)
    arr = cfg.actor_rollout_ref
    arr.model.lora_rank, arr.model.lora_alpha, arr.rollout.load_format = 8, 16, load_format
    arr.actor.optim.lr = 1e-2
    seed_everything(0)
    actor = Policy(cfg, device, trainable=True)
    frozen = Policy(cfg, device, trainable=False)          # no LoRA: the plain base model, sharded the same way
    initial_adapter = actor.adapter().state
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    engine = build_rollout(cfg, tokenizer, device)
    hf_engine = HFRollout(model_dir, tokenizer, device, lora_cfg=arr.model)
    record = {"base_loaded_at_start": engine.base_loaded}

    prompts = [tokenizer(text).input_ids for text in PROMPTS for _ in range(2)]
    seed, pad = 1000 + rank // int(tp), tokenizer.pad_token_id
    sync_rollout(actor, engine)
    sync_rollout(actor, hf_engine)
    batch, record["before"] = generate(engine, actor, prompts, seed, pad)

    sign = torch.tensor([1.0 if i % 2 == 0 else -1.0 for i in range(len(prompts))]).unsqueeze(1)
    batch["old_log_probs"] = record["before"]["actor"]
    batch["advantages"] = sign * batch["response_mask"]
    actor.update(batch, dp_size=world)

    record["hf_stale"] = hf_logprobs(hf_engine, batch)
    _, record["stale"] = generate(engine, actor, prompts, seed + 1, pad)
    sync_rollout(actor, engine)
    sync_rollout(actor, hf_engine)
    after_batch, record["after"] = generate(engine, actor, prompts, seed + 2, pad)
    record["hf_after"] = hf_logprobs(hf_engine, after_batch)
    record["lora_id"] = engine.lora_request.lora_int_id

    record["ref"], _ = AdapterDisabled(actor).compute_log_prob(after_batch, 8, False, 4096, TEMPERATURE)
    record["frozen"], _ = frozen.compute_log_prob(after_batch, 8, False, 4096, TEMPERATURE)
    on_disk = load_file(Path(model_dir) / "model.safetensors")
    base = dict(actor.base_weights())
    record["base_names_match"] = set(on_disk) <= set(base)
    record["base_differs"] = [name for name, tensor in on_disk.items() if not torch.equal(base[name], tensor)]
    adapter = actor.adapter().state
    record["adapter_changed"] = sorted(name for name, tensor in adapter.items()
                                       if not torch.equal(tensor, initial_adapter[name]))
    record["adapter_names"] = sorted(adapter)
    record["trainable"] = sorted(name for name, p in actor.model.named_parameters() if p.requires_grad)
    record["optimized"] = sum(len(group["params"]) for group in actor.optimizer.param_groups)

    save_records_and_shut_down(record, out_path, engine, world)


if __name__ == "__main__":
    main(*sys.argv[1:])
    # skip Python's teardown, as minirl.train does: gloo's threads can abort it after a run that succeeded
    failures.leave(0)
