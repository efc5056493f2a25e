"""Train a few steps through the real Trainer, with or without the skipped old-log-prob pass (for
tests/test_trainer.py):

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
    trainer = minirl.Trainer(cfg)
    trainer.fit()
    trainer.close()


if __name__ == "__main__":
    main(*sys.argv[1:])
    # skip Python's teardown, as minirl.train does: gloo's threads can abort it after a run that succeeded
    failures.leave(0)
