"""A function's graph as dynamo captures it, without compiling it: what :mod:`.regional` and :mod:`.products` hand
to inductor's ``standalone_compile`` (and to :func:`.artifacts.graph_key`, which names the saved file)."""

from __future__ import annotations

from typing import Callable

import torch


def dynamo_graph(fn: Callable, args: tuple, dynamic: bool | None = False) -> tuple[torch.fx.GraphModule, list]:
    """``fn``'s one graph for ``args`` and its example inputs (tensors, and the symbolic sizes of any dimension
    marked dynamic); ``dynamic`` as ``torch.compile``'s. ``fn`` is left as it was: no compiled code stays cached
    for it."""
    captured: list = []

    def keep(gm: torch.fx.GraphModule, inputs: list) -> Callable:
        captured.append((gm, list(inputs)))
        return gm.forward

    try:
        torch.compile(fn, backend=keep, fullgraph=True, dynamic=dynamic)(*args)
    finally:
        torch._dynamo.eval_frame.remove_from_cache(fn)  # a trace, not a compiled function to keep
    return captured[0]
