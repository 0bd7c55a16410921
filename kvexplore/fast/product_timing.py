"""How a product kernel is timed against ``F.linear`` on this machine (:mod:`.kernels` keeps a width's kernel only
where it is faster by :data:`~.kernels.MARGIN`): on a miniature of the model's own weights of that width, in
interleaved rounds, leaving out the rounds in which the process waited for a CPU."""

from __future__ import annotations

import os
import platform
import statistics
import time
from collections import Counter
from functools import cache
from typing import Callable, NamedTuple

import torch

#: values of the weights a verdict is timed on, at most (a miniature of the width's: see :func:`sample`)
SAMPLE_VALUES = 8 << 20

#: seconds a verdict is timed for, about (a model's, all verdicts together)
TIMING_S = 0.1


def shapes(weights: list[torch.Tensor]) -> str:
    """The shapes of a width's weights, with how many of each (largest first): what a verdict was timed on."""
    counts = Counter(w.shape[0] for w in weights)
    return ", ".join(f"{out} rows x{n}" for out, n in sorted(counts.items(), reverse=True))


@cache
def cpu() -> str:
    """The CPU's model, as a verdict is saved under (with :func:`.artifacts.machine`'s instructions and threads)."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def sample(weights: list[torch.Tensor]) -> list[torch.Tensor]:
    """A miniature of ``weights`` (one width's) of at most :data:`SAMPLE_VALUES` values: of each shape, a share of
    the sample as large as its share of the values, in whole weights (at least one), the first rows of one larger
    than its share (the output head). Views of the weights as they are laid out."""
    total = sum(w.numel() for w in weights) or 1
    by_out: dict[int, list[torch.Tensor]] = {}
    for w in weights:
        by_out.setdefault(w.shape[0], []).append(w)
    sample = []
    for group in by_out.values():
        share = SAMPLE_VALUES * sum(w.numel() for w in group) / total
        per = group[0].numel()
        if per <= share:
            sample += group[:max(1, int(share // per))]
        else:
            sample.append(group[0][:max(min(64, group[0].shape[0]), int(share // group[0].shape[1]))])
    return sample


class Timing(NamedTuple):
    """What :func:`timed` measured: seconds per pass on the kernel and on ``F.linear`` (medians of the steady
    rounds), the kernel's speed against ``F.linear``'s (the median of those rounds' ratios: above 1, the kernel is
    faster), and whether enough rounds were steady to go by (:data:`STEADY_ROUNDS`)."""

    kernel_s: float
    linear_s: float
    speed: float
    steady: bool


#: a round of a timing is steady where the process's threads waited for a CPU (other programs running) at most this
#: share of it; a verdict needs this many steady rounds, else the width keeps F.linear for the process, unsaved
STEADY_WAIT, STEADY_ROUNDS = 0.1, 3


def waited() -> float:
    """Seconds the threads of this process (torch's workers too: one that waits stalls the others at the end of a
    parallel loop) have waited, runnable, for a CPU: Linux's ``schedstat``; 0.0 elsewhere (every round steady)."""
    total = 0
    try:
        tasks = os.listdir("/proc/self/task")
    except OSError:
        return 0.0
    for task in tasks:
        try:
            with open(f"/proc/self/task/{task}/schedstat", "rb") as f:
                total += int(f.read().split()[1])
        except (OSError, IndexError, ValueError):  # a thread that ended meanwhile
            pass
    return total / 1e9


def timed(on_kernel: Callable, on_f_linear: Callable, budget_s: float = TIMING_S) -> Timing:
    """Time a pass on the kernel against one on ``F.linear``: interleaved rounds (the order alternating, each a few
    milliseconds: the pass repeated), five at least, then until ``budget_s`` (twice that while fewer than
    :data:`STEADY_ROUNDS` were steady; never beyond that); the rounds in which the process waited for a CPU are
    left out, and the speed is the median of the steady rounds' ratios (each pairs the two a few milliseconds
    apart). A first pair of passes slower than the whole budget (a machine so busy that each of torch's parallel
    loops waits for a time slice) is not steady, with no rounds."""
    with torch.inference_mode(False), torch.no_grad():
        first = []
        for fn in (on_kernel, on_f_linear):  # warm: the first calls load and allocate
            t0 = time.perf_counter()
            fn()
            first.append(time.perf_counter() - t0)
        if sum(first) > budget_s:
            return Timing(*first, 0.0, False)
        reps = max(1, min(200, int(0.004 / max(sum(first), 1e-7))))
        times: tuple[list[float], list[float]] = ([], [])
        steady: list[bool] = []
        start = time.perf_counter()
        for r in range(50):
            calm = True
            for i in ((0, 1) if r % 2 == 0 else (1, 0)):
                fn = (on_kernel, on_f_linear)[i]
                before = waited()
                t = time.perf_counter()
                for _ in range(reps):
                    fn()
                took = time.perf_counter() - t
                wait = waited() - before
                calm = calm and wait <= STEADY_WAIT * took
                times[i].append(took / reps)
            steady.append(calm)
            elapsed = time.perf_counter() - start
            if elapsed > 2 * budget_s or r >= 4 and elapsed > budget_s and sum(steady) >= STEADY_ROUNDS:
                break
    kept = [(k, f) for k, f, calm in zip(*times, steady) if calm and k > 0]
    if len(kept) < STEADY_ROUNDS:
        return Timing(statistics.median(times[0]), statistics.median(times[1]), 0.0, False)
    return Timing(statistics.median(k for k, _ in kept), statistics.median(f for _, f in kept),
                  statistics.median(f / k for k, f in kept), True)
