"""Benchmark the rollout engines on the demo: generated tokens/s of vLLM (colocated, in-process) against the `hf`
engine on the same prompts and sampling settings, and the seconds of one weight sync from the FSDP2 actor.

One process (a world of one rank, gloo), the demo config's sampling (temperature 1, top_p 1), both engines built
side by side; in every repeat each engine in turn gets the actor's weights and generates for the same prompts, and
the medians over repeats are compared as ratios (vLLM / hf) from this one run. Generated tokens are counted up to and
including each response's first EOS.

Usage: .venv/bin/python bench/rollout.py [--prompts 64] [--n 1] [--max-tokens 16] [--repeats 5] [--threads 1]
                                         [--demo demo] [--model DIR]
(the demo assets must exist: .venv/bin/python data.py demo --out demo)
"""
import argparse
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
from config import load_config  # noqa: E402
from models import Policy  # noqa: E402
from runtime import init_distributed, seed_everything  # noqa: E402
from rollout import HFRollout, Sampling, VLLMRollout  # noqa: E402


def demo_prompts(demo, tokenizer, count, max_prompt_length):
    from data import RLHFDataset
    dataset = RLHFDataset(str(demo / "data" / "train.parquet"), tokenizer, max_prompt_length=max_prompt_length)
    return [list(dataset[i]["raw_prompt_ids"]) for i in range(count)]


def generated_tokens(responses, eos_ids):
    """Tokens up to and including the first EOS of each response (what the trainer keeps)."""
    total = 0
    for tokens in responses:
        ends = [i for i, token in enumerate(tokens) if token in eos_ids]
        total += ends[0] + 1 if ends else len(tokens)
    return total


def timed_repeat(engine, actor, prompts, sampling, seed):
    """(sync seconds, generation seconds, generated tokens) of one sync + generate."""
    start = time.perf_counter()
    engine.sync_weights(actor.full_weights())
    synced = time.perf_counter()
    responses, _ = engine.generate(prompts, sampling, seed)
    return synced - start, time.perf_counter() - synced, generated_tokens(responses, engine.eos_ids)


def measure(engines, actor, prompts, sampling, repeats, seed=1):
    """Per engine: median sync seconds, generation seconds, tokens and tokens/s. The engines take turns within
    each repeat (so load from other processes hits both alike); the first repeat is a warm-up."""
    runs = {name: [] for name in engines}
    for repeat in range(repeats + 1):
        for name, engine in engines.items():
            result = timed_repeat(engine, actor, prompts, sampling, seed + repeat)
            if repeat > 0:
                runs[name].append(result)
    return {name: {"sync_s": statistics.median(r[0] for r in rows), "gen_s": statistics.median(r[1] for r in rows),
                   "tokens": statistics.median(r[2] for r in rows),
                   "tokens_per_s": statistics.median(r[2] / r[1] for r in rows)} for name, rows in runs.items()}


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--prompts", type=int, default=64)
    parser.add_argument("--n", type=int, default=1, help="responses per prompt (repeated, as the trainer does)")
    parser.add_argument("--max-tokens", type=int, default=16)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--demo", type=Path, default=ROOT / "demo")
    parser.add_argument("--model", type=Path, help="another model folder with the demo's tokenizer (default: demo/model)")
    parser.add_argument("--threads", type=int, default=1, help="torch threads for both engines")
    args = parser.parse_args()
    if not (args.demo / "model").is_dir():
        raise SystemExit(f"no demo model in {args.demo}: run `.venv/bin/python data.py demo --out {args.demo}`")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    out = Path(tempfile.mkdtemp(prefix="bench_rollout_"))
    _, _, device = init_distributed("cpu", "gloo")
    model = args.model or args.demo / "model"
    cfg = load_config(ROOT / "config.yaml", [f"actor_rollout_ref.model.path={model}",
                                             f"data.train_files={args.demo}/data/train.parquet", "data.val_files=null",
                                             f"af_output_dir={out}",
                                             "actor_rollout_ref.rollout.name=vllm",
                                             f"data.max_response_length={args.max_tokens}"], world_size=1)
    torch.set_num_threads(args.threads)
    seed_everything(cfg.trainer.seed)
    from transformers import AutoTokenizer
    tokenizer = AutoTokenizer.from_pretrained(cfg.actor_rollout_ref.model.path)
    actor = Policy(cfg, device, trainable=False)
    prompts = [p for p in demo_prompts(args.demo, tokenizer, args.prompts, cfg.data.max_prompt_length)
               for _ in range(args.n)]
    sampling = Sampling.from_config(cfg.actor_rollout_ref.rollout)

    start = time.perf_counter()
    hf = HFRollout(cfg.actor_rollout_ref.model.path, tokenizer, device)
    hf_start = time.perf_counter() - start
    start = time.perf_counter()
    vllm = VLLMRollout(cfg, tokenizer, device, rank=0, world_size=1)
    vllm_start = time.perf_counter() - start
    results = measure({"hf": hf, "vllm": vllm}, actor, prompts, sampling, args.repeats)
    vllm.shutdown()                          # destroys the process group

    h, v = results["hf"], results["vllm"]
    print(f"\n{model}: {len(prompts)} sequences ({args.prompts} prompts x n={args.n}), at most {args.max_tokens} tokens, "
          f"T={sampling.temperature}, {torch.get_num_threads()} threads, medians of {args.repeats} repeats, "
          f"torch {torch.__version__}")
    print("\n| engine | generated tokens/s | tokens per repeat | generate s | weight sync s | start s |")
    print("|---|---|---|---|---|---|")
    for name, r, started in (("hf", h, hf_start), ("vllm", v, vllm_start)):
        print(f"| {name} | {r['tokens_per_s']:.0f} | {r['tokens']:.0f} | {r['gen_s']:.3f} | {r['sync_s']:.4f} | "
              f"{started:.2f} |")
    print(f"| vllm / hf | {v['tokens_per_s'] / h['tokens_per_s']:.1f}x | | | {v['sync_s'] / h['sync_s']:.1f}x | |")


if __name__ == "__main__":
    main()
