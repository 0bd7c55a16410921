"""Prefix sharing: a block read from the cache must hold exactly the keys and values the request would compute there,
so whatever names a block must name everything those depend on, and a request resumes exactly where its hit ends."""

from __future__ import annotations

import dataclasses
import hashlib
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from ..diagnosis.pool_check import check_pool
from ..prefix.hashing import HashIndex
from ..prefix.pool import PrefixPool
from .catalog import Bug, register
from .runs import Run, text_ids

BLOCK = 8
NEW_TOKENS = 8
TEXT = ("Once upon a time, a little cache kept every key it was given. One day a request came that began where "
        "another had stopped, and the cache said: I have seen these words before.")


def pool_scenario(requests: Callable[[Any], list[list[int]]], make: Callable[[Any, bool], PrefixPool]):
    """The ``run`` and ``check`` of a bug shown by serving requests: ``requests(model)`` gives the prompts (token ids),
    ``make(model, planted)`` an empty pool; each request generates :data:`NEW_TOKENS` greedy tokens, one unit per
    request. The check serves them on a new pool and runs :func:`~kvexplore.diagnosis.pool_check.check_pool`."""

    def serve(model: Any, planted: bool) -> tuple[PrefixPool, list]:
        pool = make(model, planted)
        return pool, [pool.serve(ids, max_new_tokens=NEW_TOKENS, keep_logits=True) for ids in requests(model)]

    def run(model: Any, planted: bool) -> Run:
        pool, results = serve(model, planted)
        out = Run(planted, "request", [r.generated for r in results], [r.logits for r in results],
                  [len(r.prompt) - 1 for r in results], [r.prompt for r in results], pool)
        out.notes = [r.explain().splitlines()[0] for r in results]
        return out

    def check(model: Any, planted: bool) -> Any:
        return check_pool(serve(model, planted)[0])

    return run, check


class TokensOnlyIndex(HashIndex):
    """The planted bug: a block is named by its own tokens only (the chain's parent left out of the hash), so a block
    whose tokens appeared at another place, after another prefix, is a hit."""

    def _own(self, ids: Sequence[int], blocks: int) -> list[bytes]:
        arr = np.asarray(list(ids[: blocks * self.block_size]), dtype="<i8")
        size = self.block_size
        return [hashlib.sha256(arr[i * size: (i + 1) * size].tobytes()).digest() for i in range(blocks)]

    def match(self, ids: Sequence[int], hashes: list[bytes]) -> list[int]:
        return super().match(ids, self._own(ids, len(hashes)))

    def insert(self, ids: Sequence[int], pages: list[int], hashes: list[bytes]) -> list[int]:
        return super().insert(ids, pages, self._own(ids, len(hashes)))


class TokensOnlyPool(PrefixPool):
    def __init__(self, model, num_blocks: int, block_size: int = 16, **options) -> None:
        super().__init__(model, num_blocks, block_size, **options)
        self.index = self.pool.index = TokensOnlyIndex(block_size)
        self.index.pool = self.pool


def _shifted(model: Any) -> list[list[int]]:
    ids = text_ids(model, TEXT)
    return [ids[: 3 * BLOCK + 3], ids[BLOCK: 3 * BLOCK + 5]]  # the second starts with the first's second block


def _tokens_only(model: Any, planted: bool) -> PrefixPool:
    return (TokensOnlyPool if planted else PrefixPool)(model, num_blocks=32, block_size=BLOCK)


_hash_run, _hash_check = pool_scenario(_shifted, _tokens_only)
register(Bug(
    name="hash-forgets-prefix", engine="vLLM (automatic prefix caching)", reference="vllm-project/vllm#44701",
    url="https://github.com/vllm-project/vllm/issues/44701", area="prefix sharing",
    summary="Block hashes left out a field the keys depend on (a LoRA adapter's name, a cache salt), so two requests "
            "that differ only there shared blocks. Planted as the field every block hash needs most: its parent, "
            "the tokens before it; a block seen after another prefix (at another position) is then a hit.",
    invariant="a block's hash names everything its keys and values depend on: every token before it (the chain), "
              "its position, and any adapter or salt; a hit is invisible in the logits",
    symptom="a request that repeats a passage seen in another request's middle answers wrongly from its first token",
    checker="pool", run=_hash_run, check=_hash_check))


class WholePromptPool(PrefixPool):
    """The planted bug: a prompt whose length is a whole number of blocks may be a hit to its last token; the engine,
    holding the whole prompt, feeds its last token again to get the first logits, one position past its place."""

    def reusable_blocks(self, n: int) -> int:
        return n // self.block_size

    def _run(self, cache, ask, hit, hashes, *options):
        if hit >= len(ask.ids):
            ask = dataclasses.replace(ask, ids=[*ask.ids, ask.ids[-1]])  # fed again at position `hit`
        return super()._run(cache, ask, hit, hashes, *options)


def _aligned(model: Any) -> list[list[int]]:
    ids = text_ids(model, TEXT)
    return [ids[: 3 * BLOCK + 4], ids[: 2 * BLOCK]]  # the second is two whole blocks the first holds


def _whole(model: Any, planted: bool) -> PrefixPool:
    return (WholePromptPool if planted else PrefixPool)(model, num_blocks=32, block_size=BLOCK)


_whole_run, _whole_check = pool_scenario(_aligned, _whole)
register(Bug(
    name="hit-at-block-boundary", engine="SGLang (radix cache)", reference="sgl-project/sglang#22819",
    url="https://github.com/sgl-project/sglang/issues/22819", area="prefix sharing",
    summary="The radix cache corrupted a request's KV when its prefix length was exactly a multiple of the page "
            "size: the whole prompt was matched and the step that must compute the last token wrote it at the wrong "
            "place. Planted as a pool whose hit may cover a block-aligned prompt to its end, and which then feeds the "
            "last token again one position past it.",
    invariant="a hit never covers the prompt's last token (its logits give the first new token), and the request's "
              "first computed position is exactly where its hit ends",
    symptom="only prompts whose length is a multiple of the block size go wrong, from the first generated token",
    checker="pool", run=_whole_run, check=_whole_check))
