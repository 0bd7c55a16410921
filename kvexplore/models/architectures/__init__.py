"""The architectures kvexplore runs, one family module each; importing this package registers them all.

Each family module declares its :class:`~kvexplore.config.families.Architecture` entries (``ARCHITECTURES``); the
registry itself is :mod:`kvexplore.config.families`. Adding one from outside the package: docs/extending.md.
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
