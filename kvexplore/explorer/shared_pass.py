"""One prefill pass for the lanes whose pass computes the same thing.

A prefill from an empty cache computes the same hidden states, attention and logits on every lane whose cache gives
attention back exactly the keys and values it was handed, under the same mask (pre-allocated, concatenating, paged,
an evicting cache whose press runs after the pass, a sink cache whose ring holds the prompt). The first such lane runs
the model through :class:`Recording`, which notes what each layer gave its cache, whether it read back exactly that,
and the mask; every later lane is prefilled by :class:`Reusing`, which makes the same calls on that lane's cache,
feeds its tracer the same hook points and returns the recorded logits.

Nothing is taken on trust: a cache that reads back anything else, a different mask, or a layer that asks its cache
for something else makes the reuse roll that cache back, and the lane computes its own pass. The lane's record
reports the recorded pass's time plus its own cache's work.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import torch

from ..caches.one_pass import one_pass
from ..core.hooks import hook
from ..errors import KVExploreError
from ..models.model import Model
from ..models.executor import Executor

SHARED_PASSES = 2  # recorded prefill passes kept for the lanes after them (each holds the prompt's q, k, v and masks)
# what Model.forward and Attention.forward ask of a cache; a pass that asks anything else is not reused
_PASS_CALLS = frozenset({"check_write", "begin_step", "commit", "settle", "rollback", "dtype", "device", "write",
                         "read_shared", "mask"})


class NotTheSamePass(KVExploreError):
    """A lane's cache did not read back what the recorded pass's did: the lane computes its own pass."""


@dataclass
class LayerPass:
    """What one layer of the recorded pass gave its cache and read back."""

    q: torch.Tensor | None = None  # (B, nh, T, hd) after RoPE, for a press that observes queries
    k: torch.Tensor | None = None  # (B, nkv, T, hd) written (None: a layer that reads an earlier layer's cache)
    v: torch.Tensor | None = None
    mask: torch.Tensor | None = None  # what the cache gave attention (None: causal)
    exact: bool = False  # the cache read back exactly what it was given


@dataclass
class Pass:
    """A recorded prefill pass: per layer what :class:`LayerPass` holds, the logits returned, its time."""

    layers: dict[int, LayerPass] = field(default_factory=dict)
    logits: torch.Tensor | None = None
    other_calls: set[str] = field(default_factory=set)  # cache methods outside :data:`_PASS_CALLS` the pass used
    seconds: float = 0.0
    source: str = ""  # the lane that computed it
    model: Any = None  # the model that computed it: only a lane of the same model reuses it

    @property
    def shareable(self) -> bool:
        """Every layer read back exactly what it wrote and nothing else was asked of the cache."""
        return (self.logits is not None and not self.other_calls and bool(self.layers)
                and all(layer.exact for layer in self.layers.values()))


def _same(a: torch.Tensor | None, b: torch.Tensor | None) -> bool:
    if a is None or b is None:
        return a is b
    return a.shape == b.shape and a.dtype == b.dtype and bool(torch.equal(a, b))


class _EveryQuery:
    """What the model asks of a recorded pass's eviction: every layer's queries (a lane reusing the pass may press
    with them)."""

    @staticmethod
    def reads_queries(layer: int) -> bool:
        return True


class _RecordingCache:
    """The cache as the model sees it during a recorded pass: every call goes to ``cache``; writes and masks are noted
    in ``into``."""

    def __init__(self, cache: Any, into: Pass) -> None:
        self._inner, self._into = cache, into

    def __getattr__(self, name: str) -> Any:  # everything else is the cache's own
        if name not in _PASS_CALLS:
            self._into.other_calls.add(name)
        return getattr(self._inner, name)

    eviction = _EveryQuery()

    def write(self, layer: int, pos: int, k: torch.Tensor, v: torch.Tensor, queries: torch.Tensor | None = None):
        ev = self._inner.eviction
        if ev is not None and ev.reads_queries(layer):
            k_all, v_all = self._inner.write(layer, pos, k, v, queries)
        else:  # a cache of one's own may take no queries
            k_all, v_all = self._inner.write(layer, pos, k, v)
        # compared now: a pressing cache may compact what it gave back when the pass commits; every layer's queries
        # are kept: a lane reusing the pass may press with them
        self._into.layers[layer] = LayerPass(queries, k, v, exact=_same(k_all, k) and _same(v_all, v))
        return k_all, v_all

    def read_shared(self, layer: int):
        out = self._inner.read_shared(layer)
        self._into.layers[layer] = LayerPass(exact=True)
        return out

    def mask(self, layer: int, pos: int, q_len: int):
        m = self._inner.mask(layer, pos, q_len)
        if layer in self._into.layers:
            self._into.layers[layer].mask = None if m is None else m.clone()
        return m


class _Wrapping(Executor):
    """An executor standing in for ``executor`` during one prefill: its model, config, tokenizer, device and caches."""

    def __init__(self, executor: Executor) -> None:
        self._executor = executor
        self.config, self.tokenizer, self.source = executor.config, executor.tokenizer, executor.source

    @property
    def device(self) -> torch.device:
        return self._executor.device

    @property
    def dtype(self) -> torch.dtype:
        return self._executor.dtype

    @property
    def model(self) -> Any:
        return self._executor.model

    def check_cache(self, cache: Any) -> None:
        self._executor.check_cache(cache)

    def default_cache(self) -> Any:
        return self._executor.default_cache()


class Recording(_Wrapping):
    """``executor``'s pass, run as usual, with what each layer gave its cache noted in :attr:`recorded`."""

    def __init__(self, executor: Executor, source: str) -> None:
        super().__init__(executor)
        self.recorded = Pass(source=source, model=executor.model)

    def __call__(self, ids, cache, pos, tracer=None, last_only=False, keep_undo=False):
        if pos != 0 or cache.length != 0:
            self.recorded.other_calls.add("a pass after position 0")
        t = time.perf_counter()
        logits = self._executor(ids, _RecordingCache(cache, self.recorded), pos, tracer, last_only, keep_undo)
        self.recorded.seconds = time.perf_counter() - t
        self.recorded.logits = logits
        return logits


