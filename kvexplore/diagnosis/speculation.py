"""The doctor's counterpart for speculative decoding (docs/bugs.md#the-checkers): every verification against plain
greedy decoding, which it must equal token for token, and the cache after every take-back against a recomputation."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from ..errors import SettingsError
from ..core.settings import integer
from ..trace.diff import tolerance_for
from .greedy import greedy
from .run import token_ids
from .take_back import check_cache


@dataclass
class SpeculationReport:
    """``diverged``; ``verification`` (its index), ``step`` (the first record it gave), ``layer`` (None: the logits),
    ``position``, ``what`` departed, ``max_diff`` and a ``hint`` of the first finding; ``token`` / ``plain_token``
    where a kept token differs from plain decoding's. ``verifications`` checked, ``take_backs`` among them."""

    diverged: bool
    verifications: int
    take_backs: int
    tolerance: float
    verification: int | None = None
    step: int | None = None
    layer: int | None = None
    position: int | None = None
    what: str | None = None
    max_diff: float | None = None
    hint: str = ""
    token: int | None = None
    plain_token: int | None = None
    tokens: list[int] = field(default_factory=list)

    def summary(self) -> str:
        if not self.diverged:
            return (f"no divergence in {self.verifications} verifications ({self.take_backs} took drafts back): every "
                    f"kept token is plain decoding's and every take-back leaves the cache a recomputation gives "
                    f"(tolerance {self.tolerance:g})")
        layer = "the logits" if self.layer is None else f"layer {self.layer}"
        return (f"first divergence at verification {self.verification} (step {self.step}), {layer}: {self.what} at "
                f"position {self.position}" + ("" if self.max_diff is None else f" differ by {self.max_diff:.3g}")
                + f"\n  hint: {self.hint}")

    __str__ = summary


def check_speculation(generator: Any, prompt: Any, steps: int = 32) -> SpeculationReport:
    """Prefill ``generator`` (a :class:`~kvexplore.Generator` made with a ``draft``, greedy) with ``prompt`` and run
    verifications until ``steps`` tokens; after each, compare its tokens with plain greedy decoding (a fresh
    concatenating cache) and, when it took drafts back, run the doctor's step on a fork of the cache."""
    from ..caches.factory import make_cache

    steps = integer(steps, "steps", 1, 100_000, " (how many tokens to check)")
    if generator.speculation is None:
        raise SettingsError("check_speculation needs a generator made with draft=... (speculative decoding)")
    if not generator.sampling.greedy:
        raise SettingsError("check_speculation compares with plain greedy decoding: make the generator with "
                            "temperature=0")
    model = generator.model
    ids = token_ids(prompt, model.tokenizer, model.config.vocab_size)
    plain, logits = greedy(model, make_cache("concat", model), ids, steps)
    generator.prefill(ids)
    report = SpeculationReport(False, 0, 0, tolerance_for(model.dtype))
    while len(generator.history) < steps:
        first = len(generator.history)
        generator.step()
        records = generator.history[first:]
        v = generator.speculation.verifications[-1] if records[-1].verification is not None else None
        report.verifications += v is not None
        if v is not None and v.rolled_back:
            report.take_backs += 1
            found = check_cache(model, generator.cache, generator.tokens, len(ids))
            if found.first is not None:
                d = found.first
                return _found(report, v.index, first, d.layer, d.position, d.what, d.max_diff,
                              f"after the take-back of verification {v.index} ({v.take_back}: {v.rolled_back} "
                              f"position(s) given back) {found.hint}", generator)
        for i, r in enumerate(records):
            s = first + i
            if s < steps and r.token_id != plain[s]:
                row = logits[s]
                gap = float(row.max() - row[r.token_id])
                out = _found(report, r.verification, s, None, len(ids) - 1 + s, "logits", gap,
                             f"step {s} kept token {r.token_id} where plain decoding chooses {plain[s]} (its logit "
                             f"{gap:.3g} below the best): "
                             + _why(r), generator)
                out.token, out.plain_token = r.token_id, plain[s]
                return out
    report.tokens = list(generator.tokens)
    return report


def _found(report: SpeculationReport, verification, step, layer, position, what, diff, why, generator):
    report.diverged, report.verification, report.step, report.layer = True, verification, step, layer
    report.position, report.what, report.max_diff, report.hint = position, what, diff, why
    report.tokens = list(generator.tokens)
    return report


def _why(record: Any) -> str:
    """Why a kept token can differ from plain decoding's, by what the verification made of it."""
    if record.accepted:
        return "the acceptance kept a drafted token the target's own logits do not choose here"
    if record.drafted:
        return ("the token that replaced a rejected draft is not the target's choice from this position's row of "
                "logits: the correction was taken from another row (or with another rule)")
    return ("a bonus or plain token differs: the logits it came from were not the target's for this sequence (the "
            "cache it verified against, or the rows it read)")
