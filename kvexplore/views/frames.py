"""A recorded run, step by step, as the views draw it: the snapshot of every step and every figure the registry's
replayed views make of it (:func:`frames`), with each array stored once.

The HTML replay, an explorer's ``save_html`` and a notebook's static copy share this drawing and differ only in the
page around it (:mod:`.page`); which views a frame holds comes from the registry (:attr:`~.registry.View.replay`).
An array that is the start of a later step's refers to it (frames are encoded last first).
"""

from __future__ import annotations

import base64
import dataclasses
import math
from collections.abc import Mapping, Sequence
from types import SimpleNamespace
from typing import Any

import numpy as np

from ..errors import SettingsError
from ..trace.records import StepRecord
from .registry import replayed
from .snapshot import LaneDetail, LaneSnapshot, Snapshot


def model_info(run: Sequence[StepRecord]) -> SimpleNamespace:
    """The few figures of the model the views draw, from the run's meta (or, for an older trace, its records)."""
    meta = getattr(run, "meta", {}).get("model")
    if meta:
        return SimpleNamespace(**meta)
    trace = next((r.trace for r in run if r.trace is not None), None)
    layers = len(trace.layer_slots) if trace is not None and len(trace.layer_slots) > 1 else \
        1 + max((e.layer for r in run if r.trace for e in r.trace.events), default=0)
    groups = trace.gqa_groups if trace is not None else [[0]]
    return SimpleNamespace(name="", num_layers=layers, num_heads=sum(len(g) for g in groups),
                           num_kv_heads=len(groups), gqa_groups=groups, attention_sinks=False)


def texts(run: Sequence[StepRecord], upto: int) -> list[str]:
    """The text of every position of ``run`` up to step ``upto`` (the prompt's, then each record's)."""
    meta = getattr(run, "meta", {})
    prompt = meta.get("prompt_texts") or [f"[{i}]" for i in range(run[0].input_len if run else 0)]
    return list(prompt) + [r.text for r in run[: upto + 1]]


def snapshot_at(runs: Mapping[str, Sequence[StepRecord]], step: int, shown: str, layer: int = 0,
                head: int = 0) -> Snapshot:
    """The explorer's :class:`~.snapshot.Snapshot` of ``runs`` as they were after ``step``."""
    first = next(iter(runs.values()))
    config = model_info(first)
    lanes = {}
    for name, run in runs.items():
        history = list(run[: step + 1])
        lane = LaneSnapshot(name, getattr(run, "meta", {}).get("kind", name), history, [None] * len(history),
                            [None] * len(history), set())
        last = history[-1] if history else None
        slots = None
        if last is not None and last.trace is not None and last.trace.layer_slots:
            slots = [last.trace.slots_of(i) for i in range(config.num_layers)]
        # a replay keeps no stored error: a quantized lane's note says so rather than call it exact
        lane.detail = LaneDetail(texts=texts(run, step), slots=slots, norms=None, stored_error=None,
                                 lossy=bool(getattr(run, "meta", {}).get("lossy")))
        lanes[name] = lane
    return Snapshot(config, lanes, next(iter(runs)), shown, None, layer, head, "step", False)


class ArrayStore:
    """Arrays of every frame, each stored once: an array that is the start of one already stored (a later step's,
    as frames are encoded last first) is a reference to it."""

    def __init__(self) -> None:
        self.arrays: list[dict] = []
        self._base: dict[str, tuple[int, np.ndarray]] = {}  # path -> the array a prefix may refer to

    def array(self, path: str, a: np.ndarray) -> dict:
        a = np.ascontiguousarray(a)
        if a.dtype == np.bool_:
            a = a.astype(np.uint8)
        elif a.dtype == np.int64:
            a = a.astype(np.int32) if not a.size or (a.min() >= -2**31 and a.max() < 2**31) else a.astype(np.float64)
        base = self._base.get(path)
        if base is not None and base[1].dtype == a.dtype and a.size <= base[1].size and \
                np.array_equal(base[1][: a.size], a, equal_nan=bool(np.issubdtype(a.dtype, np.floating))):
            return {"$a": base[0], "n": int(a.size)}
        self.arrays.append({"dtype": str(a.dtype), "b64": base64.b64encode(a.tobytes()).decode()})
        self._base[path] = (len(self.arrays) - 1, a)
        return {"$a": len(self.arrays) - 1, "n": int(a.size)}

    def encode(self, value: Any, path: str) -> Any:
        if isinstance(value, dict):
            return {k: self.encode(v, f"{path}.{k}") for k, v in value.items()}
        if isinstance(value, (list, tuple)):
            return [self.encode(v, f"{path}[{i}]") for i, v in enumerate(value)]
        if isinstance(value, np.ndarray):
            if value.ndim == 1 and any(np.issubdtype(value.dtype, t) for t in (np.integer, np.floating, np.bool_)):
                # a flat array of numbers or booleans travels as a typed array
                return self.array(path, value)
            return self.encode(value.tolist(), path)
        if isinstance(value, np.generic):
            value = value.item()
        if isinstance(value, float) and not math.isfinite(value):
            return None
        return value


