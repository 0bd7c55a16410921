// A prefix cache replay's player (replay/prefix_page.py), after views/player_unpack.js: each frame's figures, story
// and label, and the slider over the frames.
try {
  const {all, decode} = await unpack(root);
  const frames = all.frames;
  const label = root.querySelector('.kvx-label'), storyBox = root.querySelector('.kvx-story');
  const config = {displaylogo: false, responsive: true};
  const draw = async (i) => {
    const f = frames[i];
    for (const [name, fig] of Object.entries(f.figures)) {
      const d = decode(fig);
      await Plotly.react(root.querySelector('.kvx-fig-' + name), d.data, d.layout, config);
    }
    storyBox.innerHTML = f.story;
    label.textContent = f.label;
    root.dataset.kvxFrame = String(i);
  };
  await wire(root, frames.length, draw, 1200);  // the pool as it ended; the slider goes back to any request
} catch (e) {
  root.dataset.kvxError = String(e);
  console.error('kvexplore prefix replay:', e);
}
