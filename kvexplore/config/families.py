"""The architecture registry: one :class:`Architecture` entry per transformers class kvexplore runs.

An entry is declared once, in the family module of :mod:`kvexplore.models.architectures` that implements it
(``llama.py``, ``gemma.py``, ``gpt_oss.py``, ``deepseek.py``, ``qwen3_next.py``), and registered here with
:func:`register`. This module sits in ``config/`` (below ``models/``) so that :class:`~.model_config.ModelConfig`
can read ``config.json`` and run an architecture's checks without importing the models; it holds the entries and
knows nothing about any one of them. Everything that differs between architectures is a field of the entry:

- reading ``config.json``: :attr:`~Architecture.fields` (the keys it reads beyond :data:`.config_json.COMMON_FIELDS`,
  each typed and bounded), :attr:`~Architecture.aliases` (its own names for common keys), :attr:`~Architecture.read`
  (its :class:`ModelConfig` fields from those values), :attr:`~Architecture.refuse` (options it refuses),
  :attr:`~Architecture.traits` (switches of the Llama layer it always turns on);
- the layer plan's inputs: :attr:`~Architecture.layer_types` (each layer's type when ``config.json`` lists none),
  :attr:`~Architecture.default_theta` / :attr:`~Architecture.local_theta` (RoPE bases);
- checks of a built config: :attr:`~Architecture.check`; writing ``config.json`` back: :attr:`~Architecture.to_hf`;
- the blocks the decoder builds (:attr:`~Architecture.attention`, :attr:`~Architecture.recurrent`,
  :attr:`~Architecture.mlp`, :attr:`~Architecture.experts`; ``None``: the Llama ones). The weight names and shapes
  are not declared: they are those of the model built on the meta device (:func:`kvexplore.formats.weights.
  expected_shapes`);
- GGUF names (:class:`GGUFNames`), the transformers classes the parity tests check it against, and the small
  ``example`` config those tests build.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

from ..core.registry import Registry
from ..errors import SettingsError
from .fields import Field


@dataclass(frozen=True)
class GGUFNames:
    """How llama.cpp names an architecture's file: ``general.architecture``, whether its q/k projection rows are
    stored in llama.cpp's rope order (un-permuted on reading), and its tensor names (``blk.N.<key>.weight`` ->
    ``model.layers.N.<value>.weight``; ``globals`` for the tensors outside the layers). What llama.cpp's converter
    changes or leaves out: ``norm_shift`` (added to every ``*norm.weight``, subtracted on reading: Gemma's norms
    are stored as ``1 + weight``), ``defaults`` (``config.json`` keys the file does not carry and llama.cpp supplies
    itself, such as Gemma 3's local RoPE base) and ``chat_template`` (when the file has none)."""

    name: str
    rope_rows_permuted: bool
    layer: Mapping[str, str]
    globals: Mapping[str, str]
    norm_shift: float = 0.0
    defaults: Mapping[str, Any] = field(default_factory=dict)
    chat_template: str | None = None


@dataclass(frozen=True, eq=False)
class Architecture:
    """One transformers architecture kvexplore runs (see the module docstring for what each group of fields is)."""

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
