"""A plotly figure in the page that always shows the kernel's whole figure: one synced state, drawn with
``Plotly.react``.

Why not plotly's ``FigureWidget``: it sends each change as a one-off message (restyle, relayout) that only a view
alive at that moment applies, and every one of them ships plotly.js again as its module (5 MB each). anywidget
gives a model two seconds to initialize; on a busy machine the fourth or fifth 5 MB module misses that, its view
draws the first state and then never applies an update (seen in Voila: the tensors and compare figures stuck at
the prefill while the kernel moved on). Here the figure is two synced traits (numeric arrays as binary buffers):
``base``, a whole figure, and ``patch``, what changed since that base (:mod:`.delta`; always against the same base,
so it grows with the changes, and the figure is sent as a new base with an empty patch once the patch weighs more
than :data:`REBASE` of it). A Step sends the patch, not the figure; a view made at any time draws ``base`` +
``patch``, the whole current state, and nothing is lost between messages. plotly.js travels once per page, in a
hidden :class:`PlotlyLoader` (the copy inside the installed plotly package: nothing is fetched from the network).
"""

from __future__ import annotations

import math
from functools import cached_property
from typing import Any

import anywidget
import numpy as np
import traitlets

from .delta import APPLY_JS, apply, diff, weight
from .spec import FigureSpec, changes, figure

REBASE = 0.5  # a patch heavier than this share of its figure is sent as a new base instead, and so is one once
# the patches sent since the base add up to more than the figure (each re-sends the changes before it: a new base
# then costs less than carrying them on)

# the page's copy of plotly.js: the first loader to initialize runs it (as a classic script, with AMD and CommonJS
# hidden so that it defines window.Plotly); figures wait for it
_LOADER_ESM = r"""
export default {
  initialize({ model }) {
    const g = globalThis;
    if (g.Plotly || g.__kvxPlotlyLoading) return;
    g.__kvxPlotlyLoading = true;
    model.on('msg:custom', (msg) => {
      if (!msg || typeof msg.plotly !== 'string' || g.Plotly) return;
      const s = document.createElement('script');
      s.textContent = '(function(define, module, exports){' + msg.plotly + '\n}).call(window);';
      document.head.appendChild(s);
    });
    model.send({want: 'plotly'});  // asked for, not synced: a saved notebook's widget state stays small
  },
  render({ el }) { el.style.display = 'none'; },
};
"""

