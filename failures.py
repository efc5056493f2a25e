"""How a run ends when something goes wrong: on any rank, loudly, once, and for every rank.

minirl runs one process per device under torchrun. If one rank fails and waits for the others (a barrier, a
clean shutdown), while they wait for it in a collective, the job hangs silently. So a failing rank never joins
another collective: it prints the error (only the first rank to fail prints it in full; the store that torchrun
already runs decides who was first, and the others wait for its report to be written), flushes, and leaves with
os._exit. torchrun then stops the other ranks (and a rank blocked in a collective with the dead one gets an error
from gloo/NCCL within the collective timeout).

    failures.watch_parent(LAUNCHER_PID)                      # a rank whose torchrun is gone exits too
    failures.report_sigterm()                                # SIGTERM is reported and stops every rank
    failures.report_crashes()                                # a native crash prints where each thread was
    dist.init_process_group(backend, timeout=failures.COLLECTIVE_TIMEOUT)
    ...
    except BaseException as err:
        code = failures.report(err, rank, expected)           # print once, return the exit code
        failures.exit_now(code)                               # os._exit when other ranks exist

A successful run with other ranks ends with os._exit as well (failures.leave, after the closing barrier): gloo's
worker threads may still be releasing the last collectives' tensors, and one that takes the GIL while the
interpreter finalizes aborts the process.

Left out: restarting failed ranks (torchrun --max-restarts does that, and auto-resume picks up the checkpoint).
"""
import faulthandler
import json
import os
import signal
import sys
import threading
import time
import traceback
from datetime import timedelta

import torch.distributed as dist

# A collective that waits longer than this raises instead of hanging (gloo and NCCL honour it): verl's default
# nccl_timeout, 600 s. Set MINIRL_COLLECTIVE_TIMEOUT_S for phases that may keep one rank busier for longer.
COLLECTIVE_TIMEOUT = timedelta(seconds=float(os.environ.get("MINIRL_COLLECTIVE_TIMEOUT_S", "600")))
FAILURE_KEY = "minirl/failures"
REPORTED_KEY = "minirl/failure_reported"
REPORT_WAIT = timedelta(seconds=10)    # how long a rank that failed second waits for the first to tell torchrun
# This process's rank in torchrun's job, as torchrun started it: on split devices a rollout rank later takes its
# own world's RANK (for vLLM), but reports name the rank torchrun knows.
TORCHRUN_RANK = int(os.environ.get("RANK", "0"))
EXIT_INTERRUPTED = 130
EXIT_TERMINATED = 128 + signal.SIGTERM
# Errors a collective raises on the surviving ranks when a peer has died: not a new failure, a consequence.
_PEER_DIED = ("Connection closed by peer", "Connection reset by peer", "Broken pipe")
_PEER_GONE = _PEER_DIED + ("Socket Timeout", "Timed out", "timed out", "NCCL communicator was aborted",
                           "ProcessGroup abort")


class Terminated(BaseException):
    """SIGTERM (what `timeout`, Slurm, Kubernetes and a SIGTERMed torchrun send), as report_sigterm reports it:
    instead of ending this rank silently and leaving a peer's "connection closed" to look like the cause."""


def _raise_terminated(signum, frame):
    raise Terminated()


def report_sigterm():
    """Under torchrun, SIGTERM is reported and stops every rank as Ctrl-C does, by a thread of its own: Python's C
    signal handler writes each signal's number to a wakeup pipe (signal.set_wakeup_fd), which this thread reads,
    so the report comes even while the main thread waits inside a collective, where a Python-level handler would
    not run until the wait ended (a rollout rank waiting for its next request: never)."""
    if "TORCHELASTIC_RUN_ID" not in os.environ:
        return
    read_fd, write_fd = os.pipe()
    os.set_blocking(write_fd, False)
    # caught, so Python's C handler writes to the pipe; should a library take the pipe over, the main thread still
    # raises Terminated (report lets the first of the two report)
    signal.signal(signal.SIGTERM, _raise_terminated)
    signal.set_wakeup_fd(write_fd, warn_on_full_buffer=False)

    def wait():
        while signal.SIGTERM not in os.read(read_fd, 64):         # other signals (Ctrl-C) go their usual way
            pass
        leave(report(Terminated(), TORCHRUN_RANK))

    threading.Thread(target=wait, name="minirl-sigterm", daemon=True).start()


