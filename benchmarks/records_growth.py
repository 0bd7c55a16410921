"""What an explorer lane's records hold after thousands of steps: older steps' slot views kept whole (7 bytes a
slot of capacity, every step) against kept as changes to the step before, as the lane's history keeps them
(:mod:`kvexplore.trace.kept_trace`), measured on the same run's records; and what the records and tracers allocated
during the steps (``tracemalloc``).

    python benchmarks/records_growth.py                      # tiny model, preallocated + paged, 4,000 steps
    python benchmarks/records_growth.py --steps 1000 --lanes preallocated,sink

Each kept view is counted once (layers that share a view share it); "whole" counts each kept step's distinct views
at 7 bytes a slot, "changes" sums what the history really holds (changes, and a whole view every KEYFRAME steps).
"""

from __future__ import annotations

import argparse
import time
import tracemalloc

import torch

import kvexplore
from kvexplore.explorer.session import Session
from kvexplore.trace.kept_trace import KEYFRAME

MiB = 2 ** 20


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="tiny")
    ap.add_argument("--steps", type=int, default=4000)
    ap.add_argument("--lanes", default="preallocated,paged")
    args = ap.parse_args()
    torch.set_num_threads(1)
    model = kvexplore.load(args.model)
    lanes = tuple(args.lanes.split(","))
    s = Session(model, lanes, max_seq_len=args.steps + 200)
    s.prefill("Call me Ishmael. Some years ago, never mind how long precisely, having little or no money in my purse")
    tracemalloc.start(6)
    first = tracemalloc.take_snapshot()
    t0 = time.perf_counter()
    for _ in range(args.steps):
        s.step()
    seconds = time.perf_counter() - t0
    last = tracemalloc.take_snapshot()
    tracemalloc.stop()
    grown = _total(last) - _total(first)
    store = [tracemalloc.Filter(True, "*attention_store.py", all_frames=True)]
    in_store = _total(last.filter_traces(store)) - _total(first.filter_traces(store))
    print(f"{args.model}, lanes {', '.join(lanes)}, {args.steps} steps ({seconds:.0f} s), capacity "
          f"{args.steps + 200} slots, a whole view every {KEYFRAME} kept steps")
    print(f"{'lane':14s} {'whole views MiB':>16s} {'changes MiB':>12s} {'whole/changes':>14s} "
          f"{'per step (changes)':>19s}")
    for name in lanes:
        whole = changes = 0
        seen: set[int] = set()
        for step in s.lanes[name].history._kept.steps:  # the kept steps (the newest few are as they were recorded)
            views = step.trace.views if step.trace is not None else ()
            for v in views:
                if id(v) not in seen:
                    seen.add(id(v))
                    changes += v.nbytes
                whole += 7 * v.size  # a state code, an int32 position and int16 sharers a slot
        print(f"{name:14s} {whole / MiB:16.1f} {changes / MiB:12.2f} {whole / max(changes, 1):13.0f}x "
              f"{changes / args.steps:15.0f} B")
    rest = grown - in_store
    print(f"allocated during the steps (tracemalloc, every lane): {grown / MiB:.1f} MiB, of which the attention "
          f"stores {in_store / MiB:.1f} MiB (bounded by the context: explorer/attention_store.py) and the records and "
          f"the rest {rest / MiB:.1f} MiB ({rest / args.steps / 1024:.1f} KiB per step)")


def _total(snapshot) -> int:
    return sum(stat.size for stat in snapshot.statistics("filename"))


if __name__ == "__main__":
    main()