_FIGURE_ESM = APPLY_JS + r"""
const TYPED = {int8: Int8Array, int16: Int16Array, int32: Int32Array, uint8: Uint8Array, uint16: Uint16Array,
               uint32: Uint32Array, float32: Float32Array, float64: Float64Array};

function decode(v) {  // {buffer, dtype, shape} -> a typed array; everything else as it is
  if (Array.isArray(v)) return v.map(decode);
  if (v && typeof v === 'object') {
    if (v.buffer !== undefined && v.dtype in TYPED) {
      const b = v.buffer;  // a DataView (ipywidgets) over the message's binary buffer
      return new TYPED[v.dtype](b.buffer.slice(b.byteOffset, b.byteOffset + b.byteLength));
    }
    const o = {};
    for (const [k, x] of Object.entries(v)) o[k] = decode(x);
    return o;
  }
  return v;
}

function plotly() {
  return new Promise((resolve, reject) => {
    const t0 = Date.now();
    const wait = () => {
      if (globalThis.Plotly) return resolve(globalThis.Plotly);
      if (Date.now() - t0 > 1800000) return reject(new Error('plotly.js did not load'));  // sent when the kernel is free
      setTimeout(wait, 20);
    };
    wait();
  });
}

// the person zoomed, panned or autoscaled: tell the kernel each axis' range (null: the whole axis again)
function zoomed(gd, ev, model) {
  const ranges = {};
  for (const [k, v] of Object.entries(ev || {})) {
    let m = k.match(/^([xy]axis\d*)\.range\[([01])\]$/);
    if (m) {
      const r = ranges[m[1]] || ((gd.layout[m[1]] || {}).range || [v, v]).slice();
      r[Number(m[2])] = v;
      ranges[m[1]] = r;
      continue;
    }
    m = k.match(/^([xy]axis\d*)\.range$/);
    if (m) { ranges[m[1]] = v.slice(); continue; }
    m = k.match(/^([xy]axis\d*)\.autorange$/);
    if (m && v) ranges[m[1]] = null;
  }
  if (Object.keys(ranges).length) model.send({event: 'zoom', ranges});
}

// every figure of the page draws in one queue, in the order their states arrive (the kernel sends the cache map
// first), and each draw lets the browser paint before the next starts: the figure asked for first is on screen
// while the next one draws, not after both (two figures' Plotly.react took 70-80 ms on SmolLM2)
const DRAWS = globalThis.__kvxDrawQueue = globalThis.__kvxDrawQueue || {tail: Promise.resolve()};
const painted = () => new Promise((resolve) => {  // the next frame (or 50 ms: a hidden page has none), then a task
  let done = false;
  const go = () => { if (!done) { done = true; setTimeout(resolve, 0); } };
  requestAnimationFrame(go);
  setTimeout(go, 50);
});

export default {
  render({ model, el }) {
    const gd = document.createElement('div');
    gd.style.width = '100%';
    el.appendChild(gd);
    let alive = true, P = null, listening = false;
    // double-click shows everything at once (the kernel then draws the whole figure again)
    const config = {displaylogo: false, modeBarButtonsToRemove: ['select2d', 'lasso2d'], doubleClick: 'autosize'};
    // every draw starts from the whole current state (the base and the patch on it); draws run one after another
    const draw = () => { DRAWS.tail = DRAWS.tail.then(async () => {
      P = P || await plotly();
      if (!alive) return;
      const base = model.get('base') || {}, patch = model.get('patch') || {};
      if (patch.rev !== base.rev) return;  // a base whose patch is still on its way
      const fig = applyPatch(decode(base), decode(patch));
      const layout = fig.layout || {};
      if (el.clientWidth > 0) layout.width = el.clientWidth;  // the container's width, the spec's height
      const t0 = performance.now();
      await P.react(gd, fig.data || [], layout, config);
      if (!listening) { listening = true; gd.on('plotly_relayout', (ev) => zoomed(gd, ev, model)); }
      el.dataset.kvxDrawMs = (performance.now() - t0).toFixed(1);  // for benchmarks/explorer_click.py
      el.dataset.kvxDraws = String(Number(el.dataset.kvxDraws || 0) + 1);
      if (el.dataset.kvxDraws === '1') model.send({event: 'rendered'});  // a live page: no static copy needed
      await painted();
    }).catch((e) => { el.dataset.kvxError = String(e); console.error('kvexplore figure:', e); }); };
    model.on('change:base', draw);
    model.on('change:patch', draw);
    // redrawn at the container's width whenever that changes (a figure first drawn in a hidden tab had none)
    let width = -1;
    const ro = new ResizeObserver(() => { if (el.clientWidth !== width) { width = el.clientWidth; draw(); } });
    ro.observe(el);
    draw();
    return () => {
      alive = false; model.off('change:base', draw); model.off('change:patch', draw); ro.disconnect();
      if (P) P.purge(gd);
    };
  },
};
"""


def _small_number(dtype: np.dtype) -> bool:
    """An integer or float type of at most 32 bits (a typed array in the page; not bool, not 64-bit integers)."""
    number = np.issubdtype(dtype, np.integer) or np.issubdtype(dtype, np.floating)
    return bool(number) and dtype.itemsize <= 4


