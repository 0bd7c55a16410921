"""Answers after compression: the passkey test (:func:`haystack`, :func:`passkey`) and the two-question
demonstration (:func:`two_questions`); docs/eviction.md, "Measuring quality"."""

from __future__ import annotations

import random
import re
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from ..caches.base import KVCache
from ..caches.factory import make_cache
from ..core.settings import integer
from ..errors import SettingsError
from ..models.model import Model
from .quality import CacheFactory, check_ids, feed, full_cache, kept_context

INTRO = ("There is an important info hidden inside a lot of irrelevant text. Find it and memorize it. I will quiz "
         "you about the important information there.")
FILLER = "The grass is green. The sky is blue. The sun is yellow. Here we go. There and back again."
NEEDLE = " The pass key is {key}. Remember it."
QUESTION = " What is the pass key? The pass key is"


@dataclass(frozen=True)
class Haystack:
    """``ids``: the context (intro and filler, the needle at ``needle`` = ``[start, end)`` in tokens); ``question``:
    the ids asked after it; ``key``: the digits to find."""

    ids: list[int]
    question: list[int]
    key: str
    needle: tuple[int, int]
    depth: float


def haystack(tokenizer, length: int, depth: float, key: str | None = None, filler: str | None = None,
             seed: int = 0) -> Haystack:
    """A passkey context of at most ``length`` tokens (short of it by less than one filler sentence): an intro,
    filler sentences (``filler``, cycled; default: the passkey papers' "The grass is green. ..."), and the needle
    at the sentence boundary nearest ``depth`` (0: the start, 1: the end) of the context in tokens. ``key``:
    default five digits drawn from ``seed``."""
    length = integer(length, "length", minimum=1, hint=" (tokens of the context)")
    if isinstance(depth, bool) or not isinstance(depth, (int, float)) or not 0 <= depth <= 1:
        raise SettingsError(f"depth must be a fraction from 0 (start) to 1 (end) of the context, got {depth!r}")
    key = str(random.Random(seed).randint(10000, 99999)) if key is None else str(key)
    if not key.isdigit():
        raise SettingsError(f"key must be digits, got {key!r}")
    head = ([tokenizer.bos_id] if tokenizer.add_bos else []) + tokenizer.encode(INTRO)
    needle = tokenizer.encode(NEEDLE.format(key=key))
    sentences = [s for s in re.split(r"(?<=[.!?])\s+", (filler or FILLER).strip()) if s]
    if not sentences:
        raise SettingsError("filler has no text; pass sentences (or None for the default filler)")
    units = [tokenizer.encode(" " + s) for s in sentences]
    room = length - len(head) - len(needle)
    if room < 0:
        raise SettingsError(f"length {length} is too short for the intro and the needle ({len(head) + len(needle)} "
                            f"tokens); give length >= {len(head) + len(needle)}")
    body: list[list[int]] = []
    while sum(map(len, body)) + len(units[len(body) % len(units)]) <= room:
        body.append(units[len(body) % len(units)])
    pieces = [head, *body]
    starts = [sum(map(len, pieces[:j])) for j in range(len(pieces) + 1)]  # boundaries, 0 (before the intro) first
    target = depth * (starts[-1])  # where the needle should start, in tokens of the context without it
    j = min(range(len(starts)), key=lambda i: abs(starts[i] - target))
    ids = [t for p in pieces[:j] for t in p] + needle + [t for p in pieces[j:] for t in p]
    return Haystack(ids, tokenizer.encode(QUESTION), key, (starts[j], starts[j] + len(needle)), float(depth))


def greedy(model: Model, cache: KVCache, logits: torch.Tensor, pos: int, max_new_tokens: int) -> list[int]:
    """Greedy tokens after ``logits`` (the last position's, at ``pos - 1``), stopping at an end-of-sequence id."""
    stop = set(model.tokenizer.eos_ids or []) if model.tokenizer is not None else set()
    out: list[int] = []
    for _ in range(max_new_tokens):
        token = int(logits[-1].argmax())
        out.append(token)
        if token in stop or len(out) == max_new_tokens:
            break
        logits = model(torch.tensor([[token]]), cache, pos, last_only=True)[0]
        pos += 1
    return out


def coverage(cache: KVCache, span: tuple[int, int]) -> float | None:
    """The share of the positions ``span`` = ``[start, end)`` that ``cache`` still holds, averaged over its
    full-attention layers and their KV heads; None for a cache with no full layer."""
    start, end = span
    shares = [float(kept_context(cache, i, end)[:, start:end].float().mean()) for i in cache.full_layers]
    return sum(shares) / len(shares) if shares else None


@dataclass(frozen=True)
class Answer:
    """A greedy answer: its ``text``, whether it ``passed`` (held what was expected) and the ``coverage`` of each
    needed span (``{name: share of its tokens held}``)."""

    text: str
    passed: bool
    coverage: dict[str, float | None]


