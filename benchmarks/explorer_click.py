"""From a click on Step to the repainted cache map, in a real browser: the explorer in Voila (``kvexplore app``'s
page) or, with ``--lab``, in a notebook in JupyterLab, in headless Chromium, timed from the click to the moment the
cache map's plotly div has drawn the new state.

    python benchmarks/explorer_click.py [--model tiny] [--strategies preallocated,concat,quantized] [--steps 20]
    python benchmarks/explorer_click.py --model smollm2-135m --strategies preallocated,concat --prompt-tokens 512 \
        --pause 2 --before ../kvexplore-old        # issue 40's click, another checkout measured first

Prints, per step, the click-to-repaint time, and the medians of where it goes: the kernel's work (one Step of the
same explorer run in this process: the model steps of every lane plus the refresh of the figures on screen),
plotly.js drawing the figures on screen (measured in the page), and the rest (comm messages between kernel and page,
the page's widget manager). With ``--compare`` the compare tab is shown and each lane's step time is read from the
page after every click: their medians from the third click on (the exact lanes should agree within 1.5x,
tests/screen/test_browser_timing.py). Targets: under 250 ms for the tiny model with three lanes, under 400 ms for
SmolLM2 with two, on a quiet machine.
``--prompt-tokens N`` opens the app on the first N tokens of a chapter of Moby-Dick (tests/data) instead of its
short prompt, with room for the clicks. ``--before PATH`` first runs this same script with ``PATH`` (another
checkout of kvexplore) first on ``PYTHONPATH``, so that its process, Voila server and kernel import that kvexplore,
then measures this checkout, and prints the two side by side. Needs Debian's chromium and the notebook and dev
extras (as the browser tests do). ``--lab`` opens a notebook in JupyterLab (a fresh server and profile, the page at
1280 x 800) whose one cell builds the same explorer as the app page (``app_explorer`` with the same settings) and
shows it as a cell's output.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests" / "support"))

from browser_support import (LabPage, chromium, figure, lab_server, new_page, open_voila_app,  # noqa: E402
                             start_run_all, voila_server, wait_run_finished)

DRAWS = "(el) => Number((el.closest('.kvx-fig-cache_map') || el).dataset.kvxDraws || 0)"
STEP_TIMES = """(el) => { const gd = el.closest('.js-plotly-plot') || el.querySelector('.js-plotly-plot');
  const out = {}; for (const t of gd.data) if (t.name && t.name.startsWith('ms/step · ')) out[t.name.slice(10)] = t.y;
  return out; }"""
# before a click: note the time, and when the status line's text and the right-hand view's figure next change
ARM = """(root) => { const t = window.__kvxClick = {t0: performance.now()};
  const status = root.querySelector('.kvx-status');
  const mo = new MutationObserver(() => { if (!t.status) t.status = performance.now() - t.t0; mo.disconnect(); });
  if (status) mo.observe(status, {childList: true, subtree: true, characterData: true});
  const right = [...root.querySelectorAll('.kvx-right [data-kvx-draws]')].filter(e => e.offsetParent !== null);
  t.right0 = right.map(e => Number(e.dataset.kvxDraws)); t.rightEls = right; }"""
RIGHT_DRAWN = """() => { const t = window.__kvxClick;
  if (t.rightEls.some((e, i) => Number(e.dataset.kvxDraws) > t.right0[i])) {
    if (!t.right) t.right = performance.now() - t.t0; return true; }
  return t.rightEls.length === 0; }"""
TAB_DRAWN = """([root, name, before]) => { const el = root.querySelector('.kvx-fig-' + name + ' [data-kvx-draws]')
  || root.querySelector('.kvx-fig-' + name);
  return !!el && el.offsetParent !== null && Number(el.dataset.kvxDraws || 0) > before; }"""
TAB_DRAWS = """([root, name]) => { const el = root.querySelector('.kvx-fig-' + name + ' [data-kvx-draws]')
  || root.querySelector('.kvx-fig-' + name); return el ? Number(el.dataset.kvxDraws || 0) : 0; }"""
DRAW_MS = """(root) => [...root.querySelectorAll('[data-kvx-draw-ms]')].filter(e => e.offsetParent !== null)
  .map(e => [([...(e.closest('[class*=kvx-fig-]') || e).classList].find(c => c.startsWith('kvx-fig-')) || '?').slice(8),
             Number(e.dataset.kvxDrawMs)])"""


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="tiny")
    ap.add_argument("--strategies", default="preallocated,concat,quantized")
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--pause", type=float, default=0.3, help="seconds between clicks (a person reads the figure)")
    ap.add_argument("--compare", action="store_true", help="show the compare tab; print each lane's step times")
    ap.add_argument("--prompt-tokens", type=int, default=0, help="open on a prompt of this many tokens (0: the app's)")
    ap.add_argument("--tabs", default="Memory,Attention",
                    help="after the clicks, switch between these tabs (with the same pauses) and time each switch")
    ap.add_argument("--switches", type=int, default=8, help="tab switches timed (0: none)")
    ap.add_argument("--lab", action="store_true", help="the explorer in a JupyterLab notebook instead of Voila")
    ap.add_argument("--before", metavar="PATH", help="another checkout of kvexplore, measured first")
    ap.add_argument("--json", metavar="FILE", help=argparse.SUPPRESS)  # where a --before run leaves its medians
    args = ap.parse_args()
    strategies = tuple(args.strategies.split(","))
    before = _before(args) if args.before else None
    app = _app_settings(args.model, args.prompt_tokens, args.steps)
    after = _measure(args, strategies, app)
    if args.json:
        Path(args.json).write_text(json.dumps(after))
    if before is not None:
        print(f"\n{'JupyterLab' if args.lab else 'Voila'}, {args.model}, lanes {','.join(strategies)}, "
              f"prompt {args.prompt_tokens or 'the app'}'s tokens, "
              f"pause {args.pause} s, medians, before ({args.before}) -> after (this checkout):")
        for key in after:
            print(f"  {key:<62} {before.get(key, float('nan')):7.1f} -> {after[key]:7.1f} ms")


def _before(args: argparse.Namespace) -> dict[str, float]:
    """This script's medians with the checkout ``args.before`` first on ``PYTHONPATH`` (run as a child process)."""
    argv = [a for a in sys.argv[1:]]
    i = argv.index("--before") if "--before" in argv else None
    argv = argv[:i] + argv[i + 2:] if i is not None else [a for a in argv if not a.startswith("--before=")]
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(Path(args.before).resolve()),
                                                       *filter(None, [os.environ.get("PYTHONPATH")])]))
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "before.json"
        print(f"== before: {args.before}", flush=True)
        subprocess.run([sys.executable, __file__, *argv, "--json", str(out)], env=env, check=True)
        print("== after: this checkout", flush=True)
        return json.loads(out.read_text())


