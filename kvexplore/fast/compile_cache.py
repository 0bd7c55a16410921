"""What a compile of the whole one-token step (an explicit torch.compile mode, or CUDA's) says about inductor's cache.

inductor's FX graph cache (``$TORCHINDUCTOR_CACHE_DIR``) lets a later process load the kernels of the same step,
except a CPU step with frozen weights (``compile="max-autotune"``): its oneDNN-packed weights cannot be saved, so
every process compiles it again (``compile=True`` on the CPU saves one layer in kvexplore's own folder instead).
"""

from __future__ import annotations

from contextlib import contextmanager
from pathlib import Path
from typing import Iterator


def inductor_cache_dir() -> str:
    try:
        from torch._inductor.runtime.cache_dir_utils import cache_dir
        return cache_dir()
    except Exception:  # an older torch: the default
        import getpass
        import tempfile
        return str(Path(tempfile.gettempdir()) / f"torchinductor_{getpass.getuser()}")


def _cache_counts() -> tuple[int, int, int]:
    from torch._dynamo.utils import counters
    c = counters["inductor"]
    return c["fxgraph_cache_hit"], c["fxgraph_cache_miss"], c["fxgraph_cache_bypass"]


@contextmanager
def watched() -> Iterator[dict]:
    """Around a step's first call (its compile). Yields a dict that, after the block, holds ``note``: whether the
    step was reused from inductor's cache, compiled and kept there, or compiled and not kept (and why)."""
    out: dict = {}
    before = _cache_counts()
    yield out
    hit, miss, bypass = (a - b for a, b in zip(_cache_counts(), before))
    where = inductor_cache_dir()
    if hit and not miss and not bypass:
        out["note"] = f"reused the compiled step an earlier process left in inductor's cache ({where})"
    elif bypass:
        out["note"] = ("compiled; not kept for a later process: its weights are frozen into the graph and packed for "
                       "oneDNN, which inductor's cache cannot keep (compile=True on the CPU compiles one layer "
                       "and keeps it)")
    elif miss:
        out["note"] = (f"compiled and kept in inductor's cache ({where}): a later process with the same model, "
                       f"capacity and threads reuses it")
    else:
        out["note"] = ("compiled; inductor's FX graph cache took no part (turned off? "
                       "TORCHINDUCTOR_FX_GRAPH_CACHE)")
