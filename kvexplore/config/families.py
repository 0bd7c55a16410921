"""The architecture registry: one :class:`Architecture` entry per transformers class kvexplore runs, declared in its
family module of :mod:`kvexplore.models.architectures` and registered here with :func:`register`. It sits in
``config/`` (below ``models/``) so that :class:`~.model_config.ModelConfig` can read ``config.json`` and run an
architecture's checks without importing the models (what each field declares: docs/extending.md)."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

from ..core.registry import Registry
from ..errors import SettingsError
from .fields import Field


@dataclass(frozen=True)
class GGUFNames:
    """How llama.cpp names an architecture's file: ``general.architecture``, whether its q/k rows are in llama.cpp's
    rope order, its tensor names (``blk.N.<key>`` -> ``model.layers.N.<value>``; ``globals`` outside the layers), and
    what its converter changes or leaves out: ``norm_shift`` (added to every ``*norm.weight``: Gemma stores
    ``1 + weight``), ``defaults`` (``config.json`` keys llama.cpp supplies itself) and ``chat_template``."""

    name: str
    rope_rows_permuted: bool
    layer: Mapping[str, str]
    globals: Mapping[str, str]
    norm_shift: float = 0.0
    defaults: Mapping[str, Any] = field(default_factory=dict)
    chat_template: str | None = None


@dataclass(frozen=True, eq=False)
class Architecture:
    """One transformers architecture kvexplore runs (what each group of fields declares: docs/extending.md)."""

    name: str  # short name the tests and docs use: "llama", "gemma3", "deepseek_v3"
    hf_class: str  # config.json's architectures[0]: "LlamaForCausalLM"
    model_type: str  # config.json's model_type: "llama", "gemma3_text"
    family: str  # the family module that declares it: "llama", "gemma", ...
    traits: Mapping[str, Any] = field(default_factory=dict)  # ModelConfig fields it always sets (qk_norm=True, ...)
    fields: tuple[Field, ...] = ()  # config.json keys it reads beyond the common ones
    aliases: Mapping[str, str] = field(default_factory=dict)  # its config.json key -> the common key it stands for
    read: Callable[[dict[str, Any], dict[str, Any], str], dict[str, Any]] | None = None  # (values, fields, where)
    refuse: Callable[[dict[str, Any], str], None] | None = None  # (raw config.json, where): raise on refused options
    layer_types: Callable[[dict[str, Any], int | None], list[str]] | None = None  # (values, window): default types
    hidden_act: str = "silu"  # the MLP's activation when config.json names none
    default_theta: float = 10000.0  # RoPE base when config.json gives none
    local_theta: float | None = None  # RoPE base of the sliding layers when config.json gives none (Gemma)
    check: Callable[[Any, str], None] | None = None  # (ModelConfig, where): raise on an implausible config
    to_hf: Callable[[Any], dict[str, Any]] | None = None  # (ModelConfig): config.json keys it writes
    attention: Callable[..., Any] | None = None  # (config, spec) -> the self_attn module
    recurrent: Callable[..., Any] | None = None  # (config, layer) -> the linear_attn module of a recurrent layer
    mlp: Callable[..., Any] | None = None  # (config, width) -> a dense feed-forward block
    experts: Callable[..., Any] | None = None  # (config) -> the mlp of a layer where config.uses_experts(layer)
    transformers: tuple[str, str] = ("", "")  # (config class, model class) in transformers
    example: Mapping[str, Any] = field(default_factory=dict)  # config keys of the small model the parity tests build
    gguf: GGUFNames | None = None


#: the registry: transformers class name -> its entry, in registration order (use register() to add)
ARCHITECTURES: Registry = Registry("architecture", "unregister")  # sealed by kvexplore.models.architectures


def register(arch: Architecture, replace: bool = False) -> Architecture:
    """Add ``arch`` to the registry under its transformers class name; returns it. A taken class name is refused
    unless ``replace`` (never a built-in one); :func:`unregister` removes one."""
    if not isinstance(arch, Architecture):
        raise SettingsError(f"register() takes an Architecture, got {type(arch).__name__}")
    known = ARCHITECTURES.get(arch.hf_class)
    if known is not None and known is not arch and (not replace or arch.hf_class in ARCHITECTURES.built_in):
        ARCHITECTURES.add(arch.hf_class, arch, replace)  # refused, with the registries' message
    clash = [a.hf_class for a in ARCHITECTURES.values() if a is not known and (a.name == arch.name or
                                                                           a.model_type == arch.model_type)]
    if clash:
        raise SettingsError(f"architecture {arch.hf_class}: its name {arch.name!r} or model_type "
                            f"{arch.model_type!r} is already used by {clash[0]}; choose others")
    return ARCHITECTURES.add(arch.hf_class, arch, replace)


def unregister(hf_class: str) -> Architecture:
    """Remove an architecture :func:`register` added (a built-in one stays); returns it."""
    return ARCHITECTURES.remove(hf_class)


def registered() -> tuple[Architecture, ...]:
    """Every registered architecture, in registration order."""
    return tuple(ARCHITECTURES.values())


def lookup(hf_class: str) -> Architecture | None:
    """The entry of a transformers class name, or None when kvexplore does not run it."""
    return ARCHITECTURES.get(hf_class)


def by_model_type(model_type: str | None) -> Architecture | None:
    """The entry whose ``model_type`` is this (config.json files without ``architectures``)."""
    return next((a for a in ARCHITECTURES.values() if a.model_type == model_type), None)


def by_name(name: str) -> Architecture:
    """The entry of a short name (``"llama"``, ``"gemma3"``)."""
    found = next((a for a in ARCHITECTURES.values() if a.name == name), None)
    if found is None:
        names = ", ".join(a.name for a in ARCHITECTURES.values())
        raise SettingsError(f"no architecture named {name!r}; registered: {names}")
    return found
