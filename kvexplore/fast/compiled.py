"""Compiled decoding on the pre-allocated cache: the one-token step compiled once for the cache's capacity. On the
CPU by default one decoder layer is compiled and run for every layer (:mod:`.regional`); an explicit torch.compile
mode, and CUDA, compile the whole step as one ``torch.compile`` graph (:class:`CompiledDecoder`).

The pre-allocated cache keeps every layer's keys and values at fixed addresses with a fixed shape, so the step
writes at a position given as a tensor and attends over all slots under ``slot <= position``: no shape depends on
the sequence's length (docs/python-api.md, "Compiled decoding"). The graph runs the model's own layers; only the
cache under them is replaced by :class:`~.inplace.InPlace`, and the bookkeeping is done outside it.
"""

from __future__ import annotations

import time
import weakref
from contextlib import nullcontext
from typing import Any

import torch

from ..caches.one_pass import one_pass
from ..caches.strategies.preallocated import PreallocatedCache
from ..errors import SettingsError
from . import regional
from .compile_cache import watched
from ..models.executor import CompiledExecutor
from .inplace import InPlace


def refusal(model: Any, cache: Any) -> str | None:
    """Why this model and cache cannot decode compiled (None: they can)."""
    if not isinstance(cache, PreallocatedCache):
        return f"compiled decoding needs the pre-allocated cache (fixed addresses and shape), not {cache.kind!r}"
    if cache.batch_size != 1:
        return "compiled decoding drives one sequence (batch_size=1)"
    if cache.dtype != model.dtype or cache.device != model.device:
        return (f"compiled decoding needs the cache in the model's dtype and device ({model.dtype}, {model.device}); "
                f"this one is {cache.dtype} on {cache.device}")
    c = model.config
    if any(s.shares or s.recurrent or s.ring or s.windowed for s in cache.plan):
        return ("compiled decoding covers models whose layers are all full attention (no sliding, shared or state "
                "layers)")
    if (c.num_experts or c.kv_lora_rank or c.attention_sinks or c.attn_logit_softcapping is not None
            or c.gated_attention):
        return (f"compiled decoding covers dense Llama-family layers; {c.architecture}'s experts, latent attention, "
                f"sinks or soft-capping run eager")
    return None


class _Step(torch.nn.Module):
    """The one-token step as a module (so that compiling it freezes the model's weights into the graph)."""

    def __init__(self, model: Any, capacity: int) -> None:
        super().__init__()
        self.model = model
        cos, sin = model.rotary.cos_sin(0, capacity, model.dtype)  # one table for every slot; indexed in the graph
        self.register_buffer("cos", cos, persistent=False)
        self.register_buffer("sin", sin, persistent=False)
        self.register_buffer("slots", torch.arange(capacity, device=model.device), persistent=False)

    def forward(self, token: torch.Tensor, pos: torch.Tensor, keys: list[torch.Tensor],
                values: list[torch.Tensor]) -> torch.Tensor:
        model = self.model
        mask = (self.slots <= pos).view(1, -1)  # (T=1, capacity): the slots written so far, this one included
        cache = InPlace(keys, values, pos, mask)
        cos, sin = self.cos.index_select(0, pos), self.sin.index_select(0, pos)
        x = model.embed(token)
        for layer in model.model.layers:
            x = layer(x, cache, pos, cos, sin, None)
        return model.logits(model.model.norm(x))[:, -1]


