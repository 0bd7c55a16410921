"""Extending the caches without touching the package: a toy strategy and a toy layer kind, defined here only, run
through the generator (against recomputation without a cache), the explorer's snapshot and the replay. Also: the
model-level protocol is declared by kvexplore's caches and transformers' alike."""

from __future__ import annotations

import copy
import dataclasses
import inspect

import pytest
import torch

import kvexplore
from kvexplore.caches import (FILLED, KVCache, LayerCache, ModelCache, NoCache, PreallocatedCache, StoredLayer,
                              register_layer_kind, register_strategy, unregister_layer_kind, unregister_strategy)
from kvexplore.caches.layer import FullLayer
from kvexplore.caches.layout import GrowingLayout
from kvexplore.caches.slots import SlotView
from kvexplore.config.layer_plan import register_plan_rule, unregister_plan_rule
from helpers import no_cache_logits

PROMPT = [5, 17, 42, 7, 99, 3, 12]


# -- (a) a toy strategy: keys and values as a Python list of one tensor per position ---------------------------
class ListLayer(FullLayer):
    """A full layer that keeps one ``(B, H, 1, D)`` key and value tensor per position in Python lists."""

    def __init__(self, spec, batch_size, dtype, device):
        super().__init__(spec, batch_size, dtype, device)
        self.keys: list[torch.Tensor] = []
        self.values: list[torch.Tensor] = []

    def begin(self, step):  # a write replaces list entries, never a tensor: the lists are the whole undo
        step.journal.remember(self._restore, (list(self.keys), list(self.values)))

    def _restore(self, saved):
        self.keys, self.values = list(saved[0]), list(saved[1])

    def write(self, step, k, v):
        del self.keys[step.pos:], self.values[step.pos:]
        for i in range(k.shape[2]):
            self.keys.append(k[:, :, i:i + 1].clone())
            self.values.append(v[:, :, i:i + 1].clone())
        step.counters.written_bytes += k.nbytes + v.nbytes
        return torch.cat(self.keys, 2), torch.cat(self.values, 2)

    def truncate(self, n, length, counters):
        del self.keys[n:], self.values[n:]

    def storage(self):
        return [*self.keys, *self.values]

    def _slot_view(self, length):
        return SlotView([FILLED] * length, list(range(length)), [1] * length, GrowingLayout())

    def clone(self, memo, fork=False):
        twin = copy.copy(self)
        twin.keys, twin.values = [t.clone() for t in self.keys], [t.clone() for t in self.values]
        return twin


class ListCache(KVCache):
    kind = "toy-list"

    def __init__(self, config, batch_size=1, dtype=None, device=None):
        super().__init__(config, batch_size, dtype or torch.float32, device or "cpu")
        self._build()

    def full_layer(self, spec):
        return ListLayer(spec, self.batch_size, self.dtype, self.device)


@pytest.fixture
def toy_strategy():
    register_strategy("toy-list", ListCache)
    yield "toy-list"
    unregister_strategy("toy-list")


# -- (b) a toy layer kind: a layer that keeps only the even positions --------------------------------------------
def every_other_mask(q_pos: torch.Tensor, k_pos: torch.Tensor) -> torch.Tensor:
    """A query at ``p`` reads the keys of even positions up to ``p``, and its own."""
    return (k_pos[None, :] <= q_pos[:, None]) & ((k_pos[None, :] % 2 == 0) | (k_pos[None, :] == q_pos[:, None]))


