"""Train a few steps through the real Trainer and report how the actor and the reference moved (for
tests/test_trainer.py):

    torchrun --nproc_per_node W tests/trainer_probe.py OUT.json key=value ...
"""
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import failures  # noqa: E402
from config import load_config  # noqa: E402
from minirl import Trainer  # noqa: E402
from models import full_state_dict_items  # noqa: E402


def snapshot(model):
    return {name: tensor.clone() for name, tensor in full_state_dict_items(model)}


def main(out_path, *overrides):
    cfg = load_config(Path(__file__).resolve().parents[1] / "config.yaml", list(overrides))
    trainer = Trainer(cfg)
    actor_before, ref_before = snapshot(trainer.actor.model), snapshot(trainer.ref.model)
    trainer.fit()
    actor_after, ref_after = snapshot(trainer.actor.model), snapshot(trainer.ref.model)
    report = {
        "world_size": trainer.world_size,
        "steps": trainer.global_step,
        "actor_changed": sorted(n for n in actor_before if not torch.equal(actor_before[n], actor_after[n])),
        "actor_names": sorted(actor_before),
        "ref_changed": sorted(n for n in ref_before if not torch.equal(ref_before[n], ref_after[n])),
        "ref_equals_initial_actor": all(torch.equal(ref_before[n], actor_before[n]) for n in ref_before),
    }
    if trainer.rank == 0:
        Path(out_path).write_text(json.dumps(report))
    trainer.close()


if __name__ == "__main__":
    main(*sys.argv[1:])
    # skip Python's teardown, as minirl.train does: gloo's threads can abort it after a run that succeeded
    failures.leave(0)
