"""A recorded run as one self-contained HTML file: a step slider and play/pause that replay the token strip, the
cache map with its write and read windows, the attention of one layer and head for every strategy, and the memory
lines. It needs no kernel and no network (plotly.js is inside the file), so it can go on a course page, into slides
or a bug report.

The figures are the explorer's own views (:mod:`kvexplore.views`), built for every step from the records
as they were then; the page only decodes and draws them. Arrays that grow from one step to the next (attention rows,
memory lines) are stored once: a step's array that is the start of a later step's refers to it. The data and
plotly.js travel gzip-compressed, unpacked by the browser (``DecompressionStream``).

``history.save_html(path)``, ``Explorer.save_html(path)``, ``kvexplore export TRACE -o demo.html``.
"""

from __future__ import annotations

import base64
import dataclasses
import gzip
import html
import json
import math
import uuid
from collections.abc import Mapping, Sequence
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import numpy as np

from ..errors import SettingsError
from ..trace.records import StepRecord


def model_info(run: Sequence[StepRecord]) -> SimpleNamespace:
    """The few figures of the model the views draw, from the run's meta (or, for an older trace, its records)."""
    meta = getattr(run, "meta", {}).get("model")
    if meta:
        return SimpleNamespace(**meta)
    trace = next((r.trace for r in run if r.trace is not None), None)
    layers = len(trace.layer_slots) if trace is not None and len(trace.layer_slots) > 1 else \
        1 + max((e.layer for r in run if r.trace for e in r.trace.events), default=0)
    groups = trace.gqa_groups if trace is not None else [[0]]
    return SimpleNamespace(name="", num_layers=layers, num_heads=sum(len(g) for g in groups),
                           num_kv_heads=len(groups), gqa_groups=groups, attention_sinks=False)


def _texts(run: Sequence[StepRecord], upto: int) -> list[str]:
    meta = getattr(run, "meta", {})
    prompt = meta.get("prompt_texts") or [f"[{i}]" for i in range(run[0].input_len if run else 0)]
    return list(prompt) + [r.text for r in run[: upto + 1]]


def snapshot_at(runs: Mapping[str, Sequence[StepRecord]], step: int, shown: str, layer: int = 0, head: int = 0):
    """The explorer's :class:`~kvexplore.views.snapshot.Snapshot` of ``runs`` as they were after ``step``."""
    from ..views.snapshot import LaneDetail, LaneSnapshot, Snapshot

    first = next(iter(runs.values()))
    config = model_info(first)
    lanes = {}
    for name, run in runs.items():
        history = list(run[: step + 1])
        lane = LaneSnapshot(name, getattr(run, "meta", {}).get("kind", name), history, [None] * len(history),
                            [None] * len(history), set())
        last = history[-1] if history else None
        slots = None
        if last is not None and last.trace is not None and last.trace.layer_slots:
            slots = [last.trace.slots_of(i) for i in range(config.num_layers)]
        lane.detail = LaneDetail(texts=_texts(run, step), slots=slots, norms=None, stored_error=None)
        lanes[name] = lane
    return Snapshot(config, lanes, next(iter(runs)), shown, None, layer, head, "step", False)


class _Store:
    """Arrays of every frame, each stored once: an array that is the start of one already stored (a later step's,
    as frames are encoded last first) is a reference to it."""

    def __init__(self) -> None:
        self.arrays: list[dict] = []
        self._base: dict[str, tuple[int, np.ndarray]] = {}  # path -> the array a prefix may refer to

    def array(self, path: str, a: np.ndarray) -> dict:
        a = np.ascontiguousarray(a)
        if a.dtype.kind == "b":
            a = a.astype(np.uint8)
        elif a.dtype == np.int64:
            a = a.astype(np.int32) if not a.size or (a.min() >= -2**31 and a.max() < 2**31) else a.astype(np.float64)
        base = self._base.get(path)
        if base is not None and base[1].dtype == a.dtype and a.size <= base[1].size and \
                np.array_equal(base[1][: a.size], a, equal_nan=a.dtype.kind == "f"):
            return {"$a": base[0], "n": int(a.size)}
        self.arrays.append({"dtype": str(a.dtype), "b64": base64.b64encode(a.tobytes()).decode()})
        self._base[path] = (len(self.arrays) - 1, a)
        return {"$a": len(self.arrays) - 1, "n": int(a.size)}

    def encode(self, value: Any, path: str) -> Any:
        if isinstance(value, dict):
            return {k: self.encode(v, f"{path}.{k}") for k, v in value.items()}
        if isinstance(value, (list, tuple)):
            return [self.encode(v, f"{path}[{i}]") for i, v in enumerate(value)]
        if isinstance(value, np.ndarray):
            if value.ndim == 1 and value.dtype.kind in "iufb":
                return self.array(path, value)
            return self.encode(value.tolist(), path)
        if isinstance(value, np.generic):
            value = value.item()
        if isinstance(value, float) and not math.isfinite(value):
            return None
        return value


