"""The app at a chapter's length, kernel side: the explorer ``kvexplore app`` builds (its lanes and their options, from
:func:`kvexplore.explorer.app_page.settings`), a pasted passage prefilled, then a few Steps; each lane set in a process
of its own, so each peak is its own.

    python benchmarks/app_prefill.py [--model smollm2-135m] [--chars 10807] [--steps 3] [--threads 2]
        [--lanes preallocated,concat,paged --lanes preallocated,quantized,sink,evict] [--alone]

The passage is the first ``--chars`` characters of the GPL-3 text Debian ships (/usr/share/common-licenses/GPL-3: 2,343
SmolLM2 tokens at 10,807 characters), else the Moby Dick chapter in tests/data repeated. Prints per lane set: the
prompt's tokens, the prefill's wall time, which lanes replayed another lane's pass (explorer/shared_pass.py), each
Step's time and the process's peak resident memory; ``--alone`` runs every lane's own pass (as before passes were
shared), so the two can be compared side by side in one run. Targets (issue 58, SmolLM2, 2,300 tokens, two threads,
a quiet machine): default lanes at most 15 s, preallocated + quantized + sink + evict at most 25 s, peak under 3 GiB,
Steps under 500 ms.
"""

from __future__ import annotations

import argparse
import json
import resource
import subprocess
import sys
import time
from pathlib import Path

GPL = Path("/usr/share/common-licenses/GPL-3")
MOBY = Path(__file__).resolve().parent.parent / "tests" / "data" / "moby_dick_chapter_1.txt"
LANE_SETS = ["preallocated,concat,paged", "preallocated,quantized,sink,evict"]


def passage(chars: int) -> str:
    text = GPL.read_text() if GPL.exists() else MOBY.read_text() * 4
    return text[:chars]


def one(args: argparse.Namespace, lanes: str) -> dict:
    """Run in this process: build the app's explorer for ``lanes``, prefill the passage, step."""
    import torch

    torch.set_num_threads(args.threads)
    from kvexplore.explorer import app_page, shared_pass
    from kvexplore.explorer.widget import Explorer

    if args.alone:  # every lane computes its own pass: what the app did before
        def record(generator, prompt, force, source):
            generator.prefill(prompt, force=force)
            return shared_pass.Pass(source=source)

        shared_pass.record = record
    env = {app_page.MODEL_ENV: args.model, app_page.STRATEGIES_ENV: lanes, app_page.PROMPT_ENV: ""}
    ex = Explorer(**app_page.settings(env))
    ex.controls["prompt"].value = passage(args.chars)
    t = time.perf_counter()
    ex.prefill()
    prefill_s = time.perf_counter() - t
    steps = []
    for _ in range(args.steps):
        t = time.perf_counter()
        ex.step()
        steps.append(1000 * (time.perf_counter() - t))
    return {"lanes": lanes, "tokens": len(ex.session.prompt_tokens), "prefill_s": prefill_s, "steps_ms": steps,
            "shared": {n: lane.shared_pass for n, lane in ex.lanes.items()},
            "peak_gib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2 ** 20}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--chars", type=int, default=10807)
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--lanes", action="append", default=None, help="a lane set, comma-separated (repeatable)")
    ap.add_argument("--alone", action="store_true", help="every lane computes its own prefill pass")
    ap.add_argument("--child", default=None, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child is not None:
        print(json.dumps(one(args, args.child)))
        return
    for lanes in args.lanes or LANE_SETS:
        argv = [sys.executable, __file__, "--child", lanes, "--model", args.model, "--chars", str(args.chars),
                "--steps", str(args.steps), "--threads", str(args.threads)] + (["--alone"] if args.alone else [])
        out = json.loads(subprocess.run(argv, check=True, capture_output=True, text=True).stdout.splitlines()[-1])
        shared = ", ".join(f"{n} <- {s}" for n, s in out["shared"].items() if s) or "none"
        print(f"{lanes}: {out['tokens']:,} tokens · prefill {out['prefill_s']:.1f} s · steps "
              f"{' / '.join(f'{ms:.0f}' for ms in out['steps_ms'])} ms · peak {out['peak_gib']:.2f} GiB · "
              f"passes replayed: {shared}{' (--alone)' if args.alone else ''}", flush=True)


if __name__ == "__main__":
    main()
