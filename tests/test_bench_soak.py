"""bench/soak.py's arithmetic: RSS growth from the samples after warm-up against those at the end, and a run too
short to have samples in both windows said so instead of a statistics traceback."""
import importlib.util
from pathlib import Path

import pytest

spec = importlib.util.spec_from_file_location("soak", Path(__file__).resolve().parents[1] / "bench" / "soak.py")
soak = importlib.util.module_from_spec(spec)
spec.loader.exec_module(soak)


def test_growth_compares_the_window_after_warm_up_with_the_last_one():
    # 100 steps, warm-up 0.2, windows of 10 steps: (20, 30] and [90, 100); (seconds, step logged, {rank: MiB})
    samples = [(0, 5, {0: 900.0, 1: 950.0}), (1, 25, {0: 1000.0, 1: 1100.0}), (2, 28, {0: 1010.0, 1: 1100.0}),
               (3, 60, {0: 1500.0, 1: 1100.0}), (4, 95, {0: 1050.0, 1: 1210.0}), (5, 100, {0: 3000.0, 1: 3000.0})]
    growth = soak.growth(samples, steps=100, warmup=0.2)
    assert growth[0] == pytest.approx((1005.0, 1050.0, 1050.0 / 1005.0 - 1))
    assert growth[1] == pytest.approx((1100.0, 1210.0, 0.1))


def test_a_run_too_short_for_the_sampling_says_what_to_change():
    samples = [(0, 1, {0: 900.0}), (1, 6, {0: 900.0})]
    with pytest.raises(SystemExit, match=r"6 steps are too few for --every; run more --steps"):
        soak.growth(samples, steps=6, warmup=0.2)
