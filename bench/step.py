"""Benchmark the training step: remove padding (packed) vs padded, the log-prob pass's memory, and FLOP/s.

1. Demo: the demo config for a few steps under torchrun (2 ranks, HF rollout), packed and padded
   (use_remove_padding true/false) in alternating runs (--rounds); medians of timing_s/* over their steps.
2. The model passes of a step on one micro-batch, sequences uniform in 16..384 tokens and short ones (40..80,
   demo-sized): the actor's forward+backward (update) and its no-grad log-prob pass, padded (sdpa) vs packed
   with minirl_varlen (attention.py), and packed with transformers' sdpa (a block-diagonal mask over the packed
   row: what minirl did before). Variants take turns in each repeat; medians and ratios.
3. Attention alone on the 16..384 row, forward only: minirl_varlen (length buckets), one call per sequence, a
   dense block-diagonal mask, and with --flex flex attention with a document mask (compiled; it has no backward
   on CPU, so it cannot train there).
4. Peak memory of the no-grad log-prob pass (with entropy, as the old-log-prob pass) on a tiny model with Qwen's
   152k vocabulary: logits over every position (before) vs the response positions in chunks (models.py). Each in
   a fresh process; the peak is the rise of the resident set (ru_maxrss) over what it was before the pass.
5. FLOP/s: the cores' fp32 matmul peak (2048^3, measured here) against the achieved FLOP/s of the packed actor
   forward+backward of part 2 (flops.training_flops). Then the floor the matmuls set: on a micro-batch shaped like
   bench/vs_trl.py's addition workload (8 prompts of 30 tokens x 4 responses of 64, prompts packed once), the
   actor's forward+backward with the recompute of gradient checkpointing (on in config.yaml) and the no-grad
   reference pass against the model's matmuls alone at the same shapes (matmul_floor_seconds): what is left is
   attention, norms, rotary, activations, the softmax of the head and bookkeeping.
6. GRPO groups (n responses to each prompt, adjacent as the trainer's micro-batches hold them): the packed passes
   with each prompt once in the row (forward._pack_shared) vs once per response, on GSM8K-sized prompts
   (78..286 tokens) and on the demo's short ones (about 30), responses 16..64 tokens.

Usage: .venv/bin/python bench/step.py [--steps 8] [--rounds 2] [--demo demo] [--repeats 5] [--skip-run] [--flex]
(the demo assets must exist: .venv/bin/python data.py demo --out demo)
"""
import argparse
import contextlib
import json
import os
import resource
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
import attention  # noqa: E402
import flops  # noqa: E402
import forward  # noqa: E402
from losses import entropy_from_logits, logprobs_from_logits  # noqa: E402
from forward import _model_inputs, token_logprobs  # noqa: E402
from timing import seconds_per_call  # noqa: E402

VOCAB_152K = 151936          # Qwen2's vocabulary
WARMUP_STEPS = 2             # a demo run's first steps, left out of its timings


# -- 1. the demo, packed vs padded ------------------------------------------------------------------------------

def run_demo_steps(steps, demo, remove_padding):
    out = Path(tempfile.mkdtemp(prefix="bench_step_"))
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
           str(ROOT / "minirl.py"), "--config", str(ROOT / "config.yaml"), f"af_output_dir={out}",
           f"trainer.total_training_steps={steps}", "trainer.val_before_train=false", "trainer.test_freq=-1",
           "trainer.logger=[console]", f"actor_rollout_ref.model.path={demo}/model",
           f"data.train_files={demo}/data/train.parquet", f"data.val_files={demo}/data/test.parquet",
           f"actor_rollout_ref.model.use_remove_padding={str(remove_padding).lower()}"]
    subprocess.run(cmd, cwd=ROOT, check=True, capture_output=True, env=dict(os.environ, HF_HUB_OFFLINE="1"))
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    return rows[WARMUP_STEPS:]  # the first steps warm up allocators and caches


def demo_table(packed_rows, padded_rows):
    keys = sorted({k for r in packed_rows for k in r if k.startswith("timing_s/")})
    lines = ["| phase | packed s | padded s | padded/packed |", "|---|---|---|---|"]
    for key in keys:
        packed = statistics.median(r[key] for r in packed_rows)
        padded = statistics.median(r[key] for r in padded_rows)
        lines.append(f"| {key[len('timing_s/'):]} | {packed:.3f} | {padded:.3f} | x{padded / packed:.2f} |")
    tput = statistics.median(r["perf/throughput"] for r in packed_rows)
    lines.append(f"\npacked throughput (tokens/s per rank, median): {tput:.0f}")
    return "\n".join(lines)


