"""A session step when a lane drafts (speculative decoding): the lanes stay aligned token by token.

One Step is one verification pass on the **pace lane** (the first lane that drafts) giving ``m`` tokens; every other
lane then takes ``m`` tokens too (forced, decoded, or ``generator.run(m)`` for a lane that drafts as well), so all
lanes hold sequences of one length; see docs/explorer.md ("A speculative lane"). A lane without room for ``m`` more
tokens refuses the step before it moves; a failure while the lanes step is taken back (:func:`take_back`).
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from ..errors import StateError
from ..trace.records import StepRecord


def drafts(lane: Any) -> bool:
    """Whether ``lane``'s generator drafts (speculative decoding)."""
    return lane.speculation is not None


def pace_lane(lanes: Iterable[Any]) -> Any | None:
    """The lane whose verification sets how many tokens a Step gives: the first that drafts (None: none does)."""
    return next((lane for lane in lanes if drafts(lane)), None)


def take_back(lane: Any, before: int) -> None:
    """Undo ``lane``'s part of a step that failed elsewhere: to ``before`` records (an exact undo, else a rewind)."""
    if len(lane.history) <= before:
        return
    try:
        lane.generator.undo_step()  # the last step(keep_undo=True): exact, one record or one verification
    except StateError:
        pass  # its last step keeps no undo (a run of several): the rewind takes it back
    if len(lane.history) > before:
        lane.generator.rewind(len(lane.history) - before)
    lane.forget_after(len(lane.history))


def _room(lane: Any, m: int, pace: Any) -> None:
    capacity = lane.cache.capacity
    need = len(lane.generator.tokens) + m - 1  # positions written after m more tokens (the newest is not)
    if capacity is not None and need > capacity:
        raise StateError(f"{lane.name} has room for {max(0, capacity - len(lane.generator.tokens) + 1)} more "
                         f"tokens but the verification of {pace.name} gave {m}: give {lane.name} a larger "
                         f"max_seq_len (strategy_options) or rewind")


def step(session: Any, pace: Any, order: list[Any], done: list[tuple[Any, int]]) -> dict[str, StepRecord]:
    """One verification on ``pace``, then as many tokens on every lane of ``order`` (the others, the reference
    first); ``done`` collects (lane, records before) for :func:`take_back`. Returns each lane's last record."""
    before = len(pace.history)
    done.append((pace, before))
    out = {pace.name: pace.generator.step(keep_undo=True)}
    m = len(pace.history) - before
    for lane in order:
        _room(lane, m, pace)
    ref = session.reference
    for lane in order:
        done.append((lane, len(lane.history)))
        if lane.follows and lane is not ref:
            for token in ref.generator.tokens[-m:]:
                record = lane.generator.step(force=token, keep_undo=True)
                lane.forced_at.add(record.step)
        elif m == 1 and not drafts(lane):
            lane.generator.step(keep_undo=True)
        else:
            lane.generator.run(m, stop_at_eos=False)
        out[lane.name] = lane.history[-1]
    return out


def settle_rows(lanes: Iterable[Any]) -> None:
    """For each lane that drafts and whose newest token came from a verification: the row of the pass that chose
    it gives its log-probabilities (the pass's later rows were for rejected drafts)."""
    for lane in lanes:
        spec = lane.speculation
        last = lane.last
        if spec is None or last is None or last.verification is None or not spec.verifications:
            continue
        v = spec.verifications[-1]
        if v.index == last.verification:
            lane.tracer.use_row(last.step - v.first_step)
