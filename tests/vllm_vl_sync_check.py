"""The colocated vLLM engine against the FSDP2 actor on image prompts, for tests/test_vision_runs.py:

    torchrun --nproc_per_node 2 tests/vllm_vl_sync_check.py VL_MODEL_DIR DATA.parquet OUT.pt RUN_DIR [full|lora]

Like vllm_sync_check.py, for the tiny Qwen2.5-VL (vLLM loads it from disk: see rollout.engine_load_format), the
actor packing its rows (use_remove_padding, the seed's value: the attention every tower calls is minirl's). Every
rank syncs, samples responses to image prompts, takes one optimizer step of the actor (which moves the vision tower
too), syncs again and samples again; then takes another step and syncs everything but the vision tower, to show
that a stale vision tower shows in the log-probs. For each generation it records vLLM's log-probs and, on the same
tokens, the actor's and those of the untouched model on disk; and how far the first step moved the vision tower.
With `lora` the actor trains LoRA adapters (rank 8, all-linear: the vision tower's and merger's linear layers too)
and each sync sends the adapter; the stale sync sends an adapter without its vision-tower tensors.
"""
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import failures  # noqa: E402
import lora  # noqa: E402
import vision  # noqa: E402
from data import RLHFDataset, collate  # noqa: E402
from models import Policy  # noqa: E402
from runtime import init_distributed, seed_everything  # noqa: E402
from batch import take  # noqa: E402
from minirl import sync_rollout  # noqa: E402
from forward import token_logprobs  # noqa: E402
from models import full_state_dict_items, load_model  # noqa: E402
from rollout import Sampling, build_rollout, pad_logprobs, responses_to_batch  # noqa: E402
from vllm_sync_check import RESPONSE_LEN, TEMPERATURE, config, save_records_and_shut_down  # noqa: E402


def rollout(engine, actor, disk_model, batch, seed, pad_id, skip_vision=False):
    """Sync (all weights, or all but the vision tower's), generate, and score the generated tokens under vLLM, the
    actor and the model on disk (all [b, R])."""
    if not skip_vision:
        sync_rollout(actor, engine)
    elif actor.lora:
        adapter = actor.adapter()
        engine.sync_weights((), adapter=lora.Adapter({name: tensor for name, tensor in adapter.state.items()
                                                      if ".visual." not in name}, adapter.config))
    else:
        engine.sync_weights((name, tensor) for name, tensor in actor.full_weights()
                            if ".visual." not in name)
    rows = list(range(len(batch["raw_prompt_ids"])))
    tokens, logprobs = engine.generate(batch["raw_prompt_ids"], Sampling(max_tokens=RESPONSE_LEN,
                                                                          temperature=TEMPERATURE), seed,
                                       multi_modal=vision.rollout_inputs(batch, rows))
    full = {**batch, **responses_to_batch(batch, tokens, RESPONSE_LEN, pad_id, engine.eos_ids)}
    actor_logp, _ = actor.compute_log_prob(full, 8, False, 4096, TEMPERATURE)
    with torch.no_grad():
        disk_logp, _ = token_logprobs(disk_model, full, temperature=TEMPERATURE, use_remove_padding=False)
    return full, {"tokens": tokens, "vllm": pad_logprobs(logprobs, RESPONSE_LEN), "actor": actor_logp,
                  "disk": disk_logp, "mask": full["response_mask"]}


def vision_weights(actor):
    return {name: tensor.clone() for name, tensor in full_state_dict_items(actor.model) if ".visual." in name}


def main(model_dir, data_path, out_path, run_dir, mode="full"):
    rank, world, device = init_distributed("cpu", "gloo")
    lora_keys = ["actor_rollout_ref.model.lora_rank=8", "actor_rollout_ref.model.lora_alpha=16",
                 "actor_rollout_ref.actor.optim.lr=1e-2"]
    cfg = config(model_dir, 1, run_dir, world,
                 extra=["data.max_prompt_length=64", "actor_rollout_ref.model.use_remove_padding=true",
                        *(lora_keys if mode == "lora" else [])])
    seed_everything(0)
    actor = Policy(cfg, device, trainable=True)
    disk_model = load_model(model_dir).eval()
    processor = vision.load_processor(model_dir)
    dataset = RLHFDataset(data_path, processor.tokenizer, max_prompt_length=64, processor=processor)
    engine = build_rollout(cfg, processor.tokenizer, device)
    batch = take(collate([dataset[i] for i in range(len(dataset))]), [i for i in range(4) for _ in range(2)])
    pad = processor.tokenizer.pad_token_id
    seed = 1000 + rank
    before_weights = vision_weights(actor)
    full, record = rollout(engine, actor, disk_model, batch, seed, pad)
    records = {"before": record}

    sign = torch.tensor([1.0 if i % 2 == 0 else -1.0 for i in range(8)]).unsqueeze(1)

    def step(full, record):          # push up the even rows' responses, down the odd rows'
        full["old_log_probs"] = record["actor"]
        full["advantages"] = sign * full["response_mask"]                              # [b, R]
        actor.update(full, dp_size=world)

    step(full, record)
    after_weights = vision_weights(actor)
    records["vision_change"] = max(float((after_weights[k] - before_weights[k]).abs().max()) for k in before_weights)
    records["vision_names"] = sorted(before_weights)
    full, records["after"] = rollout(engine, actor, disk_model, batch, seed + 1, pad)
    step(full, records["after"])
    _, records["stale_vision"] = rollout(engine, actor, disk_model, batch, seed + 2, pad, skip_vision=True)

    save_records_and_shut_down(records, out_path, engine, world)


if __name__ == "__main__":
    main(*sys.argv[1:])
    # skip Python's teardown, as minirl.train does: gloo's threads can abort it after a run that succeeded
    failures.leave(0)
