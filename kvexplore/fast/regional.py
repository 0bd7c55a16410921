"""Regional compilation: the CPU's compiled one-token step as one compiled decoder layer, run once per layer, and a
compiled output head.

A model's layers differ in their weights, not their code or shapes: a graph that takes a layer's weights as inputs
serves all of them, and having no constants it is saved as a file (:mod:`.artifacts`) a later process loads. Each
layer runs on a :func:`~.blocked.blocked_twin` of itself (its products over a blocked copy of each weight, fast
without frozen weights). Layers are grouped by what the trace bakes in (:func:`signature`): one graph per group.
"""

from __future__ import annotations

import dataclasses
import time
from typing import Any, Callable

import torch
from torch import nn

from ..caches.strategies.preallocated import PreallocatedCache
from ..errors import SettingsError
from . import artifacts
from .inplace import InPlace
from .blocked import BlockedLinear, blocked_twin, nbytes, tensors_of
from .capture import dynamo_graph

#: inductor options of the regional graphs: no size checks of the inputs on every call (the step builds them itself)
OPTIONS = {"size_asserts": False}


class Progress:
    """What the compile under way is doing, for a progress line (``kvexplore generate --compile``)."""

    phase = ""


PROGRESS = Progress()


def available() -> bool:
    """Whether this torch can compile a graph on its own and save it (``torch._inductor.standalone_compile``)."""
    try:
        from torch._inductor import CompiledArtifact, standalone_compile  # noqa: F401
    except ImportError:
        return False
    import inspect
    return "aot" in inspect.signature(standalone_compile).parameters


def _plain(value: Any) -> Any:
    """A module attribute as the trace may bake it in: numbers, strings and flags as they are, functions by name,
    dataclasses by their fields; tensors and modules are the graph's inputs, not part of this."""
    if value is None or isinstance(value, (bool, int, float, str, torch.dtype)):
        return value
    if isinstance(value, (tuple, list)):
        return tuple(_plain(v) for v in value)
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return tuple((f.name, _plain(getattr(value, f.name))) for f in dataclasses.fields(value))
    if callable(value):
        return getattr(value, "__qualname__", type(value).__qualname__)
    return type(value).__qualname__


def signature(twin: nn.Module) -> str:
    """What a layer's trace depends on besides its tensors' values: two layers with the same signature share a graph."""
    parts = []
    for name, module in twin.named_modules():
        attrs = sorted((k, _plain(v)) for k, v in vars(module).items()
                       if not k.startswith("_") and not isinstance(v, (torch.Tensor, nn.Module)))
        parts.append((name, type(module).__qualname__, tuple(attrs)))
    shapes = [(name, tuple(t.shape), t.stride(), str(t.dtype)) for name, t in tensors_of(twin)]
    return repr((parts, shapes))


def _unnumbered(twin: nn.Module) -> nn.Module:
    """The twin with its layer index set to 0 wherever a module keeps it (it only names hook points and cache
    calls, which the graph's cache view ignores; a layer's spec names it as its own cache's source too): one trace
    serves every layer."""
    for module in twin.modules():
        if isinstance(getattr(module, "layer", None), int):
            module.layer = 0
        spec = getattr(module, "spec", None)
        if dataclasses.is_dataclass(spec) and hasattr(spec, "index"):  # a layer's own cache: its source is itself
            own = getattr(spec, "source", None) == spec.index
            module.spec = dataclasses.replace(spec, index=0, **({"source": 0} if own else {}))
    return twin


class _Graph:
    """One compiled graph and the order it takes its inputs in (the trace's order, not the call's)."""

    def __init__(self, compiled: Callable, order: list[int]) -> None:
        self.order = order
        self.run = _innermost(compiled)

    def __call__(self, args: tuple) -> torch.Tensor:
        return self.run([args[i] for i in self.order])[0]


def _innermost(compiled: Any) -> Callable[[list], Any]:
    """The compiled code's own entry point where the artifact exposes it (inference only: it skips the autograd
    wrappers, which a step would pay at each of its graph calls), else the artifact itself."""
    inner = getattr(getattr(getattr(compiled, "inner_fn", None), "compiled_fn", None), "compiled_fn", None)
    run = getattr(inner, "current_callable", None)
    if callable(run) and not getattr(inner, "constants", None):
        return run
    return lambda args: compiled(*args)


