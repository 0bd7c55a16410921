"""The cache map's rows in pixels: the token rows on top and the layers under them, apart by a gap that holds at
every height the explorer draws the map at (beside the tab's view, two maps one above the other, presenting), and
the layers labelled every few rows so that labels stay a line apart."""

from __future__ import annotations

TOKEN_ROW_PX, ROW_GAP_PX = 10, 12  # pixels at least: a token row, and the gap between the token rows and the layers
LABEL_PX = 15  # pixels at least between two layer labels


def at_height(layout: dict, height: int) -> None:
    """Make the cache map ``height`` pixels tall: the token rows on top and the layers under them, apart by at least
    :data:`ROW_GAP_PX` (at the side-by-side height a gap of a share of the plot let the first layer's label run into
    the token row's)."""
    layout["height"] = height
    m = layout.get("margin", {})
    plot = max(40, height - m.get("t", 0) - m.get("b", 0))
    rows = len(layout["yaxis2"]["tickvals"])
    font = float(layout.get("font", {}).get("size", 12))  # presenting: 18 px labels need taller rows
    row_px, label_px = max(TOKEN_ROW_PX, 1.25 * font * (rows > 1)), max(LABEL_PX, 1.25 * font)
    tokens = max(0.12 + 0.04 * (rows - 1), row_px * rows / plot)
    gap = max(0.04, ROW_GAP_PX / plot)
    layout["yaxis2"]["domain"] = [round(1 - tokens, 4), 1]
    top = max(0.2, 1 - tokens - gap)
    layout["yaxis"]["domain"] = [0, round(top, 4)]
    layers = layout.get("meta", {}).get("layers")
    if layers:  # a layer label every dtick rows, the labels at least a line apart
        room = plot * top / layers
        layout["yaxis"]["dtick"] = next((d for d in (1, 2, 5, 10, 20, 50) if room * d >= label_px), 100)
