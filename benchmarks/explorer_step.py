"""How long one Step of the explorer takes on the server: the model step with attention capture, then the figures on
screen redrawn (the cache map and the tab's view: each a spec from one snapshot, then the whole figure serialized as
the widget sends it). Target: under 100 ms for SmolLM2 at context 512 on a normal CPU.

    python benchmarks/explorer_step.py [--model smollm2-135m] [--context 512] [--steps 12] [--threads 2]
        [--strategies preallocated]

Prints the median split (model step / figure updates / total) and the share each view takes. Steps alternate
with rewinds so every measured step runs at the same context length.
"""

from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path

import torch

import kvexplore
from kvexplore.views.plot import _to_json
from kvexplore.views.registry import VIEWS

TEXT = Path(__file__).resolve().parent.parent / "tests" / "data" / "moby_dick_chapter_1.txt"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--context", type=int, default=512)
    ap.add_argument("--steps", type=int, default=12)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--strategies", default="preallocated")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    model = kvexplore.load(args.model)
    ids = model.tokenizer.encode(TEXT.read_text())[: args.context - 1]
    ex = kvexplore.Explorer(model, strategies=tuple(args.strategies.split(",")), max_seq_len=args.context + 8)
    ex.prefill(ids)
    ex.step()  # warm up
    ex.rewind(1)
    model_ms, views_ms, total_ms = [], [], []
    views = list(VIEWS)
    per_view: dict[str, list[float]] = {name: [] for name in views}
    real_refresh = ex.refresh
    real_step = ex.session.step

    def timed_step():
        t = time.perf_counter()
        out = real_step()
        model_ms.append(1000 * (time.perf_counter() - t))
        return out

    def timed_refresh():
        t = time.perf_counter()
        real_refresh()
        views_ms.append(1000 * (time.perf_counter() - t))

    ex.session.step = timed_step
    ex.refresh = timed_refresh
    for _ in range(args.steps):
        t = time.perf_counter()
        ex.step()
        total_ms.append(1000 * (time.perf_counter() - t))
        ex.refresh = real_refresh
        ex.rewind(1)
        ex.refresh = timed_refresh
    ex.refresh = real_refresh
    # every view one at a time, as refresh() draws those on screen: the spec from the snapshot, then the figure's
    # state serialized as the widget protocol sends it
    spec_ms: dict[str, list[float]] = {name: [] for name in views}
    for _ in range(5):
        ex.session.step()
        snap = ex.snapshot()
        for name in views:
            t = time.perf_counter()
            spec = VIEWS[name].build(snap)
            mid = time.perf_counter()
            ex.figures[name].show(spec, force=True)
            _to_json(ex.figures[name].figure)
            spec_ms[name].append(1000 * (mid - t))
            per_view[name].append(1000 * (time.perf_counter() - mid))
        ex.session.rewind(1)
    length = ex.lane.cache.length
    med = statistics.median
    print(f"{args.model}, {args.strategies}, context {length}, {args.threads} threads, {args.steps} steps, medians:")
    print(f"  model step (attention of every layer captured): {med(model_ms):7.1f} ms")
    print(f"  refresh (token strip, status, compare table, {len(ex.shown())} figures on screen):  "
          f"{med(views_ms):7.1f} ms")
    print(f"  one Step, total:                                 {med(total_ms):7.1f} ms   (target < 100 ms)")
    print("  per view, spec (pure) + figure state serialized: "
          + ", ".join(f"{n} {med(spec_ms[n]):.1f} + {med(v):.1f} ms" for n, v in per_view.items()))


if __name__ == "__main__":
    main()