def _switch_tabs(page, explorer, tabs: list[str], n: int, pause: float) -> list[float]:
    """Click the tabs ``tabs`` in turn ``n`` times, each timed from the click until its view has drawn."""
    from kvexplore.views.registry import VIEWS

    names = {view.title: name for name, view in VIEWS.items()}
    out = []
    for i in range(n + 1):  # the first switch is untimed (a view drawn for the first time)
        title = tabs[i % len(tabs)]
        button = explorer.locator(f".kvx-view button:text-is('{title}')").first
        name = names[title]
        before = page.evaluate(TAB_DRAWS, [explorer.element_handle(), name])
        t0 = time.perf_counter()
        button.click()
        page.wait_for_function(TAB_DRAWN, arg=[explorer.element_handle(), name, before], polling="raf",
                               timeout=120_000)
        ms = 1000 * (time.perf_counter() - t0)
        if i:
            out.append(ms)
            print(f"tab {i:3d} ({title}): click -> drawn {ms:7.1f} ms")
        page.wait_for_timeout(int(1000 * pause))
    return out


def _app_settings(model: str, prompt_tokens: int, steps: int) -> dict:
    """The app's prompt and caches' size: its own, or the first ``prompt_tokens`` tokens of a chapter."""
    if not prompt_tokens:
        return {}
    import kvexplore
    text = (Path(__file__).resolve().parent.parent / "tests" / "data" / "moby_dick_chapter_135.txt").read_text()
    tok = kvexplore.load(model).tokenizer
    ids = tok.encode(text)[:prompt_tokens]
    if len(ids) < prompt_tokens:
        raise SystemExit(f"the chapter has {len(ids)} tokens for this model, fewer than --prompt-tokens")
    return {"prompt": tok.decode(ids), "max_seq_len": prompt_tokens + steps + 64, "prompt_tokens": prompt_tokens}


@contextlib.contextmanager
def _explorer_page(args: argparse.Namespace, strategies: tuple[str, ...], app: dict) -> Iterator[tuple]:
    """The page and the explorer's locator: the Voila app, or (``--lab``) a JupyterLab notebook showing the same
    explorer as its cell's output."""
    from kvexplore.cli import launch

    server_app = {k: v for k, v in app.items() if k != "prompt_tokens"}
    viewport = {"width": 1280, "height": 800}
    with tempfile.TemporaryDirectory(prefix="kvx-click-") as tmp, chromium(viewport) as ctx:
        if not args.lab:
            with voila_server(Path(tmp), model=args.model, strategies=strategies, inspect=False,
                              **server_app) as server:
                page = new_page(ctx)
                yield page, open_voila_app(page, server, timeout_s=300)
            return
        import nbformat

        settings = {k: v for k, v in launch.app_environment(args.model, strategies, base={}, **server_app).items()
                    if k.startswith("KVEXPLORE_APP_")}
        folder = Path(tmp) / "notebooks"
        folder.mkdir()
        nb = nbformat.v4.new_notebook()
        nb.cells = [nbformat.v4.new_code_cell("from kvexplore.explorer.app_page import app_explorer\n\n"
                                              f"explorer = app_explorer({settings!r})\nexplorer")]
        nb.metadata["kernelspec"] = {"name": "python3", "display_name": "Python 3", "language": "python"}
        nbformat.write(nb, str(folder / "click.ipynb"))
        with lab_server(folder, Path(tmp), inspect=False) as server, \
                LabPage(server, ctx).notebook("click.ipynb", viewport) as page:
            start_run_all(page)
            errors = wait_run_finished(page)
            if errors:
                raise SystemExit(f"the notebook failed: {errors}")
            yield page, page.locator(".kvx-explorer").first


