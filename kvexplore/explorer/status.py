"""The explorer's status line: where the shown lane stands (step, tokens, slots held)."""

from __future__ import annotations

from ..caches.layout import PagedLayout
from ..caches.slots import SlotView
from .session import Lane

#: the status line's hover: its two figures, and why they differ
SLOTS_TIP = ("slots: the places in the cache's storage, the cache map's columns; positions: the tokens of the "
             "sequence. The sequence limit is how many positions the cache can hold: it differs from the slots where "
             "a cache reserves whole pages or blocks, keeps slots beside them, or evicts (a ring, a press).")
STEP = "Step"
CONTINUE = "Continue"  # the Step button's name at the end of sequence: one more token past it


def status_line(lane: Lane, note: str = "", slots: SlotView | None = None) -> str:
    """The status of ``lane``, and ``note`` (what the last prefill did to the caches' size) after it.

    ``slots``: the lane's slot view of its first full layer (default: asked of the cache). The slots counted are
    the physical slots of that view, the figure the cache map's title gives; the sequence's limit in positions is
    a second figure, named as positions, where it differs."""
    after = f" · {note}" if note else ""
    last = lane.last
    if last is None:
        n = len(lane.generator.tokens)
        return (f"{lane.name} · no sequence yet: press Step (or Prefill) to run the prompt" if not n else
                f"{lane.name} · {n:,} prompt tokens, nothing generated yet (Step continues){after}")
    cache = lane.cache
    view = slots if slots is not None else cache.inspect.slot_view()
    total = len(view.states)
    held = f"cache holds {view.held:,} of {total:,} slots" if total else "cache keeps no slots"
    limit = "" if cache.capacity in (None, total) else f" · sequence limit {cache.capacity:,} positions"
    full = f" · full: sits out the steps since step {last.step}" if lane.full is not None else ""
    if lane.stopped is not None:
        full = f" · a rank stopped: sits out the steps since step {last.step} (Reset or Prefill starts its ranks again)"
    return (f"{lane.name} · step {last.step} · {len(lane.generator.tokens):,} tokens "
            f"({len(lane.generator.prompt_tokens):,} prompt) · {held}{limit}{full}{_end(lane)}{after}")


def full_note(lanes: list[Lane]) -> str:
    """What the page says while some lanes' caches are full and the others go on ("" when none is full)."""
    full = [lane for lane in lanes if lane.full is not None]
    if not full:
        return ""
    names = "; ".join(f"{lane.name} (all {lane.full.capacity:,} slots, at step {lane.last.step if lane.last else 0})"
                      for lane in full)
    return (f"Cache full, sitting out while the others go on: {names}. Rewind gives it room again, Reset starts "
            f"over; more slots: kvexplore app --max-seq-len N (Explorer(..., max_seq_len=N) in a notebook).")


def stopped_note(lanes: list[Lane]) -> str:
    """What the page says while a lane over several processes sits out because a rank of it stopped ("" when none)."""
    return " ".join(f"{lane.name} sits out the steps while the others go on: {lane.stopped}"
                    for lane in lanes if lane.stopped is not None)


def at_end(lane: Lane) -> bool:
    """Whether ``lane``'s newest token ends the sequence (the model finished its answer)."""
    return bool(lane.history) and lane.history[-1].is_eos


def _end(lane: Lane) -> str:
    """What the status says about the end-of-sequence token: at it, or how long ago the sequence passed it."""
    history = lane.history
    if at_end(lane):
        return f" · end of sequence: the model has finished (press {CONTINUE} to go on past it)"
    ended = next((r.step for r in reversed(history) if r.is_eos), None)
    return "" if ended is None else f" · past the end of sequence (step {ended} ended it)"


def fork_tip(lane: Lane) -> str:
    """What Fork does to ``lane``: a paged cache shares its pages with the fork until they part; any other is copied."""
    shares = isinstance(lane.cache.inspect.slot_view().layout, PagedLayout) if lane.history else False
    return (f"a second sequence from here, forked from {lane.name}: "
            + ("the fork shares its pages until the two sequences part (copy on write)" if shares else
               "the fork gets its own copy of the cache (only a paged cache shares pages)"))
