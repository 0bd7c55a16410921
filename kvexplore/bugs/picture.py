"""Where a decoding bug's broken run parts from its fixed twin, layer by layer and step by step (both caches fed the
fixed run's tokens): which layer departs first, from which step, and how it spreads upward."""

from __future__ import annotations

from typing import Any

import torch

from ..diagnosis.passes import KVPasses
from ..errors import SettingsError


def departure_map(reproduction: Any) -> torch.Tensor:
    """``(layers + 1, steps)``: per step of a decode bug's runs, each layer's output in the broken run against the
    fixed one's, relative to the fixed one's largest value (the last row: the logits)."""
    bug = reproduction.bug
    if reproduction.fixed.unit != "step" or reproduction.fixed.remake is None:
        raise SettingsError(f"{bug.name} is shown by a {bug.checker} check, not by greedy decoding: its departure map "
                            f"is its checker's report (reproduction.doctor)")
    (broken_model, broken_cache), (fixed_model, fixed_cache) = reproduction.broken.remake(), reproduction.fixed.remake()
    prompt, tokens = reproduction.fixed.prompt, reproduction.fixed.chosen
    a, b = KVPasses(broken_model, broken_cache), KVPasses(fixed_model, fixed_cache)
    seq = list(prompt)
    columns = []
    with torch.inference_mode():
        for step, token in enumerate(tokens):
            feed, pos = (seq, 0) if step == 0 else (seq[-1:], len(seq) - 1)
            got, ref = a.cached(feed, pos), b.cached(feed, pos)
            col = [_rel(g.out, r.out) for g, r in zip(got.layers, ref.layers)]
            columns.append(col + [_rel(got.logits, ref.logits)])
            seq.append(token)
    return torch.tensor(columns).T


def _rel(got: torch.Tensor | None, ref: torch.Tensor | None) -> float:
    if got is None or ref is None:
        return float("nan")
    return float((got - ref).abs().max()) / max(float(ref.abs().max()), 1e-6)
