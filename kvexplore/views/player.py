"""The replay's page: the HTML around the frames (slider, play/pause, one section per lane) and the player that
decodes the frames and draws them with plotly.js, in the browser, with no kernel and no network.

The player makes one figure per view the frames name (``meta.views``: the registry's per-lane views in each lane's
section, the views of the whole run below), each a ``<div class="kvx-fig kvx-<view>">`` (underscores as dashes),
so a view added to the registry is drawn with no change here.
"""

FRAGMENT = """<div class="kvx-replay__SIDE__" id="__ID__">
<style>
.kvx-replay {font-family: 'Liberation Sans', Arial, sans-serif; color: #222;}
.kvx-replay h1 {font-size: 19px;}
.kvx-replay .kvx-controls {position: sticky; top: 0; background: #fff; padding: 6px 0; z-index: 10;
  border-bottom: 1px solid #ddd; display: flex; flex-wrap: wrap; gap: 12px; align-items: center;}
.kvx-replay .kvx-slider {flex: 1; min-width: 50%;}
.kvx-replay .kvx-mark {color: #b30000; font-weight: bold;}
.kvx-replay .kvx-lane {display: grid; grid-template-columns: 1fr 1fr; gap: 8px; margin: 10px 0 18px;}
.kvx-replay .kvx-lane h2 {grid-column: 1 / 3; font-size: 16px; margin: 6px 0 0;}
.kvx-replay .kvx-strip-box {grid-column: 1 / 3;}
.kvx-side .kvx-lanes {display: grid; grid-template-columns: 1fr 1fr; gap: 16px;}
.kvx-side .kvx-lane {grid-template-columns: 1fr;}
.kvx-side .kvx-lane h2, .kvx-side .kvx-strip-box {grid-column: 1;}
</style>
<h1>__TITLE__</h1>
<div class="kvx-controls"><button class="kvx-play">▶ play</button>
<input class="kvx-slider" type="range" min="0" value="0"><span class="kvx-label">loading…</span>
<span class="kvx-mark"></span></div>
<div class="kvx-lanes"></div><div class="kvx-run-views"></div>
__PLOTLY__
<script type="application/octet-stream" class="kvx-data">__DATA__</script>
<script>(__PLAYER__)((document.currentScript && document.currentScript.parentElement) || document.getElementById("__ID__"));</script>
</div>"""

# what every player starts with: unpack(root) runs the packed plotly.js once per page (or waits for another
# fragment's), then gives the packed data (views/page.py: pack) and decode(v), which turns the array references
# ({"$a": i, "n": n}, views/frames.py: ArrayStore) back into typed arrays and lists of strings stored once in a table
# ({"$t": indices into all.strings}, replay/prefix_page.py); wire(...) then drives its slider and play button
UNPACK = r"""
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
  async function wire(root, count, draw, ms) {
    let queue = Promise.resolve();
    const show = (i) => { queue = queue.then(() => draw(i)); return queue; };
    const slider = root.querySelector('.kvx-slider'), play = root.querySelector('.kvx-play');
    slider.max = String(count - 1);
    root.kvxShow = (i) => { slider.value = String(i); return show(i); };
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
    await show(count - 1);
    slider.value = String(count - 1);
    root.dataset.kvxReady = '1';
  }
"""

PLAYER = "async function (root) {" + UNPACK + r"""
  try {
    const {all, decode} = await unpack(root);
    const meta = all.meta, frames = all.frames;
    const styleHost = document.createElement('div');
    styleHost.innerHTML = meta.style;
    root.prepend(...styleHost.children);
    const divs = {}, strips = {};
    // one div per view of the registry: the per-lane views in each lane's section, the others under the lanes
    const figure = (parent, view) => {
      const div = document.createElement('div');
      div.className = 'kvx-fig kvx-' + view.replace(/_/g, '-');
      parent.appendChild(div);
      return div;
    };
    for (const lane of meta.lanes) {
      const box = document.createElement('section');
      box.className = 'kvx-lane';
      box.dataset.lane = lane;
      box.innerHTML = '<h2></h2><div class="kvx-strip-box"></div>';
      box.querySelector('h2').textContent = lane;
      root.querySelector('.kvx-lanes').appendChild(box);
      for (const view of meta.views.lane) {  // a view that applies to some lanes only has no figure in the others
        if (frames[frames.length - 1].figures[view + ':' + lane] !== undefined) divs[view + ':' + lane] = figure(box, view);
      }
      strips[lane] = box.querySelector('.kvx-strip-box');
    }
    for (const view of meta.views.run) divs[view] = figure(root.querySelector('.kvx-run-views'), view);
    const label = root.querySelector('.kvx-label'), mark = root.querySelector('.kvx-mark');
    const config = {displaylogo: false, responsive: true};
    const strip = (lane, n) => {
      const spans = meta.spans[lane].slice(0, n);
      if (spans.length) spans[spans.length - 1] = spans[spans.length - 1].replace('kvx-tok kvx-gen', 'kvx-tok kvx-gen kvx-last');
      return '<div class="kvx-strip">' + meta.prompt[lane] + spans.join('') + '</div>';
    };
    const draw = async (i) => {
      const f = frames[i];
      for (const lane of meta.lanes) strips[lane].innerHTML = strip(lane, f.tokens[lane]);
      for (const [key, fig] of Object.entries(f.figures)) {
        const d = decode(fig);
        await Plotly.react(divs[key], d.data, d.layout, config);
      }
      label.textContent = `step ${i} of ${frames.length - 1}`;
      mark.textContent = meta.marks[String(i)] || '';
      root.dataset.kvxStep = String(i);
    };
    await wire(root, frames.length, draw, 700);  // the run as it ended; the slider goes back to any step
  } catch (e) {
    root.dataset.kvxError = String(e);
    console.error('kvexplore replay:', e);
  }
}"""
