"""Benchmark LoRA (rank 8 and 32 on all linear layers; rank 8 on q_proj/v_proj) against full fine-tuning: peak
memory, step time, bytes per weight sync.

Each variant runs in its own process (one rank, FSDP2 on CPU) on the same model and the same batch, and does what
the trainer does with its models in one step: old log-probs, reference log-probs (full fine-tuning: a second,
frozen copy; LoRA: the actor with its adapter disabled), and one update of the actor. Reported: the process's
peak RSS (and the part above the RSS after imports) over the steps and then with the syncs' gathers, the median
step time, and the bytes the actor sends to the rollout engine at each sync (full: the whole state dict; LoRA: the
adapter, plus the base weights once with load_format=dummy*). Ratios are against full fine-tuning on the same
model, measured in the same run.

Two models: the demo model (hidden 64: adapters on every linear layer are a large share of so small a model) and
a wider random Qwen2 (hidden 1024, one layer), where the proportions are closer to a real LLM's.

Usage: .venv/bin/python bench/lora.py [--demo demo] [--steps 3]
(the demo assets must exist: .venv/bin/python data.py demo --out demo)
"""
import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
# name -> (lora_rank, target_modules); rank 0 = full fine-tuning
VARIANTS = {"full": (0, "all-linear"), "lora r8": (8, "all-linear"), "lora r32": (32, "all-linear"),
            "lora r8 [q_proj,v_proj]": (8, "[q_proj,v_proj]")}
BATCH = dict(rows=4, prompt_len=16, response_len=32)


def peak_rss_mb():
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def child(model_dir, rank, targets, steps, out):
    """One variant in this process; writes its measurements to `out` (json)."""
    os.environ.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", MASTER_ADDR="127.0.0.1",
                      MASTER_PORT=str(29500 + os.getpid() % 1000))
    import torch

    from config import load_config
    from runtime import init_distributed
    from models import AdapterDisabled, Policy, full_state_dict_items
    from step import varied_batch
    _, _, device = init_distributed("cpu", "gloo")
    torch.manual_seed(0)
    baseline = peak_rss_mb()
    cfg = load_config(None, [f"actor_rollout_ref.model.path={model_dir}", "data.train_files=unused",
                             "algorithm.adv_estimator=grpo", "actor_rollout_ref.rollout.name=hf",
                             f"actor_rollout_ref.model.lora_rank={rank}", "actor_rollout_ref.model.lora_alpha=16",
                             f"actor_rollout_ref.model.target_modules={targets}",
                             "data.train_batch_size=8", "actor_rollout_ref.rollout.n=1",
                             "actor_rollout_ref.actor.ppo_mini_batch_size=8",
                             "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=8",
                             "actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu=8",
                             "actor_rollout_ref.ref.log_prob_micro_batch_size_per_gpu=8",
                             "actor_rollout_ref.actor.use_torch_compile=false",
                             "actor_rollout_ref.model.enable_gradient_checkpointing=false"],
                      world_size=1, check_paths=False)
    actor = Policy(cfg, device, trainable=True)
    ref = AdapterDisabled(actor) if actor.lora else Policy(cfg, device, trainable=False)
    length = BATCH["prompt_len"] + BATCH["response_len"]          # every row: this prompt, this response
    batch = varied_batch(BATCH["rows"], actor.model.config.vocab_size, min_len=length, max_len=length,
                         min_prompt=BATCH["prompt_len"], max_prompt=BATCH["prompt_len"])
    times = []
    for _ in range(steps + 1):                  # the first step warms up allocators
        start = time.perf_counter()
        batch["old_log_probs"], _ = actor.compute_log_prob(batch, 8, False, 0, 1.0)
        batch["ref_log_prob"], _ = ref.compute_log_prob(batch, 8, False, 0, 1.0)
        batch["advantages"] = torch.randn(batch["response_mask"].shape) * batch["response_mask"]
        actor.update(batch, dp_size=1)
        times.append(time.perf_counter() - start)
    steps_peak = peak_rss_mb()                  # before the syncs below gather whole tensors

    def nbytes(items):
        return sum(t.numel() * t.element_size() for _, t in items)

    if actor.lora:
        sync, first_sync_extra = actor.adapter().nbytes, nbytes(actor.base_weights())
    else:
        sync, first_sync_extra = nbytes(full_state_dict_items(actor.model)), 0
    Path(out).write_text(json.dumps({"step_s": statistics.median(times[1:]), "steps_peak_rss_mb": steps_peak,
                                     "peak_rss_mb": peak_rss_mb(), "baseline_rss_mb": baseline, "sync_bytes": sync,
                                     "dummy_first_sync_extra_bytes": first_sync_extra,
                                     "params": sum(p.numel() for p in actor.model.parameters())}))


