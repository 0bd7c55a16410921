"""The doctor on a pressed (``evict``) cache: the reference is a recomputation with the same kept set, a second cache
of masking storage fed in segments between the recorded presses (docs/eviction.md), and what a departure means."""

from __future__ import annotations

import torch

from ..caches.strategies.evict import EvictCache
from ..caches.layer import Step
from ..models.rope import rotate
from .compare import Departure
from .passes import KVPasses, LayerPass, Pass, _Probe, land
from ..core import host


class _SlotProbe(_Probe):
    """Also keeps, when each pressed layer's attention reads, the position of each column per head (-1: not held)."""

    def __init__(self, num_layers: int, cache: EvictCache) -> None:
        super().__init__(num_layers)
        self.cache = cache

    def hook(self, name: str, t: torch.Tensor):
        parts = name.split(".")
        if parts[0] == "layers" and ".".join(parts[2:]) == "attn.cache_read":
            i = int(parts[1])
            spec = self.cache.plan[i]
            source = spec.source if spec.shares else i  # a shared layer reads its (pressed) source's columns
            if source in self.cache.full_layers:
                _, _, valid, pos, _ = self.cache.layers[source].held_slots()
                self.columns[i] = pos[0].masked_fill(~valid[0], -1).cpu().tolist()
                super().hook(name, t.clone())  # a view of storage a press may turn in place (masked, re-rotating)
                return None
        return super().hook(name, t)


class KeptPasses(KVPasses):
    """Passes of a kvexplore model through a pressed cache, against a recomputation with the same kept set."""

    reference_name = "a recomputation with the same kept set"

    def __init__(self, model, cache: EvictCache) -> None:
        super().__init__(model, cache)
        self.history: list[tuple[int, dict[int, list[list[int]]]]] = []  # (length, layer -> kept per head)
        self.declared: dict[int, list[list[int]]] = {}  # layer -> rope positions the cache declares, per head
        self._events = len(cache.eviction.press_events)
        self._base: EvictCache | None = None  # the reference fed up to the last press (see _pressed_base)
        self._base_key: tuple | None = None

    def probe(self) -> "_SlotProbe":
        return _SlotProbe(self.num_layers, self.cache)

    def cached(self, ids: list[int], pos: int) -> Pass:
        got = super().cached(ids, pos)
        events = self.cache.eviction.press_events
        for event in events[self._events:]:  # the step pressed: what each head kept, as the reference imposes it
            kept = self.cache.eviction.kept_positions
            self.history.append((event.length, {i: kept(i) for i in self.cache.full_layers}))
        self._events = len(events)
        self.declared = {i: self.cache.eviction.rope_positions(i) for i in self.cache.full_layers}
        return got

    def reference(self, ids: list[int]) -> Pass:
        n = len(ids)
        segments = [(length, kept) for length, kept in self.history if length < n]
        start = segments[-1][0] if segments else 0
        ref = self._pressed_base(ids, segments, n)
        probe = _Probe(self.num_layers)
        logits = self.model(torch.tensor([ids[start:]]), ref, start, tracer=probe, last_only=True,
                            keep_undo=True)[0, -1]
        try:
            layers = []
            for i, spec in enumerate(self.plan):
                lp = LayerPass(out=probe.out.get(i), state=probe.state.get(i))
                if i in probe.read:
                    lp.keys, lp.positions = probe.read[i], ref.inspect.read_positions(i)  # a ring reads its window
                layers.append(lp)
            return land(logits, layers)  # copies: the rollback below cannot change them
        finally:
            ref.rollback()  # back to the last press, where the next step's reference starts again

    def _pressed_base(self, ids: list[int], segments: list, n: int) -> EvictCache:
        """The reference cache fed up to the last press before ``n`` (one forward per segment between presses, the
        recorded kept sets imposed at each press's length), kept from step to step while the presses and the tokens
        before the last one stay the same: a step feeds only what follows the last press, then rolls it back."""
        key = (len(segments), tuple(ids[:segments[-1][0]]) if segments else ())
        base = self._base
        if base is not None and self._base_key == key and base.capacity >= n:
            return base
        cache = self.cache
        base = EvictCache(self.model.config, press=cache.press, compression_ratio=0.0,
                          positions=cache.position_mode, storage="mask", dtype=cache.dtype, device=cache.device,
                          max_seq_len=max(2 * n, cache.capacity or 0))  # room for the steps to come
        start = 0
        for length, kept in segments:
            self.model(torch.tensor([ids[start:length]]), base, start, last_only=True)  # its logits go unread
            impose(base, kept, self.model.rotary)
            start = length
        self._base, self._base_key = base, key
        return base

    def explain(self, first: Departure, got: Pass, ref: Pass, tol: float) -> str | None:
        return rotation_hint(self, first, got, ref, tol) or reads_hint(first, got)


