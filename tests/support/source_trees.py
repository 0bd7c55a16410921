"""The package's modules as syntax trees, parsed once per process: the house's checks (tests/project/test_layout.py,
tests/screen/test_assets.py) read every module several times, and parsing and walking 300 files costs a second each
time."""

from __future__ import annotations

import ast
import functools


@functools.cache
def parse(source: str) -> ast.Module:
    """``ast.parse(source)``, shared: the tree must not be changed."""
    return ast.parse(source)


@functools.cache
def walk(source: str) -> tuple[ast.AST, ...]:
    """Every node of ``source``'s tree, in ``ast.walk``'s order."""
    return tuple(ast.walk(parse(source)))
