"""Real-browser test support, the pages: JupyterLab driven through ``window.jupyterapp``, the Voila app opened, the
explorer's DOM and plotly figures read, screenshots and timings kept (the servers and the browser are
``browser_servers.py``'s; ``browser_support.py`` gives both under one name).

Waits are on conditions (CSS selectors, kernel status, the cells' execution counts), never fixed sleeps.
"""

from __future__ import annotations

import contextlib
import json
import os
from collections.abc import Iterator
from pathlib import Path

from browser_servers import Server

WIDGETS_S = 180  # run all cells until the widgets are drawn, on a shared, busy machine


def open_voila_app(page, server: Server, timeout_s: float = WIDGETS_S, first_s: float = 60):
    """Open the Voila app at ``server`` in ``page`` and wait for the explorer; returns its locator.

    Voila starts a kernel per page load. On a busy machine a kernel start has been seen to never answer (CI, three
    times in about a dozen runs: the page waited out the whole timeout, 150-180 s, then a second load took seconds;
    the other Voila servers of the run were fine). A healthy first load shows the explorer in well under a minute
    even in a full run, so the first load waits ``first_s``; when the explorer has not appeared by then, the page is
    loaded once more with a fresh kernel and waits ``timeout_s``, and what the first load showed (the page's text,
    the server's log) is printed; a second failure raises with both."""
    first = ""
    for attempt in (1, 2):
        page.goto(server.base_url + "/")
        explorer = page.locator(".kvx-explorer").first
        try:
            explorer.wait_for(timeout=(min(first_s, timeout_s) if attempt == 1 else timeout_s) * 1000)
            if first:
                print(f"Voila: the explorer appeared on the second load; the first showed:\n{first}")
            # the page shows the explorer before the app's first prefill (Voila renders cell by cell): a figure draws
            # once it is done
            page.locator("[data-kvx-draws]").first.wait_for(timeout=timeout_s * 1000)
            return explorer
        except Exception as exc:  # playwright's TimeoutError
            text = page.evaluate("() => document.body ? document.body.innerText.slice(0, 1500) : ''")
            seen = f"load {attempt}: {type(exc).__name__}\npage text:\n{text}\nserver log:\n{server.output()}"
            if attempt == 2:
                raise AssertionError(f"the Voila app never showed the explorer\n{first}\n{seen}") from exc
            first = seen


def new_page(ctx):
    page = ctx.new_page()
    page.on("console", lambda m: m.type == "error" and ctx.console_errors.append(m.text[:300]))
    page.on("requestfailed", lambda r: ctx.console_errors.append(f"request failed: {r.url[:200]} ({r.failure})"))
    return page


# --- JupyterLab, through window.jupyterapp (LabApp.expose_app_in_browser) -------------------------------------

RUN_FINISHED = """() => { const w = window.jupyterapp && window.jupyterapp.shell.currentWidget;
  const k = w && w.sessionContext && w.sessionContext.session && w.sessionContext.session.kernel;
  if (!k || k.status !== 'idle') return false;
  const cells = w.content.model.cells; let done = true, failed = false;
  for (let i = 0; i < cells.length; i++) { const c = cells.get(i); if (c.type !== 'code') continue;
    if (c.executionCount === null || c.executionCount === undefined) done = false;
    for (const o of c.outputs.toJSON()) if (o.output_type === 'error') failed = true; }
  return done || failed; }"""

ERROR_OUTPUTS = """() => { const cells = window.jupyterapp.shell.currentWidget.content.model.cells; const errs = [];
  for (let i = 0; i < cells.length; i++) { const c = cells.get(i); if (c.type !== 'code') continue;
    for (const o of c.outputs.toJSON()) if (o.output_type === 'error')
      errs.push(`cell ${i}: ${o.ename}: ${o.evalue}`); }
  return errs; }"""


def start_run_all(page) -> None:
    """Run every cell of the current notebook (returns at once; see :func:`wait_run_finished`)."""
    page.evaluate("() => { window.jupyterapp.commands.execute('notebook:run-all-cells'); }")


def wait_run_finished(page) -> list[str]:
    """Wait until every code cell has run (or one failed) and the kernel is idle; the error outputs."""
    page.wait_for_function(RUN_FINISHED, timeout=WIDGETS_S * 1000, polling=250)
    return page.evaluate(ERROR_OUTPUTS)


