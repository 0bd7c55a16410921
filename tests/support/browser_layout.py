"""Geometry of the explorer on the page, read in the browser: text boxes that overlap, text clipped by its figure or
its box, plot areas squeezed by their margins, legends that scroll, and type too small for a lecture hall.

:func:`problems` runs one pass of :data:`CHECK` inside an explorer's root element and returns every problem found,
each a line naming the element and the numbers (an empty list: the layout holds). Used by
``tests/screen/test_browser_layout.py``.
"""

from __future__ import annotations

from browser_support import screenshot

# One pass over the explorer's visible text: HTML elements with text of their own (buttons, labels, the status, the
# table's cells, the token strip's tokens) and every SVG <text> of the plotly figures (titles, axis titles, tick
# labels, legend entries, annotations; hover labels excluded). Boxes are the client rectangles.
CHECK = r"""
(root, opts) => {
  const out = [];
  const vw = window.innerWidth;
  const shown = el => {
    for (let e = el; e && e !== document.body; e = e.parentElement) {
      const s = getComputedStyle(e);
      if (s.display === 'none' || s.visibility === 'hidden' || s.opacity === '0') return false;
    }
    const r = el.getBoundingClientRect();
    return r.width > 0.5 && r.height > 0.5;
  };
  const name = el => {
    const fig = el.closest('.js-plotly-plot');
    const owner = fig ? (fig.closest('[class*="kvx-fig-"]') || fig) : el.closest('[class*="kvx-"]');
    const cls = owner ? [...owner.classList].filter(c => c.startsWith('kvx-')).join('.') : '';
    const t = (el.textContent || '').trim().replace(/\s+/g, ' ').slice(0, 40);
    return `${cls || el.tagName.toLowerCase()} "${t}"`;
  };
  const texts = [];  // {el, r, fig, kind}
  for (const fig of root.querySelectorAll('.js-plotly-plot')) {
    if (!shown(fig)) continue;
    const fr = fig.getBoundingClientRect();
    for (const t of fig.querySelectorAll('svg text')) {
      if (t.closest('.hoverlayer') || !(t.textContent || '').trim() || !shown(t)) continue;
      const r = t.getBoundingClientRect();
      const kind = t.closest('.legend') ? 'legend' : t.closest('.xtick, .ytick, [class*="tick"]') ? 'tick' : 'text';
      texts.push({el: t, r, fig, kind});
      if (r.left < fr.left - 2 || r.right > fr.right + 2 || r.top < fr.top - 2 || r.bottom > fr.bottom + 2)
        out.push(`clipped: ${name(t)} at x ${r.left.toFixed(0)}..${r.right.toFixed(0)}, y ${r.top.toFixed(0)}..` +
                 `${r.bottom.toFixed(0)} outside its figure x ${fr.left.toFixed(0)}..${fr.right.toFixed(0)}, ` +
                 `y ${fr.top.toFixed(0)}..${fr.bottom.toFixed(0)}`);
    }
    const scroll = fig.querySelector('.legend .scrollbar');
    if (scroll && scroll.getBoundingClientRect().height > 1)
      out.push(`legend scrolls: ${name(fig)} (its entries do not fit its box)`);
    let plot = 0;
    for (const d of fig.querySelectorAll('.nsewdrag')) {
      const r = d.getBoundingClientRect(); plot += r.width * r.height;
    }
    const share = plot / (fr.width * fr.height);
    if (plot > 0 && share < opts.plotShare)
      out.push(`squeezed: ${name(fig)}: the plot areas take ${(100 * share).toFixed(0)}% of the figure ` +
               `(${fr.width.toFixed(0)}x${fr.height.toFixed(0)}), under ${(100 * opts.plotShare).toFixed(0)}%`);
    if (fr.right > vw + 1) out.push(`off screen: ${name(fig)} reaches x ${fr.right.toFixed(0)} of ${vw}`);
  }
  for (const el of root.querySelectorAll('*')) {
    if (el.closest('.js-plotly-plot') || el.closest('.kvx-strip')) continue;
    const own = [...el.childNodes].some(n => n.nodeType === 3 && n.textContent.trim());
    if (!own || !shown(el)) continue;
    texts.push({el, r: el.getBoundingClientRect(), fig: null, kind: 'html'});
  }
  // a box that hides what does not fit cuts it; one that scrolls (a wide table) keeps it in reach
  const scrolls = el => ['auto', 'scroll'].includes(getComputedStyle(el).overflowX);
  const inScroller = el => { for (let e = el.parentElement; e && e !== root; e = e.parentElement)
    if (scrolls(e)) return true; return false; };
  for (const el of root.querySelectorAll('.kvx-status, .kvx-error, .kvx-compare, .kvx-view, .kvx-tokens, ' +
                                         '.widget-html-content, table, .kvx-compare-scroll')) {
    if (!shown(el) || inScroller(el)) continue;
    if (el.scrollWidth > el.clientWidth + 2 && !scrolls(el) && getComputedStyle(el).overflowX !== 'visible')
      out.push(`cut: ${name(el)} is ${el.scrollWidth}px wide in a ${el.clientWidth}px box`);
    const r = el.getBoundingClientRect();
    if (r.right > vw + 1) out.push(`off screen: ${name(el)} reaches x ${r.right.toFixed(0)} of ${vw}`);
  }
  // overlaps: two text boxes that share more than a sliver (tick labels of one axis, a title and a tab bar)
  for (let i = 0; i < texts.length; i++) {
    const a = texts[i];
    for (let j = i + 1; j < texts.length; j++) {
      const b = texts[j];
      if (a.el.contains(b.el) || b.el.contains(a.el)) continue;
      const w = Math.min(a.r.right, b.r.right) - Math.max(a.r.left, b.r.left);
      const h = Math.min(a.r.bottom, b.r.bottom) - Math.max(a.r.top, b.r.top);
      if (w <= 1 || h <= 1) continue;
      const small = Math.min(a.r.width * a.r.height, b.r.width * b.r.height);
      if (w * h > 0.15 * small)
        out.push(`overlap: ${name(a.el)} and ${name(b.el)} share ${w.toFixed(0)}x${h.toFixed(0)} px`);
    }
  }
  // one screen (presenting on a projector): Step and the views under it within the window, the page as it opens
  if (opts.fitScreen) {
    const vh = window.innerHeight, step = root.querySelector('.kvx-step').getBoundingClientRect();
    if (step.top < -1 || step.bottom > vh + 1)
      out.push(`not one screen: Step at y ${step.top.toFixed(0)}..${step.bottom.toFixed(0)} of ${vh}`);
    for (const part of root.querySelectorAll('.kvx-left, .kvx-right')) {
      const r = part.getBoundingClientRect();
      if (shown(part) && r.bottom > vh + 1)
        out.push(`not one screen: ${name(part)} ends at y ${r.bottom.toFixed(0)} of ${vh} (Step at y ` +
                 `${step.top.toFixed(0)})`);
    }
  }
  if (opts.minFont) {
    for (const t of texts) {
      const size = parseFloat(getComputedStyle(t.el).fontSize);
      if (size < opts.minFont - 0.01)
        out.push(`small: ${name(t.el)} at ${size}px (presentation wants ${opts.minFont})`);
    }
  }
  return [...new Set(out)];
}
"""


