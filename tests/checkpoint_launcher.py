"""Launch minirl for tests/test_checkpoint.py under torchrun, in one of three test-only ways:

    torchrun --nproc_per_node 2 tests/checkpoint_launcher.py nan FROM_STEP key=value ...
        a normal training run, except that from global step FROM_STEP on every log-prob of the PPO update is NaN
        (so the loss and the gradient norm are NaN); exits with minirl's exit code
    torchrun --nproc_per_node 2 tests/checkpoint_launcher.py small-files FROM_STEP key=value ...
        a normal training run, except that from global step FROM_STEP on no file may grow past 32 KiB
        (launch.limit_file_size: a write to a full disk, in effect); exits with minirl's exit code
    torchrun --nproc_per_node 2 tests/checkpoint_launcher.py logprobs BATCH.pt OUT.pt key=value ...
        build the Trainer (pass trainer.resume_mode=resume_path and trainer.resume_from_path=...) and write the
        FSDP actor's log-probs of BATCH (temperature 1), the global step, the loader state and the LR to OUT
"""
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
import failures  # noqa: E402
import minirl  # noqa: E402
from config import load_config  # noqa: E402
from launch import limit_file_size  # noqa: E402


def run_with_nan(from_step, *overrides):
    poison = {"on": False}
    train_step, forward = minirl.Trainer.train_step, minirl.Policy.forward

    def poisoned_train_step(self, prompts):
        poison["on"] = self.global_step >= int(from_step)
        return train_step(self, prompts)

    def poisoned_forward(self, micro, temperature, calc_entropy=False, **kwargs):
        logp, entropy = forward(self, micro, temperature, calc_entropy, **kwargs)
        if poison["on"] and torch.is_grad_enabled():        # the update's forward, not the no-grad log-probs
            logp = logp * float("nan")
        return logp, entropy

    minirl.Trainer.train_step = poisoned_train_step
    minirl.Policy.forward = poisoned_forward
    return minirl.main(["--config", str(ROOT / "config.yaml"), *overrides])


def run_with_small_files(from_step, *overrides):
    train_step = minirl.Trainer.train_step

    def limited_train_step(self, prompts):
        if self.global_step >= int(from_step):
            limit_file_size(32 * 1024)
        return train_step(self, prompts)

    minirl.Trainer.train_step = limited_train_step
    return minirl.main(["--config", str(ROOT / "config.yaml"), *overrides])


def resumed_logprobs(batch_path, out_path, *overrides):
    trainer = minirl.Trainer(load_config(ROOT / "config.yaml", list(overrides)))
    batch = torch.load(batch_path)
    logp, _ = trainer.actor.compute_log_prob(batch, micro_size=2, dynamic=False, max_tokens=0, temperature=1.0)
    if trainer.rank == 0:
        torch.save({"logp": logp, "global_step": trainer.global_step, "loader": trainer.loader.state_dict(),
                    "lr": trainer.actor.scheduler.get_last_lr()[0], "skipped_steps": trainer.actor.skipped_steps},
                   out_path)
    trainer.close()
    return 0


if __name__ == "__main__":
    mode, *args = sys.argv[1:]
    # skip Python's teardown, as minirl.train does: gloo's threads can abort it after a run that succeeded
    failures.leave({"nan": run_with_nan, "small-files": run_with_small_files,
                    "logprobs": resumed_logprobs}[mode](*args))
