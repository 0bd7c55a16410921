"""The models the zoo runs on: the packaged tiny model, the same weights with sliding-window layers (for the rings'
bugs), or any model a caller passes. And :func:`with_module`, a copy of a model that shares its weights but has one
submodule replaced (a planted rotary embedding), leaving the caller's model as it was."""

from __future__ import annotations

import copy
import dataclasses
from typing import Any

from ..errors import SettingsError

#: the tiny model's layers, made sliding (every other one, from layer 0) with this window, for the rings' bugs
WINDOW = 12

_LOADED: dict[str, Any] = {}


def zoo_model(name: str = "tiny") -> Any:
    """``"tiny"``: the packaged model; ``"tiny-windowed"``: its weights with layers 0, 2 and 4 sliding over
    :data:`WINDOW` positions (Mistral's and Gemma's layer kind); any other name is loaded with
    :func:`kvexplore.load`. Loaded once per process."""
    if name not in _LOADED:
        from ..formats.loading import load

        _LOADED[name] = windowed(zoo_model("tiny"), WINDOW) if name == "tiny-windowed" else load(name)
    return _LOADED[name]


def windowed(model: Any, window: int) -> Any:
    """A model with ``model``'s weights (shared, not copied) whose even layers attend over the last ``window``
    positions only."""
    from ..models.model import Model

    config = model.config
    if config.num_layers < 2:
        raise SettingsError("a windowed twin needs a model of two layers or more")
    types = ["sliding_attention" if i % 2 == 0 else "full_attention" for i in range(config.num_layers)]
    twin = Model(dataclasses.replace(config, sliding_window=window, layer_types=types))
    twin.load_state_dict(model.state_dict(), assign=True)
    twin.eval()
    twin.tokenizer = model.tokenizer
    twin.source = f"{getattr(model, 'source', 'model')} (layers 0, 2, 4, ... sliding over {window} positions)"
    return twin


def with_module(model: Any, name: str, module: Any) -> Any:
    """A shallow copy of ``model`` (the same weights) whose submodule ``name`` is ``module``; ``model`` is untouched."""
    twin = copy.copy(model)
    twin._modules = dict(model._modules)  # noqa: SLF001 - the copy's own module table, so the original keeps its own
    setattr(twin, name, module)
    return twin
