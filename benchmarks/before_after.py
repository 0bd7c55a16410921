"""Decode speed of two checkouts of kvexplore, interleaved in one run: did a change slow decoding down?

    python benchmarks/before_after.py --before ../kvexplore-old            # this checkout is "after"
    python benchmarks/before_after.py --before A --after B --rounds 4 --engines eager,compiled

    python benchmarks/before_after.py --before A --what step                # per-step time on the tiny model
    python benchmarks/before_after.py --before A --what generator           # plain, kernels, compiled; tiny, SmolLM2

Each round runs ``benchmarks/decode_speed.py`` (``--what decode``) once from each checkout, in a fresh process whose
``PYTHONPATH`` is that checkout (so each side imports its own ``kvexplore`` and runs its own copy of the benchmark),
alternating the
order (before, after, after, before, ...) so a slow drift of the machine hits both sides alike. Every process builds
the same random-weight models (same seeds) and decodes the same prompt; each reports its median tok/s per shape and
engine, and this script prints, per shape and engine, the median of the rounds on each side and their ratio
(after / before: 1.00 is no change; the rounds' spread says what noise is).

``--what step`` times what a small model's decode step costs besides its matrix products: the packaged tiny model,
one torch thread, one ``Generator.step()`` at a time on each cache strategy, 5 runs of 40 steps, the lower quartile
of each run and the best run (robust on a shared machine, where decode_speed.py's medians swing 2x). Printed as
tok/s (1 / step time), so after/before reads the same way.

``--what generator`` times the generator's own speeds on named models (``--models``, default the packaged tiny
model and SmolLM2-135M, float32, ``--threads`` torch threads): ``plain`` (``Generator(model, cache)``: ``F.linear``),
``kernels`` (``Generator(model, cache, kernels=True)``: the compiled product kernels of ``kvexplore.fast.kernels``)
and ``compiled`` (``compile=True``). A checkout whose ``Generator`` takes no ``kernels=`` (before issue 59, read
from ``inspect.signature``) had the kernels always on: its ``kernels`` is its plain ``Generator(model, cache)``, and
its ``plain`` that same generator on a model loaded with ``KVEXPLORE_PRODUCTS=torch`` (column-major weights, every
product ``F.linear``: the path ``plain`` is after). Each engine decodes ``--new-tokens`` tokens after a short
prompt on its own model instance, ``--reps`` times per process in a rotating order after an untimed warm-up (which
compiles or loads the compiled step); a step's time is its wall time less the time the thread waited for a CPU
(``/proc/thread-self/schedstat``, as ``kvexplore.runtime.clock``), and a process reports 1 / the median step.
Each side saves its compiled graphs in a folder of its own (``$KVEXPLORE_HOME/compiled-before-after/<side>``), so
that the two do not overwrite each other's saved steps (and the kernels' verdicts: which widths run on them, timed
by the side's first process). Each process prints ``kernels.status()`` after its warm-up (which products ran on the
kernels, and why). A markdown table follows the text one, with the paired rounds' ratios.
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


GENERATOR = """
import inspect, os, statistics, sys, time
import torch
threads, tokens, reps = int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3])
models, engines = sys.argv[4].split(","), sys.argv[5].split(",")
torch.set_num_threads(threads)
import kvexplore

KERNELS = "kernels" in inspect.signature(kvexplore.Generator).parameters  # before issue 59: always on


def waited():  # seconds this thread has waited for a CPU (kvexplore.runtime.clock reads the same)
    try:
        with open("/proc/thread-self/schedstat") as f:
            return int(f.read().split()[1]) / 1e9
    except OSError:
        return 0.0


def load(name, engine):
    if engine == "plain" and not KERNELS:  # F.linear on column-major weights: the loader with the kernels refused
        os.environ["KVEXPLORE_PRODUCTS"] = "torch"
        try:
            return kvexplore.load(name)
        finally:
            del os.environ["KVEXPLORE_PRODUCTS"]
    return kvexplore.load(name)


def generator(model, engine, capacity):
    options = ({"compile": True} if engine == "compiled" else
               {"kernels": True} if KERNELS and engine == "kernels" else {})
    return kvexplore.Generator(model, kvexplore.make_cache("preallocated", model, max_seq_len=capacity), **options)


def decode(model, engine, n):
    gen = generator(model, engine, 256)
    gen.prefill("Once upon a time there was a little girl who")
    times = []
    for _ in range(n):
        wall, wait = time.perf_counter(), waited()
        gen.step()
        times.append(time.perf_counter() - wall - (waited() - wait))
    return times, gen.generated_tokens


