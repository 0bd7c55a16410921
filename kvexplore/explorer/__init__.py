"""The explorer: notebook widgets over a session of cache strategies in lockstep (see :class:`Explorer`)."""

from .session import Lane, Session
from ..views.registry import TABS, VIEWS
from .widget import Explorer

__all__ = ["Explorer", "Lane", "Session", "TABS", "VIEWS"]
