"""Why a request's tokens were computed instead of read from the cache, in words: a ledger of every request served and
every eviction answers it for each stretch of recomputed positions."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np

from .index import Eviction
from .result import Miss, count


@dataclass(frozen=True)
class Served:
    index: int
    label: str
    written: tuple[int, ...]  # the tokens whose keys and values it wrote: prompt and generated, but the last
    prompt_len: int
    chat: bool
    answer: str = ""  # the text it generated (special tokens left out)


class Ledger:
    def __init__(self, block_size: int, token_text: Callable[[int], str]) -> None:
        self.block_size, self.token_text = block_size, token_text
        self.served: list[Served] = []
        self._written: list[np.ndarray] = []  # each served request's written tokens as an array (compared often)
        self.evicted_at: dict[bytes, str] = {}  # chain hash -> the request whose pages it gave way to (the latest)

    def note_evictions(self, evictions: Sequence[Eviction], request: str) -> None:
        self.evicted_at.update((e.hash, request) for e in evictions)

    def add(self, served: Served) -> None:
        self.served.append(served)
        self._written.append(np.asarray(served.written, dtype=np.int64))

    def longest(self, ids: Sequence[int]) -> tuple[int, Served | None]:
        """The longest run of leading tokens ``ids`` shares with a request served before (the latest on a tie)."""
        a, best, who = np.asarray(ids), 0, None
        for s, written in zip(self.served, self._written):
            m = min(len(a), len(written))
            differ = np.flatnonzero(a[:m] != written[:m])
            common = int(differ[0]) if differ.size else m
            if common >= best and common > 0:
                best, who = common, s
        return best, who

    def _tok(self, token: int) -> str:
        return f"{self.token_text(token)!r} (id {token})"

    def explain(self, ids: Sequence[int], hit: int, matched: int, hashes: list[bytes], chat: bool,
                saved_at: Sequence[int], answers: Sequence[str] = (),
                sliding: tuple[int, str] | None = None) -> list[Miss]:
        """Every recomputed prompt position ``hit .. len(ids) - 1`` explained. ``matched``: the prefix whose blocks
        were cached (past ``hit`` only when a recurrent state was not saved where they end); ``hashes``: the chain
        hashes of the blocks that could have been hit; ``saved_at``: where states were saved along the prefix;
        ``answers``: the contents of the chat's assistant messages (to tell a template's rewrite from an edit);
        ``sliding``: where the full layers' cached blocks ended and why the sliding layers stopped ``matched`` short
        of it (:mod:`kvexplore.prefix.sliding`)."""
        bs, n = self.block_size, len(ids)
        floor, misses = len(hashes) * bs, []
        if matched > hit:
            where = (f"only at position {', '.join(str(p) for p in saved_at)} of this prefix" if saved_at else
                     "at no position of this prefix")
            misses.append(Miss("no-state-checkpoint", hit, matched,
                               f"positions 0..{matched - 1} are cached as blocks, but the recurrent layers' state "
                               f"was saved {where}: a hybrid model resumes only where its state was checkpointed, "
                               f"so this request resumes at {hit}"))
        if sliding is not None:
            misses.append(Miss("sliding-window", matched, sliding[0], sliding[1]))
            matched = sliding[0]
        start = max(hit, matched)
        if start < floor:
            misses.append(self._cause(ids, start, floor, hashes, chat, answers))
        if floor < n:
            why = (f"the last {count(n - floor, 'token')} fill no whole block of {bs}: only full blocks are shared"
                   if n - floor < bs else
                   "the block holding the prompt's last token is always computed: that token's logits start the "
                   "answer, so a hit stops one block short of a prompt that fills its blocks exactly")
            misses.append(Miss("partial-block", floor, n, why))
        return misses

    def _cause(self, ids: Sequence[int], start: int, end: int, hashes: list[bytes], chat: bool,
               answers: Sequence[str]) -> Miss:
        bs = self.block_size
        b = start // bs
        common, q = self.longest(ids)
        block = f"block {b} (positions {start}..{start + bs - 1})"
        if q is None:
            return Miss("first-seen", start, end, "no earlier request began with these tokens")
        if common >= start + bs:  # an earlier request wrote this whole block: it was cached, and is not now
            r = self.evicted_at.get(hashes[b])
            when = f"evicted under pressure at {r}" if r is not None else "not cached any more"
            return Miss("evicted", start, end, f"{block} was cached by {q.label}, then {when}: every block after it "
                                               f"is computed again too", q.index)
        if common >= len(q.written) == start:
            return Miss("first-seen", start, end,
                        f"{q.label} wrote positions up to {start - 1} only (the last token it generated is never "
                        f"written: nothing reads it), so the tokens from {start} on are new", q.index)
        if common >= len(q.written):
            return Miss("partial-block", start, end,
                        f"{q.label} wrote tokens up to position {len(q.written) - 1} only, inside {block}: its last "
                        f"{count(len(q.written) - start, 'token')} filled no whole block, so they were never cached",
                        q.index)
        mine, theirs = self._tok(ids[common]), self._tok(q.written[common])
        if common < bs:
            return Miss("shorter-than-block", start, end,
                        f"the first {common} tokens are the same as {q.label}'s, fewer than one block of {bs}, so "
                        f"no block is shared (at token {common} this request has {mine}, {q.label} had {theirs})",
                        q.index)
        if chat and q.chat and common >= q.prompt_len and _same_answer(q.answer, answers):
            return Miss("template", start, end,
                        f"the chat template changed the prefix: at token {common}, inside the answer {q.label} "
                        f"generated, it renders {mine} where {q.label} generated {theirs} (a template that rewrites "
                        f"earlier turns, e.g. one that drops their thinking, breaks the match from there)", q.index)
        where = "inside" if common % bs else "at the start of"
        edited = (f" (inside the answer {q.label} generated: this conversation's copy of that answer is not the "
                  f"text it generated; edited?)" if chat and q.chat and common >= q.prompt_len else "")
        return Miss("diverged", start, end,
                    f"diverged at token {common} ({where} block {common // bs}): this request has {mine} where "
                    f"{q.label} had {theirs}{edited}", q.index)


def _same_answer(generated: str, answers: Sequence[str]) -> bool:
    """Whether one of the chat's assistant messages is the answer as generated (one may be cut short of the other):
    then a difference in the tokens is the template's (or the tokenizer's) doing, not an edit."""
    g = generated.strip()
    return any(a.strip() and (a.strip().startswith(g) or g.startswith(a.strip())) for a in answers)
