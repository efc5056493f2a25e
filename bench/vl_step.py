"""Benchmark the vision-language step: where a VL demo step spends its time, and the vision tower's share.

Part 1 runs the VL demo (`python data.py demo-vl --out demo-vl` first) for a few steps under torchrun (2 ranks,
the HF rollout) and reports the median of each phase's seconds (timing_s/*), as bench/step.py does for text.
Part 2 takes one micro-batch of the demo's image prompts with 8-token responses and times, side by side in this
process, forward+backward of the whole actor (packed, as training runs it) and of its vision tower alone on the
same pixels; the ratio is the vision tower's share of the actor's training compute.

Usage: .venv/bin/python bench/vl_step.py [--steps 6] [--demo demo-vl] [--skip-run]
"""
import argparse
import statistics
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
import vision  # noqa: E402
from data import RLHFDataset, collate  # noqa: E402
from forward import token_logprobs  # noqa: E402
from models import load_model  # noqa: E402
from rollout import responses_to_batch  # noqa: E402
from step import run_demo_steps  # noqa: E402
from timing import median_seconds  # noqa: E402


def image_batch(demo, rows, response_len=8):
    processor = vision.load_processor(f"{demo}/model")
    dataset = RLHFDataset(f"{demo}/data/test.parquet", processor.tokenizer, max_prompt_length=64,
                          processor=processor)
    prompts = collate([dataset[i] for i in range(rows)])
    generator = torch.Generator().manual_seed(0)
    responses = torch.randint(10, 300, (rows, response_len), generator=generator).tolist()
    tokenizer = processor.tokenizer
    return {**prompts, **responses_to_batch(prompts, responses, response_len, tokenizer.pad_token_id,
                                            [tokenizer.eos_token_id])}


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


def vision_share(demo, rows, repeats):
    model = load_model(f"{demo}/model")
    batch = image_batch(demo, rows)
    inputs = vision.concat_inputs(batch["multi_modal_inputs"])

    def whole():
        model.zero_grad(set_to_none=True)
        logp, _ = token_logprobs(model, batch, use_remove_padding=True)
        (logp * batch["response_mask"]).sum().backward()

    def tower():
        model.zero_grad(set_to_none=True)
        out = model.model.visual(inputs["pixel_values"], grid_thw=inputs["image_grid_thw"])
        out.pooler_output.sum().backward()

    whole_s, tower_s = median_seconds(whole, repeats, warmup=1), median_seconds(tower, repeats, warmup=1)
    patches = inputs["pixel_values"].shape[0]
    return ("| micro-batch | image patches | actor fwd+bwd s | vision tower fwd+bwd s | vision share |\n"
            "|---|---|---|---|---|\n"
            f"| {rows} prompts + 8-token responses | {patches} | {whole_s:.4f} | {tower_s:.4f} | "
            f"{tower_s / whole_s:.0%} |")


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--demo", default=str(ROOT / "demo-vl"))
    parser.add_argument("--rows", type=int, default=16)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--skip-run", action="store_true", help="only the vision-tower share")
    args = parser.parse_args()
    if not args.skip_run:
        print("## VL demo step, 2 ranks, hf rollout\n")
        print(phase_table(run_demo_steps(args.steps, args.demo, remove_padding=True)))
    print(f"\n## vision tower share of the actor's forward+backward (median of {args.repeats} runs)\n")
    print(vision_share(args.demo, args.rows, args.repeats))


if __name__ == "__main__":
    main()
