"""Where two recorded runs of the same prompt part (``kvexplore.diff_traces(a, b)``, ``kvexplore diff A B``): the
first step whose tokens differ, and the first step and layer whose recorded keys, values or attention depart beyond a
tolerance. Nothing after the step whose tokens differ is compared: from there the runs read different sequences."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

import torch

from ..errors import SettingsError
from .parting import first_parting
from .records import StepRecord

#: relative tolerance on keys and values (of the larger magnitude compared), absolute on probabilities, by the
#: less precise dtype of the two runs
TOLERANCE = {"float32": 1e-4, "float16": 5e-3, "bfloat16": 3e-2}
WHAT = ("keys", "values", "attention")


def tolerance_for(dtype) -> float:
    """The default tolerance of runs in ``dtype`` (a torch dtype or its name; float32's when not known)."""
    return TOLERANCE.get(str(dtype).removeprefix("torch."), TOLERANCE["float32"])


@dataclass(frozen=True)
class Difference:
    """The largest difference of one quantity at one step and layer (``layer`` None: the chosen token's
    probability). ``position`` is the sequence position where it is largest."""

    step: int
    layer: int | None
    what: str  # keys, values, attention, probability
    max_diff: float
    position: int
    scale: float  # what the difference is measured against (1 for probabilities)

    @property
    def relative(self) -> float:
        """What the tolerance is compared with: ``max_diff / scale`` (the scale is 1 for attention and
        probabilities, so for them the absolute difference)."""
        return self.max_diff / self.scale if self.scale else 0.0

    def describe(self) -> str:
        where = f"layer {self.layer}" if self.layer is not None else "the output"
        return (f"step {self.step}, {where}: {self.what} differ by {self.max_diff:.3g} at position {self.position}"
                + (f" ({self.relative:.2g} of their largest magnitude {self.scale:.3g})" if self.what in
                   ("keys", "values") else ""))


@dataclass
class TraceDiff:
    """What :func:`diff_traces` found."""

    steps: int  # steps compared
    tolerance: float
    token_step: int | None = None  # the first step whose chosen tokens differ
    first: Difference | None = None  # the first difference beyond the tolerance (step, then layer order)
    largest: list[Difference] = field(default_factory=list)  # the largest differences seen, largest first
    compared: tuple[str, ...] = ()  # what the traces allowed comparing

    @property
    def diverged(self) -> bool:
        return self.token_step is not None or self.first is not None

    @property
    def step(self) -> int | None:
        return self.first.step if self.first is not None else self.token_step

    @property
    def layer(self) -> int | None:
        return None if self.first is None else self.first.layer

    @property
    def position(self) -> int | None:
        return None if self.first is None else self.first.position

    @property
    def max_diff(self) -> float:
        return self.largest[0].max_diff if self.largest else 0.0

    def summary(self) -> str:
        what = ", ".join(self.compared) or "tokens"
        if not self.diverged:
            worst = f"; largest difference: {self.largest[0].describe()}" if self.largest else ""
            return f"no divergence in {self.steps} steps (compared {what}, tolerance {self.tolerance:g}){worst}"
        f = self.first
        if f is None:
            return f"first divergence at step {self.token_step}: the chosen tokens differ"
        where = f"layer {f.layer}" if f.layer is not None else "the output"
        tokens = "never differ" if self.token_step is None else f"first differ at step {self.token_step}"
        return (f"first divergence at step {f.step}, {where}: {f.what} differ by {f.max_diff:.3g} at position "
                f"{f.position} (tolerance {self.tolerance:g}); the chosen tokens {tokens}")

    def report(self, most: int = 5) -> str:
        lines = [self.summary()]
        if self.largest:
            lines.append("largest differences:")
            lines += [f"  {d.describe()}" for d in self.largest[:most]]
        return "\n".join(lines)


def _records(run) -> list[StepRecord]:
    if isinstance(run, (str, Path)):
        from .files import load_trace

        return load_trace(run)
    if not isinstance(run, Sequence) or not all(isinstance(r, StepRecord) for r in run):  # a list or a History
        raise SettingsError(f"a run must be a trace path or a list of StepRecords, got {type(run).__name__}")
    return run


def _dtype_tolerance(a: list[StepRecord], b: list[StepRecord]) -> float:
    names = set()
    for run in (a, b):
        meta = getattr(run, "meta", {})
        if meta.get("dtype"):
            names.add(meta["dtype"])
        for r in run[:1]:
            if r.trace is not None:
                names.update(str(t.dtype).removeprefix("torch.") for t in r.trace.qkv.values())
    return max(map(tolerance_for, names), default=TOLERANCE["float32"])


def diff_traces(a, b, tolerance: float | None = None) -> TraceDiff:
    """Compare two recorded runs of the same prompt (see the module docstring). ``tolerance``: relative for keys
    and values, absolute for probabilities; default by dtype (:data:`TOLERANCE`)."""
    a, b = _records(a), _records(b)
    if not a or not b:
        raise SettingsError("a trace holds no steps: record a run with at least a prefill")
    prompts = [getattr(run, "meta", {}).get("prompt_ids") for run in (a, b)]
    if a[0].input_len != b[0].input_len or (None not in prompts and prompts[0] != prompts[1]):
        raise SettingsError("the two runs start from different prompts: a diff compares two runs of the same prompt "
                            "(record both with the same prompt)")
    tol = float(tolerance) if tolerance is not None else _dtype_tolerance(a, b)
    if not tol >= 0:
        raise SettingsError(f"tolerance must be a number >= 0, got {tolerance!r}")
    out = TraceDiff(steps=0, tolerance=tol)
    seen: list[Difference] = []
    compared: set[str] = set()
    for ra, rb in zip(a, b):
        out.steps += 1
        found = list(_step_differences(ra, rb, compared))
        seen += found
        if out.first is None:  # the rule of .parting, on each difference's relative size
            out.first = first_parting(((d, None, d.relative) for d in found), tol)
        if ra.token_id != rb.token_id:
            out.token_step = ra.step
            break  # from here on the runs read different sequences
    out.largest = sorted(seen, key=lambda d: -d.relative)[:10]
    out.compared = tuple(w for w in (*WHAT, "probability") if w in compared)
    return out


def _step_differences(ra: StepRecord, rb: StepRecord, compared: set[str]):
    """The largest difference of each recorded quantity in one step, layer by layer, then the output's."""
    ta, tb = ra.trace, rb.trace
    first_pos = ra.position - ra.input_len
    if ta is not None and tb is not None:
        layers = sorted({int(k.split(".")[1]) for k in (*ta.qkv, *tb.qkv)} | set(ta.attention_layers)
                        | set(tb.attention_layers))
        for layer in layers:
            for what, point in (("keys", "k_new"), ("values", "v_new")):
                name = f"layers.{layer}.attn.{point}"
                if name in ta.qkv and name in tb.qkv:
                    compared.add(what)
                    yield _tensor_difference(ra.step, layer, what, ta.qkv[name], tb.qkv[name], first_pos)
            if ta.has_attention(layer) and tb.has_attention(layer):
                compared.add("attention")
                yield _attention_difference(ra.step, layer, ta.attention(layer), tb.attention(layer))
    compared.add("probability")
    yield Difference(ra.step, None, "probability", abs(ra.prob - rb.prob), ra.position, 1.0)


def _tensor_difference(step: int, layer: int, what: str, x: torch.Tensor, y: torch.Tensor,
                       first_pos: int) -> Difference:
    x, y = x.float(), y.float()
    if x.shape != y.shape:
        return Difference(step, layer, what, float("inf"), first_pos, 1.0)
    diff = (x - y).abs()  # (B, heads, T, hd)
    scale = max(float(x.abs().max()), float(y.abs().max()), 1e-12) if x.numel() else 1.0
    if not diff.numel():
        return Difference(step, layer, what, 0.0, first_pos, scale)
    at = int(diff.amax(dim=(0, 1, 3)).argmax())
    return Difference(step, layer, what, float(diff.max()), first_pos + at, scale)


def _attention_difference(step: int, layer: int, x: torch.Tensor, y: torch.Tensor) -> Difference:
    """``x``, ``y``: (T, heads, positions) in logical order; the position reported is the key position."""
    width = max(x.shape[-1], y.shape[-1])
    x = torch.nn.functional.pad(x, (0, width - x.shape[-1]))
    y = torch.nn.functional.pad(y, (0, width - y.shape[-1]))
    if x.shape != y.shape:
        return Difference(step, layer, "attention", float("inf"), 0, 1.0)
    diff = (x - y).abs()
    if not diff.numel():
        return Difference(step, layer, "attention", 0.0, 0, 1.0)
    return Difference(step, layer, "attention", float(diff.max()), int(diff.amax(dim=(0, 1)).argmax()), 1.0)
