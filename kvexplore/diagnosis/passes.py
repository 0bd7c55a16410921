"""One forward pass as the doctor compares it (logits, and per layer the keys and values attention read, the output
and a recurrent state), made by a transformers model through any Cache or a kvexplore model through any of its caches,
each with its reference: a full recomputation through a fresh cache."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from ..core import host


@dataclass
class LayerPass:
    keys: torch.Tensor | None = None  # (kv_heads, columns, head_dim), as attention read them
    values: torch.Tensor | None = None
    positions: list[int] = field(default_factory=list)  # the position of each column
    out: torch.Tensor | None = None  # the layer's output (hidden state) at the last position
    state: torch.Tensor | None = None  # a linear-attention layer's recurrent state after the pass
    window: int | None = None  # a sliding layer's window (what it should read)
    head_positions: list[list[int]] | None = None  # per KV head, each column's position (-1: none; a pressed layer)
    written: tuple[torch.Tensor, torch.Tensor] | None = None  # a prefill's keys and values as the layer wrote them


@dataclass
class Pass:
    logits: torch.Tensor  # (vocab,) float32, host
    layers: list[LayerPass]


def land(logits: torch.Tensor, layers: list[LayerPass]) -> Pass:
    """Bring a pass's tensors to the host in one transfer, as float32."""
    named = [(i, n, getattr(l, n)) for i, l in enumerate(layers) for n in ("keys", "values", "out", "state")
             if getattr(l, n) is not None]
    landed = host.fetch([logits.detach().float()] + [t.detach().float() for _, _, t in named])
    for (i, n, _), t in zip(named, landed[1:]):
        setattr(layers[i], n, t)
    return Pass(landed[0], layers)


