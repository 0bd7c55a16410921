"""The explorer: notebook widgets over a session of cache strategies in lockstep (see :class:`Explorer`)."""

from .session import Lane, Session
from .widget import VIEWS, Explorer

__all__ = ["Explorer", "Lane", "Session", "VIEWS"]
