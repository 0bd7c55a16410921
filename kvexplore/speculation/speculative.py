"""Speculative decoding: a drafter proposes ``k`` tokens, the target checks them all in one forward pass of ``k + 1``
positions, and the cache takes back what the target rejected: truncated where every layer can be cut exactly (each
layer's ``take_back(n, length).way``), else rolled back from the step's undo journal and the accepted tokens written
again (``recompute``). The acceptance rules (greedy, and sampling's ``min(1, p(x) / q(x))``) and the take-backs are
explained in docs/speculative.md."""

from __future__ import annotations

import time
from contextlib import nullcontext
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING

import torch

from ..caches.memory import MemoryReport
from ..core import host
from ..core.settings import integer
from ..errors import SettingsError
from ..runtime import clock
from .drafters import Draft, Drafter, make_drafter
from ..runtime.recording import eos_ids, step_record
from ..runtime.sampling import choose, filtered_probs
from ..runtime.target import Target

if TYPE_CHECKING:
    from ..trace.records import StepRecord

TRUNCATE, RECOMPUTE, NOTHING = "truncate", "recompute", "nothing"  # how a verification's rejected drafts went
CHECKPOINT = "checkpoint"
STATE_ROLLBACKS = (CHECKPOINT, RECOMPUTE)  # how linear-attention states give drafts back (Speculation.states)


@dataclass
class Verification:
    """One verification pass: ``drafted`` tokens checked at positions ``pos + 1 ..`` (the fed newest token at
    ``pos``), ``accepted`` of them kept, ``tokens`` the new tokens it gave (the accepted drafts, then the target's
    correction or bonus token), ``rolled_back`` positions taken back of the ``written`` ones, and how (``take_back``:
    truncate, recompute or nothing; ``why``: the layer that asked to recompute); ``first_step``: its first step."""

    index: int
    first_step: int
    pos: int
    drafted: list[int]
    accepted: int
    tokens: list[int]
    written: int
    rolled_back: int
    take_back: str
    why: str | None = None
    draft_s: float = 0.0
    verify_s: float = 0.0
    take_back_s: float = 0.0
    notes: dict = field(default_factory=dict)
    pass_memory: MemoryReport | None = None  # the cache's report right after the pass wrote its k + 1 positions

    @property
    def kept(self) -> int:
        """Positions of the pass that stay in the cache: the fed token and the accepted drafts."""
        return self.written - self.rolled_back


@dataclass(frozen=True)
class Undo:
    """What :meth:`Speculation.undo` needs to take a verification back: the cache length before it, how its
    rejected drafts went (``take_back``) and how many records it gave."""

    start: int
    take_back: str
    records: int


