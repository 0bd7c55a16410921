"""The compile of a decode step as a progress line: its phase and the time so far (``kvexplore generate --compile``).

The regional step says what it is doing itself (:data:`kvexplore.fast.regional.PROGRESS`); a whole step compiled by
torch.compile is read from ``torch._dynamo.utils.compilation_time_metrics``, where each phase is entered when it
ends, so the line names the phase after the last one that finished."""

from __future__ import annotations

import sys
import threading
from contextlib import contextmanager
from typing import IO, Iterator

#: the last phase finished -> what runs now
PHASES = (
    ("aot_collect_metadata", "functionalizing and freezing the graph"),
    ("_recursive_post_grad_passes", "lowering the graph"),
    ("GraphLowering.run", "autotuning the matrix products, generating the kernels"),
    ("GraphLowering.codegen", "compiling the C++ kernels"),
    ("async_compile.wait", "building the guards"),
)
FIRST = "tracing the step"


def phase_now(metrics: dict, start: dict[str, int]) -> str:
    """What the compile is doing: what the regional step says, else what torch's phases that ended since ``start``
    (each phase's count then) tell."""
    from .regional import PROGRESS

    if PROGRESS.phase:
        return PROGRESS.phase
    done = {k for k, v in list(metrics.items()) if len(v) > start.get(k, 0)}
    return next((name for key, name in reversed(PHASES) if key in done), FIRST)


@contextmanager
def compile_progress(stream: IO[str] | None = None, every: float = 0.5) -> Iterator[None]:
    """Inside: a progress line ("compiling the decode step: <phase> [<elapsed>]") on ``stream`` (stderr), refreshed
    every ``every`` seconds and cleared at the end."""
    from tqdm import tqdm

    try:
        from torch._dynamo.utils import compilation_time_metrics as metrics
    except ImportError:
        metrics = {}
    start = {k: len(v) for k, v in list(metrics.items())}
    bar = tqdm(total=None, desc=FIRST, file=stream or sys.stderr, leave=False,
               bar_format="compiling the decode step: {desc} [{elapsed}]")
    stop = threading.Event()

    def poll() -> None:
        while not stop.wait(every):
            bar.set_description_str(phase_now(metrics, start), refresh=True)

    watcher = threading.Thread(target=poll, name="kvexplore-compile-progress", daemon=True)
    watcher.start()
    try:
        yield
    finally:
        stop.set()
        watcher.join()
        bar.close()
