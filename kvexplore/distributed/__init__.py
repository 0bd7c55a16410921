"""The cache split across processes with ``torch.distributed`` (docs/distributed.md): tensor parallelism over the
KV heads (:class:`TensorParallel`, :func:`split`, :func:`shard_model`)."""

from __future__ import annotations

from .ranks import RankError, TensorParallel
from .reduce import Traffic
from .shard import shard_model
from .split import RankSplit, split

__all__ = ["RankError", "RankSplit", "TensorParallel", "Traffic", "shard_model", "split"]
