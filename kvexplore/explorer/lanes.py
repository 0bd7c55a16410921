"""The kinds of lane an explorer session runs, by strategy name (:class:`EagerLanes`, :class:`CompiledLane`,
:class:`TransformersLanes`, :class:`BugLanes`, :class:`RankLanes`): the registry the session asks instead of reading
strategy names itself, and the only file of the explorer that reads them. What a :class:`LaneKind` answers, and how
to add one: docs/extending.md ("The lane-kind registry").
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import Any

from ..caches.factory import STRATEGIES, make_cache
from ..errors import SettingsError
from ..hf import HF_CACHES, available
from ..hf import PREFIX as HF_PREFIX
from ..models.model import Model
from ..runtime.generator import Generator
from ..runtime.sampling import SamplingSettings

COMPILED = "compiled"  # the compiled lane's strategy name
VARIANT = "@"  # "evict@mask": a second lane of kvexplore's strategy "evict", with its own strategy_options
#: a lane's options that go to its Generator (speculative decoding), not to make_cache
GENERATOR_OPTIONS = ("draft", "draft_tokens")


def split_options(options: dict[str, Any]) -> tuple[dict[str, Any], dict[str, Any]]:
    """A lane's options as (the cache's, the generator's): ``{"draft": "prompt-lookup", "draft_tokens": 4,
    "block_size": 8}`` gives ``({"block_size": 8}, {"draft": "prompt-lookup", "draft_tokens": 4})``."""
    cache = {k: v for k, v in options.items() if k not in GENERATOR_OPTIONS}
    return cache, {k: v for k, v in options.items() if k in GENERATOR_OPTIONS}


def base_strategy(strategy: str) -> str:
    """The cache strategy a lane name runs: ``"evict@mask"`` runs ``"evict"`` (so two lanes of one strategy, each
    with its own options, can run side by side); a name without ``@`` is the strategy itself."""
    return strategy.split(VARIANT, 1)[0]


@dataclass(frozen=True)
class LaneSpec:
    """What a lane is built with besides its strategy: the session's models, sizes and sampling."""

    model: Any  # the kvexplore Model kvexplore's lanes run (or, with transformers lanes only, the HFModel)
    hf: Any  # the transformers model (kvexplore.hf.HFModel) the hf:... lanes run, if any
    max_seq_len: int
    options: dict[str, Any]  # the strategy's options (strategy_options[name]; may hold its own max_seq_len)
    sampling: SamplingSettings
    seed: int
    top_candidates: int
    reuse: Any = None  # what the lane's last build left to build on (a lane over several processes: its ranks)


class LaneKind(ABC):
    """One kind of lane. Subclasses set :attr:`name` and :attr:`label` and implement :meth:`claims`,
    :meth:`offered` and :meth:`check`; :meth:`build` makes ``make_cache(strategy, model)`` eagerly by default."""

    name = ""  # the kind: "eager", "compiled", "transformers"
    label = ""  # what it runs, in words
    transformers = False  # runs the transformers model (not kvexplore's)
    compiled = False  # Generator(compile=True)
    records_attention = True  # its tracer records attention (a compiled step cannot)
    in_process = True  # its model runs in this process alone: the doctor and a zoom's recompute may run it again

    @abstractmethod
    def claims(self, strategy: str) -> bool:
        """Whether ``strategy`` is one of this kind's."""

    @abstractmethod
    def offered(self, hf: Any) -> list[str]:
        """The strategies of this kind one could ask for (for the message naming an unknown one)."""

    @abstractmethod
    def check(self, strategy: str, model: Any, hf: Any) -> None:
        """Refuse, naming the fix, a ``strategy`` of this kind that cannot run on the models given."""

    def model_for(self, spec: LaneSpec) -> Any:
        return spec.hf if self.transformers else spec.model

    def cache_strategy(self, strategy: str) -> str:
        """The name :func:`~kvexplore.make_cache` builds this lane's cache by."""
        return strategy

    def build(self, strategy: str, spec: LaneSpec, tracer: Any) -> Generator:
        """A fresh generator of lane ``strategy``: its cache (its own ``max_seq_len`` option first, else the
        session's) and the session's sampling, traced by ``tracer``; the options ``draft`` and ``draft_tokens``
        (:data:`GENERATOR_OPTIONS`) make it draft (speculative decoding), the others go to the cache."""
        options, drafting = split_options(spec.options)  # drafting: Generator(draft=..., draft_tokens=...)
        slots = options.pop("max_seq_len", spec.max_seq_len)  # a strategy may have its own size
        model = self.model_for(spec)
        cache = make_cache(self.cache_strategy(strategy), model, max_seq_len=slots, **options)
        s = spec.sampling
        return Generator(model, cache, s.temperature, s.top_k, s.top_p, spec.seed, spec.top_candidates, tracer,
                         compile=self.compiled, kernels=True, **drafting)

    def trace_options(self, generator: Generator) -> dict[str, Any]:
        """The tracer's options for a lane after its prefill: a cache that kept nothing of the prefill (its length
        is still 0) recomputes every position every step, so only the newest attention row of a step is new and
        kept (``last_row_only``)."""
        return {"last_row_only": generator.tokens != [] and generator.cache.length == 0}

    def fork(self, generator: Generator) -> Generator:
        """A second generator continuing ``generator``'s sequence (its cache's ``fork()``)."""
        if generator.tokens and generator.cache.length == 0:
            raise SettingsError("a strategy without a cache has nothing to fork; pick another strategy")
        return generator.fork()

    def release(self, generator: Generator) -> None:
        """Let go of what a lane holds outside this process (nothing, but for :class:`RankLanes`)."""

    def reusable(self, generator: Generator) -> Any:
        """What a new build of the lane may build on (:attr:`LaneSpec.reuse`; None: nothing, the lane is released)."""
        self.release(generator)
        return None


