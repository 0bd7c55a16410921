// The run replay's player (views/page.py: fragment), after player_unpack.js: a section per lane with its token strip
// and one figure per view the frames name, the views of the whole run below, and the slider over the steps. A
// replay holding several (layer, head) picks (meta.picks, the first drawn by frame.figures, the others' figures
// that differ by frame.picks["layer,head"]) has a selector; a link (#step=37&layer=3&head=1&tab=attention, the
// app's names) opens that step and pick and brings the named view's figure into view, outlined. What the file
// cannot show is said in one line above the figures, and the page opens at the nearest view it has.
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
    div.dataset.view = view;
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
  const notice = root.querySelector('.kvx-notice'), controls = root.querySelector('.kvx-controls');
  const config = {displaylogo: false, responsive: true};

  // the (layer, head) picks, the tab views (the app's names) this file has a figure of, and what a link asks
  const picks = meta.picks || [[meta.layer, meta.head]];
  const allTabs = meta.tabs || [];
  const drawn = allTabs.filter((v) => Object.values(divs).some((d) => d.dataset.view === v));
  const pair = (p) => `layer ${p[0]} head ${p[1]}`;
  const holds = picks.length === 1 ? pair(picks[0]) + ' only' : picks.map(pair).join(', ');
  let pick = 0, tab = null;
  const notes = [];
  const params = linkParams();
  const whole = (key) => {  // a link's whole number (a value that is not one: noted, and ignored)
    const v = params === null ? null : params.get(key);
    if (v === null) return null;
    if (/^\d+$/.test(v.trim())) return Number(v.trim());
    notes.push(`${key}=${v} is not a ${key} number`);
    return null;
  };
  let first = null;
  if (params !== null) {
    const asked = params.get('step');
    first = linkedStep(frames.length);
    if (asked !== null && first === null) {
      notes.push(`step=${asked} is not a step of this replay (steps 0..${frames.length - 1}), showing the last`);
    }
    const layer = whole('layer'), head = whole('head');
    if (layer !== null || head !== null) {
      const exact = picks.findIndex((p) => (layer === null || p[0] === layer) && (head === null || p[1] === head));
      if (exact >= 0) pick = exact;
      else {
        const byLayer = picks.findIndex((p) => p[0] === layer), byHead = picks.findIndex((p) => p[1] === head);
        const near = byLayer >= 0 ? byLayer : Math.max(byHead, 0);  // the same layer, else the same head, else first
        pick = near;
        const want = [layer === null ? picks[near][0] : layer, head === null ? picks[near][1] : head];
        const m = meta.model || {};
        const fits = m.layers === undefined || (want[0] < m.layers && want[1] < m.heads);
        notes.push(fits ? `${pair(want)} is not in this file, showing ${pair(picks[near])}: this replay holds ${holds}; `
                          + `save it with picks=[(${want[0]}, ${want[1]})]`
                        : `the model has no ${pair(want)} (layers 0..${m.layers - 1}, heads 0..${m.heads - 1}), `
                          + `showing ${pair(picks[near])}: this replay holds ${holds}`);
      }
    }
    const askedTab = params.get('tab');
    if (askedTab !== null) {
      if (drawn.includes(askedTab)) tab = askedTab;
      else {
        const what = allTabs.includes(askedTab) ? `this replay has no ${askedTab} figure`
          : `tab=${askedTab} is not a view`;
        notes.push(`${what}: it draws ${drawn.join(', ') || 'no tab views'} (and the cache map)`);
      }
    }
  }
  notice.textContent = notes.join(' · ');

  // the selector of the picks, when the file holds more than one
  let select = null;
  if (picks.length > 1) {
    const box = document.createElement('label');
    box.className = 'kvx-pick-box';
    select = document.createElement('select');
    select.className = 'kvx-pick';
    select.title = 'the layer and query head whose figures are drawn (the picks this file holds)';
    picks.forEach((p, i) => {
      const o = document.createElement('option');
      o.value = String(i);
      o.textContent = `layer ${p[0]} · head ${p[1]}`;
      select.appendChild(o);
    });
    select.value = String(pick);
    box.appendChild(select);
    label.before(box);
    select.addEventListener('change', () => { pick = Number(select.value); root.kvxRedraw(); });
  }

  // the tab's figures outlined; a click on a tab view's figure makes it the tab
  const marked = () => {
    for (const d of Object.values(divs)) d.classList.toggle('kvx-marked', tab !== null && d.dataset.view === tab);
  };
  for (const d of Object.values(divs)) {
    if (!drawn.includes(d.dataset.view)) continue;
    d.addEventListener('click', () => {
      if (tab === d.dataset.view) return;
      tab = d.dataset.view;
      marked();
      root.kvxRelink();
    });
  }

  const strip = (lane, n) => {
    const spans = meta.spans[lane].slice(0, n);
    if (spans.length) spans[spans.length - 1] = spans[spans.length - 1].replace('kvx-tok kvx-gen', 'kvx-tok kvx-gen kvx-last');
    return '<div class="kvx-strip">' + meta.prompt[lane] + spans.join('') + '</div>';
  };
  const draw = async (i) => {
    const f = frames[i], p = picks[pick];
    const other = pick > 0 && f.picks ? (f.picks[p[0] + ',' + p[1]] || {}) : {};
    for (const lane of meta.lanes) strips[lane].innerHTML = strip(lane, f.tokens[lane]);
    for (const [key, fig] of Object.entries(f.figures)) {
      const d = decode(other[key] !== undefined ? other[key] : fig);
      await Plotly.react(divs[key], d.data, d.layout, config);
    }
    label.textContent = `step ${i} of ${frames.length - 1}`;
    mark.textContent = meta.marks[String(i)] || '';
    root.dataset.kvxPick = p[0] + ',' + p[1];
    root.dataset.kvxStep = String(i);
  };
  const keys = () => [['layer', picks[pick][0]], ['head', picks[pick][1]], ['tab', tab]];
  const opened = () => {  // the link's view brought into view below the sticky controls, outlined
    marked();
    if (tab === null) return;
    const target = Object.values(divs).find((d) => d.dataset.view === tab);
    target.style.scrollMarginTop = (controls.offsetHeight + 8) + 'px';
    target.scrollIntoView({block: 'start'});
  };
  // the run as it ended (or the link's step); the slider goes back to any step
  await wire(root, frames.length, draw, 700, {first, keys, opened});
} catch (e) {
  root.dataset.kvxError = String(e);
  console.error('kvexplore replay:', e);
}
