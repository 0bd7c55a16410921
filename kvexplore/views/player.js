// The run replay's player (views/page.py: fragment), after player_unpack.js: a section per lane with its token strip
// and one figure per view the frames name, the views of the whole run below, and the slider over the steps.
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
