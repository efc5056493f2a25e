"""The colocated vLLM engine against the FSDP2 actor, for tests/test_vllm.py:

    torchrun --nproc_per_node 2 tests/vllm_sync_check.py MODEL_DIR OUT.pt TP RUN_DIR

Builds the actor and the vLLM engine with load_format=dummy (random weights: only the syncs make vLLM right).
Every rank then: syncs, samples 8 responses at T=0.7 (seeded by its TP group), samples them again with the same
seed and with another, takes one optimizer step of the actor, syncs again and samples again. For the first and the
last generation it records vLLM's log-probs and, on the same tokens, the actor's and those of the untouched model
on disk. Rank 0 saves every rank's record in OUT.pt, along with what vLLM's start did to the RNG states and the
thread count, and how one TP-sharded layer was split.
"""
import random
import sys
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist
from transformers import AutoModelForCausalLM, AutoTokenizer

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import failures  # noqa: E402
from config import load_config  # noqa: E402
from models import Policy  # noqa: E402
from runtime import init_distributed, seed_everything  # noqa: E402
from forward import token_logprobs  # noqa: E402
from rollout import Sampling, build_rollout, pad_logprobs, responses_to_batch  # noqa: E402

TEMPERATURE, RESPONSE_LEN = 0.7, 8
PROMPTS = ["What is 3 + 4?", "Add 2 and 5.", "hello there", "1 + 1 ="]


def config(model_dir, tp, run_dir, world, extra=()):
    overrides = [f"actor_rollout_ref.model.path={model_dir}", "data.train_files=unused", f"af_output_dir={run_dir}",
                 "algorithm.adv_estimator=grpo",
                 "actor_rollout_ref.rollout.name=vllm", "actor_rollout_ref.rollout.load_format=dummy_dtensor",
                 "actor_rollout_ref.rollout.dtype=float32", f"actor_rollout_ref.rollout.tensor_model_parallel_size={tp}",
                 f"actor_rollout_ref.rollout.temperature={TEMPERATURE}", "data.max_prompt_length=32",
                 f"data.max_response_length={RESPONSE_LEN}", "data.train_batch_size=8", "actor_rollout_ref.rollout.n=2",
                 "actor_rollout_ref.actor.ppo_mini_batch_size=8", "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=8",
                 "actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu=8", "actor_rollout_ref.actor.optim.lr=1e-3",
                 "actor_rollout_ref.ref.log_prob_micro_batch_size_per_gpu=8",
                 "actor_rollout_ref.actor.use_kl_loss=false", "actor_rollout_ref.actor.use_torch_compile=false",
                 "actor_rollout_ref.model.enable_gradient_checkpointing=false", "trainer.logger=[console]", *extra]
    return load_config(None, overrides, world_size=world, check_paths=False)


def prompt_batch(prompt_ids, pad_id):
    """Left-padded input_ids/attention_mask/position_ids [b, P] of token lists."""
    width = max(len(p) for p in prompt_ids)
    ids = torch.full((len(prompt_ids), width), pad_id, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for i, p in enumerate(prompt_ids):
        ids[i, width - len(p):] = torch.tensor(p)
        mask[i, width - len(p):] = 1
    return {"input_ids": ids, "attention_mask": mask, "position_ids": torch.clamp(mask.cumsum(-1) - 1, min=0)}


def rollout(engine, actor, disk_model, prompts, seed, pad_id):
    """Sync, generate, and score the generated tokens under vLLM, the actor and the model on disk (all [b, R])."""
    engine.sync_weights(actor.full_weights())
    tokens, logprobs = engine.generate(prompts, Sampling(max_tokens=RESPONSE_LEN, temperature=TEMPERATURE), seed)
    batch = responses_to_batch(prompt_batch(prompts, pad_id), tokens, RESPONSE_LEN, pad_id, engine.eos_ids)
    actor_logp, _ = actor.compute_log_prob(batch, 8, False, 4096, TEMPERATURE)
    with torch.no_grad():
        disk_logp, _ = token_logprobs(disk_model, batch, temperature=TEMPERATURE, use_remove_padding=False)
    return batch, {"tokens": tokens, "vllm": pad_logprobs(logprobs, RESPONSE_LEN), "actor": actor_logp,
                   "disk": disk_logp, "mask": batch["response_mask"]}


def main(model_dir, out_path, tp, run_dir):
    tp = int(tp)
    rank, world, device = init_distributed("cpu", "gloo")
    cfg = config(model_dir, tp, run_dir, world)
    seed_everything(0)
    actor = Policy(cfg, device, trainable=True)
    disk_model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    tokenizer = AutoTokenizer.from_pretrained(model_dir)

    states = (torch.get_rng_state(), random.getstate(), np.random.get_state()[1].copy())
    threads, set_num_threads = torch.get_num_threads(), torch.set_num_threads
    engine = build_rollout(cfg, tokenizer, device)
    down_proj = engine.worker.get_model().model.layers[0].mlp.down_proj      # TP-sharded along its input
    record = {"rng_kept": bool(torch.equal(states[0], torch.get_rng_state()) and states[1] == random.getstate()
                               and np.array_equal(states[2], np.random.get_state()[1])),
              "threads_kept": torch.get_num_threads() == threads and torch.set_num_threads is set_num_threads,
              "down_proj": {key: getattr(down_proj, key) for key in ("tp_rank", "tp_size", "input_size_per_partition")}}

    prompts = [tokenizer(text).input_ids for text in PROMPTS for _ in range(2)]       # 4 prompts x n=2
    seed = 1000 + rank // tp                                                          # one seed per TP group
    batch, record["before"] = rollout(engine, actor, disk_model, prompts, seed, tokenizer.pad_token_id)
    state = torch.get_rng_state()
    engine.generate(prompts[:1], Sampling(max_tokens=2), seed)
    record["rng_kept_by_generate"] = bool(torch.equal(state, torch.get_rng_state()))
    # the same prompts and seed on an engine that has generated since (what an exact resume asks of a fresh one),
    # then another seed
    sampling = Sampling(max_tokens=RESPONSE_LEN, temperature=TEMPERATURE)
    record["same_seed_tokens"], _ = engine.generate(prompts, sampling, seed)
    record["other_seed_tokens"], _ = engine.generate(prompts, sampling, seed + 7)

    # one optimizer step: push up the even rows' responses, down the odd rows'
    sign = torch.tensor([1.0 if i % 2 == 0 else -1.0 for i in range(len(prompts))]).unsqueeze(1)
    batch["old_log_probs"] = record["before"]["actor"]
    batch["advantages"] = sign * batch["response_mask"]                               # [b, R]
    actor.update(batch, dp_size=world)
    _, record["after"] = rollout(engine, actor, disk_model, prompts, seed + 1, tokenizer.pad_token_id)

    save_records_and_shut_down(record, out_path, engine, world)


def save_records_and_shut_down(record, out_path, engine, world):
    """Rank 0 saves every rank's record; then the engine shuts down, last (it destroys the default group)."""
    records = [None] * world
    dist.all_gather_object(records, record)
    if dist.get_rank() == 0:
        torch.save(records, out_path)
    dist.barrier()
    engine.shutdown()
    if dist.is_initialized():
        dist.destroy_process_group()


if __name__ == "__main__":
    main(*sys.argv[1:])
    # skip Python's teardown, as minirl.train does: gloo's threads can abort it after a run that succeeded
    failures.leave(0)