# -- 2. varied lengths ------------------------------------------------------------------------------------------

def varied_batch(rows, vocab, min_len=16, max_len=384, max_prompt=64, seed=0, min_prompt=8):
    """Left-padded prompts and right-padded responses; each sequence's total length uniform in
    [min_len, max_len], its prompt uniform in [min_prompt, max_prompt] (at most half of it)."""
    g = torch.Generator().manual_seed(seed)
    P, R = max_prompt, max_len - 8
    ids = torch.randint(10, vocab, (rows, P + R), generator=g)
    mask = torch.zeros(rows, P + R, dtype=torch.long)
    for i in range(rows):
        total = int(torch.randint(min_len, max_len + 1, (1,), generator=g))
        p = min(int(torch.randint(min_prompt, max_prompt + 1, (1,), generator=g)), total // 2)
        mask[i, P - p:P] = 1
        mask[i, P:P + total - p] = 1
    ids = ids * mask
    return {"input_ids": ids, "attention_mask": mask, "position_ids": (mask.cumsum(-1) - 1).clamp(min=0),
            "responses": ids[:, P:], "response_mask": mask[:, P:]}


def update_pass(model, batch, remove_padding):
    model.zero_grad(set_to_none=True)
    logp, _ = token_logprobs(model, batch, use_remove_padding=remove_padding)
    (logp * batch["response_mask"]).sum().backward()


def logprob_pass(model, batch, remove_padding, calc_entropy=True):
    with torch.no_grad():
        token_logprobs(model, batch, use_remove_padding=remove_padding, calc_entropy=calc_entropy)


def load(model_dir, attn):
    from transformers import AutoModelForCausalLM
    return AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32, attn_implementation=attn).eval()


def varied_lengths(model_dir, batch, repeats):
    """Median seconds per (pass, variant), alternating variants within each repeat."""
    variants = {"padded (sdpa)": (load(model_dir, "sdpa"), False),
                "packed, sdpa block-diagonal mask (before)": (load(model_dir, "sdpa"), True),
                "packed, minirl_varlen": (load(model_dir, attention.VARLEN_CPU), True)}
    results = {}
    for name, fn in (("actor forward+backward", update_pass), ("log-prob pass (no grad)", logprob_pass)):
        times = {v: [] for v in variants}
        for v, (model, packed) in variants.items():
            fn(model, batch, packed)                                        # warm up
        for _ in range(repeats):
            for v, (model, packed) in variants.items():
                times[v] += seconds_per_call(lambda: fn(model, batch, packed), 1)
        results[name] = {v: statistics.median(t) for v, t in times.items()}
    return results


def varied_table(batches, results):
    lines = ["| micro-batch | pass | padded s | packed, block-diagonal mask (before) s | packed, minirl_varlen s | "
             "padded/packed |", "|---|---|---|---|---|---|"]
    for label, batch in batches.items():
        lengths = batch["attention_mask"].sum(-1)
        shape = (f"{label}: {len(lengths)} x {int(lengths.min())}..{int(lengths.max())} tokens, "
                 f"{int(lengths.sum())}/{batch['attention_mask'].numel()} valid")
        for name, medians in results[label].items():
            padded, before, now = medians.values()
            lines.append(f"| {shape} | {name} | {padded:.3f} | {before:.3f} | {now:.3f} | x{padded / now:.2f} |")
    return "\n".join(lines)


# -- 3. attention alone -----------------------------------------------------------------------------------------

