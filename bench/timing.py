"""What the benches share: seconds of each of several calls and their median; starting a script under torchrun."""
import os
import statistics
import subprocess
import sys
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


def start_under_torchrun(processes=2):
    """Unless this process already runs under torchrun, run this script again under it with `processes` processes
    (offline, the same arguments) and exit with its status."""
    if "LOCAL_RANK" in os.environ:
        return
    sys.exit(subprocess.call([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node",
                              str(processes), os.path.abspath(sys.argv[0]), *sys.argv[1:]],
                             env=dict(os.environ, HF_HUB_OFFLINE="1")))