class EagerLanes(LaneKind):
    """kvexplore's strategies, and variants of them named ``<strategy>@<label>`` (:func:`base_strategy`)."""

    name, label = "eager", "a kvexplore cache strategy on kvexplore's model"

    def claims(self, strategy: str) -> bool:
        base, _, label = strategy.partition(VARIANT)
        return base in STRATEGIES and (label != "" or VARIANT not in strategy)

    def cache_strategy(self, strategy: str) -> str:
        return base_strategy(strategy)

    def offered(self, hf: Any) -> list[str]:
        return list(STRATEGIES)

    def check(self, strategy: str, model: Any, hf: Any) -> None:
        if not isinstance(model, Model):
            raise SettingsError(f"kvexplore does not implement {getattr(hf, 'architecture', 'this model')}, so "
                                f"{strategy!r} cannot run it: use its transformers caches "
                                f"({', '.join(HF_PREFIX + n for n in HF_CACHES)})")


class CompiledLane(LaneKind):
    name, label = "compiled", "the pre-allocated cache stepped by the compiled step"
    compiled = True
    records_attention = False

    def claims(self, strategy: str) -> bool:
        return strategy == COMPILED

    def offered(self, hf: Any) -> list[str]:
        return [COMPILED]

    def check(self, strategy: str, model: Any, hf: Any) -> None:
        if not isinstance(model, Model):
            raise SettingsError("the compiled lane runs kvexplore's own model: give a kvexplore model")

    def cache_strategy(self, strategy: str) -> str:
        return "preallocated"


class TransformersLanes(LaneKind):
    name, label = "transformers", "one of transformers' own caches on the transformers model"
    transformers = True

    def claims(self, strategy: str) -> bool:
        return strategy.startswith(HF_PREFIX)

    def offered(self, hf: Any) -> list[str]:
        return [HF_PREFIX + n for n in HF_CACHES] if hf is not None else []

    def check(self, strategy: str, model: Any, hf: Any) -> None:
        if hf is None:
            raise SettingsError(f"{strategy} runs transformers' own cache: give the explorer a transformers model "
                                f"(Explorer(AutoModelForCausalLM..., tokenizer, strategies=...))")
        why = available(strategy.removeprefix(HF_PREFIX), hf.device.type)
        if why:
            raise SettingsError(f"{strategy}: {why}")


class GivenLane(LaneKind):
    """A generator given to the explorer whose cache no kind claims (a strategy made outside kvexplore): it runs as
    it is, traced and forked like any lane; the session cannot build another of it (a new prefill refuses it)."""

    name, label = "given", "a generator given to the explorer, as it is"

    def claims(self, strategy: str) -> bool:
        return False

    def offered(self, hf: Any) -> list[str]:
        return []

    def check(self, strategy: str, model: Any, hf: Any) -> None:
        lane_kind(strategy, hf)  # refused, naming the strategies there are


BUG_PREFIX, FIXED = "bug:", ":fixed"


class BugLanes(LaneKind):
    """A zoo bug as a lane: ``bug:NAME`` runs it with the bug planted, ``bug:NAME:fixed`` its fixed twin (kvexplore's
    own class with the same options), each made by the bug's ``make`` with the lane's slots; a speculation bug's lane
    drafts as the bug's generator does. Put the twin first (the reference): the planted lane follows its tokens, and
    the page marks where the two first part."""

    name, label = "bug", "a zoo bug planted, or its fixed twin (kvexplore.bugs)"

    @staticmethod
    def parse(strategy: str) -> tuple[str, bool]:
        """``"bug:NAME:fixed"`` -> ``("NAME", True)``."""
        name = strategy[len(BUG_PREFIX):]
        return name.removesuffix(FIXED), name.endswith(FIXED)

    def claims(self, strategy: str) -> bool:
        return strategy.startswith(BUG_PREFIX)

    def offered(self, hf: Any) -> list[str]:
        from ..bugs import catalog

        return [BUG_PREFIX + b.name + end for b in catalog() if b.make is not None for end in (FIXED, "")]

    def check(self, strategy: str, model: Any, hf: Any) -> None:
        from ..bugs import get

        bug = get(self.parse(strategy)[0])  # an unknown name is refused with the names there are
        if bug.make is None:
            raise SettingsError(f"{bug.name} is a prefix pool's bug: see it with kvexplore bugs run {bug.name} --html, "
                                f"or PrefixCompare({{'planted': ..., 'fixed': ...}}) of the pools of "
                                f"kvexplore.bugs.reproduce({bug.name!r})")
        if not isinstance(model, Model):
            raise SettingsError(f"{strategy} runs on kvexplore's own model: give a kvexplore model")

    def build(self, strategy: str, spec: LaneSpec, tracer: Any) -> Generator:
        from ..bugs import get
        from ..bugs.reproduction import model_for

        name, fixed = self.parse(strategy)
        bug = get(name)
        options, _ = split_options(spec.options)
        made = bug.make(model_for(bug, spec.model), not fixed, options.get("max_seq_len", spec.max_seq_len))
        s = spec.sampling
        if isinstance(made, Generator):  # a speculation bug: its generator drafts (and may carry the planted rule)
            made.sampling, made.seed, made.top_candidates, made.tracer = s, spec.seed, spec.top_candidates, tracer
            return made
        model, cache = made
        return Generator(model, cache, s.temperature, s.top_k, s.top_p, spec.seed, spec.top_candidates, tracer,
                         kernels=True)


