"""What each layer of a model keeps in its cache: :func:`layer_plan` turns a
:class:`~kvexplore.config.model_config.ModelConfig` into one :class:`LayerSpec` per layer (full, a sliding ring of
``window`` slots, shared: reading an earlier layer's cache, or a recurrent state); the cache strategies, the memory
formula and the views read nothing else about the model's layout."""

from __future__ import annotations

from dataclasses import dataclass

from .model_config import ModelConfig

FULL, SLIDING, SHARED, STATE = "full", "sliding", "shared", "state"
#: config.json's layer type names -> the layer kinds here
LAYER_TYPES = {"full_attention": FULL, "sliding_attention": SLIDING, "linear_attention": STATE,
               "indexed_attention": FULL}  # DeepSeek-V3.2: full layers whose attention reads an indexer's top-k


@dataclass(frozen=True)
class LayerSpec:
    """One layer's cache: ``kind`` full, sliding (a ring of ``window`` slots) or shared (stores nothing, reads
    layer ``source``); ``attends`` is the attention the layer computes (full or sliding), which a shared layer
    takes from its source; ``kv_heads`` and ``head_dim`` give its keys' shape, ``value_width`` its values' width.
    An MLA layer (DeepSeek) stores per position one latent of ``kv_lora_rank`` (in the keys' place) and one rope key
    of ``qk_rope_head_dim`` (in the values' place): ``kv_heads`` is 1 and nothing is per head."""

    index: int
    kind: str
    attends: str
    window: int | None
    source: int
    kv_heads: int
    head_dim: int
    value_dim: int = 0  # the second stored tensor's width (0: head_dim, as keys and values are)
    latent: bool = False  # stores MLA's compressed latent (as "keys") and its rope key (as "values")

    @property
    def value_width(self) -> int:
        return self.value_dim or self.head_dim

    @property
    def full(self) -> bool:
        """Whether this is a full-attention layer with its own cache (the layers a strategy serves)."""
        return self.kind == FULL

    @property
    def shares(self) -> bool:
        """Whether this layer stores nothing and reads layer ``source``'s cache (Gemma 4's last layers)."""
        return self.kind == SHARED

    @property
    def recurrent(self) -> bool:
        """Whether this layer keeps a fixed-size recurrent state instead of keys and values (gated DeltaNet)."""
        return self.kind == STATE

    @property
    def ring(self) -> bool:
        """Whether this layer stores its own keys and values in a ring of ``window`` slots (a sliding layer)."""
        return self.kind == SLIDING

    @property
    def windowed(self) -> bool:
        """Whether this layer's attention reads only the last ``window`` positions (its own ring or its source's)."""
        return self.attends == SLIDING

    @property
    def stores(self) -> bool:
        """Whether this layer holds keys and values of its own (a linear-attention layer holds a state instead)."""
        return self.kind not in (SHARED, STATE)

    def position_bytes(self, itemsize: int) -> int:
        """Bytes of one position's key and value in this layer (0 for a shared or a state layer)."""
        return self.kv_heads * (self.head_dim + self.value_width) * itemsize if self.stores else 0

    def held(self, positions: int) -> int:
        """Positions this layer holds after a sequence of ``positions``: all for full, the last ``window`` for
        sliding, none for shared or state layers."""
        if self.kind in (SHARED, STATE):
            return 0
        return min(positions, self.window) if self.kind == SLIDING else positions


def layer_plan(config: ModelConfig) -> list[LayerSpec]:
    """One :class:`LayerSpec` per layer of ``config``."""
    kinds = [LAYER_TYPES[t] for t in config.layer_types]
    first_shared = config.num_layers - config.num_kv_shared_layers
    plan: list[LayerSpec] = []
    for i, attends in enumerate(kinds):
        heads, dim = config.layer_kv_heads(i), config.layer_head_dim(i)
        window = config.sliding_window if attends == SLIDING else None
        shape = dict(kv_heads=heads, head_dim=dim)
        if config.kv_lora_rank:  # MLA: one latent of kv_lora_rank and one rope key per position, no heads
            # (DeepSeek-V3.2 stores its indexer's key beside the rope key)
            shape = dict(kv_heads=1, head_dim=config.kv_lora_rank, latent=True,
                         value_dim=config.qk_rope_head_dim + (config.index_head_dim if config.index_topk else 0))
        if attends == STATE:  # a fixed-size recurrent state, no positions
            plan.append(LayerSpec(i, STATE, STATE, None, i, 0, 0))
        elif i >= first_shared:  # reads the last layer of the same type that stores its own cache
            source = max(j for j in range(first_shared) if kinds[j] == attends)
            plan.append(LayerSpec(i, SHARED, attends, window, source, **shape))
        else:
            plan.append(LayerSpec(i, attends, attends, window, i, **shape))
    for rule in PLAN_RULES:
        plan = [rule(config, spec) for spec in plan]
    return plan


#: functions ``rule(config, spec) -> spec`` applied, in order, to every layer of every plan: how a new layer kind
#: (one registered in :data:`kvexplore.caches.registry.LAYER_KINDS`) enters a model's plan without editing the
#: package. A rule returns ``spec`` unchanged for the layers and models it does not concern.
PLAN_RULES: list = []


def register_plan_rule(rule) -> None:
    """Apply ``rule(config, spec) -> spec`` to every plan made from now on (see :data:`PLAN_RULES`)."""
    PLAN_RULES.append(rule)


def unregister_plan_rule(rule) -> None:
    if rule in PLAN_RULES:
        PLAN_RULES.remove(rule)


def layers_by_kind(plan: list[LayerSpec]) -> dict[str, list[int]]:
    """The layer indices of each kind present: full, sliding, shared, state (those present), then any other kind
    (registered by :func:`register_plan_rule`) in plan order."""
    known = {k: [s.index for s in plan if s.kind == k] for k in (FULL, SLIDING, SHARED, STATE)}
    out = {k: v for k, v in known.items() if v}
    for s in plan:
        if s.kind not in known:
            out.setdefault(s.kind, []).append(s.index)
    return out
