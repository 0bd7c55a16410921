"""The cache split across processes with ``torch.distributed`` (docs/distributed.md): tensor parallelism over the
KV heads (:class:`TensorParallel`, :func:`split`, :func:`shard_model`) and context parallelism over positions
(:class:`ContextParallel`, :class:`Layout`), and prefill and decode apart (:class:`Disaggregated`,
:class:`PageLayout`)."""

from __future__ import annotations

from .context import Layout
from .handoff import Handoff, PageLayout
from .ranks import ContextParallel, Disaggregated, Pass, RankError, Ranks, TensorParallel
from .reduce import Traffic
from .shard import shard_model
from .split import RankSplit, split

__all__ = ["ContextParallel", "Disaggregated", "Handoff", "Layout", "PageLayout", "Pass", "RankError", "RankSplit",
           "Ranks", "TensorParallel", "Traffic", "shard_model", "split"]
