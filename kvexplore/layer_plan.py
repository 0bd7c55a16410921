"""What each layer of a model keeps in its cache: the per-layer plan every cache strategy builds from.

Since 2024 the layers of one model no longer keep the same thing. Gemma 3 and gpt-oss interleave *sliding*
layers (each query reads only the last ``window`` positions, so the layer needs a ring of ``window`` slots, not a
growing cache) with *full* layers (every position, like Llama). Gemma 4's last layers are *shared*: they read the
cache of an earlier layer of the same type and store nothing of their own. Gemma 4's full layers also have their
own head size and number of key/value heads.

:func:`layer_plan` turns a :class:`~kvexplore.config.ModelConfig` into one :class:`LayerSpec` per layer; the
cache strategies, the memory formula and the views read nothing else about the model's layout.
"""

from __future__ import annotations

from dataclasses import dataclass

from .config import ModelConfig

FULL, SLIDING, SHARED = "full", "sliding", "shared"
#: config.json's layer type names -> the layer kinds here
LAYER_TYPES = {"full_attention": FULL, "sliding_attention": SLIDING}


@dataclass(frozen=True)
class LayerSpec:
    """One layer's cache: ``kind`` full, sliding (a ring of ``window`` slots) or shared (stores nothing, reads
    layer ``source``); ``attends`` is the attention the layer computes (full or sliding), which a shared layer
    takes from its source; ``kv_heads`` and ``head_dim`` give its keys' shape."""

    index: int
    kind: str
    attends: str
    window: int | None
    source: int
    kv_heads: int
    head_dim: int

    @property
    def stores(self) -> bool:
        """Whether this layer holds keys and values of its own."""
        return self.kind != SHARED

    def position_bytes(self, itemsize: int) -> int:
        """Bytes of one position's key and value in this layer (0 for a shared layer)."""
        return 2 * self.kv_heads * self.head_dim * itemsize if self.stores else 0

    def held(self, positions: int) -> int:
        """Positions this layer holds after a sequence of ``positions``: all for full, the last ``window`` for
        sliding, none for shared."""
        if self.kind == SHARED:
            return 0
        return min(positions, self.window) if self.kind == SLIDING else positions


def layer_plan(config: ModelConfig) -> list[LayerSpec]:
    """One :class:`LayerSpec` per layer of ``config``."""
    kinds = [LAYER_TYPES[t] for t in config.layer_types]
    first_shared = config.num_layers - config.num_kv_shared_layers
    plan = []
    for i, attends in enumerate(kinds):
        heads, dim = config.layer_kv_heads(i), config.layer_head_dim(i)
        window = config.sliding_window if attends == SLIDING else None
        if i >= first_shared:  # reads the last layer of the same type that stores its own cache
            source = max(j for j in range(first_shared) if kinds[j] == attends)
            plan.append(LayerSpec(i, SHARED, attends, window, source, heads, dim))
        else:
            plan.append(LayerSpec(i, attends, attends, window, i, heads, dim))
    return plan


def kinds_present(plan: list[LayerSpec]) -> list[str]:
    """The layer kinds of a plan, in the order full, sliding, shared (those present)."""
    return [k for k in (FULL, SLIDING, SHARED) if any(s.kind == k for s in plan)]
