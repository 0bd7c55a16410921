"""Colours and labels shared by the views: one colour per slot state, one per strategy, one per step."""

from __future__ import annotations

# slot classes drawn by the cache map, in code order (the heatmap's z values)
SLOT_CLASSES = ("free", "not read", "read", "shared", "written", "stale", "evicted", "taken back")
SLOT_COLOURS = ("#eeeeee", "#bdbdbd", "#6baed6", "#9e72c3", "#f16913", "#e6c229", "#d62728", "#c51b7d")
SLOT_MEANING = {
    "free": "never written",
    "not read": "holds a position this sequence does not read (another sequence's page)",
    "read": "read by this step's attention",
    "shared": "read, and shared with another sequence (copy on write)",
    "written": "written this step, then read",
    "stale": "left behind by a rewind: still in storage, no longer read",
    "evicted": "its position was dropped by the strategy",
    "taken back": "written by this verification's drafts, then taken back (the target rejected them): not read",
}

# probability scales as explicit colour lists: the page's plotly.js reads a named scale its own way ("Blues" runs
# dark to light there, light to dark in plotly for Python) or not at all ("Oranges")
PROBABILITY_SCALE = [[0.0, "#f7fbff"], [0.25, "#c6dbef"], [0.5, "#6baed6"], [0.75, "#2171b5"], [1.0, "#08306b"]]
SINK_SCALE = [[0.0, "#fff5eb"], [0.5, "#fd8d3c"], [1.0, "#a63603"]]

STRATEGY_COLOURS = ("#1f77b4", "#ff7f0e", "#2ca02c", "#d62728", "#9467bd", "#8c564b", "#e377c2", "#17becf")


def strategy_colour(index: int) -> str:
    return STRATEGY_COLOURS[index % len(STRATEGY_COLOURS)]


def discrete_colorscale(colours: tuple[str, ...]) -> list[list]:
    """A plotly colorscale giving each integer ``0..n-1`` (with ``zmin=-0.5, zmax=n-0.5``) its own flat colour."""
    return [[k / len(colours), c] for i, c in enumerate(colours) for k in (i, i + 1)]


STEP_CYCLE = 32  # steps over which the token colour goes from light to dark, then starts again


def step_colour(step: int) -> str:
    """A generated token's background: light to dark blue-green over :data:`STEP_CYCLE` steps, then round again."""
    t = (step % STEP_CYCLE) / (STEP_CYCLE - 1)
    lo, hi = (224, 243, 219), (67, 162, 202)
    r, g, b = (round(a + (z - a) * t) for a, z in zip(lo, hi))
    return f"rgb({r},{g},{b})"


# the states of a prefix cache's block (kvexplore.prefix.frames.STATES, in that order: the pool heatmap's z values)
BLOCK_COLOURS = {"free": "#eeeeee", "cached": "#6baed6", "hit": "#2ca02c", "written": "#f16913",
                 "evicted": "#d62728", "held": "#9e72c3"}
# a request's tokens: found in the cache, computed again, generated (the timeline's stacked bars)
HIT_COLOUR, RECOMPUTED_COLOUR, GENERATED_COLOUR = "#2ca02c", "#f16913", "#9ecae1"
