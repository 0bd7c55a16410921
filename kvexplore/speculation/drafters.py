"""Drafters for speculative decoding: who proposes the next ``k`` tokens the target then checks in one pass:
``"prompt-lookup"`` (:class:`PromptLookup`), ``"self:L"`` (the target's first ``L`` layers, :class:`ModelDrafter`), or a
second model with the target's tokenizer (see docs/speculative.md). A model drafter keeps its own cache of the sequence,
cuts it back to what it shares with the target's and feeds what it lacks before each proposal."""

from __future__ import annotations

import time
from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from typing import Any, Callable

import numpy as np
import torch

from ..core.registry import Registry
from ..core.settings import integer
from ..errors import SettingsError
from ..runtime.sampling import SamplingSettings, filtered_probs


@dataclass
class Draft:
    """What a drafter proposed: ``tokens`` (at most ``k``), the distribution each was drawn from (``probs``, None: a
    point mass on the token), and the seconds it took; ``rng_state`` is set by the generator."""

    tokens: list[int]
    probs: list[torch.Tensor] | None = None
    seconds: float = 0.0
    notes: dict[str, Any] = field(default_factory=dict)
    rng_state: torch.Tensor | None = None  # the generator's RNG before the drafter drew (a failed pass goes back)


class Drafter(ABC):
    """Proposes tokens to continue ``tokens`` (the whole sequence so far, its newest token last)."""

    name = "drafter"

    @abstractmethod
    def propose(self, tokens: list[int], k: int, sampling: SamplingSettings, rng: torch.Generator) -> Draft:
        """Up to ``k`` tokens that may follow ``tokens`` (fewer, or none, when it has nothing to offer)."""

    def forget(self) -> None:
        """The target's sequence started again (prefill, reset): drop what was kept of the old one."""

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.name!r})"


class PromptLookup(Drafter):
    """The tokens after the latest earlier match of the last ``n`` tokens, trying ``n = max_ngram .. min_ngram``
    (the longest match wins; among equals the latest, whose continuation is the freshest)."""

    def __init__(self, max_ngram: int = 3, min_ngram: int = 1) -> None:
        self.max_ngram = integer(max_ngram, "max_ngram", 1)
        self.min_ngram = integer(min_ngram, "min_ngram", 1, self.max_ngram)
        self.name = "prompt-lookup"
        self.last_match: tuple[int, int] | None = None  # (n, where the matched n-gram starts) of the last proposal

    def propose(self, tokens: list[int], k: int, sampling: SamplingSettings, rng: torch.Generator) -> Draft:
        t0 = time.perf_counter()
        seq = np.asarray(tokens, dtype=np.int64)
        L = len(seq)
        self.last_match = None
        for n in range(min(self.max_ngram, L - 1), self.min_ngram - 1, -1):
            windows = np.lib.stride_tricks.sliding_window_view(seq[:L - 1], n)  # n-grams that end before the last
            hits = np.flatnonzero((windows == seq[L - n:]).all(axis=1))
            if len(hits):
                start = int(hits[-1])
                self.last_match = (n, start)
                out = seq[start + n:start + n + k].tolist()
                return Draft(out, None, time.perf_counter() - t0, {"ngram": n, "match_at": start})
        return Draft([], None, time.perf_counter() - t0)


class ModelDrafter(Drafter):
    """Drafts with ``executor`` (a kvexplore :class:`~kvexplore.models.executor.Executor`) through a pre-allocated
    cache of its own, grown (by one prefill) when the sequence outgrows it."""

    def __init__(self, executor: Any, name: str) -> None:
        self.executor, self.name = executor, name
        self.cache = None
        self.fed: list[int] = []  # the tokens the draft cache holds, position by position

    def forget(self) -> None:
        self.fed = []
        if self.cache is not None:
            self.cache.truncate(0)

    def _room(self, need: int) -> None:
        """A cache with room for ``need`` positions (a new, larger one re-fed from the start when it has none)."""
        cap = None if self.cache is None else self.cache.capacity
        if self.cache is not None and (cap is None or cap >= need):
            return
        size = max(1024, 1 << (need - 1).bit_length())
        from ..caches.factory import make_cache

        self.cache = make_cache("preallocated", self.executor.model, max_seq_len=size)
        self.fed = []

    def _feed(self, ids: list[int], pos: int) -> torch.Tensor:
        logits = self.executor(torch.tensor([ids], dtype=torch.long), self.cache, pos, last_only=True)[0, -1]
        return logits.float().cpu()

    def propose(self, tokens: list[int], k: int, sampling: SamplingSettings, rng: torch.Generator) -> Draft:
        t0 = time.perf_counter()
        self._room(len(tokens) + k)
        shared = list(zip(self.fed, tokens[:-1]))  # what the draft cache shares with the sequence
        keep = next((i for i, (a, b) in enumerate(shared) if a != b), len(shared))
        if keep < self.cache.length:
            self.executor.cut_back(tokens[:keep], self.cache)
        self.fed = self.fed[:keep]
        out, probs = [], []
        logits = self._feed(tokens[keep:], keep)
        self.fed = list(tokens)
        for i in range(k):
            if sampling.greedy:
                token = int(logits.argmax())
            else:
                q = filtered_probs(logits, sampling)
                token = int(torch.multinomial(q, 1, generator=rng))
                probs.append(q)
            out.append(token)
            if i + 1 < k:
                logits = self._feed([token], len(self.fed))
                self.fed.append(token)
        return Draft(out, None if sampling.greedy else probs, time.perf_counter() - t0)


