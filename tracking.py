"""Logging: console, TensorBoard, wandb and always <af_output_dir>/metrics.jsonl (rank 0 only), verl's metric
computations over a step's batch (critic/*, response_length/*, timing_*, perf/*, val-core/*), and the reward-curve
plot (`python minirl.py --plot RUN_DIR`). Left out: verl's other loggers (mlflow, swanlab, ...).
"""
from __future__ import annotations

import functools
import json
import numbers
import os
import sys
from collections.abc import Hashable
from pathlib import Path

import numpy as np
import psutil
import torch

METRICS_FILE = "metrics.jsonl"       # in af_output_dir, beside the TENSORBOARD_DIR folder
TENSORBOARD_DIR = "tensorboard"


class Tracker:
    """Where a step's metrics go (rank 0 only): metrics.jsonl always, the console, TensorBoard and wandb as
    trainer.logger asks."""

    CONSOLE_KEYS = ("critic/score/mean", "val-core", "response_length/mean", "actor/pg_loss", "actor/kl_loss",
                    "critic/vf_loss", "actor/entropy", "actor/grad_norm", "timing_s/step")

    def __init__(self, cfg, enabled, start_step=0, saved_row=None):
        """start_step: the step a resumed run continues after; rows a killed run logged past it are dropped, so
        metrics.jsonl holds each step once (and `log` merges a second row for the last step into it). saved_row:
        that step's metrics as its checkpoint kept them, logged again when metrics.jsonl lacks the step (the run was
        killed after the save, before the append)."""
        self.enabled = enabled
        self.loggers = cfg.trainer.logger
        if not enabled:
            return
        out = Path(cfg.af_output_dir)
        out.mkdir(parents=True, exist_ok=True)
        logged = drop_rows_after(out / METRICS_FILE, start_step)
        self.last_step = max(logged, default=None)
        self.jsonl = open(out / METRICS_FILE, "a")
        self.tb = self.wandb = None
        self.generation_rows = []           # the wandb table of validation generations, one row per validation
        if "tensorboard" in self.loggers:
            from torch.utils.tensorboard import SummaryWriter
            # resumed: TensorBoard hides what the killed run logged past the checkpoint, as this file does
            self.tb = SummaryWriter(log_dir=str(out / TENSORBOARD_DIR),
                                    purge_step=start_step + 1 if start_step else None)
        if "wandb" in self.loggers:
            import wandb
            os.environ.setdefault("WANDB_MODE", "offline")
            self.wandb = wandb.init(project=cfg.trainer.project_name, name=cfg.trainer.experiment_name,
                                    dir=str(out), config=cfg.to_dict())
        if saved_row is not None and start_step not in logged:
            self.log(saved_row, step=start_step)

    def log(self, metrics, step):
        if not self.enabled:
            return
        if step == self.last_step:
            # a resumed run validates before training (val_before_train, as verl) at the step it resumed from,
            # whose row metrics.jsonl holds already: the validation joins that row, so each step keeps one row
            self.add_to_last_row(metrics)
        else:
            self.jsonl.write(json.dumps({"step": step, **metrics}) + "\n")
            self.jsonl.flush()
        self.last_step = step
        if self.tb is not None:
            for key, value in metrics.items():
                self.tb.add_scalar(key, value, step)
            self.tb.flush()
        if self.wandb is not None:
            self.wandb.log(metrics, step=step)
        if "console" in self.loggers:
            shown = {k: v for k, v in metrics.items() if k.startswith(self.CONSOLE_KEYS)}
            print(f"step {step}: " + " ".join(f"{k}={v:.4g}" for k, v in shown.items()), flush=True)

    def log_generations(self, samples, step):
        """trainer.log_val_generations, as verl's ValidationGenerationsLogger writes them: `samples` (input,
        output, score) as TensorBoard text and as the wandb table "val/generations", which gains a row per
        validation (step, then input_i, output_i, score_i of each sample)."""
        if not self.enabled or not samples:
            return
        if self.tb is not None:
            self.tb.add_text("val/generations", generations_text(samples, step), step)
            self.tb.flush()
        if self.wandb is not None:
            import wandb
            columns = ["step"] + [f"{field}_{i}" for i in range(1, len(samples) + 1)
                                  for field in ("input", "output", "score")]
            self.generation_rows.append([step] + [value for sample in samples for value in sample])
            self.wandb.log({"val/generations": wandb.Table(columns=columns, data=self.generation_rows)}, step=step)

    def add_to_last_row(self, metrics):
        """Rewrite metrics.jsonl with `metrics` merged into its last row (newer values win), to a temporary file
        renamed into place; the append handle is reopened on the new file."""
        path = Path(self.jsonl.name)
        self.jsonl.close()
        rows = complete_rows(path, path.read_text(errors="replace"))
        merged = {**rows[-1][1], **metrics}
        staging = path.with_name(path.name + ".tmp")
        staging.write_text("".join(line + "\n" for line, _ in rows[:-1]) + json.dumps(merged) + "\n")
        os.replace(staging, path)
        self.jsonl = open(path, "a")

    def close(self):
        if self.enabled:
            self.jsonl.close()
            if self.tb is not None:
                self.tb.close()
            if self.wandb is not None:
                self.wandb.finish()


