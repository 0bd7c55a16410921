"""The ``kvexplore`` command line (:mod:`.commands`) and its ``lab`` and ``app`` launchers (:mod:`.launch`)."""

from .commands import main

__all__ = ["main"]
