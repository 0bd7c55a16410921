// What every replay player starts with, inside its function of the page's root (views/player.py: on_root):
// unpack(root) runs the packed plotly.js once per page (or waits for another fragment's), then gives the packed data
// (views/page.py: pack) and decode(v), which turns the array references ({"$a": i, "n": n}, views/frames.py:
// ArrayStore) back into typed arrays and lists of strings stored once in a table ({"$t": indices into all.strings},
// views/prefix_page.py); wire(...) then drives its slider and play button, opens at the step a link names
// (page.html#step=37) and keeps the address bar at the step shown (and the keys the player adds: layer, head, tab),
// so it is the link to this view.
const TYPED = {int8: Int8Array, int16: Int16Array, int32: Int32Array, uint8: Uint8Array, uint16: Uint16Array,
               uint32: Uint32Array, float32: Float32Array, float64: Float64Array};
async function gunzip(el) {
  const bin = Uint8Array.from(atob(el.textContent), (c) => c.charCodeAt(0));
  const stream = new Blob([bin]).stream().pipeThrough(new DecompressionStream('gzip'));
  return await new Response(stream).text();
}
async function loadPlotly(root) {  // the page's copy of plotly.js, run once (whichever replay gets there first)
  const packedJs = root.querySelector('.kvx-plotly');
  if (!window.Plotly && packedJs && !window.__kvxPlotlyLoading) {
    window.__kvxPlotlyLoading = true;
    (0, eval)(await gunzip(packedJs));  // plotly.js defines window.Plotly
  }
}
async function unpack(root) {
  await loadPlotly(root);
  for (let t = 0; !window.Plotly; t++) {  // another replay on the page brings it
    if (t > 1200) throw new Error('plotly.js did not load');
    await new Promise((r) => setTimeout(r, 50));
  }
  const all = JSON.parse(await gunzip(root.querySelector('.kvx-data')));
  const arrays = all.arrays.map((a) => new TYPED[a.dtype](Uint8Array.from(atob(a.b64), (c) => c.charCodeAt(0)).buffer));
  const decode = (v) => {
    if (Array.isArray(v)) return v.map(decode);
    if (v && typeof v === 'object') {
      if (v['$a'] !== undefined) return arrays[v['$a']].slice(0, v.n);
      if (v['$t'] !== undefined) return Array.from(decode(v['$t']), (i) => all.strings[i]);  // a string table's
      const o = {};
      for (const [k, x] of Object.entries(v)) o[k] = decode(x);
      return o;
    }
    return v;
  };
  return {all, decode};
}
// the slider and play/pause over frames 0..count-1, drawn by draw(i) (async; draws run one after another), every
// ms when playing; the last frame first (play from the last starts over)
function ownsAddress() {  // a saved page with one replay: its address is the replay's (never a notebook's or app's)
  return document.querySelectorAll('.kvx-slider').length === 1
    && !document.querySelector('.jp-LabShell, .jp-Notebook, #notebook-container, .jp-OutputArea');
}
function linkParams() {  // the keys of the link the page was opened with (page.html#step=37&layer=3); none: null
  if (!ownsAddress()) return null;
  return new URLSearchParams(location.hash.slice(1));
}
function linkedStep(count) {  // the step a link asks for: page.html#step=37 (out of range or not a number: none)
  const params = linkParams();
  const asked = params === null ? null : params.get('step');
  const i = asked === null || asked.trim() === '' ? NaN : Number(asked);
  return Number.isInteger(i) && i >= 0 && i < count ? i : null;
}
// opts (all optional): first, the step to open at (else the link's, else the last); keys(), the other keys the
// address carries after the step ([[key, value]...], in order; a key given null is dropped); opened(i), run once the
// first step is drawn, before the page says it is ready
async function wire(root, count, draw, ms, opts = {}) {
  let queue = Promise.resolve();
  const link = (i) => {  // the address bar is the link to this view: #step=i, then opts.keys() (other keys kept)
    if (!ownsAddress()) return;
    const old = new URLSearchParams(location.hash.slice(1)), params = new URLSearchParams();
    params.set('step', String(i));
    const keys = opts.keys ? opts.keys() : [];
    for (const [k, v] of keys) if (v !== null && v !== undefined) params.set(k, String(v));
    const mine = new Set(['step', ...keys.map(([k]) => k)]);
    for (const [k, v] of old) if (!mine.has(k)) params.append(k, v);
    history.replaceState(null, '', '#' + params.toString());
  };
  const show = (i, linked = true) => {
    if (linked) link(i);
    queue = queue.then(() => draw(i));
    return queue;
  };
  const slider = root.querySelector('.kvx-slider'), play = root.querySelector('.kvx-play');
  slider.max = String(count - 1);
  root.kvxShow = (i) => { slider.value = String(i); return show(i); };
  root.kvxRedraw = () => show(Number(slider.value));  // the same step again (another layer and head)
  root.kvxRelink = () => link(Number(slider.value));  // the address again (another tab marked)
  slider.addEventListener('input', () => show(Number(slider.value)));
  let timer = null;
  const stop = () => { clearInterval(timer); timer = null; play.textContent = '▶ play'; };
  play.addEventListener('click', () => {
    if (timer) return stop();
    if (Number(slider.value) >= count - 1) { slider.value = '0'; show(0); }
    play.textContent = '⏸ pause';
    timer = setInterval(() => {
      const next = Number(slider.value) + 1;
      if (next >= count) return stop();
      slider.value = String(next);
      show(next);
    }, ms);
  });
  // a link's step, else the run as it ended; the address is left as it was, unless a link named keys: then it is
  // written as the view shown (what the page could not open is dropped from it)
  const asked = opts.first !== undefined && opts.first !== null ? opts.first : linkedStep(count);
  const first = asked === null ? count - 1 : asked;
  const params = linkParams();
  await show(first, params !== null && [...params.keys()].length > 0 && opts.keys !== undefined);
  slider.value = String(first);
  if (opts.opened) await opts.opened(first);
  root.dataset.kvxReady = '1';
}
