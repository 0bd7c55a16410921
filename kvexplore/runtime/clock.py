"""The clock a step's forward pass is timed with: wall time, less the time the operating system kept the timing thread
waiting for a CPU while other programs ran.

On a machine that other work shares, a forward pass of a few milliseconds is often taken off the CPU for a whole time
slice: its wall time can read several times the work it did, and which lane of the explorer happened to be preempted
decides which one looks slow (docs/explorer.md, "The comparison's step times", has a measurement;
``benchmarks/speculative_speed.py`` times with this clock). Linux counts, per thread, the time it spent runnable but not
running (``/proc/thread-self/schedstat``, second field); subtracting it leaves what the step cost this process, the same
as wall time on an idle machine. Where that file is missing (not Linux) the clock is plain wall time."""

from __future__ import annotations

import os
import threading
import time

SCHEDSTAT = "/proc/thread-self/schedstat"
_local = threading.local()  # each thread's open schedstat file (the path names the thread that opens it)


def run_delay() -> float:
    """Seconds this thread has waited, runnable, for a CPU since it started (0.0 where the system does not say)."""
    fd = getattr(_local, "fd", None)
    if fd is None:
        try:
            fd = os.open(SCHEDSTAT, os.O_RDONLY)
        except OSError:
            fd = -1
        _local.fd = fd
    if fd < 0:
        return 0.0
    try:
        return int(os.pread(fd, 128, 0).split()[1]) / 1e9
    except (OSError, IndexError, ValueError):
        return 0.0


def now() -> tuple[float, float]:
    """A mark to pass to :func:`since`: (wall clock, time waited for a CPU so far)."""
    # the wait read after the wall clock (and before it in since()): a wait between the two reads counts as work
    # rather than being taken off twice
    return time.perf_counter(), run_delay()


def since(mark: tuple[float, float]) -> float:
    """Seconds since ``mark`` less the time this thread waited for a CPU meanwhile (never below 0)."""
    wall, waited = mark
    waited = run_delay() - waited
    return max(0.0, time.perf_counter() - wall - waited)
