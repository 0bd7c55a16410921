"""What an explorer runs, from what it was given: loading a model by name, folder or file, and choosing the model
kvexplore's lanes run beside transformers' (a twin on the same weights, where kvexplore implements the
architecture). The explorer widget takes a loaded model; these functions are how ``Explorer("tiny")``, an
``Explorer(transformers_model, tokenizer)`` and the model picker's Load button get one.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ..errors import SettingsError
from ..formats.loading import load
from ..formats.store import MODELS
from ..hf import HFModel, is_hf_model, load_hf, wrap
from ..models.model import Model
from ..runtime.generator import Generator
from .lanes import find

TRANSFORMERS_DEFAULT = ("hf:dynamic", "hf:static")  # the lanes of a transformers model given without strategies


@dataclass
class Source:
    """An explorer's models: ``model`` (what kvexplore's lanes run: a kvexplore model, or the transformers model
    when only its own caches run), ``hf`` (the transformers model its ``hf:`` lanes run, if any), ``generator``
    (a generator given as the source: it becomes the first lane) and the ``strategies`` to run."""

    model: Any
    hf: HFModel | None
    generator: Generator | None
    strategies: tuple[str, ...]


def transformers_source(source: Any, tokenizer: Any = None) -> HFModel | None:
    """The transformers model ``source`` is (wrapped with ``tokenizer``), or None for a kvexplore source."""
    if isinstance(source, HFModel) or is_hf_model(source):
        return wrap(source, tokenizer)
    if tokenizer is not None:
        raise SettingsError("tokenizer= goes with a transformers model; a kvexplore model brings its own")
    return None


def _runs_transformers(strategies: Sequence[str]) -> tuple[bool, bool]:
    """Whether ``strategies`` have lanes on the transformers model, and lanes on kvexplore's (a name no lane kind
    claims counts as kvexplore's: the session refuses it, naming the ones there are)."""
    on_hf = [lk is not None and lk.transformers for lk in map(find, strategies)]
    return any(on_hf), not all(on_hf)


def model_for_lanes(source: Any, hf: HFModel | None, strategies: Sequence[str], device: str | None = None,
                    dtype: str | None = None) -> Any:
    """The model kvexplore's lanes run: beside a transformers model, its kvexplore twin on the same weights when
    kvexplore implements the architecture and such lanes are asked for (else the transformers model itself); a
    generator's model; a model as it is; anything else loaded (:func:`kvexplore.load`: a name, folder or file)."""
    if hf is not None:
        _, wants_kvexplore = _runs_transformers(strategies)
        return hf.twin() if wants_kvexplore and hf.supported else hf
    if isinstance(source, Generator):
        return source.model
    if isinstance(source, Model):
        return source
    return load(source, dtype=dtype, device=device)


def open_source(source: Any, tokenizer: Any = None, strategies: Sequence[str] | None = None,
                device: str | None = None, dtype: str | None = None) -> Source:
    """Everything an explorer needs of ``source`` (see :class:`~kvexplore.Explorer`): the models and the
    strategies (default: transformers' own caches for a transformers model, a generator's own strategy, else
    ``preallocated``)."""
    hf = transformers_source(source, tokenizer)
    generator = source if isinstance(source, Generator) else None
    if strategies is None:
        strategies = TRANSFORMERS_DEFAULT if hf is not None else \
            (generator.cache.kind,) if generator is not None else ("preallocated",)
    strategies = tuple(strategies)
    return Source(model_for_lanes(source, hf, strategies, device, dtype), hf, generator, strategies)


def reopen(source: str | Path | Model | Any, strategies: Sequence[str], device: str | None = None,
           dtype: str | None = None) -> tuple[Any, HFModel | None]:
    """The models for running ``strategies`` on a newly picked ``source`` (the Load button): ``(model, hf)``. With
    transformers lanes, the transformers model is the source itself, or the same named model or folder loaded by
    transformers."""
    hf = transformers_source(source, None)
    wants_transformers, _ = _runs_transformers(strategies)
    if hf is None and wants_transformers:
        if not isinstance(source, (str, Path)):
            raise SettingsError("the transformers lanes (hf:...) need a transformers model, a folder or a named "
                                f"model; got a {type(source).__name__}")
        hf = load_hf(source, dtype=dtype, device=device)
    return model_for_lanes(source, hf, strategies, device, dtype), hf


def picker_entry(source: Any, model: Any) -> tuple[str, str]:
    """What the model picker shows for the running model, ``(label, value)``: a named model by its name (given by
    name, or loaded from that model's folder), another folder or file by its name with its path as the value that
    Load opens again, and a model that came as an object without a path as ``"<architecture> (this model)"`` with the
    value ``""`` (Load refuses it)."""
    if isinstance(source, str) and source in MODELS:
        return source, source
    path = getattr(model, "source", None) or (str(source) if isinstance(source, (str, Path)) else None)
    if path:
        name = Path(path).name
        return (name, name) if name in MODELS else (f"{name} (this model)", str(path))
    return f"{model.config.architecture} (this model)", ""
