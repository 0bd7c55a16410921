"""The explorer's status line: where the shown lane stands (step, tokens, slots held)."""

from __future__ import annotations

from .session import Lane


def status_line(lane: Lane, note: str = "") -> str:
    """The status of ``lane``, and ``note`` (what the last prefill did to the caches' size) after it."""
    after = f" · {note}" if note else ""
    last = lane.last
    if last is None:
        n = len(lane.generator.tokens)
        return (f"{lane.name} · no sequence yet: press Step (or Prefill) to run the prompt" if not n else
                f"{lane.name} · {n} prompt tokens, nothing generated yet (Step continues){after}")
    cache = lane.cache
    cap = "unbounded" if cache.capacity is None else cache.capacity
    eos = " · end of sequence" if last.is_eos else ""
    return (f"{lane.name} · step {last.step} · {len(lane.generator.tokens)} tokens "
            f"({len(lane.generator.prompt_tokens)} prompt) · cache holds {cache.held} of {cap} slots{eos}{after}")