def attention_table(batch, repeats, with_flex, heads=2, head_dim=32):
    import torch.nn.functional as F
    lengths = batch["attention_mask"].sum(-1).tolist()
    nnz = sum(lengths)
    q, k, v = (torch.randn(1, h, nnz, head_dim) for h in (heads, 1, 1))
    cu = torch.nn.functional.pad(torch.tensor(lengths).cumsum(0), (1, 0))
    doc = torch.repeat_interleave(torch.arange(len(lengths)), torch.tensor(lengths))     # [nnz] sequence ids

    class Module:
        training = False

    def varlen(ratio):
        def run():
            attention.BUCKET_LENGTH_RATIO, saved = ratio, attention.BUCKET_LENGTH_RATIO
            attention.varlen_cpu_attention(Module(), q, k, v, None, cu_seq_lens_q=cu)
            attention.BUCKET_LENGTH_RATIO = saved
        return run

    def dense_mask():
        mask = (doc[:, None] == doc[None, :]) & torch.ones(nnz, nnz, dtype=torch.bool).tril()
        F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=True)

    kernels = {f"minirl_varlen (length buckets within {attention.BUCKET_LENGTH_RATIO}x)":
               varlen(attention.BUCKET_LENGTH_RATIO), "one sdpa call per sequence": varlen(1.0),
               "sdpa, block-diagonal mask over the row": dense_mask}
    if with_flex:
        from torch.nn.attention.flex_attention import create_block_mask, flex_attention
        block_mask = create_block_mask(lambda b, h, qi, ki: (doc[qi] == doc[ki]) & (qi >= ki), 1, None, nnz, nnz,
                                       device="cpu")
        compiled = torch.compile(flex_attention)
        kernels["flex attention, document mask"] = lambda: compiled(q, k, v, block_mask=block_mask, enable_gqa=True)
    medians = {}
    with torch.no_grad():
        for name, fn in kernels.items():
            fn()                                                            # warm up (and compile)
            medians[name] = statistics.median(seconds_per_call(fn, repeats))
    best = next(iter(medians.values()))
    lines = ["| attention (forward, packed row) | s | vs minirl_varlen |", "|---|---|---|"]
    lines += [f"| {name} | {s:.4f} | x{s / best:.2f} |" for name, s in medians.items()]
    return "\n".join(lines)


# -- 4. memory of the log-prob pass -----------------------------------------------------------------------------

def logprobs_before_slicing(model, batch):
    """What the log-prob pass did before: logits and entropy at every position, then the response slice."""
    inputs, _ = _model_inputs(model, batch, True)
    logits = model(**inputs, use_cache=False).logits[0].float() / 1.0               # [nnz, V]
    labels = torch.roll(batch["input_ids"], -1, 1).reshape(-1)[batch["attention_mask"].reshape(-1).bool()]
    return logprobs_from_logits(logits, labels), entropy_from_logits(logits)


