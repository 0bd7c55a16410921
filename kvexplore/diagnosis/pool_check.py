"""The doctor's counterpart for prefix pools (docs/bugs.md#the-checkers): every request a pool served against the
same request on an empty pool, where nothing is shared: a prefix hit must be invisible in the logits and the blocks."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from ..errors import SettingsError
from ..trace.diff import tolerance_for


@dataclass
class PoolReport:
    """``diverged``; ``requests`` checked; the first finding: ``request`` (its index) and ``label``, ``token`` (of its
    answer) whose logits part by ``max_diff`` (relative), ``block`` (its index in the request's table) and ``layer``
    whose ``what`` (keys or values) part first at ``position``, ``hit`` (the block came from the cache) and a
    ``hint``; ``chosen`` / ``fresh_token`` the tokens the two runs chose there."""

    diverged: bool
    requests: int
    tolerance: float
    request: int | None = None
    label: str = ""
    token: int | None = None
    block: int | None = None
    layer: int | None = None
    position: int | None = None
    what: str | None = None
    max_diff: float | None = None
    hit: bool | None = None
    hint: str = ""
    chosen: int | None = None
    fresh_token: int | None = None

    def summary(self) -> str:
        if not self.diverged:
            return (f"no divergence in {self.requests} requests: each request's logits, and every block it holds, "
                    f"are what the same request computes on an empty pool (tolerance {self.tolerance:g})")
        where = "" if self.block is None else (f", block {self.block}" + ("" if self.layer is None else
                                                                         f", layer {self.layer}"))
        label = self.label if self.label == f"request {self.request}" else f"{self.label} (request {self.request})"
        return (f"first divergence at {label}, token {self.token} of its answer{where}: "
                f"logits differ by {self.max_diff:.3g} (relative)"
                + ("" if self.position is None else f"; {self.what} part at position {self.position}")
                + f"\n  hint: {self.hint}")

    __str__ = summary


def check_pool(pool: Any) -> PoolReport:
    """Serve every request in ``pool.results`` again, its answer forced, on an empty :class:`~kvexplore.PrefixPool`
    of the same model, size and policy, and compare (see the module's docstring). The requests must have been served
    with ``keep_logits=True``; their blocks are compared where the pool still holds them as they were written."""
    from ..prefix.pool import PrefixPool

    tol = tolerance_for(pool.cache.dtype)
    report = PoolReport(False, 0, tol)
    for result in pool.results:
        if result.logits is None:
            raise SettingsError(f"{result.label} was served without its logits: serve with keep_logits=True to check "
                                f"a pool against an empty one")
        report.requests += 1
        fresh = PrefixPool(pool.model, pool.num_blocks, pool.block_size, policy=pool.policy,
                           checkpoint_states=pool.states.where, dtype=pool.cache.dtype)
        again = fresh.serve(result.prompt, response=result.generated, keep_logits=True, keep=True)
        scale = again.logits.abs().amax(dim=-1).clamp_min(1e-6)
        rel = ((result.logits - again.logits).abs().amax(dim=-1) / scale)
        bad = (rel > tol).nonzero()
        if not len(bad):
            continue
        j = int(bad[0])
        report.diverged, report.request, report.label, report.token = True, result.index, result.label, j
        report.max_diff = float(rel[j])
        report.chosen, report.fresh_token = result.generated[j], int(again.logits[j].argmax())
        _first_block(report, pool, result, fresh, again, tol)
        return report
    return report


def _first_block(report: PoolReport, pool: Any, result: Any, fresh: Any, again: Any, tol: float) -> None:
    """The first block (then layer, keys before values) of ``result`` whose stored keys or values part from the same
    block on the empty pool, and the hint."""
    bs = pool.block_size
    written = list(result.prompt) + list(result.generated[:-1])
    for b, (page, twin) in enumerate(zip(result.blocks, again.blocks)):
        n = min(bs, len(written) - b * bs)
        if n <= 0:
            break
        if pool.pool.tokens[page] != tuple(written[b * bs: b * bs + n]):
            continue  # the pool has given this page to another block since: it cannot be compared
        for layer, (k, k0) in enumerate(zip(pool.pool.k, fresh.pool.k)):
            if k is None:
                continue
            for what, got, ref in (("keys", k[page, :, :n], k0[twin, :, :n]),
                                   ("values", pool.pool.v[layer][page, :, :n], fresh.pool.v[layer][twin, :, :n])):
                diff = (got - ref).abs().amax(dim=(0, 2))  # per slot
                worst = float(diff.max()) / max(float(ref.abs().max()), 1e-6)
                if worst > tol:
                    slot = int((diff > tol * max(float(ref.abs().max()), 1e-6)).nonzero()[0])
                    report.block, report.layer, report.what = b, layer, what
                    report.position, report.hit = b * bs + slot, page in result.hit_blocks
                    report.hint = _hint(report, pool, page, result)
                    return
    report.hint = ("the logits part while every block the pool still holds for this request agrees with the empty "
                   "pool's: what differs is not stored in its blocks (a recurrent state restored from a checkpoint, "
                   "or a block the pool has reused since)")


def _hint(report: PoolReport, pool: Any, page: int, result: Any) -> str:
    b, L, p = report.block, report.layer, report.position
    if report.hit:
        by = pool.pool.stored_by[page]
        return (f"block {b} (page {page}) was read from the cache, written by request {by}, and its layer-{L} "
                f"{report.what} differ from what this prompt computes there (from position {p}): the hit reused keys "
                f"computed for another prefix or position. A block's key must name everything its keys depend on: "
                f"every token before it (a chain hash), its position, and anything else that changes them (an adapter, "
                f"a salt)")
    return (f"block {b} was written by this request and its layer-{L} {report.what} part from the empty pool's at "
            f"position {p} (the request's hit ended at {result.hit_tokens}): the request resumed after its hit at "
            f"the wrong position, or fed other tokens than its prompt's; a request's first computed position is the "
            f"end of its hit, and a hit never covers the prompt's last token")
