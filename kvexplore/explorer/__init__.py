"""The explorer: notebook widgets over a session of cache strategies in lockstep (see :class:`Explorer`)."""

from .session import Lane, Session
from ..views.registry import TABS, VIEWS
from .widget import Explorer
from .prefix_compare import PrefixCompare
from .prefix_widget import PrefixView

__all__ = ["Explorer", "Lane", "PrefixCompare", "PrefixView", "Session", "TABS", "VIEWS"]