def memory_probe(mode, rows):
    """In a fresh process: the rise of peak RSS (MiB) during one no-grad log-prob pass."""
    from transformers import Qwen2Config, Qwen2ForCausalLM
    config = Qwen2Config(vocab_size=VOCAB_152K, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=2, num_key_value_heads=1, tie_word_embeddings=True)
    config._attn_implementation = attention.VARLEN_CPU
    model = Qwen2ForCausalLM(config).eval()
    batch = varied_batch(rows, VOCAB_152K, max_len=128, max_prompt=64)
    rss_before = int(Path("/proc/self/statm").read_text().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    high_before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    with torch.no_grad():
        if mode == "before":
            logprobs_before_slicing(model, batch)
        else:
            token_logprobs(model, batch, use_remove_padding=True, calc_entropy=True)
    high = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    print(json.dumps({"peak_mib": (high - rss_before) / 2 ** 20, "stale_high_water": high_before > high,
                      "tokens": int(batch["attention_mask"].sum()),
                      "response_tokens": int(batch["response_mask"].sum())}))


def memory_table(rows):
    runs = {}
    for mode in ("before", "after"):
        out = subprocess.run([sys.executable, __file__, "--memory-probe", mode, "--rows", str(rows)], cwd=ROOT,
                             check=True, capture_output=True, text=True)
        runs[mode] = json.loads(out.stdout.strip().splitlines()[-1])
    before, after = runs["before"], runs["after"]
    return (f"{rows} sequences of 16..128 tokens (prompt 8..64), {before['tokens']} tokens of which "
            f"{before['response_tokens']} response; vocab {VOCAB_152K}, logits fp32\n\n"
            "| log-prob pass (no grad, with entropy) | peak memory rise |\n|---|---|\n"
            f"| every position's logits (before) | {before['peak_mib']:.0f} MiB |\n"
            f"| response positions, head in chunks (now) | {after['peak_mib']:.0f} MiB |\n"
            f"\nx{before['peak_mib'] / after['peak_mib']:.1f} lower")


# -- 5. FLOP/s ---------------------------------------------------------------------------------------------------

def matmul_peak(size=2048, repeats=5):
    a, b = torch.randn(size, size), torch.randn(size, size)
    a @ b
    return 2 * size ** 3 / statistics.median(seconds_per_call(lambda: a @ b, repeats))


def flops_table(model_dir, batch, seconds):
    config = load(model_dir, "sdpa").config
    work = flops.training_flops(config, batch["attention_mask"].sum(-1).tolist(), int(batch["response_mask"].sum()))
    peak = matmul_peak()
    achieved = work / seconds
    return (f"matmul peak of {torch.get_num_threads()} thread(s) (fp32, 2048^3): {peak / 1e9:.1f} "
            f"GFLOP/s\npacked actor forward+backward: {work / 1e9:.2f} GFLOP in {seconds:.3f} s = "
            f"{achieved / 1e9:.1f} GFLOP/s, {achieved / peak:.1%} of the matmul peak")


def matmul_floor_seconds(config, tokens, head_tokens, repeats, backward=True, recompute=False):
    """Seconds of a pass's matmuls alone, at the shapes of `config`'s linear layers over `tokens` packed tokens of
    which `head_tokens` reach the LM head, on random inputs: each linear's forward and, with backward, its input-
    and weight-gradient products; recompute (gradient checkpointing) runs the layers' forwards twice."""
    def forward_backward(rows, shapes):
        x = [torch.randn(rows, fan_in) for fan_in, _ in shapes]                 # [rows, in]
        w = [torch.randn(fan_out, fan_in) for fan_in, fan_out in shapes]        # [out, in]
        g = [torch.randn(rows, fan_out) for _, fan_out in shapes]               # [rows, out]
        fwd = statistics.median(seconds_per_call(lambda: [x_ @ w_.t() for x_, w_ in zip(x, w)], repeats, 1))
        bwd = statistics.median(seconds_per_call(lambda: [(g_ @ w_, g_.t() @ x_) for x_, w_, g_ in zip(x, w, g)],
                                                 repeats, 1))
        return fwd, bwd

    layer_fwd, layer_bwd = forward_backward(tokens, flops.decoder_linear_shapes(config))
    head_fwd, head_bwd = forward_backward(head_tokens, [(config.hidden_size, config.vocab_size)])
    if not backward:
        return config.num_hidden_layers * layer_fwd + head_fwd
    return config.num_hidden_layers * ((2 if recompute else 1) * layer_fwd + layer_bwd) + head_fwd + head_bwd


def floor_table(model_dir, repeats, groups=8, n=4, prompt_tokens=30, response_tokens=64):
    """The addition-shaped micro-batch's update and reference passes against matmul_floor_seconds."""
    model = load(model_dir, attention.VARLEN_CPU)
    batch = grouped_batch(groups, n, model.config.vocab_size, (prompt_tokens,) * 2, (response_tokens,) * 2)
    head_tokens = int(batch["response_mask"].sum())
    tokens = groups * prompt_tokens + head_tokens                           # each prompt once
    lines = ["| pass (addition-shaped micro-batch) | measured s | matmuls alone s | measured / matmuls |",
             "|---|---|---|---|"]
    model.train()
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    update = statistics.median(seconds_per_call(lambda: update_pass(model, batch, True), repeats, 1))
    floor = matmul_floor_seconds(model.config, tokens, head_tokens, repeats, recompute=True)
    lines.append(f"| actor forward+backward, gradient checkpointing | {update:.4f} | {floor:.4f} | "
                 f"x{update / floor:.2f} |")
    model.gradient_checkpointing_disable()
    model.eval()
    reference = statistics.median(seconds_per_call(lambda: logprob_pass(model, batch, True, calc_entropy=False),
                                                   repeats, 1))
    floor = matmul_floor_seconds(model.config, tokens, head_tokens, repeats, backward=False)
    lines.append(f"| reference log-prob pass (no grad) | {reference:.4f} | {floor:.4f} | x{reference / floor:.2f} |")
    return "\n".join(lines)


# -- 6. GRPO groups: each prompt once -----------------------------------------------------------------------------

def grouped_batch(groups, n, vocab, prompt_lengths, response_lengths=(16, 64), seed=0):
    """`groups` prompts x n responses, a group's rows adjacent; prompt and response lengths uniform in the
    given (min, max); left-padded prompts, right-padded responses."""
    g = torch.Generator().manual_seed(seed)
    P, R = prompt_lengths[1], response_lengths[1]
    ids = torch.randint(10, vocab, (groups * n, P + R), generator=g)
    mask = torch.zeros_like(ids)
    for group in range(groups):
        p = int(torch.randint(prompt_lengths[0], P + 1, (1,), generator=g))
        rows = slice(group * n, (group + 1) * n)
        ids[rows, :P] = ids[group * n, :P]
        mask[rows, P - p:P] = 1
        for row in range(group * n, (group + 1) * n):
            mask[row, P:P + int(torch.randint(response_lengths[0], R + 1, (1,), generator=g))] = 1
    ids = ids * mask
    return {"input_ids": ids, "attention_mask": mask, "position_ids": (mask.cumsum(-1) - 1).clamp(min=0),
            "responses": ids[:, P:], "response_mask": mask[:, P:]}


@contextlib.contextmanager
def prompts_packed_once(once):
    """Switch forward's shared-prompt packing off (once=False) for a while."""
    real = forward.shares_prompts
    forward.shares_prompts = real if once else (lambda model, use_remove_padding: False)
    try:
        yield
    finally:
        forward.shares_prompts = real


def shared_prompts_table(model_dir, rows, repeats, n=4):
    model = load(model_dir, attention.VARLEN_CPU)
    batches = {"GSM8K-sized prompts 78..286": grouped_batch(rows // n, n, model.config.vocab_size, (78, 286)),
               "short prompts 26..34": grouped_batch(rows // n, n, model.config.vocab_size, (26, 34))}
    lines = ["| micro-batch | pass | prompt per response s | prompt once s | ratio |", "|---|---|---|---|---|"]
    for label, batch in batches.items():
        valid = int(batch["attention_mask"].sum())
        shape = f"{label}, {rows // n} x {n} responses 16..64 ({valid} tokens)"
        for name, fn in (("actor forward+backward", update_pass), ("log-prob pass (no grad)", logprob_pass)):
            times = {False: [], True: []}
            for once in times:
                with prompts_packed_once(once):
                    fn(model, batch, True)                                  # warm up
            for _ in range(repeats):
                for once in times:                                          # alternating
                    with prompts_packed_once(once):
                        times[once] += seconds_per_call(lambda: fn(model, batch, True), 1)
            each, once = statistics.median(times[False]), statistics.median(times[True])
            lines.append(f"| {shape} | {name} | {each:.3f} | {once:.3f} | x{each / once:.2f} |")
    return "\n".join(lines)


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=8,
                        help=f"demo steps per run (part 1); the first {WARMUP_STEPS} warm up and are not timed")
    parser.add_argument("--demo", default=str(ROOT / "demo"))
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--rounds", type=int, default=2, help="packed and padded demo runs, alternating (part 1)")
    parser.add_argument("--rows", type=int, default=16, help="sequences per micro-batch in parts 2-4")
    parser.add_argument("--skip-run", action="store_true", help="leave out the torchrun demo (part 1)")
    parser.add_argument("--flex", action="store_true", help="also time flex attention (compiles for ~1 min)")
    parser.add_argument("--threads", type=int, default=1,
                        help="torch threads in parts 2-5 (1: what each of the trainer's 2 ranks uses on 2 cores)")
    parser.add_argument("--memory-probe", choices=["before", "after"], help=argparse.SUPPRESS)
    args = parser.parse_args()
    if not args.skip_run and args.steps <= WARMUP_STEPS:
        parser.error(f"--steps {args.steps}: the first {WARMUP_STEPS} steps of a run are warm-up; pass more")
    torch.set_num_threads(args.threads)
    if args.memory_probe:
        return memory_probe(args.memory_probe, args.rows)
    model_dir = f"{args.demo}/model"
    if not args.skip_run:
        print(f"## 1. demo step, 2 ranks, hf rollout, packed vs padded (medians of {args.rounds} alternating runs "
              f"x {args.steps - WARMUP_STEPS} steps)\n")
        packed, padded = [], []
        for _ in range(args.rounds):            # the runs alternate, so a change in the machine's load hits both
            packed += run_demo_steps(args.steps, args.demo, True)
            padded += run_demo_steps(args.steps, args.demo, False)
        print(demo_table(packed, padded))
    model_vocab = load(model_dir, "sdpa").config.vocab_size
    batches = {"uniform 16..384": varied_batch(args.rows, model_vocab),
               "short 40..80": varied_batch(args.rows, model_vocab, min_len=40, max_len=80, max_prompt=64)}
    print(f"\n## 2. the model passes, demo model (median of {args.repeats}, variants alternating)\n")
    results = {label: varied_lengths(model_dir, batch, args.repeats) for label, batch in batches.items()}
    print(varied_table(batches, results))
    print(f"\n## 3. attention alone, the uniform 16..384 row (median of {args.repeats})\n")
    print(attention_table(batches["uniform 16..384"], args.repeats, args.flex))
    print("\n## 4. peak memory of the log-prob pass, 152k vocabulary\n")
    print(memory_table(args.rows))
    print("\n## 5. FLOP/s of the actor update\n")
    print(flops_table(model_dir, batches["uniform 16..384"],
                      results["uniform 16..384"]["actor forward+backward"]["packed, minirl_varlen"]))
    print()
    print(floor_table(model_dir, args.repeats))
    print(f"\n## 6. GRPO groups, each prompt once in the packed row vs once per response (median of {args.repeats})\n")
    print(shared_prompts_table(model_dir, args.rows, args.repeats))


if __name__ == "__main__":
    main()
