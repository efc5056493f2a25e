"""Run the real Trainer for a few steps, recording what flows through the PPO pieces on rank 0's first step
(for tests/test_ppo.py):

    torchrun --nproc_per_node W tests/ppo_probe.py OUT.pt key=value ...

OUT.pt holds the first call's inputs and outputs of losses.compute_advantages, losses.apply_kl_penalty,
Critic.compute_values and RewardModel.score, and which critic parameters changed over the run.
"""
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import failures  # noqa: E402
import losses  # noqa: E402
import models  # noqa: E402
from config import load_config  # noqa: E402
from minirl import Trainer  # noqa: E402

RECORDED = {}


def record_first_call(owner, name):
    original = getattr(owner, name)

    def wrapper(*args, **kwargs):
        result = original(*args, **kwargs)
        RECORDED.setdefault(name, {"args": args[1:] if owner in (models.Critic, models.RewardModel) else args,
                                   "kwargs": kwargs, "result": result})
        return result

    setattr(owner, name, wrapper)


def main(out_path, *overrides):
    for owner, name in ((losses, "compute_advantages"), (losses, "apply_kl_penalty"),
                        (models.Critic, "compute_values"), (models.RewardModel, "score")):
        record_first_call(owner, name)
    cfg = load_config(Path(__file__).resolve().parents[1] / "config.yaml", list(overrides))
    trainer = Trainer(cfg)
    before = {n: t.clone() for n, t in models.full_state_dict_items(trainer.critic.model)} if trainer.critic else {}
    trainer.fit()
    after = {n: t.clone() for n, t in models.full_state_dict_items(trainer.critic.model)} if trainer.critic else {}
    if trainer.rank == 0:
        RECORDED["critic_changed"] = sorted(n for n in before if not torch.equal(before[n], after[n]))
        RECORDED["critic_names"] = sorted(before)
        torch.save(RECORDED, out_path)
    trainer.close()


if __name__ == "__main__":
    main(*sys.argv[1:])
    # skip Python's teardown, as minirl.train does: gloo's threads can abort it after a run that succeeded
    failures.leave(0)