def _to_json(value: Any, widget: Any = None) -> Any:  # (ipywidgets passes the widget too)
    """A figure as JSON with binary buffers: 1-D numeric arrays (not 64-bit integers) as ``{buffer, dtype, shape}``,
    other arrays as lists, numpy scalars as numbers, NaN as null."""
    if isinstance(value, dict):
        return {k: _to_json(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_to_json(v) for v in value]
    if isinstance(value, np.ndarray):
        if value.ndim == 1 and (_small_number(value.dtype) or value.dtype == np.float64):
            a = np.ascontiguousarray(value)
            return {"buffer": memoryview(a), "dtype": str(a.dtype), "shape": list(a.shape)}
        return _to_json(value.tolist())
    if isinstance(value, np.generic):
        value = value.item()
    if isinstance(value, float) and math.isnan(value):
        return None
    return value


class PlotlyLoader(anywidget.AnyWidget):
    """Hidden: brings plotly.js (the installed plotly package's copy) into the page once, sent when the page asks
    (a message, not a synced trait: nbclient saves every widget's state into an executed notebook, and 4.7 MB of
    plotly.js there would make it too big to commit)."""

    _esm = _LOADER_ESM

    def __init__(self) -> None:
        super().__init__()
        self.add_class("kvx-plotly-loader")
        self.on_msg(self._answer)

    def _answer(self, _widget, content, _buffers) -> None:
        if isinstance(content, dict) and content.get("want") == "plotly":
            from plotly.offline import get_plotlyjs

            self.send({"plotly": get_plotlyjs()})


_loader: PlotlyLoader | None = None


def loader() -> PlotlyLoader:
    """The kernel's one loader (every explorer shows the same widget; the page runs plotly.js once)."""
    global _loader
    if _loader is None:
        _loader = PlotlyLoader()
    return _loader


class PlotWidget(anywidget.AnyWidget):
    """A figure drawn from a :class:`~.views.spec.FigureSpec`; :meth:`show` replaces what it draws.

    ``data`` and ``plot_layout`` give the figure shown as plotly objects (built when asked), for tests and notebooks."""

    _esm = _FIGURE_ESM
    base = traitlets.Dict().tag(sync=True, to_json=_to_json)  # a whole figure and its revision ("rev")
    patch = traitlets.Dict().tag(sync=True, to_json=_to_json)  # what changed since ``base`` (same "rev")

    def __init__(self, spec: FigureSpec, name: str) -> None:
        super().__init__()
        self.name = name
        self._carried = 0  # the weight of the patches sent since the base
        self.add_class(f"kvx-fig-{name}")
        self.layout.width = "100%"
        self.show(spec, force=True)

    def show(self, spec: FigureSpec, force: bool = False) -> bool:
        """Draw ``spec``; nothing is sent when it equals what is drawn, else what changed since the base (or a new
        base). True when the page was sent something."""
        if not force and _same_spec(spec, self.spec):
            return False
        self.spec = spec
        self.__dict__.pop("_plotly", None)
        new = {"data": spec.traces, "layout": spec.layout}  # (the page sets the width: its container's)
        patch = None if force else diff(self.base, new)
        size, whole = (weight(patch), weight(new)) if patch is not None else (0, 0)
        if patch is not None and size <= REBASE * whole and self._carried + size <= whole:
            self._carried += size
            self.patch = {**patch, "rev": self.base["rev"]}
            return True
        self._carried = 0
        rev = self.base.get("rev", 0) + 1
        with self.hold_sync():  # one message: the page never sees the new base with the old patch
            self.base = {**new, "rev": rev}
            self.patch = {"rev": rev}
        return True

    @property
    def figure(self) -> dict[str, Any]:
        """The figure the page draws: the base with the patch applied."""
        return apply(self.base, self.patch)

    @cached_property
    def _plotly(self):
        return figure(self.spec)

    @property
    def data(self):
        return self._plotly.data

    @property
    def plot_layout(self):
        """The figure's plotly layout (``layout`` is the widget's own ipywidgets layout)."""
        return self._plotly.layout


def _same_spec(a: FigureSpec, b: FigureSpec) -> bool:
    pairs = [*zip(a.traces, b.traces), (a.layout, b.layout)]
    return len(a.traces) == len(b.traces) and all(x.keys() == y.keys() and not changes(x, y) for x, y in pairs)