def shutdown_kernel(page) -> None:
    with contextlib.suppress(Exception):
        page.evaluate("() => window.jupyterapp.shell.currentWidget.sessionContext.shutdown()")


APP_READY = "() => !!(window.jupyterapp && window.jupyterapp.shell)"
OPEN_NOTEBOOK = "(p) => window.jupyterapp.commands.execute('docmanager:open', {path: p}).then(() => true)"
NOTEBOOK_READY = """(p) => { const w = window.jupyterapp.shell.currentWidget;
  const k = w && w.context && w.context.path === p && w.sessionContext && w.sessionContext.session
    && w.sessionContext.session.kernel;
  return !!k && k.status === 'idle' && w.content.widgets.length > 0; }"""
CLOSE_ALL = """async () => { const app = window.jupyterapp;
  for (const w of [...app.shell.widgets('main')]) {
    try { if (w.sessionContext && w.sessionContext.session) await w.sessionContext.shutdown(); } catch (e) {}
    if (w.context && w.context.model) w.context.model.dirty = false;  // no "save changes?" dialog
    w.dispose(); }
  return true; }"""


class LabPage:
    """One JupyterLab page for a whole run: notebooks are opened in it one after another (``docmanager:open``), so
    the app loads once. After each notebook its kernel is shut down and its tab closed; a test that fails leaves
    the next one a freshly loaded page."""

    def __init__(self, server: Server, ctx) -> None:
        self.server, self.ctx, self.page = server, ctx, None

    def _page(self):
        if self.page is None or self.page.is_closed():
            self.page = new_page(self.ctx)
            self.page.goto(f"{self.server.base_url}/lab?reset&token={self.server.token}")
            self.page.wait_for_function(APP_READY, timeout=WIDGETS_S * 1000)
            self.page.evaluate("() => window.jupyterapp.restored.then(() => true)")
        return self.page

    @contextlib.contextmanager
    def notebook(self, name: str, viewport: dict | None = None) -> Iterator[object]:
        """The page with notebook ``name`` (a path under the server's root) open and its kernel idle."""
        page = self._page()
        page.set_viewport_size(viewport or {"width": 1400, "height": 1000})
        page.evaluate(CLOSE_ALL)
        ok = False
        try:
            page.evaluate(OPEN_NOTEBOOK, name)
            page.wait_for_function(NOTEBOOK_READY, arg=name, timeout=WIDGETS_S * 1000, polling=100)
            yield page
            ok = True
        finally:
            if ok:
                page.evaluate(CLOSE_ALL)
            else:
                shutdown_kernel(page)
                page.close()
                self.page = None


# --- the explorer's DOM --------------------------------------------------------------------------------------

PLOT_SIGNATURE = """(el) => { const gd = el.querySelector('.js-plotly-plot') || el;
  const s = JSON.stringify({data: gd.data, title: gd.layout && gd.layout.title,
                            svg: gd.querySelectorAll('svg *').length});
  let h = 0; for (let i = 0; i < s.length; i++) h = (Math.imul(31, h) + s.charCodeAt(i)) | 0;
  return `${s.length}:${h}`; }"""


UNDRAWN_TRACES = """(gd) => (gd._fullData || []).filter((t, i) => {
    const d = gd.data[i] || {}; const z = d.z, y = d.y;
    const has = (z && z.length) || (!z && y && y.length);    // a trace given data...
    return has && t.visible === false && d.visible !== false;  // ...that plotly.js refused to draw
  }).map(t => `${t.type} ${JSON.stringify(t.name || '')}`)"""


def undrawn_traces(locator) -> list[str]:
    """Traces of a plotly div that carry data but that plotly.js did not draw (it sets ``visible: false`` on a trace
    whose arrays are inconsistent, e.g. a heatmap whose x/y did not reach the browser)."""
    return locator.evaluate(UNDRAWN_TRACES)


def plot_signature(locator) -> str:
    """A hash of a plotly div's data, title and svg element count: changes when the figure is redrawn with new data."""
    return locator.evaluate(PLOT_SIGNATURE)


def looking() -> bool:
    """Whether someone will look at the screenshots (``$KVX_SCREENSHOTS`` set). Otherwise the browser tests take
    only the screenshots of a failure: a shot costs Chromium a render and a PNG (about 190 a run), and nobody opens
    the temporary folder."""
    return bool(os.environ.get("KVX_SCREENSHOTS"))