class EveryOtherLayer(StoredLayer):
    """Stores the keys and values of even positions only (grown by concatenation); attention reads those and the
    step's own new keys, under :func:`every_other_mask`."""

    def __init__(self, spec, batch_size, dtype, device):
        super().__init__(spec, batch_size, dtype, device)
        self.k, self.v = self.zeros(0), self.zeros(0, values=True)
        self.last_read: list[int] | None = None

    def _kept(self, n):
        return list(range(0, n, 2))

    def begin(self, step):
        step.journal.remember(self._restore, (self.k, self.v, self.last_read))
        self.k, self.v = self.k.narrow(2, 0, len(self._kept(step.pos))), self.v.narrow(2, 0, len(self._kept(step.pos)))
        self.reading = [*self._kept(step.pos), *range(step.pos, step.end)]

    def _restore(self, saved):
        self.k, self.v, self.last_read = saved

    def write(self, step, k, v):
        out = torch.cat([self.k, k], 2), torch.cat([self.v, v], 2)
        even = torch.tensor([i for i in range(k.shape[2]) if (step.pos + i) % 2 == 0], dtype=torch.long)
        self.k, self.v = (torch.cat([self.k, k.index_select(2, even)], 2),
                          torch.cat([self.v, v.index_select(2, even)], 2))
        step.counters.written_bytes += k.nbytes + v.nbytes
        return out

    def mask(self, step):
        return every_other_mask(torch.arange(step.pos, step.end), torch.tensor(self.reading))

    def commit(self, step):
        self.last_read = self.reading

    def truncate(self, n, length, counters):
        self.k, self.v = self.k.narrow(2, 0, len(self._kept(n))), self.v.narrow(2, 0, len(self._kept(n)))
        self.last_read = None

    def _held(self, length):
        return len(self._kept(length))

    def _held_positions(self, length):
        return self._kept(length)

    def _read_positions(self, length):
        return list(self.last_read) if self.last_read is not None else self._kept(length)

    def storage(self):
        return [self.k, self.v]

    def _slot_view(self, length):
        kept = self._kept(length)
        return SlotView([FILLED] * len(kept), kept, [1] * len(kept), GrowingLayout())

    def clone(self, memo, fork=False):
        twin = copy.copy(self)
        twin.k, twin.v = self.k.clone(), self.v.clone()
        return twin

    def describe(self, count, strategy, config):
        return f"{count} every-other layer{'s' * (count != 1)}: even positions only"


class EveryOtherRecompute(LayerCache):
    """The same layer in a cache that stores nothing: the whole sequence each step, under the same mask."""

    def write(self, step, k, v):
        return k, v

    def mask(self, step):
        return every_other_mask(torch.arange(step.pos, step.end), torch.arange(step.pos, step.end))

    def _held(self, length):
        return 0

    def storage(self):
        return []

    def _slot_view(self, length):
        return SlotView([], [], [], GrowingLayout())

    def clone(self, memo, fork=False):
        return self


def make_every_other(cache, spec, built, shared):
    if not cache.stores:
        return EveryOtherRecompute(spec)
    return EveryOtherLayer(spec, cache.batch_size, cache.dtype, cache.device)


@pytest.fixture
def every_other(trained):
    """A copy of the packaged model whose odd layers are every-other layers (by a plan rule, nothing edited)."""
    model = copy.deepcopy(trained)

    def rule(config, spec):
        if config is model.config and spec.full and spec.index % 2:
            return dataclasses.replace(spec, kind="every_other", attends="every_other")
        return spec

    register_layer_kind("every_other", make_every_other)
    register_plan_rule(rule)
    yield model
    unregister_plan_rule(rule)
    unregister_layer_kind("every_other")


# -- helpers --------------------------------------------------------------------------------------------------
def decode_logits(model, cache, ids):
    """Logits of every position after the prompt, decoded one token at a time into ``cache``."""
    n = len(PROMPT)
    out = [model(torch.tensor([ids[:n]]), cache, 0)[0, -1]]
    for p in range(n, len(ids)):
        out.append(model(torch.tensor([[ids[p]]]), cache, p)[0, -1])
    return torch.stack(out)


def recomputed_logits(model, ids):
    """The same logits recomputed from scratch every step (no cache)."""
    return torch.stack([no_cache_logits(model, ids[:p + 1], last=True)
                        for p in range(len(PROMPT) - 1, len(ids))])


def generate(model, kind, steps=12, tracer=None, **options):
    gen = kvexplore.Generator(model, kvexplore.make_cache(kind, model, max_seq_len=64, **options),
                              tracer=tracer or kvexplore.Tracer())
    gen.prefill(PROMPT)
    gen.run(steps - 1, stop_at_eos=False)
    return gen