class CompiledDecoder:
    """The compiled one-token step of ``model`` over a pre-allocated cache of ``capacity`` slots, as one graph.

    ``decoder(token, cache, pos)`` returns the ``(1, vocab)`` float32 logits of ``token`` at ``pos`` and leaves its
    key and value in ``cache``; the storages are inputs of the graph, so one decoder serves any such cache.
    ``compile_s``: the first step's compile time; ``reuse_note``: whether it loaded an earlier process's step. On the
    CPU ``mode="max-autotune"`` freezes the weights into the graph (a second, packed copy that does not see later
    changes to the model's weights); on CUDA the step is captured as a CUDA graph (``mode="reduce-overhead"``).
    """

    def __init__(self, model: Any, capacity: int, mode: str | None = None) -> None:
        self.model, self.capacity = model, capacity
        device = model.device
        self._module = _Step(model, capacity)
        self._pos = torch.zeros(1, dtype=torch.long, device=device)  # a fixed address: CUDA graphs replay it
        self._token = torch.zeros(1, 1, dtype=torch.long, device=device)
        if mode is None:
            mode = "reduce-overhead" if device.type == "cuda" else "max-autotune"
        self.mode = mode
        # inductor reads freezing from its global config, not from torch.compile's options: patched around the call
        # that compiles (a patch every step costs a good share of a replayed step's Python on a GPU, docs/cuda.md;
        # later calls run the compiled code, which inductor's config no longer touches)
        self._config = {"freezing": True, "max_autotune": True, "max_autotune_gemm_backends": "CPP",
                        "autotune_num_choices_displayed": 0} \
            if mode == "max-autotune" and device.type == "cpu" else {}
        self._step = torch.compile(self._module, fullgraph=True, dynamic=False,
                                   mode=None if self._config else mode)
        self.compile_s: float | None = None
        self.reuse_note = ""  # after the first step: whether it was reused from an earlier process (compile_cache)
        self.steps = 0

    def __call__(self, token: int, cache: PreallocatedCache, pos: int) -> torch.Tensor:
        if cache.capacity != self.capacity:
            raise SettingsError(f"this compiled step was built for {self.capacity} slots, the cache has "
                                f"{cache.capacity}: make a decoder for it")
        self._pos.fill_(pos)
        self._token.fill_(token)
        keys = [cache.key(i) for i in cache.full_layers]
        values = [cache.value(i) for i in cache.full_layers]
        if self.mode == "reduce-overhead":
            _static(keys + values)
        first = self.compile_s is None
        t0 = time.perf_counter()
        import torch._inductor.config as inductor

        compiling = watched() if first else nullcontext({})
        with torch.no_grad(), inductor.patch(self._config) if first else nullcontext(), compiling as saved:
            logits = self._step(self._token, self._pos, keys, values)
        if first:
            self.compile_s = time.perf_counter() - t0
            self.reuse_note = saved.get("note", "")
        self.steps += 1
        return logits.clone() if self.mode == "reduce-overhead" else logits  # a replayed graph reuses its output


_DECODERS: "weakref.WeakKeyDictionary[Any, dict[tuple, Any]]" = weakref.WeakKeyDictionary()
#: what Generator(compile=...) takes besides True: kvexplore's regional step and torch.compile's modes
MODES = ("regional", "default", "max-autotune", "reduce-overhead")


def best_mode(device: torch.device) -> str:
    """What ``compile=True`` means on ``device``: the regional step on the CPU (where this torch can save a graph),
    a CUDA graph of the whole step on CUDA, torch.compile's max-autotune elsewhere."""
    if device.type == "cuda":
        return "reduce-overhead"
    return "regional" if device.type == "cpu" and regional.available() else "max-autotune"


def decoder_for(model: Any, capacity: int, mode: str | None = None, build: bool = True) -> Any:
    """The model's compiled step for ``capacity`` slots (and ``mode``; None: the best for the device), built once
    and shared by its generators (forks, resets): a :class:`~.regional.RegionalDecoder` or a
    :class:`CompiledDecoder`."""
    mode = mode or best_mode(model.device)
    by_key = _DECODERS.setdefault(model, {})
    key = (capacity, mode)
    if key not in by_key and build:
        _check_mode(mode)
        by_key[key] = regional.RegionalDecoder(model, capacity) if mode == "regional" else \
            CompiledDecoder(model, capacity, mode)
    return by_key.get(key)