class RankLanes(LaneKind):
    """kvexplore's model split over processes, this one rank 0 (:mod:`kvexplore.distributed.lead`): ``tp:N`` by
    heads (tensor parallel; option ``cache``: the ranks' strategy, pre-allocated by default, and its options),
    ``cp:N`` by positions (context parallel; option ``interleave``). Options ``timeout_s`` (how long a collective
    waits for a rank before the lane stops, 10 s by default) and ``threads`` (each rank's). The lane draws rank 0's
    cache; the Ranks view every rank's."""

    name, label = "ranks", "kvexplore's model over N processes, by heads (tp:N) or positions (cp:N), this one rank 0"
    in_process = False

    @staticmethod
    def _parse(strategy: str) -> tuple[str, int] | None:
        from ..distributed.lead import parse

        return parse(strategy)

    def claims(self, strategy: str) -> bool:
        return ":" in strategy and self._parse(strategy) is not None

    def offered(self, hf: Any) -> list[str]:
        return ["tp:2", "cp:2"]

    def check(self, strategy: str, model: Any, hf: Any) -> None:
        from ..distributed.lead import SPLITS

        if not isinstance(model, Model):
            raise SettingsError(f"{strategy} splits kvexplore's own model: give a kvexplore model")
        mode, n = self._parse(strategy)
        if n < 2:
            raise SettingsError(f"{strategy}: a split needs at least 2 ranks ({mode}:2)")
        SPLITS[mode].check(model.config, n, 1, "preallocated")

    def build(self, strategy: str, spec: LaneSpec, tracer: Any) -> Generator:
        from ..distributed.lead import Leader, Leading

        options, drafting = split_options(spec.options)
        if drafting:
            raise SettingsError(f"{strategy} does not draft: speculative decoding runs on one process's lanes")
        mode, n = self._parse(strategy)
        slots = options.pop("max_seq_len", spec.max_seq_len)
        leader = spec.reuse
        if leader is None or not leader.alive or leader.slots != slots:  # its ranks, with caches of another size
            if leader is not None:
                leader.close()
            leader = Leader(spec.model, mode, n, options.pop("cache", "preallocated"), slots, **options)
        s = spec.sampling
        return Generator(Leading(leader), leader.new_cache(), s.temperature, s.top_k, s.top_p, spec.seed,
                         spec.top_candidates, tracer, kernels=True)

    def fork(self, generator: Generator) -> Generator:
        raise SettingsError("a lane over several processes holds one sequence on every rank: fork another lane")

    def release(self, generator: Generator) -> None:
        generator.executor.close()

    def reusable(self, generator: Generator) -> Any:
        """The lane's ranks, still running: a new prefill starts on them (spawning them again takes seconds)."""
        leader = generator.executor.leader
        return leader if leader.alive else None


GIVEN = GivenLane()

#: the lane kinds, asked in this order which one a strategy name is
LANE_KINDS: list[LaneKind] = [TransformersLanes(), BugLanes(), RankLanes(), CompiledLane(), EagerLanes()]


def find(strategy: Any) -> LaneKind | None:
    """The kind of lane ``strategy`` is, or None for a name no kind claims."""
    claimed = (kind for kind in LANE_KINDS if isinstance(strategy, str) and kind.claims(strategy))
    return next(claimed, None)


def lane_kind(strategy: str, hf: Any = None) -> LaneKind:
    """The kind of lane ``strategy`` is; an unknown name is refused with the ones there are."""
    kind = find(strategy)
    if kind is None:
        known = [s for k in reversed(LANE_KINDS) for s in k.offered(hf)]  # kvexplore's strategies first
        raise SettingsError(f"unknown strategy {strategy!r}; available: {', '.join(known)}")
    return kind


def check_strategies(strategies: list[str], model: Any, hf: Any) -> None:
    """Refuse, naming the fix, a strategy that is unknown or cannot run on the models given."""
    for strategy in strategies:
        lane_kind(strategy, hf).check(strategy, model, hf)
