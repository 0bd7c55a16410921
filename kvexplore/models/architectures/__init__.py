"""The architectures kvexplore runs, one family module each; importing this package registers them all.

Each family module declares its :class:`~kvexplore.config.families.Architecture` entries (``ARCHITECTURES``):
config fields and checks, layer-plan inputs, the blocks the decoder builds, GGUF names where llama.cpp has them,
the transformers classes it is checked against. This file is the list of families; the registry itself is
:mod:`kvexplore.config.families` (below ``models/``, so that reading a ``config.json`` can use it). Loading
(:mod:`kvexplore.formats.loading`), the GGUF reader, the weight check and the test zoo read the registry.

Adding an architecture from outside the package (docs/extending.md)::

    from kvexplore.models.architectures import Architecture, register
    register(Architecture("toy", "ToyForCausalLM", "toy", "toy", mlp=MyMLP, ...))
"""

from __future__ import annotations

from ...config.families import (ARCHITECTURES, Architecture, GGUFNames, by_model_type, by_name, lookup, register,
                                registered, unregister)
from . import deepseek, gemma, gpt_oss, llama, qwen3_next

#: the family modules, in the order their architectures are registered (and listed in error messages)
FAMILIES = (llama, gemma, gpt_oss, deepseek, qwen3_next)

for _family in FAMILIES:
    for _arch in _family.ARCHITECTURES:
        register(_arch)
ARCHITECTURES.seal()

__all__ = ["Architecture", "FAMILIES", "GGUFNames", "by_model_type", "by_name", "lookup", "register", "registered",
           "unregister"]
