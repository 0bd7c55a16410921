"""A transformers ``Cache`` behind kvexplore's cache interface, answered from the object itself after every step
(:mod:`.watch`): the transformers cache does the caching; this only watches it."""

from __future__ import annotations

import copy
from collections import Counter
from dataclasses import replace

import torch

from ..caches.layout import EmptyLayout, StateLayout, TransformersLayout
from ..caches.slots import FILLED, FREE, STALE, SlotView
from ..config.model_config import ModelConfig
from ..errors import CacheFullError, SettingsError
from ..config.layer_plan import FULL, SLIDING, STATE, LayerSpec, layer_plan
from ..caches.held import KEYS_AND_VALUES, THIS_STEP, StorageWalk
from ..caches.memory import LayerMemory, MemoryReport
from ..caches.protocol import ModelCache
from ..core.allocator import Window, allocator_for
from . import watch


#: how the memory report names what the wrapper itself keeps (kvexplore.caches.held)
HELD_NAMES = {"_states": "what kvexplore watches", "_reads": "reads of the last step"}


class HFCache(ModelCache):
    """``kind`` ("hf:dynamic", "hf:static", ...) over ``cache``, a transformers Cache for ``config``'s model."""

    batch_size = 1

    def __init__(self, kind: str, cache: object, config: ModelConfig, dtype: torch.dtype, device: torch.device,
                 capacity: int | None, make=None) -> None:
        self.kind, self.hf, self.config, self.dtype, self.capacity = kind, cache, config, dtype, capacity
        self.device = device
        self._make = make  # () -> a fresh transformers cache of the same kind (for replays)
        self.length = 0
        self._high = 0  # the most positions written since the cache was made (static slots past length are stale)
        self.plan: list[LayerSpec] = layer_plan(config)
        self._states: list[watch.LayerState] = []
        self._moves: list[watch.Moves] = []
        self._reads: dict[int, list[int]] = {}
        self._undo: tuple | None = None
        self._report: MemoryReport | None = None
        self.allocator = allocator_for(device)
        self.window = Window(self.allocator)

    # -- what the generator asks ---------------------------------------------------------------------------
    @property
    def inspect(self) -> "HFCache":
        """Itself (:class:`~kvexplore.caches.protocol.CacheInspector`): it has no layer caches of kvexplore's to ask."""
        return self

    #: it drops nothing as it writes (transformers' sliding layers keep their window as kvexplore's rings do)
    evicts_on_write = False

    def what_it_did(self) -> str:
        return ""  # it stores what the model wrote

    def speculation_refusal(self) -> str | None:
        return None

    @property
    def full_layers(self) -> list[int]:
        return [s.index for s in self.plan if s.full]

    @property
    def held(self) -> int:
        return self.length

    def check_write(self, pos: int, q_len: int, batch_size: int = 1) -> None:
        if pos != self.length:
            raise SettingsError(f"a transformers cache takes positions from its own length ({self.length}); "
                                f"position {pos} was asked: feed the tokens from {self.length} on")
        if self.capacity is not None and pos + q_len > self.capacity:
            raise CacheFullError(f"the {self.kind} cache holds at most {self.capacity} positions and this step would "
                                 f"need {pos + q_len}: make it with a larger max_seq_len, or rewind")

    def begin_step(self, pos: int, q_len: int, model=None) -> None:
        """Keep what :meth:`rollback` needs: the layers' attributes (a concatenating layer's old tensors stay as
        they were) and copies of the tensors a layer writes in place (static and state layers)."""
        self.check_write(pos, q_len)
        saved = []
        for layer in self.hf.layers:
            attrs = {k: (dict(v) if isinstance(v, dict) else v) for k, v in vars(layer).items()}
            counters = [(t, -1, t.clone()) for t in attrs.values() if isinstance(t, torch.Tensor) and t.dim() < 2]
            saved.append((layer, attrs, self._overwritten(layer, pos, q_len) + counters))  # counters move in place
        self._undo = (saved, len(self.hf.layers), self.length, self._states, self._moves, self._reads, self._report)
        self.window = Window(self.allocator)  # the CUDA allocator inside the cache's updates this step
        self._report = None

    @staticmethod
    def _overwritten(layer: object, pos: int, q_len: int) -> list[tuple[torch.Tensor, int, torch.Tensor]]:
        """Copies of what a step will overwrite in place, as (tensor, first slot, saved): a static layer writes
        the step's slots only; a rolling window or a recurrent state may change everywhere (saved whole). A
        concatenating layer replaces its tensors, so keeping the old ones (the attributes) is enough."""
        chain = watch.class_chain(layer)
        if type(layer).__name__ == watch.FULL_STATIC:
            kv = watch.kv_tensors(layer)
            if kv is None:  # not initialised yet: the first update allocates, nothing is overwritten
                return []
            n = max(0, min(q_len, kv[0].shape[2] - pos))
            return [(t, pos, t.narrow(2, pos, n).clone()) for t in kv]
        if watch.FULL_STATIC in chain or "LinearAttentionCacheLayerMixin" in chain:
            return [(t, -1, t.clone()) for t in watch.layer_tensors(layer).values()]
        return []

    def end_step(self, pos: int, q_len: int, reads: dict[int, list[int]]) -> None:
        """Read every layer after the forward pass and what the step did to it."""
        before = self._states
        self.length = pos + q_len
        self._high = max(self._high, self.length)
        self._states = watch.observe(self.hf, self.length)
        self._adopt_plan()
        new = range(pos, pos + q_len)
        self._moves = [watch.moves(before[i] if i < len(before) else None, s, new) for i, s in enumerate(self._states)]
        self._reads = reads

    def settle(self) -> None:
        had_step, self._undo = self._undo is not None, None
        if had_step and self._report is not None:  # what the step kept to undo itself is gone
            self._report = replace(self._report, **self._storage())

    def rollback(self) -> None:
        """Put the cache back as it was before the step under way (also after a forward pass that failed)."""
        if self._undo is None:
            return
        saved, count, self.length, self._states, self._moves, self._reads, self._report = self._undo
        del self.hf.layers[count:]
        with torch.inference_mode():  # the layers' tensors were made in inference mode (HFModel.forward)
            for layer, attrs, inplace in saved:
                vars(layer).clear()
                vars(layer).update(attrs)
                for t, start, kept in inplace:
                    (t if start < 0 else t.narrow(2, start, kept.shape[2])).copy_(kept)
        self._undo = None

    def needs_replay(self, n: int) -> bool:
        """A crop cannot bring back what a window or a state forgot: those caches are rebuilt by a replay."""
        return n != self.length and not self._croppable()

    def crop_error(self, n: int) -> str | None:
        """Full layers are cut exactly by transformers' own ``crop``; sliding windows and states cannot be."""
        if n == self.length or self._croppable():
            return None
        return (f"a {self.kind} cache with sliding or state layers cannot be cropped: the step is rolled back and the "
                f"kept tokens are written again")

    def _croppable(self) -> bool:
        layers = self.hf.layers
        return bool(layers) and all(type(l).__name__ in (watch.FULL_DYNAMIC, watch.FULL_STATIC) for l in layers)

    def check_truncate(self, n: int, rings: bool = True) -> None:
        if not 0 <= n <= self.length:
            raise SettingsError(f"cannot truncate to {n}: the cache holds {self.length} positions "
                                f"(0 <= n <= {self.length})")

    def truncate(self, n: int) -> None:
        """Keep the first ``n`` positions: the cache's own ``crop`` (a fresh cache for 0 or where it cannot)."""
        self.check_truncate(n)
        if n == self.length:
            return
        if n and not self._croppable():
            raise SettingsError(f"a {self.kind} cache with sliding or state layers cannot be cropped to {n}: the "
                                f"generator replays the kept tokens instead")
        if n == 0:
            self.hf = self._make() if self._make is not None else self.hf
            if self._make is None:
                self.hf.reset()
            self._high = 0
        else:
            self.hf.crop(n - self.length)  # transformers' crop takes minus the tokens to remove
        self.length = n
        self._undo, self._report, self._reads = None, None, {}
        self._states = watch.observe(self.hf, n)
        self._moves = [watch.Moves() for _ in self._states]

    def clone(self) -> "HFCache":
        """A deep copy (its own tensors)."""
        twin = copy.copy(self)
        twin.hf = copy.deepcopy(self.hf)
        twin._undo = None
        twin._states = watch.observe(twin.hf, self.length)
        return twin

    fork = clone

    # -- what the tracer and the views ask -------------------------------------------------------------------
    def _adopt_plan(self) -> None:
        """Each layer's kind from the transformers layer classes (they decide, not the config)."""
        plan = []
        for i, layer in enumerate(self.hf.layers[: len(self.plan)]):
            spec = self.plan[i]
            chain = watch.class_chain(layer)
            window = None
            if watch.is_state_layer(layer):
                kind = STATE
            elif watch.SLIDING_DYNAMIC in chain or watch.SLIDING_STATIC in chain:
                kind = SLIDING
                window = getattr(layer, "sliding_window", None) or getattr(layer, "max_cache_len", None)
            else:
                kind = FULL
            kv = watch.kv_tensors(layer)
            heads, dim = (kv[0].shape[1], kv[0].shape[-1]) if kv is not None else (spec.kv_heads, spec.head_dim)
            plan.append(LayerSpec(i, kind, kind, window, i, heads, dim))  # each layer attends as it stores
        self.plan = plan + self.plan[len(plan):]

    def storage(self, layer: int) -> list[torch.Tensor]:
        if layer >= len(self.hf.layers):
            return []
        return list(watch.layer_tensors(self.hf.layers[layer]).values())

    def read_window(self, layer: int, count: int) -> tuple[int, int]:
        return (self._reads.get(layer) or [0])[0], count

    def read_group(self, layer: int) -> tuple:
        return ("layer", layer)

    def read_positions(self, layer: int | None = None) -> list[int]:
        return list(self._reads.get(self.main_layer if layer is None else layer, []))

    @property
    def main_layer(self) -> int:
        return self.full_layers[0] if self.full_layers else 0

    def pending_reads(self) -> dict[int, torch.Tensor]:
        return {}

    def land_reads(self, landed: dict[int, torch.Tensor]) -> None:
        pass

    def slot_view(self, layer: int | None = None) -> SlotView:
        layer = self.main_layer if layer is None else layer
        if layer >= len(self._states):
            return SlotView([], [], [], EmptyLayout())
        s = self._states[layer]
        if s.state:
            conv = sum(b for n, b in s.nbytes.items() if n.startswith("conv"))
            recurrent = next((list(shape[1:]) for n, shape in s.shapes.items() if n.startswith("recurrent")), [])
            return SlotView([], [], [], StateLayout(conv_bytes=conv, recurrent_bytes=s.reserved_bytes - conv,
                                                    shape=recurrent))
        spec = self.plan[layer]
        moved = self._moves[layer].moved if layer < len(self._moves) else False
        cap = len(s.positions) if watch.FULL_STATIC in s.layer_class or "Static" in s.layer_class else 0
        layout = TransformersLayout(s.layer_class, moved, (spec.window or 0) if spec.ring else 0, cap)
        states = [FILLED if p >= 0 else STALE if cap and spec.full and i < self._high else FREE
                  for i, p in enumerate(s.positions)]
        return SlotView(states, list(s.positions), [1] * len(s.positions), layout)

    def slot_views(self) -> list[SlotView]:
        return [self.slot_view(i) for i in range(len(self.plan))]

    def memory_report(self) -> MemoryReport:
        if self._report is None:
            self._report = self._make_report()
        return self._report

    def _make_report(self) -> MemoryReport:
        layers = []
        for i, spec in enumerate(self.plan):
            s = self._states[i] if i < len(self._states) else None
            m = self._moves[i] if i < len(self._moves) else watch.Moves()
            if s is None:
                layers.append(LayerMemory(i, spec.kind, 0, 0, 0, 0))
                continue
            held = 0 if s.state else s.held
            logical = s.reserved_bytes if s.state else held * s.position_bytes
            analytic = s.reserved_bytes if s.state else spec.position_bytes(self.dtype.itemsize) * held
            layers.append(LayerMemory(i, spec.kind, held, logical, s.reserved_bytes, analytic, m.written_bytes,
                                      m.copied_bytes))
        total = lambda name: sum(getattr(m, name) for m in self._moves)  # noqa: E731
        return MemoryReport(
            length=self.length, logical_bytes=sum(l.logical_bytes for l in layers),
            reserved_bytes=sum(l.reserved_bytes for l in layers), analytic_bytes=sum(l.analytic_bytes for l in layers),
            written_bytes=total("written_bytes"), copied_bytes=total("copied_bytes"),
            allocated_bytes=total("allocated_bytes"), freed_bytes=total("freed_bytes"),
            allocations=total("allocations"), frees=total("frees"), cuda=self.window.figures(),
            cuda_now=self.allocator.now() if self.allocator is not None else {}, layers=tuple(layers),
            **self._storage())

    def _storage(self) -> dict:
        """Every tensor storage reachable from the transformers cache and this wrapper (kvexplore.caches.held): each
        layer's keys and values first, then what else its layer objects keep, by attribute; the step's undo apart."""
        walk, layers = StorageWalk(), list(getattr(self.hf, "layers", ()))
        for layer in layers:
            walk.add(KEYS_AND_VALUES, getattr(layer, "keys", None), getattr(layer, "values", None))
        for layer in layers:
            for name, value in vars(layer).items():
                name = name.lstrip("_")
                walk.add(KEYS_AND_VALUES if name in ("quantized_keys", "quantized_values") else name, value)
        walk.add("transformers cache", self.hf)
        walk.add(THIS_STEP, self._undo)
        for name, value in vars(self).items():  # the wrapper's own: the reads of the last step, what it watches
            walk.add(HELD_NAMES.get(name, name.lstrip("_")), value)
        parts = dict(walk.parts)  # part -> bytes
        step = parts.pop(THIS_STEP, 0)
        return dict(held_bytes=sum(parts.values()), held=parts, step_bytes=step)

    @property
    def reserved_bytes(self) -> int:
        return sum(s.reserved_bytes for s in self._states)

    def describe_layers(self) -> str:
        names = Counter(type(layer).__name__ for layer in self.hf.layers)
        return "; ".join(f"{n} × transformers {name}" for name, n in names.items()) or "no layers yet"

    def __repr__(self) -> str:
        cap = "unbounded" if self.capacity is None else self.capacity
        return f"HFCache({self.kind}, {type(self.hf).__name__}, length={self.length}, capacity={cap})"
