// The static copy hides itself on a page that draws the live widget (kvexplore/explorer/static.py): the kernel empties
// the copy when it hears of the draw, but a page that shows outputs as they were when it was made (Voila) never gets
// that update. A figure that has drawn has data-kvx-draws.
(function (copy) {
  if (!copy) return;
  const live = () => document.querySelector('[data-kvx-draws]');
  const hide = () => { copy.style.display = 'none'; };
  if (live()) return hide();
  const watch = new MutationObserver(() => { if (live()) { hide(); watch.disconnect(); } });
  watch.observe(document.body, {subtree: true, childList: true, attributes: true, attributeFilter: ['data-kvx-draws']});
})(document.currentScript && document.currentScript.parentElement);
