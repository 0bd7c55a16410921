"""Recurrent states saved at block boundaries for hybrid models, keyed by the chain hash of the block they end and
dropped with it: a prefix is reusable only up to where its state was saved (``checkpoint_states``: docs/prefix.md)."""

from __future__ import annotations

import torch

from ..errors import SettingsError

WHERE = ("ends", "blocks")


class StateCheckpoints:
    def __init__(self, layers: list[int], where: str) -> None:
        if where not in WHERE:
            raise SettingsError(f"checkpoint_states must be one of {WHERE}, got {where!r}")
        self.layers, self.where = layers, where
        self.saved: dict[bytes, list[tuple[torch.Tensor, torch.Tensor]]] = {}  # block hash -> state per layer

    @property
    def needed(self) -> bool:
        """Whether the model has recurrent layers at all (otherwise nothing here does anything)."""
        return bool(self.layers)

    def points(self, start: int, prompt_len: int, written: int, block_size: int) -> list[int]:
        """Positions past ``start`` (block boundaries) after which to save the state: with ``"ends"`` the last full
        block of the prompt (not counting its last token, which is always computed) and of the written tokens."""
        if not self.needed:
            return []
        if self.where == "blocks":
            return list(range(start + block_size, written + 1, block_size))
        ends = {(prompt_len - 1) // block_size * block_size, written // block_size * block_size}
        return sorted(p for p in ends if p > start)

    def usable(self, hashes: list[bytes], matched: int) -> int:
        """How many of the ``matched`` leading blocks can be resumed from: the longest ending where a state was
        saved (all of them without recurrent layers)."""
        if not self.needed:
            return matched
        return max((k for k in range(1, matched + 1) if hashes[k - 1] in self.saved), default=0)

    def save(self, cache, h: bytes) -> None:
        self.saved[h] = [tuple(t.clone() for t in cache.states.read(i)) for i in self.layers]

    def restore(self, cache, h: bytes) -> int:
        """Copy the state saved at block ``h`` into ``cache``'s recurrent layers; the bytes copied."""
        n = 0
        for i, saved in zip(self.layers, self.saved[h]):
            for live, kept in zip(cache.states.read(i), saved):
                live.copy_(kept)
                n += kept.nbytes
        return n

    def drop(self, h: bytes) -> None:
        self.saved.pop(h, None)

    @property
    def bytes(self) -> int:
        return sum(t.nbytes for states in self.saved.values() for pair in states for t in pair)
