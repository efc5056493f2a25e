"""Benchmark the weight sync's FSDP gather: one all-gather per tensor vs one per bucket
(rollout.update_weights_bucket_megabytes), side by side in one 2-rank run.

The demo model (or --model) is sharded as the trainer shards the actor (models.shard_fsdp2), and every rank
iterates models.full_state_dict_items, as a sync does, with bucket_bytes=0 (per tensor, DTensor.full_tensor) and
with --bucket-mb (verl's default 512 MiB: the demo model is one bucket). The variants take turns in each repeat;
medians and the ratio. The tensors are checked equal first.

Usage: .venv/bin/python bench/weight_sync.py [--model demo/model] [--repeats 20] [--bucket-mb 512]
(it starts itself under torchrun with 2 processes; the demo assets must exist: .venv/bin/python data.py demo --out demo)
"""
import argparse
import statistics
import sys
from pathlib import Path

import torch
import torch.distributed as dist

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
from models import full_state_dict_items, shard_fsdp2  # noqa: E402
from timing import seconds_per_call, start_under_torchrun  # noqa: E402


def gather_all(model, bucket_bytes):
    for _ in full_state_dict_items(model, bucket_bytes=bucket_bytes):
        pass


def main(args):
    from transformers import AutoModelForCausalLM
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    model = shard_fsdp2(AutoModelForCausalLM.from_pretrained(args.model, dtype=torch.float32))
    bucketed = args.bucket_mb * 2**20
    per_tensor = dict(full_state_dict_items(model))
    assert all(torch.equal(per_tensor[name], tensor) for name, tensor in full_state_dict_items(model, None, bucketed))
    variants = {"one all-gather per tensor": 0, f"buckets of {args.bucket_mb} MiB": bucketed}
    times = {name: [] for name in variants}
    for _ in range(args.repeats):
        for name, bucket_bytes in variants.items():
            dist.barrier()
            times[name] += seconds_per_call(lambda: gather_all(model, bucket_bytes), 1)
    if dist.get_rank() == 0:
        per, bucket = (statistics.median(t) for t in times.values())
        mib = sum(t.numel() * t.element_size() for t in per_tensor.values()) / 2**20
        print(f"{args.model}: {len(per_tensor)} tensors, {mib:.1f} MiB, 2 ranks (gloo), median of {args.repeats}")
        print("| gather | seconds per sync |\n|---|---|")
        print(f"| one all-gather per tensor ({len(per_tensor)}) | {per:.4f} |")
        print(f"| buckets of {args.bucket_mb} MiB | {bucket:.4f} |")
        print(f"| per tensor / bucketed | x{per / bucket:.1f} |")
    dist.destroy_process_group()


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default=str(ROOT / "demo" / "model"))
    parser.add_argument("--repeats", type=int, default=20)
    parser.add_argument("--bucket-mb", type=int, default=512)
    args = parser.parse_args()
    if args.bucket_mb < 1:
        parser.error(f"--bucket-mb must be at least 1 (MiB, as rollout.update_weights_bucket_megabytes), got "
                     f"{args.bucket_mb}")
    start_under_torchrun(2)
    main(args)
