"""Benchmark Ulysses sequence parallelism: activation memory per rank and forward+backward time of one long packed
micro-batch, sp=1 vs sp=2, side by side in one 2-rank run.

sp=1: each rank runs a whole micro-batch of --tokens tokens (data parallel). sp=2: the two ranks run one such
micro-batch together, each on half of the sequence (ulysses.py). Activation memory = the bytes autograd keeps for
backward during the forward (saved tensors, parameters excluded), the memory Ulysses divides; on CUDA also the
peak allocated memory above the model's. The model is the demo model, unsharded (FSDP does not change activations),
without gradient checkpointing. The demo model has 2 query heads and 1 KV head: with sp=2 each rank attends with
1 head (the KV head repeated, as verl does).

Usage: .venv/bin/python bench/ulysses.py [--demo demo] [--tokens 4096] [--repeats 3]
(it starts itself under torchrun with 2 processes; the demo assets must exist: .venv/bin/python data.py demo --out demo)
"""
import argparse
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
import ulysses  # noqa: E402
from forward import token_logprobs  # noqa: E402
from timing import start_under_torchrun  # noqa: E402


def long_row(tokens, vocab, seed):
    """One sequence of `tokens` tokens, its second half the response."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(10, vocab, (1, tokens), generator=g)
    return {"input_ids": ids, "attention_mask": torch.ones_like(ids), "position_ids": torch.arange(tokens)[None],
            "responses": ids[:, tokens // 2:]}


def saved_activation_bytes(model, run):
    """Run `run()` recording every tensor autograd saves for backward (by storage, parameters excluded)."""
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    saved = {}

    def pack(tensor):
        storage = tensor.untyped_storage()
        if storage.data_ptr() not in params:
            saved[storage.data_ptr()] = storage.nbytes()
        return tensor

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
        out = run()
    return out, sum(saved.values())


def measure(model, batch, device, sp_group, repeats):
    """(saved activation MiB, peak extra MiB on CUDA or None, median forward+backward seconds, slowest rank)."""
    batch = {k: v.to(device) for k, v in batch.items()}

    def forward():
        logp, _ = token_logprobs(model, batch, use_remove_padding=True, sp_group=sp_group)
        return logp

    times, activation, peak = [], 0, None
    for step in range(repeats + 1):                       # the first pass warms up
        model.zero_grad(set_to_none=True)
        if device.type == "cuda":
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
            base = torch.cuda.memory_allocated()
        dist.barrier()
        start = time.perf_counter()
        logp, activation = saved_activation_bytes(model, forward)
        logp.sum().backward()
        if device.type == "cuda":
            torch.cuda.synchronize()
            peak = (torch.cuda.max_memory_allocated() - base) / 2**20
        elapsed = torch.tensor([time.perf_counter() - start], dtype=torch.float64, device=device)
        dist.all_reduce(elapsed, op=dist.ReduceOp.MAX)
        if step:
            times.append(float(elapsed))
    return activation / 2**20, peak, statistics.median(times)


def main(args):
    from transformers import AutoModelForCausalLM
    device_type = "cuda" if torch.cuda.is_available() and torch.cuda.device_count() >= 2 else "cpu"
    dist.init_process_group("nccl" if device_type == "cuda" else "gloo")
    rank = dist.get_rank()
    device = torch.device(device_type, rank) if device_type == "cuda" else torch.device("cpu")
    torch.set_num_threads(1)
    path = f"{args.demo}/model"
    results = {}
    for sp in (1, 2):
        model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, attn_implementation="sdpa")
        group = None
        if sp > 1:
            group, _ = ulysses.device_groups(device_type, sp)
            ulysses.enable(model, sp, group, "ulysses_sequence_parallel_size")
        model.to(device)
        # sp=1: each rank its own row (data parallel); sp=2: the group's one row
        batch = long_row(args.tokens, model.config.vocab_size, seed=rank if sp == 1 else 0)
        results[sp] = measure(model, batch, device, group, args.repeats)
        del model
    if rank == 0:
        (act1, peak1, t1), (act2, peak2, t2) = results[1], results[2]
        print(f"## Ulysses, one micro-batch of {args.tokens} tokens, 2 ranks ({device_type}, median of "
              f"{args.repeats})\n")
        print("| sp | tokens per rank | saved activations per rank (MiB) | peak extra memory per rank (MiB) | "
              "forward+backward s |")
        print("|---|---|---|---|---|")
        for sp, (act, peak, seconds) in results.items():
            print(f"| {sp} | {args.tokens // sp} | {act:.1f} | {'n/a' if peak is None else f'{peak:.1f}'} | "
                  f"{seconds:.3f} |")
        print(f"\nsp=2 / sp=1: activations x{act2 / act1:.2f}"
              + ("" if peak1 is None else f", peak memory x{peak2 / peak1:.2f}")
              + f", time per micro-batch x{t2 / t1:.2f}, tokens/s per rank x{(t1 / t2) / 2:.2f}")
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--demo", default=str(ROOT / "demo"))
    parser.add_argument("--tokens", type=int, default=4096)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    start_under_torchrun(2)
    main(args)