def ask(model: Model, cache: KVCache, context: list[int], question: list[int], question_in_context: bool,
        max_new_tokens: int, written: bool = False) -> tuple[list[int], KVCache]:
    """Write ``context`` and ``question`` into ``cache`` (the question in the same first write when
    ``question_in_context``, else after it: after the prompt's press) and answer greedily. ``written``: the
    context is in ``cache`` already (only the question is written)."""
    if written:
        logits = feed(model, cache, question, len(context), every=False)
    elif question_in_context:
        logits = feed(model, cache, context + question, 0, every=False)
    else:
        feed(model, cache, context, 0, every=False)
        logits = feed(model, cache, question, len(context), every=False)
    return greedy(model, cache, logits, len(context) + len(question), max_new_tokens), cache


def passkey(model: Model, hay: Haystack, factory: CacheFactory = full_cache, question_in_context: bool = False,
            max_new_tokens: int = 8) -> Answer:
    """Ask ``hay``'s question through ``factory(model, max_seq_len)``'s cache; passes when the key appears in the
    greedy answer. ``coverage["needle"]``: the share of the needle's tokens the cache holds after answering."""
    if model.tokenizer is None:
        raise SettingsError("the passkey test needs the model's tokenizer (a model loaded with kvexplore.load)")
    max_new_tokens = integer(max_new_tokens, "max_new_tokens", minimum=1)
    n = len(hay.ids) + len(hay.question) + max_new_tokens
    out, cache = ask(model, factory(model, n), hay.ids, hay.question, question_in_context, max_new_tokens)
    text = model.tokenizer.decode(out)
    return Answer(text, hay.key in re.sub(r"\D", "", text), {"needle": coverage(cache, hay.needle)})


def token_span(tokenizer, text: str, fragment: str, offset: int = 0, after: int = 0) -> tuple[int, int]:
    """``[start, end)`` of the tokens of ``tokenizer.encode(text)`` (shifted by ``offset``) that cover ``fragment``'s
    first occurrence in ``text`` from character ``after`` on."""
    at = text.find(fragment, after)
    if at < 0:
        raise SettingsError(f"{fragment!r} is not in the context; give a fact copied from the context's text")
    ids = tokenizer.encode(text)

    def first(chars: int) -> int:  # the fewest tokens whose text reaches ``chars`` characters
        lo, hi = 0, len(ids)
        while lo < hi:
            mid = (lo + hi) // 2
            lo, hi = (mid + 1, hi) if len(tokenizer.decode(ids[:mid])) < chars else (lo, mid)
        return lo

    return offset + max(first(at + 1) - 1, 0), offset + first(at + len(fragment))


@dataclass(frozen=True)
class QA:
    """One answer of :func:`two_questions`: ``mode`` (``"full"``, ``"once"``: compressed once without the question,
    ``"per question"``: compressed with the question in the window), the question, the greedy answer."""

    mode: str
    question: str
    answer: Answer


def two_questions(model: Model, context: str, questions: Sequence[tuple[str, str, str]], press: str = "knorm",
                  query_aware_press: str = "snapkv", compression_ratio: float = 0.5, max_new_tokens: int = 8,
                  **cache_options) -> list[QA]:
    """``context`` asked each of ``questions`` (``(question, fact, expected)``: the text asked after the context, the
    context's sentence holding the answer, the text the answer should contain) through the full cache, through one
    evicting cache (``press``) compressed once with the context alone and cloned per question, and through a cache
    compressed per question with it inside ``query_aware_press``'s window. Each answer's ``coverage``: every fact's
    share of tokens held (the needed one is the question's own), and each expected answer's (when its fact holds it)."""
    tok = model.tokenizer
    if tok is None:
        raise SettingsError("two_questions needs the model's tokenizer (a model loaded with kvexplore.load)")
    if len(questions) < 1 or any(len(q) != 3 for q in questions):
        raise SettingsError("questions must be (question, fact, expected) triples, e.g. (' Q: ... A:', 'the "
                            "sentence of the context that answers it', 'the answer')")
    head = [tok.bos_id] if tok.add_bos else []
    ctx = check_ids(head + tok.encode(context), "context", model)
    spans = {fact: token_span(tok, context, fact, len(head)) for _, fact, _ in questions}
    for _, fact, expected in questions:  # the answer's own tokens, inside its fact
        if expected in fact:
            spans[expected] = token_span(tok, context, expected, len(head), after=context.find(fact))
    asked = [(q, check_ids(tok.encode(q), "question", model), expected) for q, _, expected in questions]
    n = len(ctx) + max(len(ids) for _, ids, _ in asked) + max_new_tokens

    def evict(name: str) -> KVCache:
        return make_cache("evict", model, max_seq_len=n, press=name, compression_ratio=compression_ratio,
                          **cache_options)

    def answer(mode: str, question: str, cache: KVCache, ids: list[int], inside: bool, expected: str,
               written: bool = False) -> QA:
        out, cache = ask(model, cache, ctx, ids, inside, max_new_tokens, written)
        text = tok.decode(out)
        return QA(mode, question, Answer(text, expected.lower() in text.lower(),
                                         {fact: coverage(cache, span) for fact, span in spans.items()}))

    once = evict(press)
    feed(model, once, ctx, 0, every=False)
    rows = []
    for q, ids, expected in asked:
        rows.append(answer("full", q, full_cache(model, n), ids, False, expected))
        rows.append(answer("once", q, once.clone(), ids, False, expected, written=True))  # compressed once
        rows.append(answer("per question", q, evict(query_aware_press), ids, True, expected))
    return rows
