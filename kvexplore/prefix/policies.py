"""Prefix policies by name: :data:`POLICIES` maps a name to ``make(block_size) -> PrefixIndex``; ``"hash"`` (vLLM)
and ``"radix"`` (SGLang) are built in, :func:`register_policy` adds one."""

from __future__ import annotations

from collections.abc import Callable

from ..core.registry import Registry
from ..errors import SettingsError
from .hashing import HashIndex
from .index import PrefixIndex
from .radix import RadixIndex

POLICIES: Registry = Registry("prefix policy", "unregister_policy")


def register_policy(name: str, make: Callable[[int], PrefixIndex], replace: bool = False) -> Callable:
    """Make ``make(block_size)`` (a :class:`PrefixIndex` subclass or a function returning one) the policy ``name``;
    returns ``make``. A taken name is refused unless ``replace`` (never a built-in one)."""
    if not callable(make):
        raise SettingsError(f"prefix policy {name!r}: give a PrefixIndex subclass or a function of the block size "
                            f"that returns one, got {make!r}")
    return POLICIES.add(name, make, replace)


def unregister_policy(name: str) -> Callable:
    """Remove a policy :func:`register_policy` added; returns what made it."""
    return POLICIES.remove(name)


def make_index(name: str, block_size: int) -> PrefixIndex:
    """The index of policy ``name`` for blocks of ``block_size`` positions (checked)."""
    if name not in POLICIES:
        raise SettingsError(f"policy must be one of {sorted(POLICIES)} (vLLM's block hashes or SGLang's radix tree, "
                            f"or one added with register_policy), got {name!r}")
    index = POLICIES[name](block_size)
    if not isinstance(index, PrefixIndex):
        raise SettingsError(f"prefix policy {name!r} made a {type(index).__name__}, not a PrefixIndex (see "
                            f"kvexplore/prefix/index.py for what a policy answers)")
    return index


register_policy("hash", HashIndex)
register_policy("radix", RadixIndex)
POLICIES.seal()
