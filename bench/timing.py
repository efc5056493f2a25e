"""Wall-clock timing shared by the benches: seconds of each of several calls, and their median."""
import statistics
import time


def seconds_per_call(fn, repeats, warmup=0):
    """Call fn `warmup` times untimed, then `repeats` times; the seconds of each timed call."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return times


def median_seconds(fn, repeats, warmup=0):
    """The median of seconds_per_call."""
    return statistics.median(seconds_per_call(fn, repeats, warmup))
