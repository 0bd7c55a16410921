// Pools side by side (replay/prefix_compare_page.py), after views/player_unpack.js: waits for every column's replay,
// then one slider (the first .kvx-slider in the page: the one on top) moves them all.
try {
  await loadPlotly(root);  // the columns wait for the page's one copy of plotly.js
  const pages = [...root.querySelectorAll('.kvx-columns > .kvx-prefix-page')];
  const settled = (p) => p.dataset.kvxReady === '1' || !!p.dataset.kvxError;
  while (!pages.every(settled)) await new Promise((r) => setTimeout(r, 50));
  const failed = pages.find((p) => p.dataset.kvxError);
  if (failed) throw new Error(failed.dataset.kvxError);
  const count = Math.min(...pages.map((p) => Number(p.querySelector('.kvx-slider').max) + 1));
  const label = root.querySelector('.kvx-label');
  const draw = async (i) => {
    await Promise.all(pages.map((p) => p.kvxShow(i)));
    label.textContent = pages[0].querySelector('.kvx-label').textContent;
    root.dataset.kvxFrame = String(i);
  };
  await wire(root, count, draw, 1200);
} catch (e) {
  root.dataset.kvxError = String(e);
  console.error('kvexplore prefix comparison:', e);
}
