"""Benchmark one-step-off-policy on split devices against the colocated default, on the same number of ranks.

Both variants train the demo model under torchrun with the same total number of processes (default 2): colocated
(every rank generates its share, then trains on it) and split (trainer.n_gpus_per_node = ranks - 1, one rollout
rank generating the next batch while the trainer learns). The workload is generation-dominated: long responses
(ignore_eos, so every response has max_response_length tokens). Reports the median wall time per step (steps after
the first two) of each variant, side by side from this one invocation, the ratio, and the split run's median
timing_s/wait_prev_gen (how long the trainer still waited for generation).

Usage: .venv/bin/python bench/offpolicy.py [--demo demo] [--ranks 2] [--steps 6] [--response-length 160] [--engine hf]
(the demo assets must exist: .venv/bin/python data.py demo --out demo)
"""
import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def run(demo, ranks, steps, response_length, engine, split):
    out = Path(tempfile.mkdtemp(prefix="bench_offpolicy_"))
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", str(ranks),
           str(ROOT / "minirl.py"), "--config", str(ROOT / "config.yaml"), f"af_output_dir={out}",
           f"trainer.total_training_steps={steps}", "trainer.val_before_train=false", "trainer.test_freq=-1",
           "trainer.logger=[console]", "trainer.save_freq=-1", f"actor_rollout_ref.model.path={demo}/model",
           f"data.train_files={demo}/data/train.parquet", "data.val_files=null", "data.train_batch_size=8",
           "actor_rollout_ref.rollout.n=4", "actor_rollout_ref.actor.ppo_mini_batch_size=8",
           "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=8", f"data.max_response_length={response_length}",
           "actor_rollout_ref.rollout.ignore_eos=true", f"actor_rollout_ref.rollout.name={engine}"]
    if split:
        cmd += [f"trainer.n_gpus_per_node={ranks - 1}", "rollout.n_gpus_per_node=1"]
    env = dict(os.environ, HF_HUB_OFFLINE="1", OMP_NUM_THREADS="1")
    subprocess.run(cmd, cwd=ROOT, check=True, capture_output=True, env=env, timeout=900)
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines() if line.strip()]
    return rows[2:]       # the first steps warm up (and the split run's first step primes the pipeline)


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--demo", default="demo")
    parser.add_argument("--ranks", type=int, default=2)
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--response-length", type=int, default=160)
    parser.add_argument("--engine", default="hf", choices=("hf", "vllm"))
    args = parser.parse_args()
    demo = Path(args.demo).resolve()
    results = {}
    for name, split in (("colocated", False), ("split", True)):
        rows = run(demo, args.ranks, args.steps, args.response_length, args.engine, split)
        results[name] = rows
        median = statistics.median(r["timing_s/step"] for r in rows)
        extra = ""
        if split:
            wait = statistics.median(r.get("timing_s/wait_prev_gen", 0.0) for r in rows)
            extra = f", of which waiting for generation {wait:.3f} s"
        else:
            gen = statistics.median(r["timing_s/gen"] for r in rows)
            extra = f", of which generation {gen:.3f} s"
        print(f"{name:10s} ({args.ranks} ranks, {args.engine}): median step {median:.3f} s{extra}")
    colocated = statistics.median(r["timing_s/step"] for r in results["colocated"])
    split = statistics.median(r["timing_s/step"] for r in results["split"])
    print(f"split / colocated step time: {split / colocated:.2f} (below 1: the split wins)")


if __name__ == "__main__":
    main()
