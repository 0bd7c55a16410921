"""What keeps the lanes' step times comparable when the session runs in a Jupyter kernel behind a page.

In a plain Python loop every lane's step runs on a warm, quiet process. Behind a page it does not: a click arrives
after the previous Step's refresh (figures built, serialized and sent) and often after a pause, and the click's own
handler queues messages at once (the buttons turning disabled). Whatever lane steps first then pays for the rest:

- the kernel's IOPub thread sends the queued messages while that lane computes; each send holds the GIL, which the
  model's forward pass releases and takes back at every operation, so on a busy machine every hand-over waits for the
  scheduler. :func:`quiet` waits (at most :data:`DRAIN_S`) until the IOPub thread has sent what was queued;
- a garbage collection set off by the refresh's objects can land in the timed forward pass (a full one takes many
  times a step in the app's kernel): :func:`quiet` turns the collector off while the lanes step, and it runs
  afterwards;
- after the kernel has waited for the page (even the moment the page takes to draw) the processor needs some
  milliseconds of work to come back to speed: the lane stepped first reads slower than the next for the same work,
  and one untimed pass of the model does not change that. :func:`warm_up` runs the model's one-row products,
  untimed, for :data:`WARM_S`, which evens the lanes out.

The figures behind these choices are in docs/explorer.md ("The comparison's step times");
``tests/screen/test_browser_timing.py`` holds the lanes' step times to agree, and ``benchmarks/explorer_click.py``
times a click.
"""

from __future__ import annotations

import contextlib
import gc
import sys
import threading
import time
from collections.abc import Iterator

import torch
from torch import nn

from ..models.model import Model

DRAIN_S = 0.25  # the longest quiet() waits for the kernel's IOPub thread to send what is queued
WARM_S = 0.01  # warm_up() runs the model for at least this long


def kernel_io_thread():
    """The IOPub thread of the Jupyter kernel this runs in (ipykernel's ``IOPubThread``), or None outside one."""
    app = sys.modules.get("ipykernel.kernelapp")
    if app is None or not app.IPKernelApp.initialized():
        return None
    thread = getattr(app.IPKernelApp.instance(), "iopub_thread", None)
    return thread if hasattr(thread, "schedule") and getattr(thread, "thread", None) is not None else None


def drain_kernel_output(timeout: float = DRAIN_S) -> bool:
    """Wait until the kernel's IOPub thread has sent every message queued so far (its events run in order, so an
    event scheduled now runs after them). True when drained, or when not in a kernel."""
    io = kernel_io_thread()
    if io is None or not io.thread.is_alive():
        return True
    done = threading.Event()
    io.schedule(done.set)
    return done.wait(timeout)


@contextlib.contextmanager
def quiet() -> Iterator[None]:
    """The kernel's output sent, and no garbage collection, while the block runs (the collector's state is put back
    after)."""
    drain_kernel_output()
    was_on = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was_on:
            gc.enable()


def warm_up(model, seconds: float = WARM_S) -> int:
    """Untimed one-row products through ``model``'s weight matrices (the path a decode step takes: its
    ``nn.Linear`` modules and output head, on the compiled kernels where :mod:`kvexplore.fast.kernels` applied them),
    in layer order and round again, for at least
    ``seconds``: torch's threads awake, the processor back to speed, and as many weights read as that time allows
    (all of a small model's, many times; a large model's would not stay in the processor's caches anyway). A whole
    forward pass did this before, but on SmolLM2 that costs several times what is needed of every click.
    Nothing for a model kvexplore does not run itself (a transformers model). Returns the number of products."""
    if not isinstance(model, Model):
        return 0
    head = model.head_weight
    products = [(m, m.weight) for m in model.modules() if isinstance(m, nn.Linear)] + [
        (lambda x: model.project(x, head), head)]
    rows = {w.shape[1]: torch.ones(1, w.shape[1], dtype=w.dtype, device=w.device) for _, w in products}
    end, done = time.perf_counter() + seconds, 0
    with torch.inference_mode():
        while time.perf_counter() < end or not done:
            for product, w in products:
                product(rows[w.shape[1]])
                done += 1
                if time.perf_counter() >= end:
                    break
    return done
