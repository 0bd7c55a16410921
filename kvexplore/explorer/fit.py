"""How many slots the explorer's caches get for a prompt: the size asked for, or, for a prompt that does not leave
a slot to step into, the prompt and :data:`ROOM` more (up to the model's context), so that a pasted chapter
prefills and steps instead of failing with a size the page cannot change."""

from __future__ import annotations

from ..errors import SettingsError

ROOM = 128  # slots a grown cache keeps beyond its prompt for the steps that follow
QUANTUM = 64  # a grown size is a multiple of this


def slots_for(prompt_tokens: int, asked: int, context: int | None) -> int:
    """The caches' size for a prompt of ``prompt_tokens``: ``asked`` when the prompt leaves at least one slot free,
    else the prompt plus :data:`ROOM` rounded up to :data:`QUANTUM`, at most ``context`` (the model's positions).
    A prompt longer than both ``asked`` and ``context`` is refused, naming both."""
    if prompt_tokens < asked:
        return asked
    if context is not None and prompt_tokens >= context:
        raise SettingsError(f"the prompt has {prompt_tokens:,} tokens and the model reads at most {context:,} "
                            f"positions (its context): shorten the prompt to fewer than {context:,} tokens, or "
                            f"choose a model with a longer context")
    grown = -(-(prompt_tokens + ROOM) // QUANTUM) * QUANTUM
    return grown if context is None else min(grown, context)


def growth_note(prompt_tokens: int, asked: int, slots: int) -> str:
    """What the status line says when the caches grew for a prompt ("" when they did not)."""
    if slots == asked:
        return ""
    return (f"the caches grew from {asked:,} to {slots:,} slots to hold the {prompt_tokens:,}-token prompt "
            f"(max_seq_len={asked:,})")
