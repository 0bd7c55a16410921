"""The packaged tiny model the course's checks run on, loaded once per process (the checks never change its
weights), so a check and each of its answers and mistakes do not load it again."""

from __future__ import annotations

from functools import cache


@cache
def tiny():
    from ..formats.loading import load

    return load("tiny")