def report_crashes():
    """A crash below Python (a segmentation fault in a native library or a user's C extension, an abort) ends a
    rank with no exception to report, and torchrun says only "Signal 11". Print every thread's Python stack to
    stderr first (faulthandler), so the log names the line each thread was on when the process died."""
    faulthandler.enable(file=sys.stderr, all_threads=True)


class ReportedError(RuntimeError):
    """An error whose message already says everything; `shown_traceback` is the traceback worth printing (the
    user's code that failed), or None for a one-line report."""

    shown_traceback = None


_watching = []


def watch_parent(parent=None, poll_s=1.0):
    """Under torchrun, exit this process when its parent (torchrun's agent) is gone, e.g. SIGKILLed: workers
    must never outlive the job (orphans would hold devices and ports, wait 10 minutes for a store that is gone,
    or join a later job's store on the same port). `parent`: the launcher's pid as read when this process started
    (minirl.LAUNCHER_PID, so a torchrun killed while this rank was still importing is noticed too); by default
    the parent now. The first call starts the watch; later ones do nothing."""
    if "TORCHELASTIC_RUN_ID" not in os.environ or _watching:
        return
    parent = os.getppid() if parent is None else parent
    _watching.append(parent)

    def watch():
        while os.getppid() == parent:
            time.sleep(poll_s)
        print(f"rank {TORCHRUN_RANK}: torchrun (pid {parent}) is gone; exiting", file=sys.stderr, flush=True)
        os._exit(1)

    threading.Thread(target=watch, name="minirl-parent-watch", daemon=True).start()


_split_job = {}        # split devices: torchrun's own store and world size (use_job_store)


def use_job_store(store, world_size):
    """Split devices (offpolicy.init_process_groups): the trainer and the rollout ranks each get a default process
    group of their own, over a prefixed store, so failures are counted, and "several ranks" judged, over torchrun's
    whole job, in its own store, or every side would think it failed first."""
    _split_job.update(store=store, world_size=world_size)


def _job_world_size():
    if _split_job:
        return _split_job["world_size"]
    return dist.get_world_size() if dist.is_initialized() else 1


def _job_store():
    """torchrun's key-value store, when this rank is one of several (None otherwise)."""
    if _job_world_size() == 1:
        return None
    store = _split_job.get("store") or dist.distributed_c10d._get_default_store()
    store.set_timeout(timedelta(seconds=5))
    return store


def _first_to_fail():
    """True for the first rank to report a failure in this job (an atomic counter in torchrun's store, not a
    collective: it works while the other ranks are busy or dead)."""
    try:
        store = _job_store()
        return store is None or store.add(FAILURE_KEY, 1) == 1
    except Exception:          # the store is gone with its host: say everything rather than nothing
        return True


def _mark_reported():
    try:
        store = _job_store()
        if store is not None:
            store.set(REPORTED_KEY, "1")
    except Exception:
        pass                   # the ranks waiting for it give up after REPORT_WAIT


def _wait_for_first_report():
    """Block (at most REPORT_WAIT) until the first failing rank has written its report: torchrun stops every rank
    as soon as one exits, so a second rank that left at once could end the first before its error file exists,
    and torchrun's closing report would name nobody's error."""
    try:
        store = _job_store()
        if store is not None:
            store.wait([REPORTED_KEY], REPORT_WAIT)
    except Exception:
        pass                   # the first rank died before reporting, or the store is gone: nothing to wait for


def caused_by_a_dead_peer(err, phrases=_PEER_GONE):
    """A collective's error on a surviving rank: a peer is gone (or, with _PEER_DIED, closed its connection)."""
    return isinstance(err, (dist.DistBackendError, RuntimeError)) and any(s in str(err) for s in phrases)


