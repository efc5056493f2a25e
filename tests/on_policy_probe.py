"""Train a few steps through minirl.train, with or without the skipped old-log-prob pass (for
tests/test_trainer.py and tests/test_offpolicy.py):

    torchrun --nproc_per_node W tests/on_policy_probe.py skip|recompute key=value ...

`recompute` forces the separate old-log-prob pass even where minirl.update_is_on_policy would skip it. The
metrics land in <af_output_dir>/metrics.jsonl. The CPU gets a made-up peak of 1 TFLOP/s, so that
perf/mfu/actor is logged as on an accelerator.
"""
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import failures  # noqa: E402
import minirl  # noqa: E402
from config import load_config  # noqa: E402


def main(mode, *overrides):
    minirl.flops.peak_flops = lambda device_name: 1e12
    if mode == "recompute":
        minirl.update_is_on_policy = lambda cfg, global_step: False
    cfg = load_config(Path(__file__).resolve().parents[1] / "config.yaml", list(overrides))
    return minirl.train(cfg)          # colocated, or on split devices the trainer and the rollout ranks


if __name__ == "__main__":
    # skip Python's teardown, as minirl.train does with several ranks: gloo's threads can abort it
    failures.leave(main(*sys.argv[1:]))
