"""From a click on Step to the repainted cache map, in a real browser: the explorer in Voila (``kvexplore app``'s
page) in headless Chromium, timed from the click to the moment the cache map's plotly div has drawn the new state.

    python benchmarks/explorer_click.py [--model tiny] [--strategies preallocated,concat,quantized] [--steps 20]

Prints, per step, the click-to-repaint time, and the medians of where it goes: the kernel's work (one Step of the
same explorer run in this process: the model steps of every lane plus the refresh of the figures on screen),
plotly.js drawing the figures on screen (measured in the page), and the rest (comm messages between kernel and page,
the page's widget manager). With ``--compare`` the compare tab is shown and each lane's step time is read from the page after every click: their
medians from the third click on (the exact lanes should agree within 1.5x, tests/test_browser_timing.py). Targets:
under 250 ms for the tiny model with three lanes, under 400 ms for SmolLM2 with two, on a quiet machine.
Needs Debian's chromium and the notebook and dev extras (as the browser tests do).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))

from browser_support import chromium, figure, new_page, voila_server  # noqa: E402

DRAWS = "(el) => Number((el.closest('.kvx-fig-cache_map') || el).dataset.kvxDraws || 0)"
STEP_TIMES = """(el) => { const gd = el.closest('.js-plotly-plot') || el.querySelector('.js-plotly-plot');
  const out = {}; for (const t of gd.data) if (t.name && t.name.startsWith('ms/step · ')) out[t.name.slice(10)] = t.y;
  return out; }"""
DRAW_MS = """(root) => [...root.querySelectorAll('[data-kvx-draw-ms]')]
  .filter(e => e.offsetParent !== null).map(e => Number(e.dataset.kvxDrawMs))"""


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="tiny")
    ap.add_argument("--strategies", default="preallocated,concat,quantized")
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--pause", type=float, default=0.3, help="seconds between clicks (a person reads the figure)")
    ap.add_argument("--compare", action="store_true", help="show the compare tab; print each lane's step times")
    args = ap.parse_args()
    strategies = tuple(args.strategies.split(","))
    kernel = _kernel_ms(args.model, strategies, args.steps, args.pause)
    with tempfile.TemporaryDirectory(prefix="kvx-click-") as tmp, \
            voila_server(Path(tmp), model=args.model, strategies=strategies, inspect=False) as server, \
            chromium({"width": 1280, "height": 800}) as ctx:
        page = new_page(ctx)
        page.goto(server.base_url + "/")
        explorer = page.locator(".kvx-explorer").first
        explorer.wait_for(timeout=300_000)
        plot = figure(explorer, "cache_map")
        plot.wait_for(timeout=300_000)
        if args.compare:
            explorer.locator(".kvx-view button", has_text="Compare strategies").click()
            figure(explorer, "compare").wait_for(timeout=60_000)
        step = explorer.locator(".kvx-step").first
        total, drawing = [], []
        for i in range(args.steps + 2):  # the first two warm the page up, untimed
            before = plot.evaluate(DRAWS)
            t0 = time.perf_counter()
            step.click()
            page.wait_for_function(f"([el, n]) => ({DRAWS})(el) > n", arg=[plot.element_handle(), before],
                                   polling="raf", timeout=120_000)
            ms = 1000 * (time.perf_counter() - t0)
            page.wait_for_function("(root) => !root.querySelector('.kvx-step').disabled",
                                   arg=explorer.element_handle(), polling=50)
            if i >= 2:
                total.append(ms)
                drawing.append(sum(explorer.evaluate(DRAW_MS)))
                print(f"step {i - 1:3d}: click -> cache map repainted {ms:7.1f} ms")
            page.wait_for_timeout(int(1000 * args.pause))
        med = statistics.median
        print(f"\n{args.model}, lanes {','.join(strategies)}, {args.steps} steps, medians:")
        print(f"  click -> cache map repainted: {med(total):7.1f} ms  (min {min(total):.1f}, max {max(total):.1f})")
        print(f"  kernel (model steps + refresh, same explorer in this process): {med(kernel):7.1f} ms")
        print(f"  plotly.js drawing the figures on screen: {med(drawing):7.1f} ms")
        print(f"  the rest (messages, widget manager): {med(total) - med(kernel) - med(drawing):7.1f} ms")
        if args.compare:
            lanes = figure(explorer, "compare").evaluate(STEP_TIMES)
            print("  forward ms per step read from the page, median from the third click on: " + ", ".join(
                f"{name} {med(ms[2:]):.2f}" for name, ms in lanes.items()))


def _kernel_ms(model: str, strategies: tuple[str, ...], steps: int, pause: float) -> list[float]:
    """One Step of the app's explorer in this process (what the kernel does for a click), with the same pauses."""
    import kvexplore
    from kvexplore.cli import launch

    ex = kvexplore.Explorer(model, strategies=strategies, max_seq_len=128, prompt=launch.APP_PROMPT)
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
