"""Benchmark losses.py's vectorised GRPO and GAE advantages against naive Python-loop versions written here.

GRPO's naive version loops over samples and groups with a dict of uids (as verl v0.5.0 does); GAE's naive version
loops over samples and time steps with Python floats. Both are checked to agree with losses.py before timing.
The "grpo, R=1" row times GRPO on a one-token mask: the group statistics alone, without the [B, R] broadcast of
the advantage (which costs the same in both versions and dominates at R = 1024).
Usage: .venv/bin/python bench/advantage_estimators.py [--quick] [--repeats N] [--threads N]
Prints the median time of each and the speedup, then a markdown table.
"""

import argparse
import os
import sys
from collections import defaultdict

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import losses  # noqa: E402
from timing import median_seconds  # noqa: E402


def naive_grpo(scores, uids, mask, eps=1e-6):
    """Per-sample / per-group loop: group scores in a dict, then normalise each sample by its group's stats."""
    by_uid = defaultdict(list)
    for i in range(scores.shape[0]):
        by_uid[uids[i]].append(scores[i])
    stats = {}
    for uid, group in by_uid.items():
        if len(group) == 1:
            stats[uid] = (torch.tensor(0.0), torch.tensor(1.0))
        else:
            group_scores = torch.stack(group)
            stats[uid] = (group_scores.mean(), group_scores.std())
    normalised = scores.clone()
    for i in range(scores.shape[0]):
        mean, std = stats[uids[i]]
        normalised[i] = (scores[i] - mean) / (std + eps)
    advantages = normalised.unsqueeze(-1) * mask  # [B, R]
    return advantages, advantages


def naive_gae(rewards, values, mask, gamma, lam):
    """Per-sample loop over time with Python floats, then batch whitening."""
    raw = []
    for r_row, v_row, m_row in zip(rewards.tolist(), values.tolist(), mask.tolist()):
        next_value, last = 0.0, 0.0
        row = [0.0] * len(r_row)
        for step in range(len(r_row) - 1, -1, -1):
            if m_row[step]:
                last = r_row[step] + gamma * next_value - v_row[step] + gamma * lam * last
                next_value = v_row[step]
            row[step] = last
        raw.append(row)
    raw = torch.tensor(raw)  # [B, R]
    return losses.masked_whiten(raw, mask), raw + values


def make_batch(rows, length, group_size, seed=0):
    gen = torch.Generator().manual_seed(seed)
    lengths = torch.randint(length // 8, length + 1, (rows,), generator=gen)
    mask = (torch.arange(length)[None, :] < lengths[:, None]).float()  # [B, R]
    rewards = torch.zeros(rows, length)
    rewards[torch.arange(rows), lengths - 1] = torch.randint(0, 2, (rows,), generator=gen).float()  # outcome reward
    values = torch.randn(rows, length, generator=gen) * mask
    uids = [f"prompt-{i // group_size}" for i in range(rows)]
    return rewards, values, mask, uids


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="small batch (256 x 128) for a fast smoke run")
    parser.add_argument("--repeats", type=int, default=7, help="timed repeats of each implementation")
    parser.add_argument("--threads", type=int, default=None,
                        help="torch intra-op threads (default: torch's choice); 1 is steadier on a busy machine")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    rows, length, group_size = (256, 128, 8) if args.quick else (4096, 1024, 8)
    rewards, values, mask, uids = make_batch(rows, length, group_size)
    scores = rewards.sum(-1)  # [B]
    gamma, lam = 0.99, 0.95

    one_token = mask[:, :1]  # [B, 1]: isolates the group statistics from the [B, R] broadcast both versions share
    cases = {
        "grpo": (lambda: losses.grpo_advantages(token_rewards=rewards, mask=mask, group_ids=uids),
                 lambda: naive_grpo(scores, uids, mask)),
        "grpo, R=1": (lambda: losses.grpo_advantages(token_rewards=scores[:, None], mask=one_token, group_ids=uids),
                      lambda: naive_grpo(scores, uids, one_token)),
        "gae": (lambda: losses.gae_advantages(token_rewards=rewards, values=values, mask=mask, gamma=gamma, lam=lam),
                lambda: naive_gae(rewards, values, mask, gamma, lam)),
    }
    print(f"batch {rows} x {length}, groups of {group_size}, torch {torch.__version__}, "
          f"{torch.get_num_threads()} threads, {args.repeats} repeats")
    results = []
    for name, (vectorised, naive) in cases.items():
        for got, want in zip(vectorised(), naive()):
            torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)
        fast = median_seconds(vectorised, args.repeats)
        slow = median_seconds(naive, args.repeats)
        results.append((name, fast, slow))
        print(f"{name}: losses.py {fast * 1e3:.1f} ms, naive loop {slow * 1e3:.1f} ms, speedup {slow / fast:.1f}x")

    print(f"\n| estimator (batch {rows}x{length}) | losses.py (ms, median) | naive loop (ms, median) | speedup |")
    print("|---|---|---|---|")
    for name, fast, slow in results:
        print(f"| {name} | {fast * 1e3:.1f} | {slow * 1e3:.1f} | {slow / fast:.1f}x |")


if __name__ == "__main__":
    main()
