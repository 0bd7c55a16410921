"""vLLM's rule for a hybrid model's sliding-window layers in its prefix cache (its hybrid KV cache manager, as in
vLLM 0.32): which blocks those layers keep cached, and how far a hit reaches when every group must hold what it would
read. The hash policy follows it; docs/prefix.md ("Sliding-window layers") tells it with the numbers vLLM gave.

A sliding layer of window ``w`` resuming at block ``b`` reads only the ``need = ceil((w - 1) / block_size)`` blocks
before ``b``. vLLM frees a sliding layer's blocks once they fall out of the window, and caches them only where a later
request could resume (``prefix_cache_retention_interval``): with ``0``, its default, the ``need`` blocks before a
prompt's last block (its replay boundary) and before a shared-prefix junction (where the full layers could have hit
further than the sliding ones); a positive interval adds the ``need`` blocks before every multiple of it; ``None``
caches every block. A hit then stops where every sliding group finds ``need`` cached blocks in a row right before it
(or a run of cached blocks from block 0)."""

from __future__ import annotations

from collections.abc import Sequence

from ..core.runs import runs
from ..errors import SettingsError


def blocks_needed(window: int, block_size: int) -> int:
    """How many blocks before the resume point a sliding layer of ``window`` reads."""
    return -(-(window - 1) // block_size)


class SlidingRetention:
    """The sliding groups' cached blocks (by chain hash, one set per window) and vLLM's hit rule over them. Without
    sliding layers (or for the radix policy, ``windows=()``) it changes nothing."""

    def __init__(self, windows: Sequence[int], block_size: int, interval: int | None) -> None:
        if interval is not None and (not isinstance(interval, int) or isinstance(interval, bool) or interval < 0
                                     or interval % block_size):
            raise SettingsError(f"retention_interval must be None (every sliding block cached), 0 (vLLM's default: "
                                f"only where a request can resume) or a positive multiple of block_size "
                                f"{block_size}, got {interval!r}")
        self.block_size, self.interval = block_size, interval
        self.need = {w: blocks_needed(w, block_size) for w in sorted(set(windows))}
        self.cached: dict[int, set[bytes]] = {w: set() for w in self.need}

    def hit(self, hashes: Sequence[bytes], blocks: int) -> int:
        """How many of the ``blocks`` leading blocks (the full layers' hit) every sliding group can resume after: the
        longest such length, reduced group by group until none reduces it (vLLM's fixed point)."""
        while True:
            before = blocks
            for w in self.need:
                blocks = self._find(w, hashes, blocks)
            if blocks == before:
                return blocks

    def _find(self, window: int, hashes: Sequence[bytes], limit: int) -> int:
        """Searching from the right: the end of the first run of ``need`` cached blocks, or a shorter run that
        starts at block 0 (a window reaching back to the start)."""
        need, cached, run = self.need[window], self.cached[window], 0
        for i in range(limit - 1, -1, -1):
            if hashes[i] not in cached:
                run = 0
                continue
            run += 1
            if run >= need:
                return i + need
        return run

    def missing(self, hashes: Sequence[bytes], blocks: int) -> dict[int, list[int]]:
        """Per window, the blocks a resume after ``blocks`` would read that its group does not hold cached."""
        return {w: [i for i in range(max(blocks - need, 0), blocks) if hashes[i] not in self.cached[w]]
                for w, need in self.need.items()}

    def retain(self, hashes: Sequence[bytes], start: int, prompt_len: int, junction: int) -> None:
        """Cache the sliding groups' blocks ``start ..`` of a request's written ``hashes`` as vLLM's mask picks them:
        the tails before its replay boundary (``prompt_len - 1``) and before ``junction`` (tokens; 0: none), plus
        every ``interval``'s tail, or all of them."""
        bs = self.block_size
        for w, need in self.need.items():
            keep: set[int] = set()
            per_segment = (bs if self.interval is None else self.interval) // bs  # 0: no periodic tails
            if per_segment and need >= per_segment:
                keep = set(range(start, len(hashes)))
            else:
                if per_segment:
                    keep = {i for i in range(start, len(hashes)) if i % per_segment >= per_segment - need}
                for boundary in (prompt_len - 1, junction):
                    end = boundary // bs if boundary > 0 else 0
                    keep.update(range(max(start, end - need), min(len(hashes), end)))
            self.cached[w].update(hashes[i] for i in keep)

    def drop(self, h: bytes) -> None:
        """A block evicted from the pool leaves every group."""
        for cached in self.cached.values():
            cached.discard(h)

    def words(self, hashes: Sequence[bytes], blocks: int, hit: int, writer: str | None = None) -> str:
        """Why a hit that the full layers would take to ``blocks`` stops at ``hit`` (blocks); ``writer``: an earlier
        request that wrote those blocks (named, with what the sliding layers keep of them)."""
        bs = self.block_size
        parts = []
        for w, lacking in self.missing(hashes, blocks).items():
            if lacking:
                kept = [i for i in range(blocks) if hashes[i] in self.cached[w]]
                by = (f" ({writer} wrote blocks 0..{blocks - 1}; of them the sliding layers keep "
                      f"{_runs(kept) if kept else 'none'} cached, the rest were freed as the window moved past "
                      f"them)" if writer else "")
                parts.append(f"the sliding layers (window {w}) resuming at position {blocks * bs} read blocks "
                             f"{max(blocks - self.need[w], 0)}..{blocks - 1}, and {_runs(lacking)} "
                             f"{'is' if len(lacking) == 1 else 'are'} not cached for them{by}")
        rule = ("vLLM caches a sliding layer's blocks only in the blocks before a prompt's last block or a "
                "shared-prefix junction (prefix_cache_retention_interval=0) and frees the rest as they leave the "
                "window" if self.interval == 0 else
                f"vLLM caches a sliding layer's blocks only before every {self.interval} tokens, a prompt's last "
                f"block or a shared-prefix junction (prefix_cache_retention_interval={self.interval})")
        where = (f"the nearest earlier point with its window cached is position {hit * bs}" if hit else
                 "no earlier point has its window's blocks cached")
        return (f"positions 0..{blocks * bs - 1} are cached in the full-attention layers, but {'; '.join(parts)}: "
                f"{rule}; {where}, so this request resumes at {hit * bs}; it now caches that tail, so the next "
                f"request sharing these {blocks * bs} tokens hits them")


def _runs(blocks: list[int]) -> str:
    """``[3, 4, 5, 9]`` as ``"blocks 3..5 and 9"``."""
    parts = [f"{a}..{b}" if b > a else f"{a}" for a, b in runs(blocks)]
    text = ", ".join(parts[:-1]) + (" and " if len(parts) > 1 else "") + parts[-1]
    return f"block{'s' * (len(blocks) > 1)} {text}"
