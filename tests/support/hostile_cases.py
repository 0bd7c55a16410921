"""The hostile-input sweep's cases, in one namespace: damaged model folders and GGUF files
(``hostile_files.py``: :func:`build_corpus`, :func:`load_and_generate`, ``ERROR`` and ``ANY``) and misuses of the
Python API (``hostile_misuses.py``: :data:`MISUSES`, :func:`misuse`, :func:`state`, :func:`same_state`).

:func:`build_corpus` writes the damaged files (in the test process); :func:`load_and_generate` and :func:`misuse`
run inside a sandboxed child (see ``sandbox.py``). Each corruption says what it may give: ``"error"`` (a
kvexplore error must be raised) or ``"any"`` (harmless damage, such as a bit flip inside a weight: a clean load
or a kvexplore error). A misuse must raise a kvexplore error and leave the generator exactly as it was.
"""

from __future__ import annotations

from hostile_files import ANY, ERROR, build_corpus, load_and_generate
from hostile_misuses import MISUSES, misuse, same_state, state, still_steps

__all__ = ["ANY", "ERROR", "MISUSES", "build_corpus", "load_and_generate", "misuse", "same_state", "state",
           "still_steps"]