class Speculation:
    """A generator's drafting settings and what its verifications did (``Generator.speculation``). The generator
    calls :meth:`draft`, :meth:`verify` and :meth:`undo` with its tokens and its :class:`Target`."""

    def __init__(self, draft, draft_tokens: int, executor, cache) -> None:
        self.k = integer(draft_tokens, "draft_tokens", 1, 64, hint=" (tokens drafted per verification)")
        if msg := cache.inspect.speculation_refusal():
            raise SettingsError(f"draft={draft!r}: {msg}")
        self.drafter: Drafter = make_drafter(draft, executor)
        self.verifications: list[Verification] = []
        self.states = CHECKPOINT

    @property
    def states(self) -> str:
        """How a linear-attention state gives back rejected drafts: ``"checkpoint"`` (the verification keeps the state
        after each position and the cut restores one) or ``"recompute"`` (rolled back, accepted tokens fed again)."""
        return self._states

    @states.setter
    def states(self, value: str) -> None:
        if value not in STATE_ROLLBACKS:
            raise SettingsError(f"speculation.states must be one of {', '.join(STATE_ROLLBACKS)}, got {value!r}")
        self._states = value

    def draft(self, tokens: list[int], limit: int, target: Target) -> Draft:
        """What the drafter proposes after ``tokens``, at most ``limit`` tokens and no more than the cache has room
        for. A failing drafter leaves the RNG as it was."""
        k = min(self.k, limit)
        if target.cache.capacity is not None:
            k = min(k, target.cache.capacity - len(tokens))
        if k <= 0:
            return Draft([])
        rng = target.rng
        state = rng.get_state()  # a model drafter that samples draws from the generator's RNG
        try:
            draft = self.drafter.propose(list(tokens), k, target.sampling, rng)
        except BaseException:
            rng.set_state(state)
            raise
        draft.rng_state = state
        return draft

    def verify(self, draft: Draft, tokens: list[int], step: int, target: Target, stop_at_eos: bool,
               keep_undo: bool) -> tuple[list["StepRecord"], Undo | None]:
        """Check ``draft`` (proposed after ``tokens``; the next record is step number ``step``) in one pass, keep
        the accepted tokens, take back the rest: the new records (at least one) and, with ``keep_undo``, what
        :meth:`undo` needs. A failure anywhere leaves the cache, the RNG and this object as they were."""
        cache, ex, tracer, rng = target.cache, target.executor, target.tracer, target.rng
        k = len(draft.tokens)
        start = cache.length
        feed = [*tokens[start:], *draft.tokens]
        pos = len(tokens) - 1  # where the newest token goes
        state = draft.rng_state if draft.rng_state is not None else rng.get_state()  # before the draft's draws
        cache.settle()
        if tracer is not None:
            tracer.begin_step(cache, start, len(feed))
        mark = clock.now()
        truncated = False
        # linear-attention layers keep their state after each position of the pass
        checkpoints = cache.checkpointing_states() if self.states == CHECKPOINT else nullcontext()
        try:
            with checkpoints:
                logits = ex(torch.tensor([feed], dtype=torch.long), cache, start, tracer=tracer, keep_undo=True)
            pass_memory = cache.inspect.memory_report()  # what the pass wrote, before the take-back
            logits = logits[0, -(k + 1):]
            (logits,) = host.fetch([logits])
            verify_s, t1 = clock.since(mark), time.perf_counter()
            new, accepted = self.accept(logits, draft, target.sampling, rng)
            if stop_at_eos:
                ends = set(eos_ids(ex))
                eos = next((i for i, t in enumerate(new) if t in ends), None)
                if eos is not None:
                    new, accepted = new[:eos + 1], min(accepted, eos)
            keep = pos + len(new)  # the fed token and the accepted drafts stay; positions from keep on go
            how, why = NOTHING, None
            tb = time.perf_counter()
            if cache.stores and keep < cache.length:
                why = cache.inspect.crop_error(keep)
                if why is None and keep_undo and (undo := cache.inspect.crop_error(start)) is not None:
                    why = f"undo_step needs the journal (a cut back to {start} would not be exact: {undo})"
                if why is None:
                    cache.truncate(keep)
                    truncated = True
                    how = TRUNCATE
                else:
                    cache.rollback()
                    ex(torch.tensor([feed[:keep - start]], dtype=torch.long), cache, start, last_only=True,
                       keep_undo=True)
                    how = RECOMPUTE
            take_back_s = time.perf_counter() - tb
            records = []
            for i, token in enumerate(new):
                last = i == len(new) - 1
                r = step_record(logits[i], token, step=step + i, first=False, pos=0, feed=len(feed),
                                context=tokens + new[:i], executor=ex, cache=cache,
                                top_candidates=target.top_candidates, forward_s=verify_s if i == 0 else 0.0,
                                sampled_at=t1, tracer=tracer if last else None)
                records.append(replace(r, position=pos + 1 + i, draft_token=draft.tokens[i] if i < k else None,
                                       verification=len(self.verifications)))
            trace = records[-1].trace
            for r in records[:-1]:
                r.trace = trace
        except BaseException:
            back_to(start, TRUNCATE if truncated else RECOMPUTE, target, tokens)
            rng.set_state(state)
            raise
        written = k + 1  # positions the pass checked: the newest token and the drafts
        self.verifications.append(Verification(
            index=len(self.verifications), first_step=step, pos=pos, drafted=list(draft.tokens), accepted=accepted,
            tokens=list(new), written=written, rolled_back=written - len(new) if cache.stores else 0, take_back=how,
            why=why, draft_s=draft.seconds, verify_s=verify_s, take_back_s=take_back_s, notes=dict(draft.notes),
            pass_memory=pass_memory))
        return records, Undo(start, how, len(records)) if keep_undo else None

    @staticmethod
    def accept(logits: torch.Tensor, draft: Draft, settings, rng: torch.Generator) -> tuple[list[int], int]:
        """The new tokens from the verification's ``k + 1`` rows of logits and the draft (:func:`accept`)."""
        return accept(logits, draft, settings, rng)

    def undo(self, undo: Undo, target: Target, tokens: list[int]) -> int:
        """Take back the last verification (one :meth:`verify` gave ``undo`` for): the cache as it was before it,
        ``tokens`` being the sequence before it; returns how many records it gave (the generator drops them)."""
        back_to(undo.start, undo.take_back, target, tokens)
        self.verifications.pop()
        return undo.records

    @property
    def drafted(self) -> int:
        return sum(len(v.drafted) for v in self.verifications)

    @property
    def accepted(self) -> int:
        return sum(v.accepted for v in self.verifications)

    @property
    def rolled_back(self) -> int:
        return sum(v.rolled_back for v in self.verifications)

    @property
    def acceptance(self) -> float:
        """Share of drafted tokens the target accepted (0 when nothing was drafted)."""
        return self.accepted / self.drafted if self.drafted else 0.0

    def counts(self) -> list[dict]:
        """Per verification: drafted, accepted, rolled back, tokens gained, how the take-back went."""
        return [{"step": v.first_step, "pos": v.pos, "drafted": len(v.drafted), "accepted": v.accepted,
                 "rolled_back": v.rolled_back, "tokens": len(v.tokens), "take_back": v.take_back}
                for v in self.verifications]

    def forget_after(self, steps: int) -> None:
        """Keep the verifications whose tokens all lie within the first ``steps`` records."""
        self.verifications = [v for v in self.verifications if v.first_step + len(v.tokens) <= steps]

    def forget(self) -> None:
        self.verifications = []
        self.drafter.forget()