def frames(runs: Mapping[str, Sequence[StepRecord]], layer: int = 0, head: int = 0) -> tuple[list[dict], _Store]:
    """Every step's figures (cache map and attention per strategy, the memory lines) and how many generated tokens
    each lane's strip shows."""
    from ..views import attention, cache_map, memory

    if not runs or not all(len(r) for r in runs.values()):
        raise SettingsError("nothing to replay: every run needs at least its prefill record")
    config = model_info(next(iter(runs.values())))
    if not 0 <= layer < config.num_layers:
        raise SettingsError(f"layer {layer} does not exist: the model has layers 0..{config.num_layers - 1}")
    if not 0 <= head < config.num_heads:
        raise SettingsError(f"head {head} does not exist: the model has query heads 0..{config.num_heads - 1}")
    steps = max(len(r) for r in runs.values())
    store = _Store()
    out: list[dict | None] = [None] * steps
    for step in reversed(range(steps)):  # last first: earlier arrays are prefixes of later ones
        snap = snapshot_at(runs, step, next(iter(runs)), layer, head)
        figs = {}
        for name in runs:
            figs[f"cache_map:{name}"] = cache_map.from_snapshot(snap, name)
            figs[f"attention:{name}"] = attention.from_snapshot(dataclasses.replace(snap, shown=name))
        figs["memory"] = memory.from_snapshot(dataclasses.replace(snap, shown=list(runs)[-1]))
        out[step] = {"step": step,
                     "figures": {key: store.encode({"data": f.traces, "layout": f.layout}, key)
                                 for key, f in figs.items()},
                     "tokens": {name: min(step, len(run) - 1) + 1 for name, run in runs.items()}}
    return out, store  # type: ignore[return-value]


def fragment(runs: Mapping[str, Sequence[StepRecord]], layer: int = 0, head: int = 0, title: str | None = None,
             marks: Mapping[int, str] | None = None, plotly: bool = True, side_by_side: bool = False) -> str:
    """The replay as one HTML element (its data, its player and, with ``plotly``, plotly.js), to put in a page:
    :func:`save_html` wraps it in a document; a notebook's static copy of an explorer embeds it. Without ``plotly``
    it waits for another fragment on the page to bring plotly.js. ``side_by_side``: the lanes in columns (each
    lane's figures one above the other), as ``kvexplore diff --html`` shows two runs."""
    from ..views import tokens

    all_frames, store = frames(runs, layer, head)
    config = model_info(next(iter(runs.values())))
    meta = {"title": title or f"kvexplore replay · {config.name or 'model'} · {', '.join(runs)}",
            "lanes": list(runs), "layer": layer, "head": head, "steps": len(all_frames),
            "marks": {str(k): v for k, v in (marks or {}).items()},
            "prompt": {name: tokens.prompt_spans(_texts(run, -1)) for name, run in runs.items()},
            "spans": {name: [tokens.token_span(r) for r in run] for name, run in runs.items()},
            "style": tokens.STYLE}
    data = json.dumps({"meta": meta, "arrays": store.arrays, "frames": all_frames}, separators=(",", ":"),
                      allow_nan=False)
    packed = base64.b64encode(gzip.compress(data.encode(), 6, mtime=0)).decode()
    plotly_js = ""
    if plotly:
        try:
            from plotly.offline import get_plotlyjs
        except ImportError as e:  # pragma: no cover - the notebook extra
            raise SettingsError('an HTML replay needs plotly: pip install -e ".[notebook]"') from e
        packed_js = base64.b64encode(gzip.compress(get_plotlyjs().encode(), 6, mtime=0)).decode()
        plotly_js = f'<script type="application/octet-stream" class="kvx-plotly">{packed_js}</script>'
    uid = f"kvx-replay-{uuid.uuid4().hex[:12]}"  # two identical replays on one page are still two
    return (_FRAGMENT.replace("__ID__", uid).replace("__SIDE__", " kvx-side" if side_by_side else "")
            .replace("__TITLE__", html.escape(meta["title"]))
            .replace("__PLOTLY__", plotly_js).replace("__DATA__", packed).replace("__PLAYER__", _PLAYER))


def save_html(runs: Mapping[str, Sequence[StepRecord]], path: str | Path, layer: int = 0, head: int = 0,
              title: str | None = None, marks: Mapping[int, str] | None = None, side_by_side: bool = False) -> Path:
    """Write the replay of ``runs`` (lane name -> records, as ``Explorer`` or ``load_trace`` give them) to ``path``.
    ``marks``: step -> a note shown at that step (the diff marks where two runs part)."""
    path = Path(path)
    body = fragment(runs, layer, head, title, marks, side_by_side=side_by_side)
    name = html.escape(title or "kvexplore replay")
    path.write_text(f'<!DOCTYPE html>\n<html lang="en"><head><meta charset="utf-8"><title>{name}</title></head>\n'
                    f'<body style="margin: 12px 18px">\n{body}\n</body></html>\n', encoding="utf-8")
    return path


