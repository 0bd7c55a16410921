// A PlotWidget's module (kvexplore/views/plot.py), after delta.js (applyPatch): draws the synced base with its patch
// applied, with Plotly.react, and tells the kernel the ranges a person zooms to.
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
