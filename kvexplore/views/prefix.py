"""A prefix cache as the views draw it: the frames of a source (a :class:`~kvexplore.prefix.pool.PrefixPool`, or
anything with ``frames()``, or a list of :class:`~kvexplore.prefix.frames.PoolFrame`) and, for one frame, the three
figures (:mod:`.prefix_pool`, :mod:`.prefix_tree`, :mod:`.prefix_timeline`) and its story (:mod:`.prefix_words`).
The notebook widget (:class:`kvexplore.explorer.prefix_widget.PrefixView`) and the HTML replay
(:func:`kvexplore.views.prefix_page.save_prefix_html`) both draw from here.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any

from ..core.registry import Registry
from ..errors import SettingsError
from ..prefix.frames import PoolFrame
from . import prefix_pool, prefix_timeline, prefix_tree
from .prefix_words import explain_html
from .registry import css_name
from .spec import FigureSpec

#: name -> build(frames, i) -> FigureSpec: the figures of a prefix cache's frame, drawn by the widget and the replay
#: page in this order (the three built in, then any registered, in a row of their own)
PREFIX_FIGURES: Registry = Registry("prefix figure", "unregister_prefix_figure")


def register_prefix_figure(name: str, build: Callable[[Sequence[PoolFrame], int], FigureSpec],
                           replace: bool = False) -> Callable:
    """Draw ``build(frames, i)`` (a :class:`~.spec.FigureSpec` of frame ``i``) as the prefix figure ``name`` in the
    :class:`~kvexplore.PrefixView` widgets and replay pages made after this; returns ``build``."""
    css_name(name, "prefix figure")
    if not callable(build):
        raise SettingsError(f"prefix figure {name!r}: build must be a function of (frames, i) to a FigureSpec")
    return PREFIX_FIGURES.add(name, build, replace)


def unregister_prefix_figure(name: str) -> Callable:
    """Remove a figure :func:`register_prefix_figure` added; returns its function."""
    return PREFIX_FIGURES.remove(name)


register_prefix_figure("prefix_pool", lambda frames, i: prefix_pool.spec(frames[i]))
register_prefix_figure("prefix_tree", lambda frames, i: prefix_tree.spec(frames[i]))
register_prefix_figure("prefix_timeline", prefix_timeline.spec)
PREFIX_FIGURES.seal()
BUILT_IN = tuple(PREFIX_FIGURES)  # the three the widget and the page lay out where they are, in this order


def frames_of(source: Any) -> list[PoolFrame]:
    """The frames of ``source``: a pool's ``frames()``, or a non-empty list of PoolFrames, checked."""
    if hasattr(source, "frames") and callable(source.frames):
        got = list(source.frames())
    elif isinstance(source, Sequence) and not isinstance(source, (str, bytes)):
        got = list(source)
    else:
        raise SettingsError(f"cannot draw a prefix cache from {type(source).__name__}: pass a PrefixPool (anything "
                            "with .frames()) or a list of kvexplore.prefix.frames.PoolFrame")
    bad = [i for i, f in enumerate(got) if not isinstance(f, PoolFrame)]
    if bad:
        raise SettingsError(f"item {bad[0]} is a {type(got[bad[0]]).__name__}, not a PoolFrame: pass the frames a "
                            "PrefixPool or an event stream gives (pool.frames())")
    if not got:
        raise SettingsError("no frames to draw: a PrefixPool has at least its empty frame; pass pool.frames() or a "
                            "non-empty list of PoolFrames")
    return got


def side_by_side(sources: Any) -> dict[str, Any]:
    """Pools to draw side by side (the widget's :class:`~kvexplore.explorer.prefix_compare.PrefixCompare` and the
    replay page's): ``{name: pool}`` as given, or a list named by each pool's policy (numbered when two share one),
    checked: two or more, all having served the same number of requests."""
    if isinstance(sources, Mapping):
        named = {str(name): s for name, s in sources.items()}
    elif isinstance(sources, Sequence) and not isinstance(sources, (str, bytes)):
        named = {getattr(s, "policy", f"pool {i}"): s for i, s in enumerate(sources)}
        if len(named) < len(sources):  # two pools of one policy: number them
            named = {f"{getattr(s, 'policy', 'pool')} {i}": s for i, s in enumerate(sources)}
    else:
        raise SettingsError(f"a side-by-side view takes a list or a dict of pools, got {type(sources).__name__}")
    if len(named) < 2:
        raise SettingsError(f"a side-by-side view shows two or more pools side by side, got {len(named)}; one pool: "
                            f"kvexplore.PrefixView(pool), or save_prefix_html(pool, path)")
    counts = {name: len(frames_of(s)) for name, s in named.items()}
    if len(set(counts.values())) > 1:
        raise SettingsError(f"a side-by-side view needs two or more pools that served the same requests, got {counts}: "
                            f"they served different numbers of requests (the counts are frames: each has its empty "
                            f"frame 0); serve every request to every pool (kvexplore.PrefixPool.serve_each(pools, "
                            f"request, ...))")
    return named


def figures(frames: Sequence[PoolFrame], i: int) -> dict[str, FigureSpec]:
    """The figures of frame ``i`` (a position in ``frames``), by name: every one of :data:`PREFIX_FIGURES`."""
    if not 0 <= i < len(frames):
        raise SettingsError(f"frame {i} does not exist: there are frames 0..{len(frames) - 1}")
    return {name: build(frames, i) for name, build in PREFIX_FIGURES.items()}


def extra_figures() -> list[str]:
    """The prefix figures registered beyond the built-in three (drawn in a row of their own)."""
    return [name for name in PREFIX_FIGURES if name not in BUILT_IN]


def story(frames: Sequence[PoolFrame], i: int) -> str:
    """Frame ``i``'s explanation as HTML (the panel beside the figures)."""
    return explain_html(frames[i])


def frame_label(frames: Sequence[PoolFrame], i: int) -> str:
    """The slider's label at frame ``i``: its place among the frames and its title (which request or batch)."""
    return f"frame {i}/{len(frames) - 1}" + (f" · {frames[i].title}" if frames[i].title else "")
