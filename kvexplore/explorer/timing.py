"""What keeps the lanes' step times comparable when the session runs in a Jupyter kernel behind a page.

Behind a page, whatever lane steps first pays for the click: the kernel's IOPub thread sending what the click queued
(its sends take the GIL the forward pass hands back at every operation), a garbage collection set off by the refresh,
and a processor that needs some milliseconds of work to come back to speed after the kernel waited. :func:`quiet`
drains the kernel's output (at most :data:`DRAIN_S`) and turns the collector off while the lanes step;
:func:`warm_up` runs the model's one-row products, untimed, for :data:`WARM_S`. The measurements behind these
choices: docs/explorer.md ("The comparison's step times").
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
    """The kernel's output sent, and no garbage collection while the block runs (the collector's state put back)."""
    drain_kernel_output()
    was_on = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was_on:
            gc.enable()


def warm_up(model, seconds: float = WARM_S) -> int:
    """Untimed one-row products through ``model``'s weight matrices (a decode step's path: its ``nn.Linear``
    modules and output head, compiled kernels included), in layer order and round again, for at least ``seconds``:
    torch's threads awake, the processor back to speed, as many weights read as that time allows. Nothing for a model
    kvexplore does not run itself (a transformers model). Returns the number of products."""
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