def problems(explorer, min_font: float | None = None, plot_share: float = 0.25, fit_screen: bool = False) -> list[str]:
    """Every layout problem of ``explorer`` (a locator of its ``.kvx-explorer`` root) as it is on screen now;
    ``fit_screen``: Step and both columns of views within the window too."""
    return explorer.evaluate(CHECK, {"minFont": min_font, "plotShare": plot_share, "fitScreen": fit_screen})


SIZES = ({"width": 1280, "height": 800}, {"width": 1920, "height": 1080})
MAP_TAB = "Cache map"  # presenting, the cache map's tab (kvexplore.explorer.controls.MAP_TAB)
TO_TOP = "() => document.querySelectorAll('*').forEach(e => { if (e.scrollTop) e.scrollTop = 0; })"
PRESENTING_PX = 18


# One wait in the page for a look (no round trip per condition): no operation runs (Step enabled); the kernel's state
# that it put in the page after its last refresh (``KVEXPLORE_INSPECT``, browser_truth.py) is what the look asked for:
# presenting or not, the lane, the view picked (presenting, the cache map's tab: the maps alone; a plain screen: the
# maps and one view), which the kernel publishes after the figures, table and status of the same refresh; then every
# figure has drawn what it was sent (their one draw queue, kvexplore/views/plot_figure.js, empty) and two frames have
# passed. A page without the kernel's state waits 250 ms for the kernel's figure messages instead.
SETTLE = """async (root, want) => {
  const frames = () => new Promise(r => requestAnimationFrame(() => requestAnimationFrame(r)));
  const sleep = ms => new Promise(r => setTimeout(r, ms));
  const shows = () => { const e = root.querySelector('.kvx-truth pre');
    if (root.querySelector('.kvx-step').disabled) return false;
    if (!e) return true;
    const t = JSON.parse(e.textContent), shown = t.shown || [];
    const maps = shown.filter(v => v.startsWith('cache_map')).length, others = shown.length - maps;
    if (root.classList.contains('kvx-presenting') !== want.presenting) return false;
    if (want.lane !== null && t.lane !== want.lane) return false;
    if (want.view === 'cache_map') return others === 0;
    if (want.view !== null) return shown.includes(want.view) && (want.presenting ? others === 1 : maps > 0);
    return want.lane !== null || (want.presenting ? others === 0 : others === 1 && maps > 0); };
  const t0 = Date.now();
  while (!shows()) {
    if (Date.now() - t0 > want.timeout_ms) return `the page never showed ${JSON.stringify(want)}`;
    await sleep(50);
  }
  if (!root.querySelector('.kvx-truth pre')) await sleep(250);
  await frames();
  const q = globalThis.__kvxDrawQueue;
  for (let i = 0; q && i < 50; i++) {
    const tail = q.tail, late = Symbol();
    if (await Promise.race([tail.then(() => null), sleep(want.timeout_ms).then(() => late)]) === late)
      return 'the figures never finished drawing';
    await frames();
    if (tail === q.tail) break; }
  return ''; }"""