def screenshot(target, path, **options) -> None:
    """``target.screenshot(path=path)`` (a page or an element) when someone will look (:func:`looking`) or the name
    says it is a failure's."""
    if looking() or "FAILED" in Path(path).name:
        target.screenshot(path=str(path), **options)


def tall_screenshot(page, path, scroller: str | None = None, element=None, max_height: int = 12000,
                    parts: dict | None = None) -> None:
    """A screenshot of the whole content (or of ``element``), also when it scrolls inside an element (JupyterLab's
    notebook panel, Voila's page): the viewport is made as tall as the scrolled content for the shot, then restored.
    ``parts`` (path -> locator): more element screenshots taken in the same tall viewport.

    Only when someone will look at them (:func:`looking`): a viewport as tall as a notebook makes every plotly figure
    in it lay out again, seconds a shot on a busy machine. Otherwise only a failure's shot is taken, of the screen as
    it is."""
    tall = looking()
    if not tall and "FAILED" not in Path(path).name:
        return
    size = page.viewport_size
    try:
        if tall:
            extra = page.evaluate("""(sel) => { const els = sel ? [...document.querySelectorAll(sel)] : [];
                els.push(document.scrollingElement || document.documentElement);
                return Math.max(0, ...els.map(e => e.scrollHeight - e.clientHeight)); }""", scroller)
            height = min(size["height"] + extra, max_height)
            if height > size["height"]:
                page.set_viewport_size({"width": size["width"], "height": height})
                page.wait_for_function("() => new Promise(r => requestAnimationFrame(() => r(true)))")
        if element is None:
            page.screenshot(path=str(path), full_page=tall)
        else:
            element.scroll_into_view_if_needed()
            element.screenshot(path=str(path))
        for part_path, part in (parts or {}).items():
            part.scroll_into_view_if_needed()
            part.screenshot(path=str(part_path))
    finally:
        page.set_viewport_size(size)


RENDERED_CELLS = """async () => { const nb = window.jupyterapp.shell.currentWidget.content;
  const frame = () => new Promise(r => requestAnimationFrame(() => requestAnimationFrame(r)));
  const seen = {cells: 0, markdown: 0, code: 0, outputs: 0};
  for (let i = 0; i < nb.widgets.length; i++) {
    const cell = nb.widgets[i];
    if (nb.scrollToItem) await nb.scrollToItem(i, 'start'); else cell.node.scrollIntoView();
    for (let t = 0; t < 100 && !cell.node.isConnected; t++) await frame();  // drawn once in view
    await frame();
    if (!cell.node.isConnected) continue;
    seen.cells++;
    if (cell.node.querySelector('.jp-RenderedMarkdown')) seen.markdown++;
    if (cell.model.type === 'code' && cell.node.querySelector('.jp-InputArea')) seen.code++;
    seen.outputs += cell.node.querySelectorAll('.jp-OutputArea-output').length; }
  if (nb.scrollToItem) await nb.scrollToItem(0, 'start');
  return seen; }"""


def rendered_cells(page) -> dict:
    """Scroll the current notebook to each of its cells in turn (JupyterLab draws only the cells near the screen)
    and count the cells drawn, the rendered markdown cells, the code cells and the output areas."""
    return page.evaluate(RENDERED_CELLS)


LAB_SCROLLER = ".jp-NotebookPanel:not(.lm-mod-hidden) .jp-WindowedPanel-outer"
VOILA_SCROLLER = "body, #rendered_cells, .jp-LabShell, main"


def figure(explorer, name: str):
    """The plotly div of the explorer's figure ``name`` (the FigureWidget's element carries both classes; a wrapper
    box with the class is accepted too)."""
    return explorer.locator(f".kvx-fig-{name}.js-plotly-plot, .kvx-fig-{name} .js-plotly-plot").first


def token_count(explorer) -> int:
    return explorer.locator(".kvx-tokens .kvx-tok").count()


def save_timings(folder: Path, name: str, timings: dict[str, float]) -> None:
    path = folder / "timings.json"
    data = json.loads(path.read_text()) if path.exists() else {}
    data[name] = {k: round(v, 2) for k, v in timings.items()}
    path.write_text(json.dumps(data, indent=1))
    print(f"\n{name} timings (s): {data[name]}")