def check_same_vocabulary(target: Any, draft: Any) -> None:
    """Raise SettingsError unless ``draft`` (an executor) speaks the target's vocabulary: the same size and, where both
    have tokenizers, the same text for a spread of token ids."""
    n, m = target.config.vocab_size, draft.config.vocab_size
    if n != m:
        raise SettingsError(f"the draft model's vocabulary has {m} tokens and the target's {n}: speculative decoding "
                            f"needs a draft model with the target's tokenizer")
    a, b = target.tokenizer, draft.tokenizer
    if a is None or b is None:
        return
    for i in range(0, n, max(1, n // 997)):
        if a.decode([i]) != b.decode([i]):
            raise SettingsError(f"the draft model's tokenizer differs from the target's: token {i} is "
                                f"{b.decode([i])!r} there and {a.decode([i])!r} here; use a draft model with the "
                                f"target's tokenizer")


def _prompt_lookup(argument: str | None, executor: Any) -> Drafter:
    if argument is not None:
        raise SettingsError(f"draft='prompt-lookup:{argument}': prompt lookup takes nothing after its name; give "
                            f"draft='prompt-lookup'")
    return PromptLookup()


def _first_layers(argument: str | None, executor: Any) -> Drafter:
    from ..models.executor import as_executor

    draft = f"self:{argument or ''}"
    first = getattr(executor.model, "first_layers", None)
    if first is None:
        raise SettingsError(f"draft={draft!r} runs the target's own first layers, which only a kvexplore "
                            f"Model can do; give draft='prompt-lookup' or a draft model")
    n = executor.config.num_layers
    layers = argument or ""
    if not layers.isdigit() or not 1 <= int(layers) < n:
        raise SettingsError(f"draft={draft!r}: L must be a whole number of layers 1..{n - 1} (the target has "
                            f"{n}), e.g. draft='self:{max(1, n // 4)}'")
    return ModelDrafter(as_executor(first(int(layers))), draft)


DRAFTERS: Registry = Registry("drafter", "unregister_drafter")


def register_drafter(name: str, make: Callable[[str | None, Any], Drafter], replace: bool = False) -> Callable:
    """Make ``draft="name"`` (or ``"name:argument"``) give ``make(argument, executor)``: a :class:`Drafter` for the
    target that ``executor`` runs (``argument`` None without a colon); returns ``make``. A taken name is refused
    unless ``replace`` (never a built-in one); :func:`unregister_drafter` removes one."""
    if not isinstance(name, str) or not name or ":" in name:
        raise SettingsError(f"a drafter's name is a non-empty string without ':' (what follows it is the "
                            f"drafter's argument), got {name!r}")
    if not callable(make):
        raise SettingsError(f"drafter {name!r}: make must be a function (argument, executor) -> Drafter")
    return DRAFTERS.add(name, make, replace)


def unregister_drafter(name: str) -> Callable:
    """Remove a drafter :func:`register_drafter` added; returns its factory."""
    return DRAFTERS.remove(name)


register_drafter("prompt-lookup", _prompt_lookup)
register_drafter("self", _first_layers)
DRAFTERS.seal()


def make_drafter(draft: Any, executor: Any) -> Drafter:
    """The drafter ``draft`` names for a target run by ``executor``: ``"prompt-lookup"``, ``"self:L"``, a name
    :func:`register_drafter` added, a model, or a :class:`Drafter`."""
    from ..models.executor import as_executor

    if isinstance(draft, Drafter):
        return draft
    if isinstance(draft, str):
        name, colon, argument = draft.partition(":")
        make = DRAFTERS.get(name)
        if make is None:
            others = "".join(f", {n!r}" for n in DRAFTERS if n not in DRAFTERS.built_in)
            raise SettingsError(f"draft={draft!r} is not a drafter: give 'prompt-lookup', 'self:L' (the target's "
                                f"first L layers){others}, a draft model, or None")
        made = make(argument if colon else None, executor)
        if not isinstance(made, Drafter):
            raise SettingsError(f"drafter {name!r} made a {type(made).__name__}, not a Drafter")
        return made
    try:
        other = as_executor(draft)
    except SettingsError as exc:
        raise SettingsError(f"draft must be 'prompt-lookup', 'self:L', a draft model or a Drafter; {exc}") from exc
    check_same_vocabulary(executor, other)
    return ModelDrafter(other, f"model:{other.source or type(draft).__name__}")