def pick_validation_generations(inputs, outputs, scores, count):
    """The `count` validation generations verl logs (RayPPOTrainer._maybe_log_val_generations, v0.5.0): the
    (input, output, score) triples sorted by input, shuffled by numpy's RandomState(42), the first `count`, so each
    validation shows the same prompts while they fit."""
    samples = sorted(zip(inputs, outputs, scores), key=lambda sample: sample[0])
    np.random.RandomState(42).shuffle(samples)
    return samples[:count]


def generations_text(samples, step):
    """The samples as one Markdown text (TensorBoard's text tab renders it)."""
    parts = [f"**Generation Results - Step {step}**\n\n"]
    for number, (prompt, response, score) in enumerate(samples, 1):
        parts.append(f"### Sample {number}\n**Input:** {prompt}\n\n**Output:** {response}\n\n**Score:** {score}\n\n"
                     f"---\n\n")
    return "".join(parts)


def complete_rows(path, text):
    """[(line, row)] for the metrics rows in `text` (the file at `path`). A line that is not a JSON row with a step
    (the partial last line of an append that a crash cut short, or one still being written) is left out with a
    warning."""
    rows = []
    for number, line in enumerate(text.splitlines(), 1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
            row["step"]
        except (ValueError, KeyError, TypeError):
            print(f"warning: {path}, line {number}: not a complete metrics row ({line[:60]!r}...); left out",
                  file=sys.stderr, flush=True)
            continue
        rows.append((line, row))
    return rows


def drop_rows_after(path, step):
    """Rewrite the metrics file without rows past `step` or lines that are not rows (complete_rows), to a temporary
    file renamed into place. Returns the steps of the rows kept."""
    if not path.is_file():
        return set()
    text = path.read_text(errors="replace")
    kept = [(line, row) for line, row in complete_rows(path, text) if row["step"] <= step]
    if len(kept) < len([line for line in text.splitlines() if line.strip()]) or not text.endswith("\n"):
        staging = path.with_name(path.name + ".tmp")
        staging.write_text("".join(line + "\n" for line, _ in kept))
        os.replace(staging, path)
    return {row["step"] for _, row in kept}


def stats(prefix, values):
    values = np.asarray(values, dtype=np.float64)
    if values.size == 0:
        return {}
    return {f"{prefix}/mean": float(values.mean()), f"{prefix}/max": float(values.max()),
            f"{prefix}/min": float(values.min())}


def data_metrics(batch, response_length):
    """verl's compute_data_metrics over the whole batch (critic/score, critic/advantages, response_length, ...)."""
    mask = batch["response_mask"].bool()
    resp_len = batch["attention_mask"][:, -response_length:].sum(-1).float()   # multi-turn: tool tokens count too
    prompt_len = batch["attention_mask"][:, :batch["prompts"].shape[1]].sum(-1).float()
    m = {}
    m.update(stats("critic/score", batch["token_level_scores"].sum(-1).tolist()))
    m.update(stats("critic/rewards", batch["token_level_rewards"].sum(-1).tolist()))
    m.update(stats("critic/advantages", batch["advantages"][mask].tolist()))
    m.update(stats("critic/returns", batch["returns"][mask].tolist()))
    if "values" in batch:
        values, returns = batch["values"][mask], batch["returns"][mask]
        m.update(stats("critic/values", values.tolist()))
        m["critic/vf_explained_var"] = float(1 - torch.var(returns - values) / (torch.var(returns) + 1e-5))
    m.update(stats("response_length", resp_len.tolist()))
    m["response_length/clip_ratio"] = float((resp_len == response_length).float().mean())
    m.update(stats("prompt_length", prompt_len.tolist()))
    m["prompt_length/clip_ratio"] = float((prompt_len == batch["prompts"].shape[1]).float().mean())
    return m


BOOTSTRAP_SAMPLES, BOOTSTRAP_SEED = 1000, 42     # verl's bootstrap_metric defaults


def validation_metrics(scores, sources, n, extras=None):
    """Per data_source and variable, verl's validation metrics (process_validation_metrics and the val-core rule of
    RayPPOTrainer._validate, v0.5.0). The variables: the reward, and each number a reward function's dict result
    holds in every row (verl's reward_extra_info, e.g. "acc", and its "score"); the core one is "acc" where there
    is one, else the reward. Per prompt and variable: mean@n; with n > 1 also std@n (over its n values) and, for
    k = 2, 4, 8, ... below n and k = n, best@k and worst@k (/mean and /std over BOOTSTRAP_SAMPLES draws of k of
    its n values with replacement: bootstrap_draws) and, where the results hold a "pred", maj@k (the value of the
    first drawn response giving the draw's most common pred). Each is then averaged over the source's prompts.
    The core variable's mean, best and maj at n are val-core/<source>/..., the rest val-aux/<source>/....
    `scores`/`sources`/`extras` hold n consecutive entries per prompt."""
    variables = {**_numbers_in_every_row(extras or []), "reward": scores}
    core = "acc" if "acc" in variables else "reward"
    prompt_sources = np.asarray(sources[::n])
    has_preds = n > 1 and extras and all(isinstance(row.get("pred"), Hashable) and "pred" in row for row in extras)
    majority = {}                          # bootstrap size k -> [prompts, B] the response maj@k takes
    if has_preds:
        preds = [row["pred"] for row in extras]
        per_prompt_preds = [preds[start:start + n] for start in range(0, len(preds), n)]
        majority = {k: majority_positions(bootstrap_draws(n, k), per_prompt_preds) for k in bootstrap_sizes(n)}
    metrics = {}
    for name, values in variables.items():
        per_prompt = np.asarray(values, dtype=np.float64).reshape(-1, n)                # [prompts, n]
        stats = _prompt_statistics(per_prompt, majority)                               # {stat: [prompts]}
        for source in sorted(set(prompt_sources)):
            mine = prompt_sources == source
            for stat, per_prompt_values in stats.items():
                is_core = name == core and stat.startswith(("mean", "maj", "best")) and f"@{n}" in stat
                section = "val-core" if is_core else "val-aux"
                metrics[f"{section}/{source}/{name}/{stat}"] = float(per_prompt_values[mine].mean())
    return metrics


def bootstrap_sizes(n):
    """The k of best@k, worst@k, maj@k: 2, 4, 8, ... below n, and n."""
    return [2 ** i for i in range(1, n.bit_length()) if 2 ** i < n] + [n]


def _prompt_statistics(per_prompt, majority):
    """{statistic name: [prompts]} for one variable's values [prompts, n]; majority: majority_positions per k
    ({} without preds)."""
    n = per_prompt.shape[1]
    stats = {f"mean@{n}": per_prompt.mean(1)}
    if n == 1:
        return stats
    stats[f"std@{n}"] = per_prompt.std(1)
    for k in bootstrap_sizes(n):
        drawn = per_prompt[:, bootstrap_draws(n, k)]                                    # [prompts, B, k]
        picked = {"best": drawn.max(2), "worst": drawn.min(2)}                         # [prompts, B]
        if k in majority:
            picked["maj"] = np.take_along_axis(per_prompt, majority[k], 1)
        for label, values in picked.items():
            stats[f"{label}@{k}/mean"], stats[f"{label}@{k}/std"] = values.mean(1), values.std(1)
    return stats


@functools.lru_cache(maxsize=None)
def bootstrap_draws(n, k):
    """[BOOTSTRAP_SAMPLES, k] indices into n values: the draws verl's bootstrap_metric makes (numpy's legacy
    generator seeded with BOOTSTRAP_SEED, then k indices with replacement per sample). verl seeds again for every
    prompt and variable, so all of them get these same draws. (Cached: do not modify the array.)"""
    generator = np.random.RandomState(BOOTSTRAP_SEED)
    return np.stack([generator.choice(n, size=k, replace=True) for _ in range(BOOTSTRAP_SAMPLES)])


def _numbers_in_every_row(extras):
    """{key: values} of the extras' keys that hold a real number (bools included) in every row, in the first
    row's order; verl leaves text, such as a "pred", out of the means as well."""
    if not extras:
        return {}
    return {key: [row[key] for row in extras] for key in extras[0]
            if all(isinstance(row.get(key), (numbers.Real, np.bool_)) for row in extras)}


def majority_positions(draws, preds, chunk=128):
    """The bootstrap draws [B, k] and preds (a list of n per prompt) -> [prompts, B]: per prompt and draw, which
    of the n responses verl's calc_maj_val takes the value of: the first drawn response whose pred is the most
    common one in the draw (ties: the pred drawn first). Prompts go `chunk` at a time ([chunk, B, k, n] booleans)."""
    n, k = len(preds[0]), draws.shape[1]
    codes = np.asarray([[list(dict.fromkeys(row)).index(pred) for pred in row] for row in preds])   # [P, n]
    positions = []
    for start in range(0, len(codes), chunk):
        drawn = codes[start:start + chunk][:, draws]                                      # [c, B, k]
        votes = drawn[..., None] == np.arange(n)                                          # [c, B, k, n]
        counts = votes.sum(2)                                                              # [c, B, n] per pred code
        first = np.where(votes.any(2), votes.argmax(2), k)                                # [c, B, n] first drawn at
        tied = counts == counts.max(2, keepdims=True)                                      # [c, B, n]
        winner_at = np.where(tied, first, k).min(2)                                        # [c, B] first drawn of them
        positions.append(draws[np.arange(len(draws)), winner_at])                         # [c, B] into n
    return np.concatenate(positions)


def memory_metrics(device):
    """verl's memory figures of an actor update (fsdp_workers.update_actor, v0.5.0), this rank's: the host's used
    memory, and on an accelerator the peak memory allocated and reserved since the process started."""
    m = {"perf/cpu_memory_used_gb": psutil.virtual_memory().used / 2**30}
    if device.type != "cpu":
        accelerator = getattr(torch, device.type)          # torch.cuda, or torch.npu (torch_npu)
        m["perf/max_memory_allocated_gb"] = accelerator.max_memory_allocated() / 2**30
        m["perf/max_memory_reserved_gb"] = accelerator.max_memory_reserved() / 2**30
    return m


def timing_metrics(timings, batch, world_size):
    total_tokens = int(batch["attention_mask"].sum())
    response_tokens = int(batch["response_mask"].sum())
    m = {f"timing_s/{k}": v for k, v in timings.items()}
    for name, seconds in timings.items():
        if name in ("gen",):
            m[f"timing_per_token_ms/{name}"] = 1000 * seconds / max(response_tokens, 1)
        elif name != "step":
            m[f"timing_per_token_ms/{name}"] = 1000 * seconds / max(total_tokens, 1)
    m["perf/total_num_tokens"] = total_tokens
    m["perf/time_per_step"] = timings["step"]
    m["perf/throughput"] = total_tokens / (timings["step"] * world_size)
    return m


# ----------------------------------------------------------------------------------------------------------------
# Plotting: the reward curve of a run


def plot(run_dir, out=None):
    """PNG of training score and validation reward against the step, from <run_dir>/metrics.jsonl."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    path = Path(run_dir) / METRICS_FILE
    if not path.is_file():
        raise SystemExit(f"--plot: no metrics.jsonl in '{run_dir}' (pass the run's af_output_dir)")
    rows = [row for _, row in complete_rows(path, path.read_text(errors="replace"))]   # a live run's too
    fig, ax = plt.subplots(figsize=(7, 4))
    train = [(r["step"], r["critic/score/mean"]) for r in rows if "critic/score/mean" in r]
    if train:
        ax.plot(*zip(*train), label="train score (mean)", alpha=0.6)
    val_keys = sorted({k for r in rows for k in r if k.startswith("val-core/")})
    for key in val_keys:
        points = [(r["step"], r[key]) for r in rows if key in r]
        ax.plot(*zip(*points), marker="o", label=key)
    ax.set_xlabel("step")
    ax.set_ylabel("reward")
    ax.grid(alpha=0.3)
    ax.legend()
    out = out or str(Path(run_dir) / "reward_curve.png")
    fig.tight_layout()
    fig.savefig(out, dpi=120)
    print(f"wrote {out}")
    return out