def impose(cache: EvictCache, kept: dict[int, list[list[int]]], rotary) -> None:
    """Keep exactly ``kept`` (layer -> positions per KV head) in ``cache`` (a masked one) now, and turn the kept keys
    to the rotations its position mode gives, with the model's own RoPE tables (not the cache's turn): a replay of
    another cache's press."""
    step = Step(cache.length, 0, cache.length, cache.device)
    rerotate, cache.pressplan.rerotate = cache.pressplan.rerotate, False  # the layer keeps; the turn is done here
    try:
        for i, heads in kept.items():
            layer = cache.layers[i]
            k, _, valid, pos, rot = layer.held_slots()
            mask = torch.zeros_like(valid)
            for h, positions in enumerate(heads):
                mask[:, h] = torch.isin(pos[:, h], host.upload(positions, pos.device, pos.dtype))
            mask &= valid
            if rerotate:
                rank = mask.long().cumsum(-1) - 1
                new = torch.where(mask, cache.length - mask.long().sum(-1, keepdim=True) + rank, rot)
                k.copy_(_turned(rotary, k, new - rot, layer.layer_type))
                rot.copy_(new)
            layer.keep(step, mask, rot)
    finally:
        cache.pressplan.rerotate = rerotate
    cache.pressplan.horizon = cache.length


def _turned(rotary, k: torch.Tensor, delta: torch.Tensor, layer_type: str) -> torch.Tensor:
    """``k`` turned by ``delta`` positions each, from the cos and sin tables the model rotates with (made pure
    rotations: a yarn attention factor is already in the keys)."""
    top = int(delta.abs().max()) if delta.numel() else 0
    cos, sin = rotary.cos_sin(-top, 2 * top + 1, torch.float32, layer_type)
    norm = (cos ** 2 + sin ** 2).sqrt()
    cos, sin = (cos / norm)[delta + top], (sin / norm)[delta + top]  # (B, H, S, rot)
    return rotate(k.float(), cos, sin).to(k.dtype)


def rotation_hint(passes: KeptPasses, first: Departure, got: Pass, ref: Pass, tol: float) -> str | None:
    """When a pressed layer's keys depart: are they the reference's keys turned by RoPE, and do the rotations the
    cache declares disagree with its position mode?"""
    from .hints import rope_offset

    L, p = first.layer, first.position
    g, r = got.layers[L], ref.layers[L]
    if first.what != "keys" or g.head_positions is None or p is None:
        return None
    for h, columns in enumerate(g.head_positions):
        if p not in columns:
            continue
        kept = passes.cache.eviction.kept_positions(L)[h]
        said = dict(zip(kept, passes.declared[L][h])).get(p) if L in passes.declared else None
        span = range(-passes.cache.length, passes.cache.length + 1)  # a turn from any origin the sequence held
        d = rope_offset(passes, L, g.keys[h:h + 1, columns.index(p)], r.keys[h:h + 1, p], p, tol,
                        (*span, *(() if said is None else (said - p,))))
        if d is None:
            return None
        mode = passes.cache.position_mode
        return (f"positions and rotations disagree: layer {L} head {h} reads position {p}'s key turned {d:+d} "
                f"positions from the recomputation's (positions={mode!r}"
                f"{'' if said is None else f'; the cache says it is rotated at {said}'}): a kept key was re-rotated "
                + ('when it should keep its position' if mode == 'keep' else
                   'by the wrong amount, twice, or not at all'))
    return None


def reads_hint(first: Departure, got: Pass) -> str | None:
    """When a pressed layer's output departs though its keys and values matched the reference head by head (they are
    compared first): its attention read other columns than each KV head holds."""
    L = first.layer
    if first.what != "output" or L is None or got.layers[L].head_positions is None:
        return None
    return (f"layer {L}'s keys and values match a recomputation with the same kept set head by head, yet its output "
            f"departs: its attention read other slots than each KV head holds (a mask or a head mapping taken from "
            f"another head, or a head's empty slots read)")