# -- the toy strategy -------------------------------------------------------------------------------------------
def test_a_toy_strategy_is_exact_against_recomputation(trained, toy_strategy):
    cache = kvexplore.make_cache(toy_strategy, trained)
    assert isinstance(cache, ListCache) and "toy-list" in kvexplore.caches.STRATEGIES
    ids = [*PROMPT, *range(20, 32)]
    got = decode_logits(trained, cache, ids)
    assert torch.equal(got, decode_logits(trained, PreallocatedCache(trained.config, 64), ids))  # the same keys
    assert (got - recomputed_logits(trained, ids)).abs().max() < 1e-4
    assert cache.length == len(ids) and cache.inspect.used_bytes == kvexplore.kv_bytes(trained.config, len(ids))
    report = cache.inspect.memory_report()
    assert report.written_bytes == report.layers[0].written_bytes * len(cache.layers)
    assert "full layers: toy-list" in cache.inspect.describe_layers()


def test_a_toy_strategy_rolls_back_truncates_and_clones(trained, toy_strategy):
    gen = generate(trained, toy_strategy, steps=6)
    cache = gen.cache
    before = [t.clone() for t in cache.inspect.storage(0)]
    twin = cache.clone()
    gen.step(keep_undo=True)
    gen.undo_step()  # the journal puts the lists back
    assert cache.length == twin.length and all(map(torch.equal, cache.inspect.storage(0), before))
    cache.truncate(4)
    assert len(cache.inspect.storage(0)) == 8 and twin.length == len(PROMPT) + 5  # the clone kept its own lists


def test_a_toy_strategy_runs_in_the_generator_explorer_and_replay(trained, toy_strategy, tmp_path):
    pytest.importorskip("plotly")
    pytest.importorskip("ipywidgets")
    from kvexplore.replay import frames, save_html

    toy, ref = generate(trained, toy_strategy), generate(trained, "preallocated")
    assert [r.token_id for r in toy.history] == [r.token_id for r in ref.history]
    assert toy.history.meta["kind"] == "toy-list"
    steps, _ = frames({"toy": toy.history, "preallocated": ref.history})
    assert len(steps) == 12
    assert "toy" in save_html({"toy": toy.history}, tmp_path / "toy.html").read_text()
    ex = kvexplore.Explorer(trained, strategies=("toy-list", "preallocated"), max_seq_len=48)
    ex.prompt = "Call me"
    ex.run(3)
    snap = ex.snapshot()
    assert snap.lanes["toy-list"].kind == "toy-list"
    assert [r.token_id for r in snap.lanes["toy-list"].history] == [r.token_id for r in
                                                                     snap.lanes["preallocated"].history]


# -- the toy layer kind -----------------------------------------------------------------------------------------
def test_a_toy_layer_kind_enters_the_plan_by_registration(every_other):
    cache = kvexplore.make_cache("preallocated", every_other, max_seq_len=64)
    kinds = [s.kind for s in cache.plan]
    assert kinds == ["full" if i % 2 == 0 else "every_other" for i in range(len(kinds))]
    assert isinstance(cache.layers[1], EveryOtherLayer) and isinstance(NoCache(every_other.config).layers[1],
                                                                        EveryOtherRecompute)
    assert "every-other layer" in cache.inspect.describe_layers()


def test_a_toy_layer_kind_equals_its_own_recomputation(every_other, trained):
    ids = [*PROMPT, *range(20, 34)]
    cache = kvexplore.make_cache("preallocated", every_other, max_seq_len=64)
    got = decode_logits(every_other, cache, ids)
    assert (got - recomputed_logits(every_other, ids)).abs().max() < 1e-4
    plain = decode_logits(trained, PreallocatedCache(trained.config, 64), ids)
    assert (got - plain).abs().max() > 1e-3  # the kind matters: this is not plain attention
    n = len(ids)
    assert cache.layers[1].positions(n).count == (n + 1) // 2
    assert cache.inspect.read_positions(1) == [*range(0, n - 1, 2), n - 1]
    assert cache.inspect.slot_view(1).positions == cache.inspect.held_positions_of(1) == list(range(0, n, 2))
    assert cache.inspect.held_positions_of(0) == list(range(n))


