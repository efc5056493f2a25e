"""Batch rows and who holds them.

A batch is a dict of tensors [B, ...] and python lists [B] (uid, data_source, reward_model, ...), one row per
response. The rule the trainer follows (minirl.Trainer.train_step): every rank holds the full batch, computes on
its own rows (`rows_of_rank`), then gathers the results so every rank holds the full batch again.

Left out: verl's DataProto (meta info, chunking, padding to a divisor); rows here always divide by the world size
(batch_plan.check_batch checks it, validation pads).
"""
from __future__ import annotations

import heapq
import math

import numpy as np
import torch
import torch.distributed as dist


def batch_size_of(batch):
    return len(batch["uid"]) if "uid" in batch else len(next(iter(batch.values())))


def take(batch, index):
    """Rows `index` of every field of a batch dict (tensors indexed, lists picked)."""
    index_tensor = torch.as_tensor(index, dtype=torch.long)
    return {k: (v[index_tensor] if isinstance(v, torch.Tensor) else [v[i] for i in index]) for k, v in batch.items()}


def concat(batches):
    """The rows of several batches with the same fields, one batch after another."""
    return {key: torch.cat([b[key] for b in batches]) if isinstance(value, torch.Tensor)
            else [row for b in batches for row in b[key]] for key, value in batches[0].items()}


def repeat_interleave(batch, n):
    """Each prompt n times in a row: p0,p0,..,p1,p1,.. (verl's repeat(interleave=True))."""
    return take(batch, [i for i in range(batch_size_of(batch)) for _ in range(n)])


def rows_of_rank(total, rank, world_size):
    """The row indices rank `rank` of `world_size` works on: its contiguous share of `total` rows."""
    if total % world_size:
        raise ValueError(f"{total} rows do not split evenly over {world_size} ranks")
    share = total // world_size
    return list(range(rank * share, (rank + 1) * share))


# ----------------------------------------------------------------------------------------------------------------
# Collectives (no-ops on one process)


def gather_tp_groups(rows, world_size, tp_size):
    """All ranks' rows, keeping one copy per TP group (its first rank's), in group order: a [b, ...] tensor gives
    [b * world/tp, ...], a list of python objects (pickled across) the concatenated list. Ranks of a TP group
    generated the same rows, so the other copies are redundant. A collective."""
    if world_size == 1:
        return rows
    if not isinstance(rows, torch.Tensor):
        parts = [None] * world_size
        dist.all_gather_object(parts, rows)
        return [row for part in parts[::tp_size] for row in part]
    parts = [torch.empty_like(rows) for _ in range(world_size)]
    dist.all_gather(parts, rows.contiguous())
    return torch.cat(parts[::tp_size])


def all_gather_rows(rows, world_size):
    """Concatenate each rank's rows (a [b, ...] tensor, same b on every rank, or a list) in rank order."""
    return gather_tp_groups(rows, world_size, tp_size=1)


def all_reduce_sum(values, device, group=None):
    """Sum a list of floats over the ranks of `group` (default: all; one collective); the same list when not
    distributed."""
    tensor = torch.tensor(values, dtype=torch.float64, device=device)
    if dist.is_initialized() and dist.get_world_size() > 1:
        dist.all_reduce(tensor, group=group)
    return tensor.tolist()


# ----------------------------------------------------------------------------------------------------------------
# Balancing: equal-count partitions of near-equal token totals


def balanced_partitions(lengths, k, equal_size=False):
    """Split row indices into k groups with near-equal total length (longest-first greedy: each row goes to the
    lightest group; with equal_size, only to groups that still have room). Groups keep ascending row order.
    verl uses Karmarkar-Karp here; the partition differs. With one mini-batch per step the loss does not (it is
    normalised over the whole mini-batch); with several, the rows updated together differ."""
    n = len(lengths)
    capacity = math.ceil(n / k) if equal_size else n
    heap = [(0, g) for g in range(k)]
    groups = [[] for _ in range(k)]
    order = sorted(range(n), key=lambda i: (-lengths[i], i))
    for i in order:
        skipped = []
        total, g = heapq.heappop(heap)
        while len(groups[g]) >= capacity:
            skipped.append((total, g))
            total, g = heapq.heappop(heap)
        groups[g].append(i)
        heapq.heappush(heap, (total + lengths[i], g))
        for item in skipped:
            heapq.heappush(heap, item)
    return [sorted(group) for group in groups]


def seqlen_metrics(lengths, parts):
    """verl's global_seqlen/*: token totals per rank before (contiguous shares) and after balancing."""
    per_rank = [sum(lengths[i] for i in part) for part in parts]
    before = [sum(lengths[i] for i in rows_of_rank(len(lengths), r, len(parts))) for r in range(len(parts))]
    return {"global_seqlen/min": min(before), "global_seqlen/max": max(before),
            "global_seqlen/minmax_diff": max(before) - min(before), "global_seqlen/balanced_min": min(per_rank),
            "global_seqlen/balanced_max": max(per_rank), "global_seqlen/mean": float(np.mean(before))}


def balance_and_shard(batch, rank, world_size, balance=True, whole_groups=False):
    """Reorder the full batch rank-major so that rank r's rows are rows_of_rank(B, r, world_size); with `balance`
    (trainer.balance_batch) rank r gets the r-th of `world_size` equal-count partitions of near-equal token totals.
    whole_groups: the partitions are of whole uid groups (a prompt's n responses stay together, in order, so the
    packed forward holds their prompt once: forward.shares_prompts), when the groups are of one size and divide
    over the ranks; rows otherwise, as verl.
    Returns (the reordered full batch, this rank's row indices in it, this rank's rows, global_seqlen metrics)."""
    lengths = batch["attention_mask"].sum(-1).tolist()
    metrics = {}
    if balance:
        units = uid_groups(batch) if whole_groups else None
        if not units or len(units) % world_size or len({len(unit) for unit in units}) != 1:
            units = [[i] for i in range(len(lengths))]
        unit_parts = balanced_partitions([sum(lengths[i] for i in unit) for unit in units], world_size,
                                         equal_size=True)
        parts = [[i for u in part for i in units[u]] for part in unit_parts]
        metrics = seqlen_metrics(lengths, parts)
    else:
        parts = [rows_of_rank(len(lengths), r, world_size) for r in range(world_size)]
    batch = take(batch, [i for part in parts for i in part])                  # full batch, rank-major
    mine = rows_of_rank(len(lengths), rank, world_size)
    return batch, mine, take(batch, mine), metrics


def uid_groups(batch):
    """Row indices grouped by uid (the rows of one prompt), groups in order of first appearance; [] without uids."""
    groups = {}
    for row, uid in enumerate(batch.get("uid", [])):
        groups.setdefault(uid, []).append(row)
    return list(groups.values())