for name in models:
    loaded = {engine: load(name, engine) for engine in engines}
    for engine in engines:
        decode(loaded[engine], engine, 8)  # warm-up: kernels built or loaded, the compiled step compiled or loaded
    if KERNELS and "kernels" in engines:  # which of the model's products run on the kernels, and why
        from kvexplore.fast import kernels
        print(f"kernels {name}: {kernels.status()}")
    steps, tokens_of = {e: [] for e in engines}, {}
    for rep in range(reps):
        for engine in engines[rep % len(engines):] + engines[:rep % len(engines)]:
            times, tokens_of[engine] = decode(loaded[engine], engine, tokens)
            steps[engine] += times
    for engine in engines:
        same = tokens_of[engine] == tokens_of[engines[0]]
        print(f"result {name}/{engine} {1 / statistics.median(steps[engine]):.2f} {'same' if same else 'DIFFER'}")
    del loaded
"""


def run_generator(checkout: Path, args: argparse.Namespace, side: str) -> dict[tuple[str, str], float]:
    """The generator's speeds in a process that imports ``checkout``'s kvexplore: tok/s per (model, engine)."""
    home = Path(os.environ.get("KVEXPLORE_HOME") or Path.home() / ".cache" / "kvexplore").expanduser()
    env = {**os.environ, "PYTHONPATH": str(checkout),
           "KVEXPLORE_COMPILED": str(home / "compiled-before-after" / side)}
    cmd = [sys.executable, "-c", GENERATOR, str(args.threads), str(args.new_tokens), str(args.reps), args.models,
           args.engines]
    out = subprocess.run(cmd, env=env, cwd=checkout, capture_output=True, text=True)
    if out.returncode != 0:
        raise SystemExit(f"the generator timing failed in {checkout}:\n{out.stderr[-4000:]}")
    found = {}
    for line in out.stdout.splitlines():
        if line.startswith("kernels "):
            print(f"  {side}: {line}", flush=True)
        if line.startswith("result "):
            _, key, value, same = line.split()
            found[tuple(key.split("/"))] = float(value)
            if same != "same":
                print(f"  {side}: {key}'s tokens differ from the first engine's", flush=True)
    return found


def run_side(checkout: Path, args: argparse.Namespace, side: str = "") -> dict[tuple[str, str], float]:
    """One decode_speed.py run from ``checkout``: tok/s per (shape, engine)."""
    if args.what == "step":
        return run_steps(checkout)
    if args.what == "generator":
        return run_generator(checkout, args, side)
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
    ap.add_argument("--what", choices=("decode", "step", "generator"), default="decode",
                    help="decode: decode_speed.py's tok/s; step: the tiny model's step time per strategy; generator: "
                         "plain, kernels and compiled generators' tok/s on named models")
    ap.add_argument("--rounds", type=int, default=4, help="runs per side, interleaved")
    ap.add_argument("--shapes", default="24M,135M")
    ap.add_argument("--engines", default=None,
                    help="decode: kvexplore's engines only, eager (default), compiled; generator: plain, kernels, "
                         "compiled (default all three)")
    ap.add_argument("--models", default="tiny,smollm2-135m", help="generator: the named models")
    ap.add_argument("--reps", type=int, default=3, help="decode_speed.py's repetitions within one run")
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args(argv)
    if args.engines is None:
        args.engines = "plain,kernels,compiled" if args.what == "generator" else "eager"
    sides = {"before": args.before.resolve(), "after": args.after.resolve()}
    results: dict[str, list[dict]] = {"before": [], "after": []}
    for i in range(args.rounds):
        order = ["before", "after"] if i % 2 == 0 else ["after", "before"]
        for side in order:
            results[side].append(run_side(sides[side], args, side))
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
    if args.what == "generator":  # the same as a markdown table: the paired rounds' ratios beside the medians
        print("\n| model | engine | before tok/s | after tok/s | after / before | per round |")
        print("|---|---|---:|---:|---:|---|")
        for key in results["before"][0]:
            b = [r[key] for r in results["before"]]
            a = [r[key] for r in results["after"]]
            rounds = " ".join(f"{x / y:.2f}" for x, y in zip(a, b))
            print(f"| {key[0]} | {key[1]} | {statistics.median(b):.1f} ({min(b):.1f}..{max(b):.1f}) | "
                  f"{statistics.median(a):.1f} ({min(a):.1f}..{max(a):.1f}) | "
                  f"{statistics.median(a) / statistics.median(b):.2f}x | {rounds} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