def wide_model(tokenizer_dir, out):
    """A random Qwen2 with hidden 1024 (head_dim 64), 1 layer, the demo tokenizer's vocabulary."""
    from transformers import AutoTokenizer, Qwen2Config, Qwen2ForCausalLM
    tokenizer = AutoTokenizer.from_pretrained(tokenizer_dir)
    config = Qwen2Config(vocab_size=len(tokenizer), hidden_size=1024, intermediate_size=2816, num_hidden_layers=1,
                         num_attention_heads=16, num_key_value_heads=2, tie_word_embeddings=True,
                         max_position_embeddings=512)
    Qwen2ForCausalLM(config).save_pretrained(out)
    tokenizer.save_pretrained(out)
    return out


def compare(model_dir, steps):
    results = {}
    for name, (rank, targets) in VARIANTS.items():
        with tempfile.NamedTemporaryFile(suffix=".json") as f:
            cmd = [sys.executable, __file__, "--child", str(model_dir), str(rank), targets, str(steps), f.name]
            run = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True,
                                 env=dict(os.environ, HF_HUB_OFFLINE="1", OMP_NUM_THREADS="1"))
            if run.returncode != 0:
                raise SystemExit(f"the {name} variant failed (exit {run.returncode}):\n{run.stderr[-3000:]}")
            results[name] = json.loads(Path(f.name).read_text())
    full = results["full"]
    lines = ["| variant | peak RSS MB over the steps (above imports) | with the syncs (above imports) | step s | "
             "bytes per sync | full/variant: memory above imports over the steps, step time, sync bytes |",
             "|---|---|---|---|---|---|"]
    for name, r in results.items():
        above = r["steps_peak_rss_mb"] - r["baseline_rss_mb"]
        full_above = full["steps_peak_rss_mb"] - full["baseline_rss_mb"]
        # a model small beside the imports may not raise the peak at all
        memory_ratio = f"x{full_above / above:.2f}" if above > 0 else "n/a"
        extra = (f" (+{r['dummy_first_sync_extra_bytes'] / 2**20:.2f} MiB base once with dummy*)"
                 if r["dummy_first_sync_extra_bytes"] else "")
        lines.append(f"| {name} | {r['steps_peak_rss_mb']:.0f} ({above:.0f}) | "
                     f"{r['peak_rss_mb']:.0f} ({r['peak_rss_mb'] - r['baseline_rss_mb']:.0f}) | {r['step_s']:.3f} | "
                     f"{r['sync_bytes'] / 2**20:.3f} MiB{extra} | {memory_ratio}, "
                     f"x{full['step_s'] / r['step_s']:.2f}, x{full['sync_bytes'] / r['sync_bytes']:.1f} |")
    return f"{full['params']:,} parameters\n\n" + "\n".join(lines)


def main():
    if len(sys.argv) > 1 and sys.argv[1] == "--child":
        sys.path.append(str(ROOT / "bench"))          # for step.varied_batch, after the repo root
        child(sys.argv[2], int(sys.argv[3]), sys.argv[4], int(sys.argv[5]), sys.argv[6])
        return
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--demo", default=str(ROOT / "demo"))
    parser.add_argument("--steps", type=int, default=2)
    args = parser.parse_args()
    batch = f"{BATCH['rows']} rows x ({BATCH['prompt_len']} + {BATCH['response_len']}) tokens"
    print(f"## demo model, {batch}, median of {args.steps} steps\n")
    print(compare(f"{args.demo}/model", args.steps))
    with tempfile.TemporaryDirectory() as tmp:
        print(f"\n## wide random Qwen2 (hidden 1024, 1 layer), {batch}, median of {args.steps} steps\n")
        print(compare(wide_model(f"{args.demo}/model", tmp), args.steps))


if __name__ == "__main__":
    main()