_FRAGMENT = """<div class="kvx-replay__SIDE__" id="__ID__">
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
<div class="kvx-lanes"></div><div class="kvx-memory"></div>
__PLOTLY__
<script type="application/octet-stream" class="kvx-data">__DATA__</script>
<script>(__PLAYER__)((document.currentScript && document.currentScript.parentElement) || document.getElementById("__ID__"));</script>
</div>"""

_PLAYER = r"""async function (root) {
  const TYPED = {int8: Int8Array, int16: Int16Array, int32: Int32Array, uint8: Uint8Array, uint16: Uint16Array,
                 uint32: Uint32Array, float32: Float32Array, float64: Float64Array};
  async function gunzip(el) {
    const bin = Uint8Array.from(atob(el.textContent), (c) => c.charCodeAt(0));
    const stream = new Blob([bin]).stream().pipeThrough(new DecompressionStream('gzip'));
    return await new Response(stream).text();
  }
  try {
    const packedJs = root.querySelector('.kvx-plotly');
    if (!window.Plotly && packedJs && !window.__kvxPlotlyLoading) {
      window.__kvxPlotlyLoading = true;
      (0, eval)(await gunzip(packedJs));  // plotly.js defines window.Plotly
    }
    for (let t = 0; !window.Plotly; t++) {  // another replay on the page brings it
      if (t > 1200) throw new Error('plotly.js did not load');
      await new Promise((r) => setTimeout(r, 50));
    }
    const all = JSON.parse(await gunzip(root.querySelector('.kvx-data')));
    const meta = all.meta, frames = all.frames;
    const arrays = all.arrays.map((a) => new TYPED[a.dtype](Uint8Array.from(atob(a.b64), (c) => c.charCodeAt(0)).buffer));
    const decode = (v) => {
      if (Array.isArray(v)) return v.map(decode);
      if (v && typeof v === 'object') {
        if (v['$a'] !== undefined) return arrays[v['$a']].slice(0, v.n);
        const o = {};
        for (const [k, x] of Object.entries(v)) o[k] = decode(x);
        return o;
      }
      return v;
    };
    const styleHost = document.createElement('div');
    styleHost.innerHTML = meta.style;
    root.prepend(...styleHost.children);
    const divs = {}, strips = {};
    for (const lane of meta.lanes) {
      const box = document.createElement('section');
      box.className = 'kvx-lane';
      box.dataset.lane = lane;
      box.innerHTML = '<h2></h2><div class="kvx-strip-box"></div><div class="kvx-fig kvx-cache-map"></div>' +
                      '<div class="kvx-fig kvx-attention"></div>';
      box.querySelector('h2').textContent = lane;
      root.querySelector('.kvx-lanes').appendChild(box);
      divs['cache_map:' + lane] = box.querySelector('.kvx-cache-map');
      divs['attention:' + lane] = box.querySelector('.kvx-attention');
      strips[lane] = box.querySelector('.kvx-strip-box');
    }
    divs['memory'] = root.querySelector('.kvx-memory');
    const slider = root.querySelector('.kvx-slider'), label = root.querySelector('.kvx-label');
    const mark = root.querySelector('.kvx-mark'), play = root.querySelector('.kvx-play');
    slider.max = String(frames.length - 1);
    const config = {displaylogo: false, responsive: true};
    let queue = Promise.resolve();
    const strip = (lane, n) => {
      const spans = meta.spans[lane].slice(0, n);
      if (spans.length) spans[spans.length - 1] = spans[spans.length - 1].replace('kvx-gen"', 'kvx-gen kvx-last"');
      return '<div class="kvx-strip">' + meta.prompt[lane] + spans.join('') + '</div>';
    };
    const show = (i) => {
      queue = queue.then(async () => {
        const f = frames[i];
        for (const lane of meta.lanes) strips[lane].innerHTML = strip(lane, f.tokens[lane]);
        for (const [key, fig] of Object.entries(f.figures)) {
          const d = decode(fig);
          await Plotly.react(divs[key], d.data, d.layout, config);
        }
        label.textContent = `step ${i} of ${frames.length - 1}`;
        mark.textContent = meta.marks[String(i)] || '';
        root.dataset.kvxStep = String(i);
      });
      return queue;
    };
    root.kvxShow = (i) => { slider.value = String(i); return show(i); };
    slider.addEventListener('input', () => show(Number(slider.value)));
    let timer = null;
    const stop = () => { clearInterval(timer); timer = null; play.textContent = '▶ play'; };
    play.addEventListener('click', () => {
      if (timer) return stop();
      play.textContent = '⏸ pause';
      timer = setInterval(() => {
        const next = Number(slider.value) + 1;
        if (next >= frames.length) return stop();
        slider.value = String(next);
        show(next);
      }, 700);
    });
    await show(frames.length - 1);  // the run as it ended; the slider goes back to any step
    slider.value = String(frames.length - 1);
    root.dataset.kvxReady = '1';
  } catch (e) {
    root.dataset.kvxError = String(e);
    console.error('kvexplore replay:', e);
  }
}"""
