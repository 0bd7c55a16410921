"""Decode speed of two checkouts of kvexplore, interleaved in one run: did a change slow decoding down?

    python benchmarks/before_after.py --before ../kvexplore-old            # this checkout is "after"
    python benchmarks/before_after.py --before A --after B --rounds 4 --engines eager,compiled

    python benchmarks/before_after.py --before A --what step                # per-step time on the tiny model

Each round runs ``benchmarks/decode_speed.py`` (``--what decode``) once from each checkout, in a fresh process whose
``PYTHONPATH`` is
that checkout (so each side imports its own ``kvexplore`` and runs its own copy of the benchmark), alternating the
order (before, after, after, before, ...) so a slow drift of the machine hits both sides alike. Every process builds
the same random-weight models (same seeds) and decodes the same prompt; each reports its median tok/s per shape and
engine, and this script prints, per shape and engine, the median of the rounds on each side and their ratio
(after / before: 1.00 is no change; the rounds' spread says what noise is).

``--what step`` times what a small model's decode step costs besides its matrix products: the packaged tiny model,
one torch thread, one ``Generator.step()`` at a time on each cache strategy, 5 runs of 40 steps, the lower quartile
of each run and the best run (robust on a shared machine, where decode_speed.py's medians swing 2x). Printed as
tok/s (1 / step time), so after/before reads the same way.
"""

from __future__ import annotations

import argparse
import os
import re
import statistics
import subprocess
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent.parent
ROW = re.compile(r"^\s{2}(\S+)\s+((?:\s*[\d.]+ \(\s*[\d.]+%\))+)\s+(identical|DIFFER)")
CELL = re.compile(r"([\d.]+) \(\s*[\d.]+%\)")


STEP = """
import sys, time, torch
torch.set_num_threads(1)
import kvexplore
m = kvexplore.load("tiny")
for kind in ("preallocated", "concat", "paged", "sink", "quantized"):
    best = []
    for rep in range(5):
        g = kvexplore.Generator(m, kvexplore.make_cache(kind, m, max_seq_len=256))
        g.prefill("Once upon a time there was")
        ts = []
        for _ in range(40):
            t0 = time.perf_counter(); g.step(); ts.append(time.perf_counter() - t0)
        best.append(sorted(ts)[len(ts) // 4])
    print(f"tiny/{kind} {1 / min(best):.1f}")
"""


def run_steps(checkout: Path) -> dict[tuple[str, str], float]:
    """The per-step script in a process that imports ``checkout``'s kvexplore: tok/s per (model, strategy)."""
    out = subprocess.run([sys.executable, "-c", STEP], env={**os.environ, "PYTHONPATH": str(checkout)}, cwd=checkout,
                         capture_output=True, text=True)
    if out.returncode != 0:
        raise SystemExit(f"the step timing failed in {checkout}:\n{out.stderr[-4000:]}")
    rows = [line.split() for line in out.stdout.splitlines() if line.startswith("tiny/")]
    return {tuple(name.split("/")): float(v) for name, v in rows}


def run_side(checkout: Path, args: argparse.Namespace) -> dict[tuple[str, str], float]:
    """One decode_speed.py run from ``checkout``: tok/s per (shape, engine)."""
    if args.what == "step":
        return run_steps(checkout)
    cmd = [sys.executable, str(checkout / "benchmarks" / "decode_speed.py"), "--shapes", args.shapes,
           "--engines", args.engines, "--reps", str(args.reps), "--new-tokens", str(args.new_tokens),
           "--threads", str(args.threads), "--no-diff-check"]
    env = {**os.environ, "PYTHONPATH": str(checkout)}
    out = subprocess.run(cmd, env=env, cwd=checkout, capture_output=True, text=True)
    if out.returncode != 0:
        raise SystemExit(f"decode_speed.py failed in {checkout}:\n{out.stdout[-2000:]}\n{out.stderr[-4000:]}")
    engines = args.engines.split(",")
    found = {}
    for line in out.stdout.split("summary", 1)[-1].splitlines():
        if m := ROW.match(line):
            for engine, value in zip(engines, CELL.findall(m.group(2))):
                found[(m.group(1), engine)] = float(value)
    if not found:
        raise SystemExit(f"no summary table in the output of {checkout}:\n{out.stdout[-2000:]}")
    return found


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--before", type=Path, required=True, help="the checkout before the change")
    ap.add_argument("--after", type=Path, default=HERE, help="the checkout after the change (default: this one)")
    ap.add_argument("--what", choices=("decode", "step"), default="decode",
                    help="decode: decode_speed.py's tok/s; step: the tiny model's step time per strategy")
    ap.add_argument("--rounds", type=int, default=4, help="runs per side, interleaved")
    ap.add_argument("--shapes", default="24M,135M")
    ap.add_argument("--engines", default="eager", help="kvexplore's engines only: eager, compiled")
    ap.add_argument("--reps", type=int, default=3, help="decode_speed.py's repetitions within one run")
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args(argv)
    sides = {"before": args.before.resolve(), "after": args.after.resolve()}
    results: dict[str, list[dict]] = {"before": [], "after": []}
    for i in range(args.rounds):
        order = ["before", "after"] if i % 2 == 0 else ["after", "before"]
        for side in order:
            results[side].append(run_side(sides[side], args))
            row = ", ".join(f"{s}/{e} {v:.1f}" for (s, e), v in results[side][-1].items())
            print(f"round {i + 1}/{args.rounds} {side:6}: tok/s {row}", flush=True)
    print(f"\nbefore: {sides['before']}\nafter:  {sides['after']}")
    print(f"{'shape/engine':20}{'before tok/s':>22}{'after tok/s':>22}{'after/before':>14}")
    for key in results["before"][0]:
        b = [r[key] for r in results["before"]]
        a = [r[key] for r in results["after"]]
        spread_b, spread_a = (f"{min(xs):.1f}..{max(xs):.1f}" for xs in (b, a))
        print(f"{'/'.join(key):20}{statistics.median(b):>9.1f} ({spread_b:>11}){statistics.median(a):>9.1f} "
              f"({spread_a:>11}){statistics.median(a) / statistics.median(b):>13.2f}x")
    return 0


if __name__ == "__main__":
    sys.exit(main())
