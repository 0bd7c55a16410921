"""Time to the first compiled token, in a first process and in a later one, with the default compiled step (packed
oneDNN products, not kept by inductor's cache) and with KVEXPLORE_COMPILE_REUSE=1 (kept; kvexplore.runtime.compile_cache).

    python benchmarks/compile_reuse.py                       # tiny and SmolLM2, float32, compile=True (CPU: max-autotune)
    python benchmarks/compile_reuse.py --models tiny --threads 2

Each figure is a fresh process: load the model, build a generator with ``compile=True``, prefill, then time the
first decode step (the compile) and 60 more (the step's speed). "default" is the step as ``compile=True`` builds it
(each linear weight packed into a oneDNN tensor, which inductor's cache refuses: every process compiles again);
"reuse" sets ``KVEXPLORE_COMPILE_REUSE=1`` (weights left unpacked, the step kept for a later process). Both run
against one empty inductor cache folder each, side by side in one run.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile

CHILD = """
import json, sys, time
import torch
torch.set_num_threads(int(sys.argv[3]))
import kvexplore
from torch._dynamo.utils import counters
t0 = time.perf_counter()
model = kvexplore.load(sys.argv[1])
gen = kvexplore.Generator(model, kvexplore.make_cache("preallocated", model, max_seq_len=256), compile=True)
gen.prefill("Call me Ishmael. Some years ago, never mind how long precisely")
gen.step()
first = time.perf_counter() - t0
t1 = time.perf_counter()
gen.run(60, stop_at_eos=False)
step = (time.perf_counter() - t1) / 60
c = counters["inductor"]
print(json.dumps({"first": first, "compile": gen.compile_s, "step_ms": step * 1000, "note": gen.compile_reuse,
                  "built": c["fxgraph_cache_miss"], "refused": c["fxgraph_cache_bypass"], "tokens": gen.tokens}))
"""


def run(model: str, how: str, threads: int, cache: str) -> dict:
    env = {"TORCHINDUCTOR_CACHE_DIR": cache, "KVEXPLORE_COMPILE_REUSE": "1" if how == "reuse" else "0"}
    import os
    out = subprocess.run([sys.executable, "-c", CHILD, model, how, str(threads)], capture_output=True, text=True,
                         env={**os.environ, **env}, timeout=1800)
    if out.returncode:
        raise SystemExit(out.stderr[-3000:])
    return json.loads(out.stdout.strip().splitlines()[-1])


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--models", default="tiny,smollm2-135m")
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args(argv)
    print(f"compile=True (CPU: frozen weights, max-autotune), float32, capacity 256, {args.threads} threads; "
          f"seconds from load to the first compiled token")
    print(f"{'model':14} {'':7} {'first process':>14} {'later process':>14} {'step ms (1st/later)':>20}  later says")
    for model in args.models.split(","):
        for how in ("default", "reuse"):
            with tempfile.TemporaryDirectory(prefix="kvx-compile-reuse-") as cache:
                a, b = run(model, how, args.threads, cache), run(model, how, args.threads, cache)
            assert a["tokens"] == b["tokens"]
            print(f"{model:14} {how:7} {a['first']:13.1f}s {b['first']:13.1f}s {a['step_ms']:9.2f} / {b['step_ms']:.2f}"
                  f"  {b['note'] or '-'} (graphs built {b['built']}, refused {b['refused']})", flush=True)


if __name__ == "__main__":
    main()