def _check_mode(mode: str | None) -> None:
    if mode == "regional" and not regional.available():
        raise SettingsError(f"compile='regional' needs torch._inductor.standalone_compile with aot=True (torch "
                            f"{torch.__version__} has none): use compile=True or a torch.compile mode")


class CompiledStep(CompiledExecutor):
    """The compiled one-token step behind the executor contract: ``eager`` (an
    :class:`~kvexplore.runtime.eager.EagerExecutor`) supplies the model and everything the generator reads; a call runs
    the model's shared :class:`CompiledDecoder` and does the cache's bookkeeping around the graph. A tracer gets what a
    trace without attention holds, read from the cache after."""

    def __init__(self, eager: Any, mode: str | None = None) -> None:
        _check_mode(mode)  # at the generator's construction, not its first step
        self.eager, self.mode = eager, mode

    config = property(lambda self: self.eager.config)
    tokenizer = property(lambda self: self.eager.tokenizer)
    source = property(lambda self: self.eager.source)
    device = property(lambda self: self.eager.device)
    dtype = property(lambda self: self.eager.dtype)
    model = property(lambda self: self.eager.model)

    def __call__(self, ids: torch.Tensor, cache: PreallocatedCache, pos: int, tracer: Any = None,
                 last_only: bool = False, keep_undo: bool = False) -> torch.Tensor:
        if ids.shape != (1, 1) or not last_only:
            raise SettingsError(f"the compiled step feeds one token for its last position's logits, got ids of shape "
                                f"{tuple(ids.shape)} (last_only={last_only}); run longer feeds eager")
        token = int(ids[0, 0])
        with one_pass(cache, pos, 1, keep_undo=keep_undo):
            cache.note_inplace_write(pos, 1)
            logits = decoder_for(self.eager.model, cache.capacity, self.mode)(token, cache, pos)[0]
            if tracer is not None:
                self._feed(tracer, cache, pos, logits)
        return logits.view(1, 1, -1)

    @staticmethod
    def _feed(tracer: Any, cache: PreallocatedCache, pos: int, logits: torch.Tensor) -> None:
        """What a trace without attention holds, read from the cache after the step."""
        for layer in cache.full_layers:
            name = f"layers.{layer}.attn"
            keys, values = cache.key(layer), cache.value(layer)
            tracer.hook(f"{name}.k_new", keys.narrow(2, pos, 1).clone())
            tracer.hook(f"{name}.v_new", values.narrow(2, pos, 1).clone())
            tracer.hook(f"{name}.cache_read", keys.narrow(2, 0, pos + 1))  # the slots the mask let through
        tracer.hook("logits", logits.view(1, 1, -1))

    def sees_inside(self, tracer: Any) -> bool:
        return tracer is not None and ("qkv" in getattr(tracer, "capture", ()) or any(
            tracer.wants_attention(i) for i in range(self.config.num_layers)))

    def compile_s(self, cache: Any) -> float | None:
        decoder = decoder_for(self.eager.model, cache.capacity, self.mode, build=False)
        return None if decoder is None else decoder.compile_s

    def reuse_note(self, cache: Any) -> str:
        decoder = decoder_for(self.eager.model, cache.capacity, self.mode, build=False)
        return "" if decoder is None else decoder.reuse_note

    def compile_refusal(self, cache: Any) -> str | None:
        return refusal(self.eager.model, cache)

    def replay(self, ids, cache) -> None:
        self.eager.replay(ids, cache)


def _static(storages: list[torch.Tensor]) -> None:
    """Mark the cache's storages as tensors at fixed addresses, as parameters are: CUDA graphs then replay writes into
    them in place (an input the graph mutates is otherwise refused, and the step runs without a graph). Unguarded:
    another cache of the same capacity re-records the graph rather than recompiling."""
    for t in storages:
        if getattr(t, "_dynamo_static_input_type", None) is None:
            torch._dynamo.mark_static_address(t, guard=False)
