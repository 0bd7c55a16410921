"""Time to the first compiled token in a first and a later process, and the compiled step's speed: the regional step
(``compile=True`` on the CPU: one layer compiled, saved in $KVEXPLORE_HOME/compiled) against the whole step with
frozen, autotuned weights (``compile="max-autotune"``, what ``compile=True`` was before; not kept by any cache).

    python benchmarks/compile_reuse.py                       # tiny and SmolLM2, float32, 2 threads
    python benchmarks/compile_reuse.py --models smollm2-135m --rounds 16

Each first / later figure is a fresh process: load the model, build a generator, prefill, then time the first
decode step (the compile, or the load) from the load of the model. Each mode gets an empty $KVEXPLORE_HOME/compiled
and an empty inductor cache folder, shared by its first and later process; "later, inductor cache cleared" keeps
kvexplore's saved graphs but not inductor's folder (a reboot that empties /tmp: the C++ is built again from the
saved code). The speed is measured in one more process that builds both steps and runs them in interleaved rounds
(the machine's load moves both alike): medians and the ratio regional / whole.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile

FIRST_TOKEN = """
import json, sys, time
import torch
torch.set_num_threads(int(sys.argv[3]))
t0 = time.perf_counter()
import kvexplore
model = kvexplore.load(sys.argv[1])
loaded = time.perf_counter() - t0
mode = True if sys.argv[2] == "regional" else sys.argv[2]
gen = kvexplore.Generator(model, kvexplore.make_cache("preallocated", model, max_seq_len=256), compile=mode)
gen.prefill("Call me Ishmael. Some years ago, never mind how long precisely")
gen.step()
first = time.perf_counter() - t0
gen.run(16, stop_at_eos=False)
from kvexplore.fast.compiled import decoder_for
built = getattr(decoder_for(model, 256, None if mode is True else mode), "built", None)
print(json.dumps({"first": first, "load": loaded, "compile": gen.compile_s, "note": gen.compile_reuse,
                  "built": built, "tokens": gen.tokens}))
"""

SPEED = """
import json, statistics, sys, time
import torch
torch.set_num_threads(int(sys.argv[2]))
import kvexplore
from kvexplore.fast.compiled import decoder_for
model = kvexplore.load(sys.argv[1])
steps = {}
for name, mode in (("regional", "regional"), ("whole", "max-autotune")):
    cache = kvexplore.make_cache("preallocated", model, max_seq_len=256)
    decoder = decoder_for(model, 256, mode)
    decoder(1, cache, 0)
    steps[name] = (decoder, cache)
times = {name: [] for name in steps}
for r in range(int(sys.argv[3])):
    for name, (decoder, cache) in sorted(steps.items(), reverse=r % 2 == 1):  # the order alternating
        t = time.perf_counter()
        for pos in range(1, 21):
            decoder(5, cache, pos)
        times[name].append((time.perf_counter() - t) / 20 * 1000)
print(json.dumps({name: statistics.median(v) for name, v in times.items()} | {"all": times}))
"""


def child(code: str, args: list[str], env: dict[str, str]) -> dict:
    out = subprocess.run([sys.executable, "-c", code, *args], capture_output=True, text=True, timeout=1800,
                         env={**os.environ, **env})
    if out.returncode:
        raise SystemExit(out.stderr[-3000:])
    return json.loads(out.stdout.strip().splitlines()[-1])


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--models", default="tiny,smollm2-135m")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--rounds", type=int, default=12, help="interleaved rounds of 20 steps for the speed")
    args = ap.parse_args(argv)
    models_home = os.environ.get("KVEXPLORE_HOME")  # the models are read from here, the graphs saved elsewhere
    print(f"float32, capacity 256, {args.threads} threads; seconds from loading the model to the first compiled token")
    for model in args.models.split(","):
        print(f"\n{model}")
        print(f"  {'':44} {'first':>8} {'later':>8} {'later, inductor cache cleared':>30}")
        for how, label in (("max-autotune", "whole step, frozen weights (before)"),
                           ("regional", "regional (compile=True)")):
            with tempfile.TemporaryDirectory(prefix="kvx-compile-") as tmp:
                env = {"TORCHINDUCTOR_CACHE_DIR": f"{tmp}/inductor"}
                if how == "regional":
                    env["KVEXPLORE_COMPILED"] = f"{tmp}/compiled"
                a = child(FIRST_TOKEN, [model, how, str(args.threads)], env)
                b = child(FIRST_TOKEN, [model, how, str(args.threads)], env)
                c = child(FIRST_TOKEN, [model, how, str(args.threads)], {**env, "TORCHINDUCTOR_CACHE_DIR": f"{tmp}/i2"})
            assert a["tokens"] == b["tokens"] == c["tokens"]
            print(f"  {label:44} {a['first']:7.1f}s {b['first']:7.1f}s {c['first']:29.1f}s   (model load "
                  f"{a['load']:.1f}s; graphs compiled first / later: {a['built']} / {b['built']})", flush=True)
            print(f"  {'':44} later says: {b['note']}")
        speed = child(SPEED, [model, str(args.threads), str(args.rounds)], {})
        print(f"  step ms, {args.rounds} interleaved rounds of 20: whole {speed['whole']:.2f}, regional "
              f"{speed['regional']:.2f} -> regional / whole {speed['regional'] / speed['whole']:.3f}", flush=True)
    if models_home:
        print(f"(models from {models_home})")


if __name__ == "__main__":
    main()