class RegionalDecoder:
    """The compiled one-token step of ``model`` over a pre-allocated cache of ``capacity`` slots, built on the first
    call from one compiled layer graph (per group of layers alike) and a compiled head; ``decoder(token, cache, pos)``
    as :class:`~.compiled.CompiledDecoder`'s. ``compile_s``: the build's time; ``reuse_note``: what it did with the
    saved graphs; ``built``: graphs compiled (0: all loaded); ``held_bytes``: the blocked weight copies.
    """

    mode = "regional"

    def __init__(self, model: Any, capacity: int, saved: artifacts.Saved | None = None) -> None:
        self.model, self.capacity = model, capacity
        self._saved = saved
        device = model.device
        self._pos = torch.zeros(1, dtype=torch.long, device=device)
        self._token = torch.zeros(1, 1, dtype=torch.long, device=device)
        self._slots = torch.arange(capacity, device=device)
        self._cos, self._sin = model.rotary.cos_sin(0, capacity, model.dtype)
        self._layers: list[tuple[_Graph, list[torch.Tensor]]] | None = None
        self._head: tuple[_Graph, list[torch.Tensor]] | None = None
        self.compile_s: float | None = None
        self.reuse_note = ""
        self.built = 0
        self.held_bytes = 0
        self.steps = 0

    def __call__(self, token: int, cache: PreallocatedCache, pos: int) -> torch.Tensor:
        if cache.capacity != self.capacity:
            raise SettingsError(f"this compiled step was built for {self.capacity} slots, the cache has "
                                f"{cache.capacity}: make a decoder for it")
        if self._layers is None:
            t0 = time.perf_counter()
            try:
                with torch.no_grad():
                    self._build(cache)
            finally:
                PROGRESS.phase = ""
            self.compile_s = time.perf_counter() - t0
        with torch.no_grad():
            logits = self._step(token, cache, pos)
        self.steps += 1
        return logits

    def _inputs(self, pos: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        self._pos.fill_(pos)
        mask = (self._slots <= self._pos).view(1, -1)  # (T=1, capacity): the slots written so far, this one included
        return mask, self._cos.index_select(0, self._pos), self._sin.index_select(0, self._pos)

    def _step(self, token: int, cache: PreallocatedCache, pos: int) -> torch.Tensor:
        mask, cos, sin = self._inputs(pos)
        self._token.fill_(token)
        x = self.model.embed(self._token)
        for layer, (graph, tensors) in zip(cache.full_layers, self._layers):
            x = graph((x, cache.key(layer), cache.value(layer), self._pos, mask, cos, sin, *tensors))
        graph, tensors = self._head
        return graph((x, *tensors))

    def _build(self, cache: PreallocatedCache) -> None:
        model = self.model
        saved = self._saved or artifacts.Saved()
        PROGRESS.phase = "copying the weights into blocks"
        twins = [_unnumbered(blocked_twin(layer)) for layer in model.model.layers]
        head = BlockedLinear(model.head_weight)
        self.held_bytes = sum(nbytes(t) for t in twins) + head.blocks.nbytes
        mask, cos, sin = self._inputs(0)
        x = model.embed(self._token)
        graphs: dict[str, _Graph] = {}
        keys: list[str] = []
        layers = []
        for layer, twin in zip(cache.full_layers, twins):
            sig = signature(twin)
            tensors = [t for _, t in tensors_of(twin)]
            if sig not in graphs:
                names = [n for n, _ in tensors_of(twin)]

                def body(x, keys_, values_, pos, mask, cos, sin, *weights, twin=twin, names=names):
                    view = InPlace([keys_], [values_], pos, mask)  # the twin's layer index is 0
                    return torch.func.functional_call(twin, dict(zip(names, weights)),
                                                      (x, view, pos, cos, sin, None), strict=True)

                scratch = torch.empty_like(cache.key(layer)), torch.empty_like(cache.value(layer))
                graphs[sig] = self._graph(body, (x, *scratch, self._pos, mask, cos, sin, *tensors), saved, keys,
                                          f"layer {layer}")
            layers.append((graphs[sig], tensors))
        norm = model.model.norm
        norm_names = [n for n, _ in tensors_of(norm)]

        def tail(x, blocks, *norm_tensors):
            h = torch.func.functional_call(norm, dict(zip(norm_names, norm_tensors)), (x,))
            return model.capped(torch.func.functional_call(head, {"blocks": blocks}, (h,)).float())[:, -1]

        head_tensors = [head.blocks, *(t for _, t in tensors_of(norm))]
        self._head = (self._graph(tail, (x, *head_tensors), saved, keys, "the output head"), head_tensors)
        self._layers = layers
        self.reuse_note = artifacts.note(saved, artifacts.step_key(model, self.capacity, self.mode), keys, self.built,
                                         stored=all(saved.file(k).exists() for k in keys))

    def _graph(self, fn: Callable, args: tuple, saved: artifacts.Saved, keys: list[str], what: str) -> _Graph:
        """``fn`` traced for ``args``, loaded from ``saved`` or compiled (and saved)."""
        PROGRESS.phase = f"tracing {what}"
        gm, inputs = dynamo_graph(fn, args)
        where = {id(a): i for i, a in enumerate(args)}  # each input's place in args
        if any(id(t) not in where for t in inputs):  # a tensor the graph found elsewhere would be baked into it
            raise SettingsError("the layer's graph reads a tensor that is not among its inputs: it cannot be shared")
        key = artifacts.graph_key(gm, inputs, OPTIONS)
        keys.append(key)
        PROGRESS.phase = f"loading the compiled graph of {what}"
        compiled = artifacts.load(saved, key)
        if compiled is None:
            PROGRESS.phase = f"compiling {what}" + (" (one graph for every layer)" if what.startswith("layer") else "")
            compiled = torch._inductor.standalone_compile(gm, inputs, dynamic_shapes="from_example_inputs", aot=True,
                                                          options={"config_patches": OPTIONS})
            self.built += 1
            artifacts.store(saved, key, compiled)
        return _Graph(compiled, [where[id(t)] for t in inputs])