class Reusing(_Wrapping):
    """Prefill a cache with a recorded :class:`Pass`: the same calls on the cache in the same order, each checked to
    read back exactly what it was given under the recorded mask (else :class:`NotTheSamePass`, the cache rolled back),
    the lane's tracer fed the same hook points; returns the recorded logits."""

    def __init__(self, executor: Executor, recorded: Pass) -> None:
        super().__init__(executor)
        self.recorded = recorded

    def __call__(self, ids, cache, pos, tracer=None, last_only=False, keep_undo=False):
        rec = self.recorded
        if rec.model is not self._executor.model:
            raise NotTheSamePass("the pass was computed by another model")
        B, T = ids.shape
        with one_pass(cache, pos, T, B, self._executor.model, keep_undo):
            for layer in range(self.config.num_layers):
                lp = rec.layers.get(layer)
                name = f"layers.{layer}.attn"
                if lp is None:
                    raise NotTheSamePass(f"layer {layer} was not in the recorded pass")
                if lp.k is None:  # reads an earlier layer's cache
                    k_all, v_all = cache.read_shared(layer)
                else:
                    k, v = lp.k, lp.v
                    if tracer is not None:
                        if lp.q is not None:
                            hook(tracer, f"{name}.q", lp.q)
                        k, v = hook(tracer, f"{name}.k_new", k), hook(tracer, f"{name}.v_new", v)
                        k = hook(tracer, f"{name}.cache_write", k)
                    if (ev := cache.eviction) is not None and ev.reads_queries(layer):
                        if lp.q is None:
                            raise NotTheSamePass(f"layer {layer}'s press reads queries the recorded pass did not note")
                        k_all, v_all = cache.write(layer, pos, k, v, lp.q)
                    else:
                        k_all, v_all = cache.write(layer, pos, k, v)
                    if not (_same(k_all, lp.k) and _same(v_all, lp.v)):
                        raise NotTheSamePass(f"layer {layer}'s cache read back other keys or values")
                if tracer is not None:
                    hook(tracer, f"{name}.cache_read", k_all)
                if not _same(cache.mask(layer, pos, T), lp.mask):
                    raise NotTheSamePass(f"layer {layer}'s cache gave another mask")
            logits = rec.logits if last_only else None
            if logits is None:
                raise NotTheSamePass("the recorded pass kept the last position's logits only")
            if tracer is not None:
                hook(tracer, "logits", logits)
        return logits


@contextmanager
def _running(generator: Any, executor: _Wrapping) -> Iterator[None]:
    """``generator`` runs ``executor`` in place of its own while the block runs."""
    generator.executor = executor
    try:
        yield
    finally:
        generator.executor = executor._executor


def record(generator: Any, prompt: str | Sequence[int], force: int | None, source: str) -> Pass:
    """``generator.prefill(prompt, force=force)`` as usual, its pass recorded."""
    recording = Recording(generator.executor, source)
    with _running(generator, recording):
        generator.prefill(prompt, force=force)
    return recording.recorded


def reuse(generator: Any, recorded: Pass, prompt: str | Sequence[int], force: int | None) -> bool:
    """Prefill ``generator`` with ``recorded`` where its cache reads back the same (True); False, and nothing changed,
    where it does not (the caller prefills it as usual). Its record's time is the recorded pass's plus its own."""
    try:
        with _running(generator, Reusing(generator.executor, recorded)):
            record_ = generator.prefill(prompt, force=force)
    except NotTheSamePass:
        return False
    record_.forward_s += recorded.seconds  # (its own forward_s timed the reuse: its cache's work)
    return True


def prefill_lane(lane: Any, prompt: str | Sequence[int], force: int | None, shared: list[tuple[Pass, Any]],
                 fresh: Callable[[Any], Any]) -> Any:
    """Prefill an explorer lane (:class:`~kvexplore.explorer.session.Lane`): by reusing one of the ``shared`` passes
    where its cache reads back the same under the same masks (checked), else by its own pass, recorded into ``shared``
    for the lanes after it when it can be shared (the newest :data:`SHARED_PASSES` are kept). Only lanes of
    kvexplore's own model stepped eagerly take part. Returns the lane: ``fresh(lane)``, a new one, where a reuse was
    refused (its tracer saw a step begin)."""
    if not (lane.lane_kind.name == "eager" and isinstance(lane.generator.model, Model)):
        lane.generator.prefill(prompt, force=force)
        return lane
    for recorded, source in shared:
        if reuse(lane.generator, recorded, prompt, force):
            lane.tracer.adopt(source.tracer, source.history[0].trace, lane.history[0].trace)
            lane.shared_pass = source.name
            return lane
        lane, old = fresh(lane), lane
        lane.tracer.on_layer = old.tracer.on_layer
    recorded = record(lane.generator, prompt, force, lane.name)
    if recorded.shareable:
        shared.append((recorded, lane))
        del shared[:-SHARED_PASSES]
    return lane