def tell_torchrun(line, failed_at, cause=True):
    """torchrun ends a failed job with its own report, whose 'Root Cause' block shows the failing rank's error file
    (TORCHELASTIC_ERROR_FILE, set per worker), else only a link to torch's docs. Write our one line there, so the
    last thing the user reads names the error. failed_at: time.time() when this rank failed, before any other rank
    could have stopped because of it."""
    path = os.environ.get("TORCHELASTIC_ERROR_FILE")
    if not path:
        return
    # torchrun takes the rank with the smallest timestamp as the root cause and stamps ranks without a file with its
    # own clock when it sees them exit, in whole seconds; a tie goes to the lowest rank, so a cause is stamped a
    # second before it failed, and a rank that only saw another die (cause=False) two seconds after (torchrun may
    # see the dead one a moment after this rank did, across a second's boundary)
    stamp = int(failed_at) - 1 if cause else int(failed_at) + 2
    try:
        with open(path, "w") as f:
            # torch's own format (elastic's ErrorHandler.record_exception), the line standing in for the traceback
            json.dump({"message": {"message": line, "extraInfo": {"py_callstack": line, "timestamp": str(stamp)}}}, f)
    except OSError:
        pass                         # the report on stderr stands without it


_reporting = threading.Lock()


def report(err, rank, expected=()):
    """Print `err` for the job and return the exit code. `expected`: ((exception class, prefix, exit code), ...)
    for errors whose message is the whole story (bad config, data or checkpoint): one line, no traceback.
    Anything else prints its traceback and a one-line summary. Only the first failing rank prints in full."""
    if not _reporting.acquire(blocking=False):   # the SIGTERM thread and the main thread both failing: the first
        threading.Event().wait()                  # report ends the process
    failed_at = time.time()
    if not _first_to_fail():
        _wait_for_first_report()       # first, so this line comes after that report, not before it or inside it
        why = "the other ranks stopped" if caused_by_a_dead_peer(err) else f"{type(err).__name__}"
        print(f"rank {rank}: stopped as well ({why}); the first failure is reported by the rank that had it",
              file=sys.stderr, flush=True)
        return _stop_code(err) or 1
    if caused_by_a_dead_peer(err, _PEER_DIED):     # a peer ended without a word (kill -9, out of memory): its fault
        line = (f"rank {rank}: stopped: another rank closed its connection without reporting an error (killed, or "
                f"out of memory?); torchrun's report names the rank that ended first")
        print(line, file=sys.stderr, flush=True)
        tell_torchrun(line, failed_at, cause=False)
        _mark_reported()
        return 1
    line, code = _summary(err, rank, expected)
    print(line, file=sys.stderr, flush=True)
    tell_torchrun(line, failed_at)
    _mark_reported()
    return code


def _summary(err, rank, expected):
    """The first failing rank's one-line report and exit code (a traceback worth reading is printed first)."""
    if _stop_code(err):
        how = "interrupted" if isinstance(err, KeyboardInterrupt) else "terminated (SIGTERM)"
        return f"rank {rank}: {how}; stopping every rank", _stop_code(err)
    for cls, prefix, code in expected:
        if isinstance(err, cls):
            return f"{prefix}: {err}", code
    if isinstance(err, ReportedError):
        shown = err.shown_traceback
        if shown is not None:
            traceback.print_exception(type(shown), shown, shown.__traceback__, chain=False)
        return f"error: rank {rank}: {err}", 1
    traceback.print_exception(type(err), err, err.__traceback__)
    first_line = (str(err).splitlines() or [""])[0]
    return f"error: rank {rank} failed with {type(err).__name__}: {first_line[:300]} (traceback above)", 1


def _stop_code(err):
    """The exit code of a rank told to stop (Ctrl-C: 130, SIGTERM: 143), None for a failure."""
    return {KeyboardInterrupt: EXIT_INTERRUPTED, Terminated: EXIT_TERMINATED}.get(type(err))


def exit_now(code):
    """End this process now when other ranks exist (no atexit handlers, no process-group teardown: both could
    wait for ranks that will never answer); with one process, return the code to the caller."""
    if _job_world_size() > 1:
        leave(code)
    return code


def leave(code):
    """Flush stdout and stderr and end the process with `code`, skipping Python's teardown (os._exit)."""
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)