def test_a_toy_layer_kind_runs_in_the_generator_and_replay(every_other, tmp_path):
    pytest.importorskip("plotly")
    from kvexplore.replay import frames

    cached, recomputed = generate(every_other, "preallocated", 10), generate(every_other, "none", 10)
    assert [r.token_id for r in cached.history] == [r.token_id for r in recomputed.history]
    for a, b in zip(cached.history, recomputed.history):
        assert abs(a.prob - b.prob) < 1e-4
    steps, _ = frames({"every-other": cached.history, "none": recomputed.history}, layer=1)
    assert len(steps) == 10
    n = cached.cache.length
    cached.rewind(3)  # truncate through the layer objects, then generate the same tokens again
    assert cached.cache.length == n - 3 and cached.cache.layers[1].positions(n - 3).count == (n - 2) // 2
    cached.run(3, stop_at_eos=False)
    assert [r.token_id for r in cached.history] == [r.token_id for r in recomputed.history]


def test_a_toy_layer_kind_shows_in_the_explorers_snapshot(every_other):
    pytest.importorskip("plotly")
    pytest.importorskip("ipywidgets")
    ex = kvexplore.Explorer(every_other, strategies=("preallocated", "none"), max_seq_len=48)
    ex.prompt = "Call me"
    ex.run(4)
    snap = ex.snapshot()
    lane = snap.lanes["preallocated"]
    n = lane.history[-1].cache_length
    assert [r.token_id for r in lane.history] == [r.token_id for r in snap.lanes["none"].history]
    assert lane.detail.slots[1].positions == list(range(0, n, 2))  # the every-other layer's own slots
    assert lane.detail.slots[0].positions[:n] == list(range(n))


# -- the model-level protocol -----------------------------------------------------------------------------------
def test_kvexplore_and_transformers_caches_declare_the_same_protocol():
    from kvexplore.hf.cache import HFCache

    assert issubclass(KVCache, ModelCache) and issubclass(HFCache, ModelCache)
    for name in ModelCache.__abstractmethods__:
        for cls in (PreallocatedCache, HFCache):
            assert name not in cls.__abstractmethods__, (cls, name)
            mine, declared = getattr(cls, name), getattr(ModelCache, name)
            if callable(declared):
                assert list(inspect.signature(mine).parameters) == list(inspect.signature(declared).parameters), \
                    (cls, name)


def test_the_hf_prefix_is_a_registry_entry():
    from kvexplore.caches.registry import PREFIXES, prefix_factory
    from kvexplore.hf import model as hf_model

    assert prefix_factory("hf:dynamic") is PREFIXES["hf:"] is hf_model._make_cache
    with pytest.raises(kvexplore.SettingsError, match="wrap it with"):
        kvexplore.make_cache("hf:dynamic", object())


def public_names(cls: type) -> set[str]:
    """What the class offers, counted over it and its bases: methods, properties and class attributes whose name has
    no leading underscore (its instances' data attributes are listed in its docstring, not counted)."""
    return {name for name in dir(cls) if not name.startswith("_")}


def test_the_cache_protocols_stay_narrow():
    from kvexplore.caches.registry import STRATEGIES
    from kvexplore.caches.strategies.ggml import GGMLCache
    from kvexplore.prefix.cache import PoolCache

    assert len(public_names(ModelCache)) <= 15, sorted(public_names(ModelCache))
    assert len(public_names(KVCache)) <= 25, sorted(public_names(KVCache))
    assert len(public_names(LayerCache)) <= 12, sorted(public_names(LayerCache))
    wide = {cls.__name__: len(public_names(cls)) for cls in [*map(STRATEGIES.__getitem__, STRATEGIES), GGMLCache,
                                                              PoolCache] if len(public_names(cls)) > 30}
    assert not wide, f"strategies over 30 public names: {wide}"
    # what a cache says about itself is asked of its inspector, and what a lossy one did of its facets
    assert {"memory_report", "slot_view", "what_it_did", "stored_error"}.isdisjoint(public_names(KVCache))
