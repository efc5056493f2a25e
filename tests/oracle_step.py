"""One PPO update of the actor on a fixed batch, for the oracle test (launched by tests/test_trainer.py):

    torchrun --nproc_per_node W tests/oracle_step.py BATCH.pt OUT.pt MODEL_DIR VARIANT [VARIANT ...]

VARIANT is `name:key=value,key=value` (config overrides). Each variant loads the model afresh, computes the
log-probs and entropy of this rank's contiguous share of the batch (Policy.compute_log_prob) and runs Policy.update
on it, and rank 0 saves the full log-probs, entropy, gradients and the weights after the optimizer step under
OUT.pt[name], with what FSDP did: the parameters left gathered after the log-prob pass and the all-gathers and
reduce-scatters of the update.
"""
import contextlib
import sys
from pathlib import Path

import torch
from torch.distributed.tensor import DTensor

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import failures  # noqa: E402
from batch import all_gather_rows, rows_of_rank, take  # noqa: E402
from batch_plan import batch_plan  # noqa: E402
from config import load_config  # noqa: E402
from runtime import init_distributed, seed_everything  # noqa: E402
from models import Policy, decoder_layers  # noqa: E402

BASE = ["algorithm.adv_estimator=grpo", "data.train_batch_size=4", "actor_rollout_ref.rollout.n=2",
        "actor_rollout_ref.actor.ppo_mini_batch_size=4", "actor_rollout_ref.actor.use_kl_loss=true",
        "actor_rollout_ref.actor.kl_loss_coef=0.1", "actor_rollout_ref.actor.entropy_coeff=0.01",
        "actor_rollout_ref.actor.use_torch_compile=false", "actor_rollout_ref.actor.optim.lr=1e-3",
        "actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu=8", "actor_rollout_ref.rollout.name=hf",
        "actor_rollout_ref.ref.log_prob_micro_batch_size_per_gpu=8", "actor_rollout_ref.rollout.temperature=0.9",
        "actor_rollout_ref.model.enable_gradient_checkpointing=false", "data.max_prompt_length=6",
        "data.max_response_length=5", "trainer.logger=[console]"]


@contextlib.contextmanager
def counting(module, name):
    """Record each call of module.name in the yielded list."""
    inner, calls = getattr(module, name), []

    def counted(*args, **kwargs):
        calls.append(1)
        return inner(*args, **kwargs)
    setattr(module, name, counted)
    try:
        yield calls
    finally:
        setattr(module, name, inner)


def full(tensor):
    return tensor.full_tensor() if hasattr(tensor, "full_tensor") else tensor


def main(batch_path, out_path, model_dir, *variants):
    rank, world, device = init_distributed("cpu", "gloo")
    batch = torch.load(batch_path)
    local = take(batch, rows_of_rank(batch["responses"].shape[0], rank, world))
    results = {}
    for variant in variants:
        name, _, overrides = variant.partition(":")
        extra = [o for o in overrides.split(",") if o]
        cfg = load_config(None, BASE + [f"actor_rollout_ref.model.path={model_dir}", "data.train_files=unused"] + extra,
                          world_size=world, check_paths=False)
        seed_everything(0)
        actor = Policy(cfg, device, trainable=True)
        rollout, plan = cfg.actor_rollout_ref.rollout, batch_plan(cfg, world)
        logp, entropy = actor.compute_log_prob(local, plan["old_log_prob_micro_batch"],
                                               rollout.log_prob_use_dynamic_bsz,
                                               rollout.log_prob_max_token_len_per_gpu, rollout.temperature,
                                               calc_entropy=True)
        gathered = [n for n, p in actor.model.named_parameters() if not isinstance(p, DTensor)]
        layer_calls = []    # checkpointing re-enters each layer in backward (a pre-hook: recompute may stop early)
        hook = decoder_layers(actor.model)[0].register_forward_pre_hook(lambda *_: layer_calls.append(1))
        with (counting(torch.distributed, "all_gather_single") as all_gathers,          # FSDP2's unshard
              counting(torch.distributed, "reduce_scatter_single") as reduce_scatters):   # and gradient reduce
            metrics = actor.update(local, dp_size=plan["dp"])
        hook.remove()
        grads = {n: full(p.grad).clone() for n, p in actor.model.named_parameters()}
        weights = {n: full(p.detach()).clone() for n, p in actor.model.named_parameters()}
        results[name] = {"grads": grads, "weights": weights, "metrics": metrics,
                         "log_probs": all_gather_rows(logp, world), "entropy": all_gather_rows(entropy, world),
                         "update_layer_calls": len(layer_calls), "gathered_after_log_prob": gathered,
                         "update_all_gathers": len(all_gathers), "update_reduce_scatters": len(reduce_scatters)}
    if rank == 0:
        torch.save(results, out_path)
    torch.distributed.barrier()           # no rank tears gloo down while another still uses it
    torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main(*sys.argv[1:])
    # skip Python's teardown, as minirl.train does: gloo's threads can abort it after a run that succeeded
    failures.leave(0)