def accept(logits: torch.Tensor, draft: Draft, settings, rng: torch.Generator) -> tuple[list[int], int]:
    """The new tokens from ``k + 1`` rows of host logits and the draft, and how many drafts were accepted."""
    out: list[int] = []
    for i, d in enumerate(draft.tokens):
        if settings.greedy:
            token = choose(logits[i], settings, rng)
            if token != d:
                return [*out, token], i
        else:
            p = filtered_probs(logits[i], settings)
            q = draft.probs[i] if draft.probs is not None else None
            qd = 1.0 if q is None else float(q[d])
            if not float(torch.rand((), generator=rng)) * qd < float(p[d]):
                rest = p.clone() if q is None else (p - q).clamp_min(0)
                if q is None:
                    rest[d] = 0
                if not float(rest.sum()) > 0:  # p is all on the drafted token but it lost: only rounding
                    rest = p
                return [*out, int(torch.multinomial(rest / rest.sum(), 1, generator=rng))], i
        out.append(d)
    return [*out, choose(logits[len(draft.tokens)], settings, rng)], len(draft.tokens)


def back_to(start: int, how: str, target: Target, tokens: list[int]) -> None:
    """Put the cache back as it was before a verification that began at ``start`` and whose take-back was ``how``:
    from the undo journal (of its pass, or of the pass that wrote the accepted tokens again), or, once a truncate has
    dropped the journal, by cutting back to ``start`` where that is exact, else by recomputing the sequence."""
    cache = target.cache
    if how != TRUNCATE:
        cache.rollback()
    elif cache.inspect.crop_error(start) is None:
        cache.truncate(start)
    else:
        target.executor.replay(tokens[:start], cache)
