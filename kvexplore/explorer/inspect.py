"""Ask a running kernel what its explorers hold: a comm target the browser (or a test driving it) can open.

Every :class:`~kvexplore.Explorer` made in a Jupyter kernel registers itself here under a number, and its root box
carries the CSS class ``kvx-id-<number>``. A front end that opens a comm on target :data:`TARGET` and sends
``{"explorer": number}`` gets back one message: the explorer's specs (every figure's traces and layout, arrays as
plain lists, NaN as null), its comparison rows, the view shown and the last error. That is what the page must show;
the browser tests compare it with each plotly figure's ``gd.data``. Comms are the one channel Voila leaves open
(it refuses execute requests from the page), so the same question works in JupyterLab and in Voila.
"""

from __future__ import annotations

import math
import weakref
from typing import Any

import numpy as np

TARGET = "kvexplore.inspect"
_explorers: "weakref.WeakValueDictionary[int, Any]" = weakref.WeakValueDictionary()
_next_id = 0
_registered = False


def plain(v: Any) -> Any:
    """``v`` with numpy arrays and scalars as lists and numbers, NaN as None (JSON has no NaN)."""
    if isinstance(v, np.ndarray):
        v = v.tolist()
    if isinstance(v, (list, tuple)):
        return [plain(x) for x in v]
    if isinstance(v, dict):
        return {k: plain(x) for k, x in v.items()}
    if isinstance(v, (float, np.floating)):
        return None if math.isnan(v) else float(v)
    if isinstance(v, np.integer):
        return int(v)
    if isinstance(v, np.bool_):
        return bool(v)
    return v


def state(explorer: Any) -> dict[str, Any]:
    """What ``explorer`` holds, as JSON-safe data."""
    return {"specs": {name: {"traces": plain(s.traces), "layout": plain(s.layout)}
                      for name, s in explorer.specs().items()},
            "compare": explorer.compare_rows(), "view": explorer.view, "error": explorer.error,
            "tokens": len(explorer.lane.generator.tokens), "lane": explorer.lane.name, "shown": explorer.shown()}


def track(explorer: Any) -> int:
    """Number ``explorer`` (its CSS class ``kvx-id-<n>``) and answer for it on :data:`TARGET` when in a kernel."""
    global _next_id
    _next_id += 1
    _explorers[_next_id] = explorer
    _register()
    return _next_id


def _register() -> None:
    global _registered
    if _registered:
        return
    try:
        from IPython import get_ipython

        shell = get_ipython()
        kernel = getattr(shell, "kernel", None)
        manager = getattr(kernel, "comm_manager", None)
        if manager is None:
            import comm

            manager = comm.get_comm_manager() if kernel is not None else None
    except Exception:  # not in a kernel: nobody to answer
        return
    if manager is None:
        return
    manager.register_target(TARGET, _opened)
    _registered = True


def _opened(comm, open_msg) -> None:
    def answer(msg) -> None:
        number = (msg.get("content", {}).get("data") or {}).get("explorer")
        explorer = _explorers.get(number)
        if explorer is None:
            comm.send({"error": f"no explorer number {number!r}; live: {sorted(_explorers)}"})
        else:
            try:
                comm.send({"state": state(explorer)})
            except Exception as e:  # the asker gets the reason, the kernel keeps going
                comm.send({"error": f"{type(e).__name__}: {e}"})

    comm.on_msg(answer)