def unit_turns(cos: torch.Tensor, sin: torch.Tensor, offsets: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin of RoPE at ``|offsets|`` made pure rotations (a yarn scale multiplies both) and turned the
    other way for negative offsets."""
    cos, sin = cos.float().cpu(), sin.float().cpu()
    norm = (cos ** 2 + sin ** 2).sqrt().clamp_min(1e-12)
    sign = torch.tensor([1.0 if d >= 0 else -1.0 for d in offsets])[:, None]
    return cos / norm, sin / norm * sign


class HFPasses:
    """Passes of a transformers model (an :class:`~kvexplore.hf.HFModel`) through ``cache`` (any transformers Cache)."""

    def __init__(self, model, cache) -> None:
        self.model, self.cache = model, cache
        self.dtype = model.dtype
        self.num_layers = model.config.num_layers
        text = model.hf_config
        self.layer_types = list(getattr(text, "layer_types", None) or [])
        self.window = getattr(text, "sliding_window", None)

    def cached(self, ids: list[int], pos: int) -> Pass:
        return self._pass(ids, pos, self.cache)

    def bounds(self, ref: Pass) -> None:
        """A transformers cache is checked as an exact one (see :meth:`KVPasses.bounds`)."""

    def reference(self, ids: list[int]) -> Pass:
        import transformers

        return self._pass(ids, 0, transformers.DynamicCache(config=self.model.hf.config))

    def _pass(self, ids: list[int], pos: int, cache) -> Pass:
        from ..hf.step import watching

        with watching(cache, pos, len(ids)) as seen:
            out = self.model.forward(torch.tensor([ids]), cache, hidden=True)
        return land(out.logits[0, -1], self._layers(seen, out.hidden_states))

    def _layers(self, seen: dict, hidden) -> list[LayerPass]:
        layers = []
        for i in range(self.num_layers):
            lp = LayerPass(out=hidden[i + 1][0, -1] if hidden is not None and i + 1 < len(hidden) else None)
            if i in seen["read"]:
                lp.keys, lp.values = seen["read"][i][0], seen["values"][i][0]
                lp.positions = list(seen["reads"][i])
            if i in seen["state"]:
                lp.state = seen["state"][i][0]
            if i < len(self.layer_types) and self.layer_types[i] == "sliding_attention":
                lp.window = self.window
            layers.append(lp)
        return layers

    def rotation(self, layer: int, offsets: list[int]):
        """(cos, sin) that turn a key by each of ``offsets`` positions, (len, rotary dims), from the rotary
        embedding's inverse frequencies (its forward may be the thing under test); None without RoPE."""
        rotary = getattr(getattr(self.model.hf, "model", None), "rotary_emb", None)
        kind = self.layer_types[layer] if layer < len(self.layer_types) else ""
        inv = getattr(rotary, f"{kind}_inv_freq", None) if rotary is not None else None
        inv = inv if inv is not None else getattr(rotary, "inv_freq", None)
        if not isinstance(inv, torch.Tensor):
            return None
        freqs = torch.tensor([abs(d) for d in offsets], dtype=torch.float32)[:, None] * inv.float().cpu()[None]
        emb = torch.cat((freqs, freqs), dim=-1)
        return unit_turns(emb.cos(), emb.sin(), offsets)


class KVPasses:
    """Passes of a kvexplore :class:`~kvexplore.Model` through ``cache`` (any kvexplore cache)."""

    def __init__(self, model, cache) -> None:
        self.model, self.cache = model, cache
        self.dtype = model.dtype
        self.num_layers = model.config.num_layers
        self.plan = cache.plan

    def probe(self) -> "_Probe":
        """The tracer a cached pass runs with."""
        return _Probe(self.num_layers)

    def cached(self, ids: list[int], pos: int) -> Pass:
        probe = self.probe()
        logits = self.model(torch.tensor([ids]), self.cache, pos, tracer=probe, last_only=True)[0, -1]
        layers = []
        for i, spec in enumerate(self.plan):
            lp = LayerPass(out=probe.out.get(i), state=probe.state.get(i),
                           window=spec.window if spec.attends == "sliding" else None)
            if i in probe.read:
                lp.keys = probe.read[i]
                lp.positions = self.cache.inspect.read_positions(i) or list(range(pos + len(ids)))
                lp.head_positions = probe.columns.get(i)
            if pos == 0 and i in probe.new:  # every position read was written by this pass
                lp.written = probe.new[i]
            layers.append(lp)
        return land(logits, layers)

    def reference(self, ids: list[int]) -> Pass:
        from ..caches.factory import make_cache

        probe = _Probe(self.num_layers)
        fresh = make_cache("concat", self.model)
        logits = self.model(torch.tensor([ids]), fresh, 0, tracer=probe, last_only=True)[0, -1]
        layers = []
        for i, spec in enumerate(self.plan):
            lp = LayerPass(out=probe.out.get(i), state=probe.state.get(i))
            if i in probe.new:
                lp.keys, lp.values = probe.new[i]
                lp.positions = list(range(len(ids)))
            layers.append(lp)
        return land(logits, layers)

    def bounds(self, ref: Pass) -> list[torch.Tensor | None] | None:
        """Per layer, how far the keys a correct cache of this lossy-by-design kind gives attention may be from
        ``ref``'s (its ``quantization.error_bound``; None for a layer it keeps exact); None while the whole cache is
        exact."""
        lossy = self.cache.quantization
        if lossy is None:
            return None
        out = [None if lp.keys is None else lossy.error_bound(i, lp.keys, lp.values) for i, lp in enumerate(ref.layers)]
        return [b[0] if b is not None else None for b in out] if any(b is not None for b in out) else None

    def rotation(self, layer: int, offsets: list[int]):
        kind = self.model.config.layer_types[layer]
        top = max(abs(d) for d in offsets) + 1
        cos, sin = self.model.rotary.cos_sin(0, top, torch.float32, kind)
        idx = [abs(d) for d in offsets]
        return unit_turns(cos.reshape(top, -1)[idx], sin.reshape(top, -1)[idx], offsets)


class _Probe:
    """A tracer that keeps, per layer, the keys read, the new keys and values, the output and the state."""

    def __init__(self, num_layers: int) -> None:
        self.read, self.new, self.out, self.state, self._k = {}, {}, {}, {}, {}
        self.columns: dict[int, list[list[int]]] = {}  # a pressed layer's column positions per head (kept.py)

    def wants_attention(self, layer: int) -> bool:
        return False

    def hook(self, name: str, t: torch.Tensor):
        parts = name.split(".")
        if parts[0] != "layers":
            return
        i, point = int(parts[1]), ".".join(parts[2:])
        if point == "attn.cache_read":
            self.read[i] = t[0]
        elif point == "attn.k_new":
            self._k[i] = t[0]
        elif point == "attn.v_new":
            self.new[i] = (self._k.pop(i), t[0])
        elif point == "attn.out":
            self.out[i] = t[0, -1]
        elif point == "attn.state":
            self.state[i] = t[0]