def check_picks(runs: Mapping[str, Sequence[StepRecord]], layer: int, head: int) -> SimpleNamespace:
    """Refuse runs with nothing to replay, or a layer or head the model does not have; the model's figures."""
    if not runs or not all(len(r) for r in runs.values()):
        raise SettingsError("nothing to replay: every run needs at least its prefill record")
    config = model_info(next(iter(runs.values())))
    check_layer_head(config, layer, head)
    return config


def check_layer_head(config: Any, layer: int, head: int) -> None:
    """Refuse a layer or query head the model of ``config`` does not have."""
    if not 0 <= layer < config.num_layers:
        raise SettingsError(f"layer {layer} does not exist: the model has layers 0..{config.num_layers - 1}")
    if not 0 <= head < config.num_heads:
        raise SettingsError(f"head {head} does not exist: the model has query heads 0..{config.num_heads - 1}")


def pick_list(layer: int, head: int, picks: Sequence[Sequence[int]] | None = None) -> list[tuple[int, int]]:
    """The (layer, head) picks a replay holds: ``(layer, head)`` first (the one it opens at), then ``picks`` in their
    order, each once."""
    out = [(layer, head)]
    for pick in picks or ():
        try:
            pair = tuple(pick)
            ok = len(pair) == 2 and all(isinstance(v, (int, np.integer)) and not isinstance(v, bool) for v in pair)
        except TypeError:
            ok = False
        if not ok:
            raise SettingsError(f"picks: {pick!r} is not a (layer, head) pair of whole numbers; "
                                f"write picks=[(3, 1), (5, 0)]")
        pair = (int(pair[0]), int(pair[1]))
        if pair not in out:
            out.append(pair)
    return out


def pick_key(layer: int, head: int) -> str:
    """How a frame names the figures of a pick other than the first (``frame["picks"]["3,1"]``)."""
    return f"{layer},{head}"


def _same(a: Any, b: Any) -> bool:
    """Whether two figures' traces or layouts are the same (arrays by value, NaN equal to NaN)."""
    if isinstance(a, np.ndarray) or isinstance(b, np.ndarray):
        a, b = np.asarray(a), np.asarray(b)
        if a.shape != b.shape or a.dtype != b.dtype:
            return False
        return bool(np.array_equal(a, b, equal_nan=np.issubdtype(a.dtype, np.inexact)))
    if isinstance(a, dict) and isinstance(b, dict):
        return a.keys() == b.keys() and all(_same(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)):
        return len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b))
    if isinstance(a, float) and isinstance(b, float) and math.isnan(a) and math.isnan(b):
        return True
    return type(a) is type(b) and a == b


def _figures(runs: Mapping[str, Sequence[StepRecord]], step: int, layer: int, head: int, per_lane, per_run) -> dict:
    snap = snapshot_at(runs, step, next(iter(runs)), layer, head)
    figs = {}
    for name in runs:
        shown = dataclasses.replace(snap, shown=name)
        for view in per_lane:
            if view.drawn_for(runs[name]):
                figs[f"{view.name}:{name}"] = view.build(shown)
    whole = dataclasses.replace(snap, shown=list(runs)[-1])
    for view in per_run:
        figs[view.name] = view.build(whole)
    return figs


def frames(runs: Mapping[str, Sequence[StepRecord]], layer: int = 0, head: int = 0,
           picks: Sequence[Sequence[int]] | None = None) -> tuple[list[dict], ArrayStore]:
    """Every step's figures (``"<view>:<lane>"`` for a view drawn per lane, ``"<view>"`` for a view of the whole
    run) and how many generated tokens each lane's strip shows.

    ``figures`` are drawn at ``(layer, head)``. With ``picks`` (more (layer, head) pairs, see :func:`pick_list`) a
    frame also has ``picks``: for each other pick (:func:`pick_key`), only the figures that differ from the first
    pick's at that step (the attention, press scores and eviction of that layer and head; the memory lines, which no
    layer or head changes, are stored once)."""
    chosen = pick_list(layer, head, picks)
    for pick in chosen:
        check_picks(runs, *pick)
    per_lane, per_run = replayed(runs)
    steps = max(len(r) for r in runs.values())
    store = ArrayStore()
    out: list[dict | None] = [None] * steps
    for step in reversed(range(steps)):  # last first: earlier arrays are prefixes of later ones
        figs = _figures(runs, step, layer, head, per_lane, per_run)
        out[step] = {"step": step,
                     "figures": {key: store.encode({"data": f.traces, "layout": f.layout}, key)
                                 for key, f in figs.items()},
                     "tokens": {name: min(step, len(run) - 1) + 1 for name, run in runs.items()}}
        if len(chosen) > 1:
            other: dict[str, dict] = {}
            for pick in chosen[1:]:
                key = pick_key(*pick)
                other[key] = {name: store.encode({"data": f.traces, "layout": f.layout}, f"{name}@{key}")
                              for name, f in _figures(runs, step, *pick, per_lane, per_run).items()
                              if name not in figs or not (_same(f.traces, figs[name].traces)
                                                          and _same(f.layout, figs[name].layout))}
            out[step]["picks"] = other  # type: ignore[index]
    return out, store  # type: ignore[return-value]