def _measure(args: argparse.Namespace, strategies: tuple[str, ...], app: dict) -> dict[str, float]:
    kernel = _kernel_ms(args.model, strategies, args.steps, args.pause, app)
    with _explorer_page(args, strategies, app) as (page, explorer):
        plot = figure(explorer, "cache_map")
        plot.wait_for(timeout=300_000)
        if args.compare:
            explorer.locator(".kvx-view button", has_text="Compare strategies").click()
            figure(explorer, "compare").wait_for(timeout=60_000)
        step = explorer.locator(".kvx-step").first
        total, drawing, each, status, right = [], [], {}, [], []
        for i in range(args.steps + 2):  # the first two warm the page up, untimed
            before = plot.evaluate(DRAWS)
            explorer.evaluate(ARM)
            t0 = time.perf_counter()
            step.click()
            page.wait_for_function(f"([el, n]) => ({DRAWS})(el) > n", arg=[plot.element_handle(), before],
                                   polling="raf", timeout=120_000)
            ms = 1000 * (time.perf_counter() - t0)
            page.wait_for_function("(root) => !root.querySelector('.kvx-step').disabled",
                                   arg=explorer.element_handle(), polling=50)
            page.wait_for_function(RIGHT_DRAWN, polling="raf", timeout=120_000)
            seen = page.evaluate("() => [window.__kvxClick.status || null, window.__kvxClick.right || null]")
            if i < 2:  # untimed, but a person sees them: the page's first clicks
                print(f"warm-up click {i + 1}: click -> cache map repainted {ms:7.1f} ms, "
                      f"right-hand view {seen[1] or 0:7.1f} ms; drawing " + ", ".join(
                          f"{name} {d:.1f} ms" for name, d in explorer.evaluate(DRAW_MS)))
            else:
                total.append(ms)
                status += [seen[0]] if seen[0] is not None else []
                right += [seen[1]] if seen[1] is not None else []
                draws = explorer.evaluate(DRAW_MS)
                drawing.append(sum(d for _, d in draws))
                for name, d in draws:
                    each.setdefault(name, []).append(d)
                print(f"step {i - 1:3d}: click -> cache map repainted {ms:7.1f} ms, status {seen[0] or 0:7.1f} ms, "
                      f"right-hand view {seen[1] or 0:7.1f} ms")
            page.wait_for_timeout(int(1000 * args.pause))
        switches = _switch_tabs(page, explorer, args.tabs.split(","), args.switches, args.pause)
        med = statistics.median
        # the figures draw one after another, the cache map first (kvexplore.views.plot): the click waits for its draw
        mine = med(each.get("cache_map", drawing))
        out = {"click -> cache map repainted": med(total),
               "kernel (model steps + refresh, same explorer in this process)": med(kernel),
               "plotly.js drawing the cache map": mine,
               "the rest (messages, widget manager)": med(total) - med(kernel) - mine,
               "plotly.js drawing every figure on screen, the cache map first": med(drawing)}
        if status:
            out["click -> status line repainted (in the page)"] = med(status)
        if right:
            out["click -> right-hand view repainted (in the page)"] = med(right)
        if switches:
            out["tab switch -> its view drawn"] = med(switches)
        print(f"\n{'JupyterLab' if args.lab else 'Voila'}, {args.model}, lanes {','.join(strategies)}, "
              f"{args.steps} steps, medians:")
        for key, ms in out.items():
            print(f"  {key}: {ms:7.1f} ms" + (f"  (min {min(total):.1f}, max {max(total):.1f})"
                                               if key == "click -> cache map repainted" else ""))
        print("  drawing, per figure: " + ", ".join(f"{name} {med(ms):.1f} ms" for name, ms in each.items()))
        if args.compare:
            lanes = figure(explorer, "compare").evaluate(STEP_TIMES)
            print("  forward ms per step read from the page, median from the third click on: " + ", ".join(
                f"{name} {med(ms[2:]):.2f}" for name, ms in lanes.items()))
        return out


def _kernel_ms(model: str, strategies: tuple[str, ...], steps: int, pause: float, app: dict) -> list[float]:
    """One Step of the app's explorer in this process (what the kernel does for a click), with the same pauses."""
    import kvexplore
    from kvexplore.cli import launch

    ex = kvexplore.Explorer(model, strategies=strategies, max_seq_len=app.get("max_seq_len", launch.APP_MAX_SEQ_LEN),
                            prompt=app.get("prompt", launch.APP_PROMPT))
    out = []
    for i in range(steps + 2):
        t0 = time.perf_counter()
        ex.step()
        if i >= 2:
            out.append(1000 * (time.perf_counter() - t0))
        time.sleep(pause)
    return out


if __name__ == "__main__":
    main()
