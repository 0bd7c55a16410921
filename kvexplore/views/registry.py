"""The views by name: each a title and a function of a :class:`~.snapshot.Snapshot` to a :class:`~.spec.FigureSpec`.

The one list the explorer widget, the HTML replay and a notebook's static copy all draw from: a view :func:`register`-ed
here appears in the widget (a figure, and a tab when ``tab``: the views beside the always-shown cache map, one at a
time), in every replay frame (``replay``: :data:`PER_LANE`, :data:`PER_RUN`, or None for the widget only) and so in
the static copy, with no other change (docs/extending.md).
"""

from __future__ import annotations

import re
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

from ..core.registry import Registry
from ..errors import SettingsError
from . import attention, cache_map, compare, eviction, memory, press, ranks, speculation, tensors
from ..trace.records import StepRecord
from .snapshot import Snapshot
from .spec import FigureSpec

PER_LANE = "lane"  # the replay draws the view once per lane (the snapshot's ``shown`` is that lane)
PER_RUN = "run"  # the replay draws the view once for the whole run
REPLAY_SCOPES = (PER_LANE, PER_RUN, None)


@dataclass(frozen=True)
class View:
    name: str
    title: str
    build: Callable[[Snapshot], FigureSpec]
    tab: bool = True  # one of the views picked for the panel beside the cache map
    replay: str | None = None  # how a replay draws it: PER_LANE, PER_RUN or None (not replayed)
    # which lanes a replay draws it for: a function of one lane's records (None: every lane). A view drawn per lane
    # is drawn for the lanes it applies to, a view of the whole run when it applies to one lane at least
    applies: Callable[[Sequence[StepRecord]], bool] | None = None
    # for a live lane (the explorer's), whether the view applies before its records can say so (a drafting lane
    # before its first verification): a function of the lane (None: its records decide)
    live: Callable[[object], bool] | None = None

    def drawn_for(self, records: Sequence[StepRecord]) -> bool:
        return self.applies is None or bool(self.applies(records))


VIEWS: Registry = Registry("view", "unregister")
for _view in (
    View("cache_map", "Cache map", cache_map.from_snapshot, tab=False, replay=PER_LANE),
    View("attention", "Attention", attention.from_snapshot, replay=PER_LANE),
    View("memory", "Memory", memory.from_snapshot, replay=PER_RUN),
    View("tensors", "Stored K/V", tensors.from_snapshot),
    View("compare", "Compare strategies", compare.from_snapshot),
    View("press", "Press scores", press.scores_from_snapshot, replay=PER_LANE, applies=press.presses),
    View("kept", "Held per head", press.kept_from_snapshot, replay=PER_LANE, applies=press.presses),
    View("eviction", "Eviction", eviction.from_snapshot, replay=PER_RUN, applies=press.presses),
    View("speculation", "Speculation", speculation.from_snapshot, replay=PER_LANE, applies=speculation.drafts,
         live=lambda lane: lane.speculation is not None),
    View("ranks", "Ranks", ranks.from_snapshot, replay=PER_LANE, applies=ranks.distributed),
    View("cache_map_b", "Second strategy's cache map", cache_map.second_from_snapshot, tab=False),
):
    VIEWS.add(_view.name, _view)
VIEWS.seal()
BUILT_IN = VIEWS.built_in  # what register() may not replace


class _Tabs(Sequence):
    """The tab views' names in registry order, read from :data:`VIEWS` each time (one added later is a tab at once)."""

    def _names(self) -> tuple[str, ...]:
        return tuple(name for name, v in VIEWS.items() if v.tab)

    def __getitem__(self, i):
        return self._names()[i]

    def __len__(self) -> int:
        return len(self._names())

    def __eq__(self, other) -> bool:
        return tuple(self) == tuple(other) if isinstance(other, Sequence) else NotImplemented

    def __repr__(self) -> str:
        return repr(self._names())


TABS: Sequence[str] = _Tabs()


def css_name(name: str, what: str) -> str:
    """``name`` if it can name a figure's CSS class ``kvx-fig-<name>`` (lower-case letters, digits, underscores)."""
    if not isinstance(name, str) or not re.fullmatch(r"[a-z][a-z0-9_]*", name):
        raise SettingsError(f"{what} name {name!r}: use lower-case letters, digits and underscores (it names the "
                            f"figure's CSS class kvx-fig-<name>)")
    return name


def register(view: View, replace: bool = False) -> View:
    """Add ``view`` to the registry (checked first; a bad one changes nothing). ``replace``: allow a view of that
    name registered before (never a built-in one). Returns the view."""
    if not isinstance(view, View):
        raise SettingsError(f"register a kvexplore.views.registry.View, got {type(view).__name__}")
    css_name(view.name, "view")
    if not callable(view.build):
        raise SettingsError(f"view {view.name!r}: build must be a function of a Snapshot to a FigureSpec")
    if view.applies is not None and not callable(view.applies):
        raise SettingsError(f"view {view.name!r}: applies must be a function of a lane's records to a bool")
    if view.live is not None and not callable(view.live):
        raise SettingsError(f"view {view.name!r}: live must be a function of a live lane to a bool")
    if view.replay not in REPLAY_SCOPES:
        raise SettingsError(f"view {view.name!r}: replay={view.replay!r}; use PER_LANE, PER_RUN or None")
    return VIEWS.add(view.name, view, replace)


def unregister(name: str) -> View:
    """Remove a view :func:`register` added (an explorer made after this no longer draws it)."""
    return VIEWS.remove(name)


def replayed(runs: Mapping[str, Sequence[StepRecord]] | None = None) -> tuple[list[View], list[View]]:
    """The views a replay draws: those drawn per lane, then those drawn once for the whole run (registry order);
    with ``runs``, those that apply to one of its lanes at least (:attr:`View.applies`)."""
    lanes = list(runs.values()) if runs is not None else None
    return tuple([v for v in VIEWS.values() if v.replay == scope and (lanes is None or any(map(v.drawn_for, lanes)))]
                 for scope in (PER_LANE, PER_RUN))
