"""What the views need of a session, taken once per refresh: every lane's records and comparison figures, and for
the lanes on screen their slots, key/value norms, stored error and token texts.

Views are functions of a :class:`Snapshot` (see :mod:`.registry`); they never reach into a session, a cache or a
tracer, and never ask what kind of cache they look at beyond the ``kind`` label each lane carries.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from ..caches.base import SlotView
from ..caches.inspector import lossy_by_design
from ..config.model_config import ModelConfig
from ..trace.records import StepRecord

MAX_BINS = 512  # columns a figure draws at most: wider slots and positions are binned (kvexplore.views.bins)


@dataclass
class LaneDetail:
    """A lane on screen, as it is now."""

    texts: list[str]  # the text of every position
    slots: list[SlotView] | None  # the cache's slots now, per layer (None before any step)
    norms: torch.Tensor | None  # (2, kv_heads, positions) of the chosen layer; NaN where nothing was recorded
    stored_error: torch.Tensor | None  # (kv_heads, length): the cache's error for the chosen layer (lossy caches)
    state: tuple[list[int], torch.Tensor] | None = None  # a linear-attention layer's state norms over the steps
    # the keys' and values' max error per KV head and channel, (kv_heads, head_dim) each (the quantized cache)
    channel_error: tuple[torch.Tensor, torch.Tensor] | None = None
    # the same channels' magnitudes and the codes of each one's worst block (PartDetail; the quantized cache), asked
    # for by the view that draws them (it reads the layer's codes back: work a refresh of the other views need not do)
    channel_detail: Callable[[], tuple[Any, Any] | None] | None = None
    # the lane's attention: its bounded store and rows recomputed on a zoom (kvexplore.explorer.recompute.LaneAttention,
    # which the session gives: session.lane_attention(lane))
    attention: Any = None
    lossy: bool = False  # the cache stores lossily by design (its quantization says how far off it may be)


@dataclass
class SpecInfo:
    """A lane that drafts (speculative decoding), live: its drafter, tokens drafted per verification, its
    verifications (:class:`~kvexplore.speculation.speculative.Verification`), how each kind of layer of its cache takes
    drafts back (``cache.inspect.crop_ways()``) and the doctor's verdict after its last take-back, short and in full
    (None: not run)."""

    drafter: str
    k: int
    verifications: list[Any]
    ways: dict[str, str]
    checkup: str | None = None
    checkup_detail: str | None = None
    paced_by: str | None = None  # the lane whose verification sets a Step's tokens, when it is another lane


@dataclass
class LaneSnapshot:
    name: str
    kind: str
    history: list[StepRecord]
    kl: list[float | None]
    top1: list[bool | None]
    forced: set[int]
    detail: LaneDetail | None = None  # for the lanes on screen only
    speculation: SpecInfo | None = None  # a lane that drafts (live only: a replay has the records alone)
    did: str = ""  # what a lossy cache did so far (KVCache.what_it_did: "nothing quantized yet: ..."); live only

    @property
    def last(self) -> StepRecord | None:
        return self.history[-1] if self.history else None


@dataclass
class Snapshot:
    config: ModelConfig
    lanes: dict[str, LaneSnapshot]
    reference: str
    shown: str  # the lane the cache map, attention and tensors draw
    second: str | None  # the lane of the second cache map (side by side), if any
    layer: int
    head: int
    last_op: str  # the session's last operation: the step's windows are drawn only right after a prefill or step
    cuda: bool
    extra: dict[str, Any] = field(default_factory=dict)
    # what the screen shows: per figure name, the axis ranges the person zoomed to ({"cache_map": {"xaxis": (0, 99)}};
    # absent: the whole figure), and how many columns (bins) a figure draws at most (see :mod:`.bins`)
    zoom: dict[str, dict[str, tuple[float, float]]] = field(default_factory=dict)
    max_bins: int = MAX_BINS

    @property
    def lane(self) -> LaneSnapshot:
        return self.lanes[self.shown]

    @property
    def fresh(self) -> bool:
        return self.last_op in ("prefill", "step")

    def records(self) -> dict[str, list[StepRecord]]:
        return {n: l.history for n, l in self.lanes.items()}


def take(session: Any, strip: Any, shown: str, second: str | None, layer: int, head: int,
         zoom: dict[str, dict[str, tuple[float, float]]] | None = None, max_bins: int = MAX_BINS) -> Snapshot:
    """The snapshot of ``session`` with ``shown`` (and ``second``) on screen; ``strip`` names the tokens."""
    tokenizer = session.model.tokenizer
    lanes = {}
    pace = session.pace.name if session.pace is not None else None
    for name, lane in session.lanes.items():
        lanes[name] = LaneSnapshot(name, lane.kind, list(lane.history), lane.kl, lane.top1, set(lane.forced_at),
                                   speculation=_speculation(lane, pace),
                                   did=lane.cache.inspect.what_it_did() if lane.history else "")
    for name in dict.fromkeys(n for n in (shown, second) if n in session.lanes):
        lane = session.lanes[name]
        has = bool(lane.history)
        lossy = lane.cache.quantization if has else None  # None: an exact cache, or nothing stepped yet
        lanes[name].detail = LaneDetail(
            texts=strip.texts(tokenizer, lane.generator),
            slots=lane.cache.inspect.slot_views() if has else None,
            norms=lane.tracer.norms[lane.cache.plan[layer].source] if has else None,  # a shared layer: its source's
            stored_error=lossy.stored_error(layer) if lossy is not None else None,
            lossy=lossy_by_design(lane.cache),
            state=lane.tracer.state_history(layer, lane.cache.length) if has else None,
            channel_error=lossy.channel_error(layer) if lossy is not None else None,
            channel_detail=(lambda lossy=lossy: lossy.channel_detail(layer)) if lossy is not None else None,
            attention=session.lane_attention(lane) if has else None)
    return Snapshot(session.model.config, lanes, session.reference.name, shown,
                    second if second in session.lanes else None, layer, head, session.last_op,
                    session.model.device.type == "cuda", zoom=dict(zoom or {}), max_bins=max_bins)


def _speculation(lane: Any, pace: str | None) -> SpecInfo | None:
    spec = lane.speculation
    if spec is None:
        return None
    checkups = lane.checkups
    last = checkups[max(checkups)] if checkups else None
    return SpecInfo(spec.drafter.name, spec.k, list(spec.verifications), lane.cache.inspect.crop_ways(),
                    last.short if last else None, last.text if last else None,
                    pace if pace != lane.name else None)
