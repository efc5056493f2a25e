"""Benchmark one training step of the demo config, and the remove-padding speedup.

Part 1 runs the demo config for a few steps under torchrun (2 ranks, the HF rollout) and reports the median of
each phase's seconds (timing_s/*) and the throughput, from the run's metrics.jsonl.
Part 2 times forward+backward of the actor on one batch of varied lengths, padded vs packed (use_remove_padding),
side by side in this process, and prints the ratio.

Usage: .venv/bin/python bench/step.py [--steps 12] [--demo demo] [--skip-run]
(the demo assets must exist: .venv/bin/python data.py demo --out demo)
"""
import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
from models import token_logprobs  # noqa: E402


def run_demo_steps(steps, demo):
    out = Path(tempfile.mkdtemp(prefix="bench_step_"))
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", str(ROOT / "minirl.py"),
           "--config", str(ROOT / "config.yaml"), f"af_output_dir={out}", f"trainer.total_training_steps={steps}",
           "trainer.val_before_train=false", "trainer.test_freq=-1", "trainer.logger=[console]",
           f"actor_rollout_ref.model.path={demo}/model", f"data.train_files={demo}/data/train.parquet",
           f"data.val_files={demo}/data/test.parquet"]
    subprocess.run(cmd, cwd=ROOT, check=True, capture_output=True, env=dict(os.environ, HF_HUB_OFFLINE="1"))
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    return rows[2:]  # the first steps warm up allocators and caches


def phase_table(rows):
    keys = sorted({k for r in rows for k in r if k.startswith("timing_s/")})
    lines = ["| phase | median s | share of step |", "|---|---|---|"]
    step = statistics.median(r["timing_s/step"] for r in rows)
    for key in keys:
        median = statistics.median(r[key] for r in rows)
        lines.append(f"| {key[len('timing_s/'):]} | {median:.3f} | {median / step:.0%} |")
    tput = statistics.median(r["perf/throughput"] for r in rows)
    lines.append(f"\nthroughput (tokens/s per rank, median): {tput:.0f}")
    return "\n".join(lines)


def varied_batch(batch_size, prompt_len, response_len, vocab, seed=0):
    """Left-padded prompts and right-padded responses whose lengths vary from 1 to the maximum."""
    g = torch.Generator().manual_seed(seed)
    P, R = prompt_len, response_len
    ids = torch.randint(10, vocab, (batch_size, P + R), generator=g)
    mask = torch.zeros(batch_size, P + R, dtype=torch.long)
    for i in range(batch_size):
        p = int(torch.randint(1, P + 1, (1,), generator=g))
        r = int(torch.randint(1, R + 1, (1,), generator=g))
        mask[i, P - p:P] = 1
        mask[i, P:P + r] = 1
    return {"input_ids": ids * mask, "attention_mask": mask, "position_ids": (mask.cumsum(-1) - 1).clamp(min=0),
            "responses": (ids * mask)[:, P:]}


def time_forward_backward(model, batch, remove_padding, repeats):
    times = []
    for _ in range(repeats):
        model.zero_grad(set_to_none=True)
        start = time.perf_counter()
        logp, _ = token_logprobs(model, batch, use_remove_padding=remove_padding)
        (logp * batch["attention_mask"][:, -logp.shape[1]:]).sum().backward()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def remove_padding_speedup(model_dir, repeats, shapes=((16, 64, 16), (64, 128, 256))):
    """Rows of (shape, valid tokens, padded s, packed s, padded/packed) for micro-batches of each shape."""
    from transformers import AutoModelForCausalLM
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    lines = ["| micro-batch (rows x (prompt + response)) | valid tokens | padded s | packed s | speedup |",
             "|---|---|---|---|---|"]
    for rows, prompt_len, response_len in shapes:
        batch = varied_batch(rows, prompt_len, response_len, model.config.vocab_size)
        time_forward_backward(model, batch, True, 1)     # warm up both paths
        time_forward_backward(model, batch, False, 1)
        packed = time_forward_backward(model, batch, True, repeats)
        padded = time_forward_backward(model, batch, False, repeats)
        valid, total = int(batch["attention_mask"].sum()), batch["attention_mask"].numel()
        lines.append(f"| {rows} x ({prompt_len} + {response_len}) | {valid}/{total} | {padded:.4f} | {packed:.4f} | "
                     f"x{padded / packed:.2f} |")
    return "\n".join(lines)


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--demo", default=str(ROOT / "demo"))
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--skip-run", action="store_true", help="only the remove-padding comparison")
    args = parser.parse_args()
    if not args.skip_run:
        print("## demo step, 2 ranks, hf rollout\n")
        print(phase_table(run_demo_steps(args.steps, args.demo)))
    print("\n## remove padding, forward+backward of the demo model (median of", args.repeats, "runs)\n")
    print(remove_padding_speedup(f"{args.demo}/model", args.repeats))


if __name__ == "__main__":
    main()
