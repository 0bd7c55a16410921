"""How long one Step of the explorer takes on the server: the model step with attention capture, then every figure
updated in place (inside ``batch_update``). Target: under 100 ms for SmolLM2 at context 512 on a normal CPU.

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
    per_view: dict[str, list[float]] = {name: [] for name in ex.views}
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
    # the views one at a time, as refresh() runs them after a step: spec (pure) then apply (changes only)
    spec_ms: dict[str, list[float]] = {name: [] for name in ex.views}
    for _ in range(5):
        ex.session.step()
        for name in ex.views:
            t = time.perf_counter()
            spec = _one(ex, name)
            mid = time.perf_counter()
            ex._live.update(name, spec)
            spec_ms[name].append(1000 * (mid - t))
            per_view[name].append(1000 * (time.perf_counter() - mid))
        ex.session.rewind(1)
    length = ex.lane.cache.length
    med = statistics.median
    print(f"{args.model}, {args.strategies}, context {length}, {args.threads} threads, {args.steps} steps, medians:")
    print(f"  model step (attention of every layer captured): {med(model_ms):7.1f} ms")
    print(f"  figure updates (token strip, status, {len(ex.views)} figures):  {med(views_ms):7.1f} ms")
    print(f"  one Step, total:                                 {med(total_ms):7.1f} ms   (target < 100 ms)")
    print("  per view, spec (pure) + apply (in place): "
          + ", ".join(f"{n} {med(spec_ms[n]):.1f} + {med(v):.1f} ms" for n, v in per_view.items()))


def _one(ex, name):
    views, ex.views = ex.views, (name,)
    try:
        return ex.specs()[name]
    finally:
        ex.views = views


if __name__ == "__main__":
    main()
