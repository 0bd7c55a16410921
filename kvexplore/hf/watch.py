"""Reading a transformers ``Cache`` layer by layer from the objects themselves, assuming nothing of a cache class: a
layer whose keys moved to a new storage was reallocated, and slots changed in place are found by a fingerprint of
each slot (the sum of its keys) taken after every step."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from ..core import host
from ..caches.memory import StepCounters

# the transformers layer classes whose slot order kvexplore knows (others are drawn as one block of storage)
FULL_DYNAMIC, SLIDING_DYNAMIC, FULL_STATIC, SLIDING_STATIC = "DynamicLayer", "DynamicSlidingWindowLayer", \
    "StaticLayer", "StaticSlidingWindowLayer"


def class_chain(layer: object) -> list[str]:
    return [c.__name__ for c in type(layer).__mro__]


def is_state_layer(layer: object) -> bool:
    """A linear-attention layer (a fixed conv and recurrent state, no positions)."""
    return "LinearAttentionCacheLayerMixin" in class_chain(layer) and not any(
        n in class_chain(layer) for n in (FULL_DYNAMIC, FULL_STATIC))


def layer_tensors(layer: object) -> dict[str, torch.Tensor]:
    """Every tensor ``layer`` holds (bookkeeping scalars left out), by attribute name (``conv_states.0`` for an
    entry of a dict, ``_quantized_keys.0`` for one of a tuple)."""
    out: dict[str, torch.Tensor] = {}
    for name, value in vars(layer).items():
        items = (value.items() if isinstance(value, dict) else enumerate(value) if isinstance(value, tuple)
                 else [(None, value)])
        for key, t in items:
            if isinstance(t, torch.Tensor) and t.dim() >= 2 and t.numel():
                out[name if key is None else f"{name}.{key}"] = t
    return out


def key_tensor(layer: object) -> torch.Tensor | None:
    """The tensor whose slots are positions (b, kv_heads, slots, head_dim): the keys, or their quantized copy."""
    keys = getattr(layer, "keys", None)
    if isinstance(keys, torch.Tensor) and keys.dim() == 4 and keys.numel():
        return keys
    q = getattr(layer, "_quantized_keys", None)
    if isinstance(q, tuple) and isinstance(q[0], torch.Tensor) and q[0].dim() == 4:
        return q[0]
    return None


def kv_tensors(layer: object) -> tuple[torch.Tensor, torch.Tensor] | None:
    """(keys, values) as the layer stores them in its own precision (None for a state layer or an empty one)."""
    keys, values = getattr(layer, "keys", None), getattr(layer, "values", None)
    if isinstance(keys, torch.Tensor) and isinstance(values, torch.Tensor) and keys.dim() == 4 and keys.numel():
        return keys, values
    return None


def slot_positions(layer: object, length: int) -> list[int]:
    """The position each slot of ``layer``'s keys holds after ``length`` positions were written (-1: none)."""
    keys = key_tensor(layer)
    if keys is None:
        return []
    slots, chain = keys.shape[-2], class_chain(layer)
    if SLIDING_STATIC in chain or SLIDING_DYNAMIC in chain:  # the last positions, oldest first (rolled left)
        held = min(length, slots) if SLIDING_STATIC in chain else slots
        first = length - held
        return [first + i if i < held else -1 for i in range(slots)]
    return [i if i < length else -1 for i in range(slots)]


def position_bytes(layer: object) -> int:
    """Bytes one position takes in ``layer``'s keys and values as stored."""
    keys = key_tensor(layer)
    if keys is None:
        return 0
    values = getattr(layer, "values", None)
    qv = getattr(layer, "_quantized_values", None)
    if keys is not getattr(layer, "keys", None) and isinstance(qv, tuple):
        values = qv[0]
    per = keys.shape[0] * keys.shape[1] * keys.shape[-1] * keys.element_size()
    if isinstance(values, torch.Tensor) and values.dim() == 4:
        per += values.shape[0] * values.shape[1] * values.shape[-1] * values.element_size()
    return per


@dataclass
class LayerState:
    """One layer after a step: its tensors' shapes, dtypes, ``data_ptr`` and storage bytes, and its slots."""

    layer_class: str
    shapes: dict[str, tuple[int, ...]]
    dtypes: dict[str, str]
    data_ptrs: dict[str, int]
    storage_bytes: dict[int, int]  # storage data_ptr -> bytes (each storage once)
    nbytes: dict[str, int]  # each tensor's own bytes
    positions: list[int]
    position_bytes: int
    state: bool  # a linear-attention layer
    fingerprint: torch.Tensor | None = None  # (slots,) sum of each slot's keys (host, float64)

    @property
    def reserved_bytes(self) -> int:
        return sum(self.storage_bytes.values())

    @property
    def held(self) -> int:
        return sum(1 for p in self.positions if p >= 0)


def observe(cache: object, length: int) -> list[LayerState]:
    """Every layer of ``cache`` now (the slots' fingerprints come over in one transfer)."""
    states, prints = [], []
    for layer in getattr(cache, "layers", []):
        tensors = layer_tensors(layer)
        keys = key_tensor(layer)
        storages = {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in tensors.values()}
        states.append(LayerState(type(layer).__name__, {n: tuple(t.shape) for n, t in tensors.items()},
                                 {n: str(t.dtype).removeprefix("torch.") for n, t in tensors.items()},
                                 {n: t.data_ptr() for n, t in tensors.items()}, storages,
                                 {n: t.nbytes for n, t in tensors.items()},
                                 slot_positions(layer, length), position_bytes(layer), is_state_layer(layer)))
        prints.append(keys.detach()[0].double().sum(dim=(0, 2)) if keys is not None else torch.zeros(0))
    for state, fp in zip(states, host.fetch(prints)):
        state.fingerprint = fp
    return states


@dataclass
class Moves(StepCounters):
    """What one step did to one layer, found by comparing the layer before and after it."""

    moved: bool = False  # the keys are in a new storage
    rewritten: list[int] = field(default_factory=list)  # slots whose contents changed in place


def moves(before: LayerState | None, after: LayerState, new_positions: range) -> Moves:
    """Bytes written (new positions the layer holds), copied (positions carried into a new storage, or moved
    between slots in place), allocated and freed (storages that appeared or went) by one step."""
    m = Moves()
    old = before.storage_bytes if before is not None else {}
    born = [nbytes for ptr, nbytes in after.storage_bytes.items() if ptr not in old]
    gone = [nbytes for ptr, nbytes in old.items() if ptr not in after.storage_bytes]
    m.allocated_bytes, m.allocations, m.freed_bytes, m.frees = sum(born), len(born), sum(gone), len(gone)
    if after.state:  # rewritten in place every step: the whole state is what the step wrote
        m.written_bytes = after.reserved_bytes if new_positions else 0
        return m
    new = sum(1 for p in after.positions if p in new_positions)
    m.written_bytes = new * after.position_bytes
    key_name = next((n for n in after.data_ptrs if n in ("keys", "_quantized_keys.0")), None)
    m.moved = before is None or key_name is None or before.data_ptrs.get(key_name) != after.data_ptrs[key_name]
    if m.moved:
        carried = after.held - new if before is not None and before.held else 0
        m.copied_bytes = max(0, carried) * after.position_bytes
    else:
        a, b = after.fingerprint, before.fingerprint
        n = min(len(a), len(b))
        m.rewritten = changed = [i for i in range(n) if a[i] != b[i]] + list(range(n, len(a)))
        m.copied_bytes = max(0, len(changed) - new) * after.position_bytes
    return m
