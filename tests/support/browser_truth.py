"""What the page shows against what the kernel holds: every plotly figure's ``gd.data`` and layout, and the compare
table's text, read from the browser and compared with the explorer's specs read from its kernel.

The kernel's side comes from ``kvexplore.explorer.inspect``: with ``KVEXPLORE_INSPECT=1`` every explorer keeps its
state, ``{"specs": {view: {"traces": [...], "layout": {...}}}, "compare": rows, "shown": [...], ...}``, as JSON in a
hidden element after every refresh.

:func:`mismatches` compares the two: every property the kernel's spec gives a trace (recursively, numbers within a
float tolerance, NaN equal to NaN or to a missing value) must be in the page's trace, and the layout's titles,
annotations' texts, shapes and axis ranges must be the page's. A mismatch names the figure, the trace and the
property.
"""

from __future__ import annotations

import json
import math
from typing import Any

# a figure's data or layout in the page as plain values: typed arrays as lists, NaN as null, private keys dropped
PLAIN = """
  const plain = (v) => {
    if (ArrayBuffer.isView(v)) return Array.from(v, x => Number.isNaN(x) ? null : x);
    if (Array.isArray(v)) return v.map(plain);
    if (typeof v === 'number') return Number.isNaN(v) ? null : v;
    if (v && typeof v === 'object') { const o = {};
      for (const [k, x] of Object.entries(v)) if (!k.startsWith('_')) o[k] = plain(x); return o; }
    return v;
  };"""
# every figure of an explorer in the page, by its kvx-fig-<view> class: data with typed arrays made plain lists, as
# one JSON string (a string crosses from the page to Python several times faster than the same data as objects)
PAGE_FIGURES = """(root) => {""" + PLAIN + """
  const out = {};
  for (const gd of root.querySelectorAll('.js-plotly-plot')) {
    const cls = [...gd.classList, ...(gd.parentElement ? gd.parentElement.classList : [])]
      .find(c => c.startsWith('kvx-fig-'));
    if (!cls || !gd.data) continue;
    out[cls.slice(8)] = {data: plain(gd.data), layout: plain(gd.layout || {})};
  }
  return JSON.stringify(out);
}"""

COMPARE_TABLE = """(root) => [...root.querySelectorAll('.kvx-compare-table tbody tr')]
  .map(tr => [...tr.querySelectorAll('td')].map(td => td.textContent))"""


TRUTH = """(root) => { const e = root.querySelector('.kvx-truth pre'); return e ? e.textContent : null; }"""


def kernel_truth(explorer) -> dict:
    """What the kernel's explorer holds: its specs, compare rows, views on screen and last error, which it puts in
    its hidden ``kvx-truth`` element after every refresh (the kernel runs with ``KVEXPLORE_INSPECT=1``)."""
    text = explorer.evaluate(TRUTH)
    assert text is not None, "the explorer has no kvx-truth element: start the kernel with KVEXPLORE_INSPECT=1"
    return json.loads(text)


def page_truth(explorer) -> dict:
    """What the page holds: ``{"figures": {view: {"data", "layout"}}, "compare": rows}``."""
    return {"figures": page_figures(explorer), "compare": explorer.evaluate(COMPARE_TABLE)}


def page_figures(root) -> dict:
    """Every plotly figure inside ``root`` (a locator), by view: ``{view: {"data", "layout"}}``."""
    return json.loads(root.evaluate(PAGE_FIGURES))


def _close(a: Any, b: Any, rel: float = 1e-5, abs_: float = 1e-6) -> bool:
    if isinstance(a, bool) or isinstance(b, bool):
        return a == b
    if isinstance(a, (int, float)) and isinstance(b, (int, float)):
        return math.isclose(a, b, rel_tol=rel, abs_tol=abs_)
    return a == b


def _diff(want: Any, got: Any, path: str, out: list[str], missing_is_nan: bool = True) -> None:
    if isinstance(want, dict):
        if not isinstance(got, dict):
            out.append(f"{path}: the kernel has an object, the page {_short(got)}")
            return
        for k, v in want.items():
            if k == "colorscale" and isinstance(v, str) and isinstance(got.get(k), list):
                continue  # plotly.js expands a named colour scale into its stops
            if k not in got:
                if v is None or v == [] or v == {}:
                    continue  # an empty property the page did not keep
                out.append(f"{path}.{k}: missing in the page (kernel: {_short(v)})")
                continue
            _diff(v, got[k], f"{path}.{k}", out)
        return
    if isinstance(want, list):
        if not isinstance(got, list):
            if got is None and not want:
                return
            out.append(f"{path}: the kernel has a list of {len(want)}, the page {_short(got)}")
            return
        if len(want) != len(got):
            out.append(f"{path}: {len(want)} items in the kernel, {len(got)} in the page")
            return
        bad = [i for i, (a, b) in enumerate(zip(want, got)) if not isinstance(a, (dict, list)) and not _close(a, b)]
        if bad:
            i = bad[0]
            out.append(f"{path}[{i}]: kernel {_short(want[i])}, page {_short(got[i])} ({len(bad)} items differ)")
        for i, (a, b) in enumerate(zip(want, got)):
            if isinstance(a, (dict, list)):
                _diff(a, b, f"{path}[{i}]", out)
        return
    if not _close(want, got):
        out.append(f"{path}: kernel {_short(want)}, page {_short(got)}")


def _short(v: Any) -> str:
    s = json.dumps(v)
    return s if len(s) <= 80 else s[:77] + "..."


LAYOUT_KEYS = ("title", "annotations", "shapes", "height")


def mismatches(kernel: dict, page: dict, views: list[str] | None = None) -> list[str]:
    """Every difference between the kernel's specs and the page's figures (and the compare table), by name."""
    out: list[str] = []
    figures = page["figures"]
    if views is None:
        views = kernel.get("shown")  # the views on screen (the others are drawn when their tab is picked)
    for view, spec in kernel["specs"].items():
        if views is not None and view not in views:
            continue
        if view not in figures:
            out.append(f"{view}: figure not in the page")
            continue
        data, layout = figures[view]["data"], figures[view]["layout"]
        if len(data) != len(spec["traces"]):
            out.append(f"{view}: {len(spec['traces'])} traces in the kernel, {len(data)} in the page")
            continue
        for i, (want, got) in enumerate(zip(spec["traces"], data)):
            want = {k: v for k, v in want.items() if k != "type"}
            if want.get("type", got.get("type")) != got.get("type", want.get("type")):
                out.append(f"{view} trace {i}: type {want.get('type')} in the kernel, {got.get('type')} in the page")
            _diff(want, got, f"{view} trace {i} {want.get('name')!r}", out)
        for key in LAYOUT_KEYS:
            if key in spec["layout"]:
                _diff(spec["layout"][key], layout.get(key), f"{view} layout.{key}", out)
        for key, axis in spec["layout"].items():
            if key.startswith(("xaxis", "yaxis")) and isinstance(axis, dict) and "range" in axis:
                _diff(axis["range"], (layout.get(key) or {}).get("range"), f"{view} layout.{key}.range", out)
    if "compare" in kernel and views is not None and "compare" in views:
        if kernel["compare"] != page["compare"]:
            out.append(f"compare table: kernel {kernel['compare']}, page {page['compare']}")
    return out
