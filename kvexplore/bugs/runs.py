"""One run of a bug's scenario (:class:`Run`: decode steps or served requests), and where two runs first part
(:func:`first_divergence`)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

from ..caches.factory import make_cache
from ..errors import SettingsError
from ..trace.parting import first_parting

#: two runs part where a logit differs by more than this (absolute), or a chosen token differs
LOGIT_TOL = 1e-2


@dataclass
class Run:
    """``unit`` is ``"step"`` or ``"request"``; per unit: ``tokens`` (the tokens it chose), ``logits`` (``(n, vocab)``
    float32, or None where the run does not keep them), ``positions`` (the position of the pass that chose the first of
    them). ``prompt``: the token ids the run started from (a list of them per request); ``subject``: the cache, pool
    or generator after the run, as it is (for views and the checker's picture); ``notes``: what the run did, in
    words."""

    planted: bool
    unit: str
    tokens: list[list[int]] = field(default_factory=list)
    logits: list[torch.Tensor | None] = field(default_factory=list)
    positions: list[int] = field(default_factory=list)
    prompt: Any = None
    subject: Any = None
    notes: list[str] = field(default_factory=list)
    replay: Any = None  # () -> the run's StepRecords (traced: cache map, memory), for the replay page; None: a pool
    remake: Any = None  # a decoding run: () -> (model, a fresh cache) as the run used them

    def records(self) -> list:
        """The run as :class:`~kvexplore.StepRecord` objects (what the replay page draws)."""
        if self.replay is None:
            raise SettingsError("this run served requests on a pool: draw it with the pool's replay (save_html)")
        return self.replay()

    @property
    def chosen(self) -> list[int]:
        """Every token the run chose, in order."""
        return [t for unit in self.tokens for t in unit]


@dataclass(frozen=True)
class Divergence:
    """Where the broken run first parts from the fixed one: ``unit`` (``"step"`` or ``"request"``) number ``index``,
    the token ``offset`` within it (a request's answer), ``position`` (of the pass whose logits part), the two tokens
    chosen there, ``max_diff`` (the largest logit difference there; None where the runs keep no logits), and from the
    checker's report on the broken run: ``layer`` (None: only the logits part), ``block`` (a prefix pool's block),
    ``what`` (keys, values, output, logits, ...)."""

    unit: str
    index: int
    offset: int
    position: int
    broken_token: int
    fixed_token: int
    max_diff: float | None
    layer: int | None = None
    block: int | None = None
    what: str | None = None

    def __str__(self) -> str:
        where = f"{self.unit} {self.index}" + (f", token {self.offset} of its answer" if self.offset else "")
        layer = "" if self.layer is None else f", layer {self.layer}"
        block = "" if self.block is None else f", block {self.block}"
        diff = "" if self.max_diff is None else f"; logits differ by up to {self.max_diff:.3g}"
        tokens = (f"the broken run chose token {self.broken_token}, the fixed run {self.fixed_token}"
                  if self.broken_token != self.fixed_token else f"both chose token {self.broken_token}")
        return f"{where} (position {self.position}{layer}{block}): {tokens}{diff}"


def first_divergence(broken: Run, fixed: Run, report: Any = None) -> Divergence | None:
    """The first unit and token where ``broken`` chose another token than ``fixed`` or its logits differ by more than
    :data:`LOGIT_TOL` (the rule of :mod:`kvexplore.trace.parting`); None when they agree throughout. ``report``: the
    checker's report on the broken run, whose ``layer``, ``block`` and ``what`` are carried over."""
    at = first_parting(_compared(broken, fixed), LOGIT_TOL)
    if at is None:
        return None
    i, j, a, b, diff = at
    return Divergence(broken.unit, i, j, fixed.positions[i] + j, a, b, diff, layer=getattr(report, "layer", None),
                      block=getattr(report, "block", None), what=getattr(report, "what", None))


def _compared(broken: Run, fixed: Run):
    """Each token of the two runs side by side, in order: ``((unit, offset, broken's token, fixed's token, largest
    logit difference or None), same token, that difference)``; a token one run did not choose reads -1."""
    for i, (tb, tf) in enumerate(zip(broken.tokens, fixed.tokens)):
        lb = broken.logits[i] if i < len(broken.logits) else None
        lf = fixed.logits[i] if i < len(fixed.logits) else None
        for j in range(max(len(tb), len(tf))):
            both = lb is not None and lf is not None and j < len(lb) and j < len(lf)
            diff = float((lb[j] - lf[j]).abs().max()) if both else None
            a = tb[j] if j < len(tb) else -1
            b = tf[j] if j < len(tf) else -1
            yield (i, j, a, b, diff), a == b, diff


def decode_run(model: Any, cache: Any, prompt: list[int], steps: int, planted: bool) -> Run:
    """Greedy decoding of ``steps`` tokens after ``prompt`` through ``cache`` (one pass for the prompt, then one per
    token), keeping every step's logits."""
    from ..diagnosis.greedy import greedy

    chosen, logits = greedy(model, cache, prompt, steps)
    return Run(planted, "step", [[t] for t in chosen], [row[None] for row in logits],
               [len(prompt) - 1 + s for s in range(steps)], list(prompt), cache)


def forced_records(model: Any, cache: Any, prompt: list[int], tokens: list[int]) -> list:
    """The records of a traced generator fed ``prompt`` and then ``tokens`` (each forced: the run's own choices)."""
    from ..runtime.generator import Generator
    from ..trace.tracer import Tracer

    gen = Generator(model, cache, tracer=Tracer())
    gen.prefill(prompt, force=tokens[0])
    for t in tokens[1:]:
        gen.step(force=t)
    return list(gen.history)


def text_ids(model: Any, text: str) -> list[int]:
    """``text`` as the model's tokenizer reads it, with its BOS token where it adds one."""
    tok = model.tokenizer
    ids = tok.encode(text)
    return [tok.bos_id, *ids] if tok.add_bos else list(ids)


def decode_scenario(text: str, steps: int, make: Any) -> tuple[Any, Any]:
    """The ``run`` and ``check`` of a bug shown by greedy decoding: ``make(model, planted) -> (model, cache)`` gives
    the model (the caller's, or a planted twin of it) and the cache to decode ``text`` and ``steps`` tokens through;
    the check is the cache doctor on the same."""
    from ..diagnosis import doctor

    def run(model: Any, planted: bool) -> Run:
        m, cache = make(model, planted)
        out = decode_run(m, cache, text_ids(m, text), steps, planted)
        out.remake = lambda: make(model, planted)
        out.replay = lambda: forced_records(*out.remake(), out.prompt, out.chosen)
        return out

    def check(model: Any, planted: bool) -> Any:
        m, cache = make(model, planted)
        return doctor(m, prompt=text_ids(m, text), steps=steps, cache=cache)

    return run, check


def planted_maker(planted_class: type, kind: str, options: dict[str, Any] | None = None):
    """``make(model, planted, slots)`` of a decoding bug: ``(model, planted_class(...))`` with the bug planted, else
    ``(model, make_cache(kind, ...))``, both of ``slots`` positions with ``options``."""
    def make(model: Any, planted: bool, slots: int = 64) -> tuple[Any, Any]:
        if planted:
            return model, planted_class(model.config, max_seq_len=slots, dtype=model.dtype, **(options or {}))
        return model, make_cache(kind, model, max_seq_len=slots, **(options or {}))
    return make
