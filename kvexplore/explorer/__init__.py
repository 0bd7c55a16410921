"""The explorer: notebook widgets over a session of cache strategies in lockstep (see :class:`Explorer`).

The session (:class:`Session`, :class:`Lane`) and the view registry need only the engine; the widgets
(:class:`Explorer`, :class:`PrefixView`, :class:`PrefixCompare`) are imported on first use, since they need the
notebook extra's libraries (anywidget, ipywidgets, plotly): without them, using one raises
:class:`~kvexplore.errors.MissingExtraError`, which names the missing module and ``pip install "kvexplore[notebook]"``.
"""

from importlib import import_module
from importlib.util import find_spec

from ..errors import missing_extra
from ..views.registry import TABS, VIEWS
from .session import Lane, Session

#: the widgets, each from its module: imported when first asked for
WIDGETS = {"Explorer": ".widget", "PrefixCompare": ".prefix_compare", "PrefixView": ".prefix_widget"}


def widgets_available() -> bool:
    """Whether the widgets' libraries are installed (looked up, not imported)."""
    try:
        return all(find_spec(module) is not None for module in ("anywidget", "ipywidgets", "plotly", "traitlets"))
    except ValueError:  # a module already imported without a spec: there, at least
        return True


# ``from kvexplore.explorer import *``, ``dir()`` (and so ``help()`` and tab completion) show the widgets only where
# they can be imported; where they cannot, using one still says what to install
__all__ = ["Lane", "Session", "TABS", "VIEWS"] + (sorted(WIDGETS) if widgets_available() else [])


def __getattr__(name: str):
    if name not in WIDGETS:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    try:
        module = import_module(WIDGETS[name], __name__)
    except ImportError as e:
        error = missing_extra(f"kvexplore.{name}", e)
        if error is None:
            raise
        raise error from e
    value = getattr(module, name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | (set(WIDGETS) if widgets_available() else set()))