def _settle(page, explorer, presenting: bool, lane: str | None = None, title: str | None = None) -> None:
    """Wait until the page shows what the look asked for, drawn (:data:`SETTLE`): ``presenting`` and the ``lane`` or
    the tab ``title`` (neither: the presentation box was just clicked)."""
    from kvexplore.views.registry import VIEWS

    view = next(name for name, v in VIEWS.items() if v.title == title) if title else None
    failed = explorer.evaluate(SETTLE, {"lane": lane, "presenting": presenting, "view": view,
                                        "timeout_ms": 120_000})
    assert not failed, failed


def _lane(page, explorer, lane: str, presenting: bool) -> None:
    explorer.locator(".kvx-lane select").first.select_option(label=lane)
    _settle(page, explorer, presenting, lane=lane)


def check_layout(page, explorer, shots, name: str, lanes: dict[str, tuple[str, ...]] | None = None,
                 plot_share: float = 0.25, sizes: tuple[dict, ...] = SIZES, one_screen: bool = False) -> list[str]:
    """At each of ``sizes`` (1280 x 800 and 1920 x 1080), without and with presentation, every tab of the explorer and,
    for each lane of
    ``lanes`` (lane -> the tabs to look at with it on screen; default: the lane shown, every tab), the layout
    holds (:func:`problems`; presenting, every text at 18 px at least, and with ``one_screen`` Step and the views
    within the window at 1280 x 800: the app on a projector). A screenshot of each look goes to
    ``shots``; the first look with problems fails, naming them and its screenshot. Returns what was looked at."""
    looked = []
    first_lane = explorer.locator(".kvx-lane select").first.input_value()
    tabs_titles = [b.inner_text() for b in explorer.locator(".kvx-view button").all()]
    lanes = lanes or {first_lane: tuple(tabs_titles)}
    box = explorer.locator(".kvx-presentation input").first
    try:
        for size in sizes:
            page.set_viewport_size(size)
            for presenting in (False, True):
                if box.is_checked() != presenting:
                    box.click()
                    _settle(page, explorer, presenting)
                for lane, tabs in lanes.items():
                    _lane(page, explorer, lane, presenting)
                    fit = one_screen and presenting and size == SIZES[0]
                    for title in (MAP_TAB, *tabs) if presenting else tabs:  # presenting, the cache map is a tab
                        explorer.locator(f".kvx-view button:text-is('{title}')").first.click()
                        _settle(page, explorer, presenting, lane, title)
                        if fit:  # the page as it opens: the app's header too
                            page.evaluate(TO_TOP)
                        else:
                            explorer.evaluate("(e) => e.scrollIntoView({block: 'start'})")
                        tag = (f"{name}_{size['width']}x{size['height']}{'_presenting' if presenting else ''}_"
                               f"{lane.replace('@', '-').replace(' ', '_')}_{title.replace(' ', '_').replace('/', '')}")
                        path = shots / f"layout_{tag}.png"
                        screenshot(page, path)
                        found = problems(explorer, PRESENTING_PX if presenting else None, plot_share, fit)
                        assert not found, f"{tag} ({path}):\n  " + "\n  ".join(found[:30])
                        looked.append(tag)
    finally:
        if box.is_checked():
            box.click()
            _settle(page, explorer, False)
        page.set_viewport_size(SIZES[0])
        _lane(page, explorer, first_lane, False)
    return looked
