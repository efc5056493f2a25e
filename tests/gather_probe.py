"""models.full_state_dict_items in buckets against one tensor at a time, for tests/test_models.py:

    torchrun --nproc_per_node 3 tests/gather_probe.py OUT.pt

A small FSDP2 model whose shapes split unevenly over 3 ranks (7, 5, 2 and 1 rows: the last ranks hold fewer or
none), with a bf16 unit beside fp32 ones and a buffer FSDP does not shard. Rank 0 saves, for several bucket sizes,
what the bucketed gather yields (names in order, tensors), the per-tensor gather's, and the weights before
sharding."""
import sys
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.fsdp import fully_shard

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import failures  # noqa: E402
from models import full_state_dict_items  # noqa: E402

BUCKETS = (1, 64, 200, 2**20)          # bytes: every tensor alone, a few together, all together


class Probe(nn.Module):
    def __init__(self):
        super().__init__()
        self.first = nn.Linear(3, 7)                                    # weight [7, 3], bias [7]
        self.low = nn.Linear(4, 5).to(torch.bfloat16)                  # its own unit: one dtype per unit
        self.rows = nn.Parameter(torch.randn(2, 3, 2))
        self.one = nn.Parameter(torch.randn(1))
        self.register_buffer("counts", torch.arange(6))


def main(out_path):
    dist.init_process_group("gloo")
    torch.manual_seed(0)                                       # the same full weights on every rank before sharding
    unsharded = {name: tensor.clone() for name, tensor in Probe().state_dict().items()}
    torch.manual_seed(0)
    model = Probe()
    fully_shard(model.low)
    fully_shard(model)
    full = dict(full_state_dict_items(model))
    bucketed = {size: list(full_state_dict_items(model, bucket_bytes=size)) for size in BUCKETS}
    kept = list(full_state_dict_items(model, keep=lambda name: name != "first.bias", bucket_bytes=2**20))
    if dist.get_rank() == 0:
        torch.save({"full": full, "bucketed": bucketed, "kept": kept, "unsharded": unsharded}, out_path)
    dist.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1])
    # skip Python's teardown, as minirl.train does: gloo's threads can abort it after a run that succeeded
    failures.leave(0)
