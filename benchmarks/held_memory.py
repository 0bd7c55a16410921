"""What each cache really holds against what its memory report says, on a real model at a real length.

    python benchmarks/held_memory.py                       # SmolLM2-135M, 1,000 tokens, 8 decode steps
    python benchmarks/held_memory.py --model tiny --tokens 300

For every strategy: a prompt of ``--tokens`` tokens (the Moby-Dick chapter shipped with the package, repeated as
needed), then ``--steps`` greedy decode steps. Printed per strategy: every tensor storage reachable from the cache
object, each counted once (through the garbage collector: :func:`kvexplore.caches.held.referents_bytes`, a count
that shares no code with the report), the report's ``held_bytes`` and their ratio, the report's ``reserved_bytes``
(the storage meant for keys and values), the parts beyond keys and values, and what the cache holds against the
full pre-allocated cache of the same positions (the evict cache's press at ratio 0.5 should bring it to at most 0.6x).
"""

from __future__ import annotations

import argparse
import datetime
from pathlib import Path

import torch

import kvexplore
from kvexplore.caches.held import referents_bytes
from kvexplore.caches.memory import format_bytes

TEXT = Path(kvexplore.__file__).parent / "data" / "texts" / "moby_dick_chapter_4.txt"
KINDS = {
    "preallocated": {},
    "concat": {},
    "paged": {"block_size": 16},
    "sink": {"sinks": 4, "window": 256},
    "quantized": {"bits": 4},
    "evict (knorm 0.5, compact)": {"kind": "evict", "press": "knorm", "compression_ratio": 0.5},
    "evict (snapkv 0.5, mask)": {"kind": "evict", "press": "snapkv", "compression_ratio": 0.5, "storage": "mask"},
}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--tokens", type=int, default=1000)
    ap.add_argument("--steps", type=int, default=8)
    args = ap.parse_args()
    torch.set_num_threads(max(1, torch.get_num_threads()))
    model = kvexplore.load(args.model)
    ids = model.tokenizer.encode(TEXT.read_text())
    while len(ids) < args.tokens:
        ids = ids + ids
    ids = ids[:args.tokens]
    rows, full = [], None
    for name, options in KINDS.items():
        options = dict(options)
        kind = options.pop("kind", name)
        cache = kvexplore.make_cache(kind, model, max_seq_len=args.tokens + args.steps, **options)
        gen = kvexplore.Generator(model, cache)
        gen.prefill(ids)
        gen.run(args.steps, stop_at_eos=False)
        report = cache.inspect.memory_report()
        really = referents_bytes(cache)
        full = really if name == "preallocated" else full
        extra = {k: v for k, v in report.held.items() if k != "keys and values"}
        rows.append((name, really, report.held_bytes, report.reserved_bytes, extra))
        del gen, cache
    print(f"# held memory, {args.model}, {args.tokens} prompt tokens + {args.steps} decode steps, float32, "
          f"torch {torch.__version__}, {datetime.date.today()}")
    print()
    print("| strategy | reachable | report held | ratio | reserved (K/V storage) | beyond keys and values | vs full |")
    print("|---|---:|---:|---:|---:|---|---:|")
    for name, really, held, reserved, extra in rows:
        parts = ", ".join(f"{k} {format_bytes(v)}" for k, v in sorted(extra.items(), key=lambda kv: -kv[1])) or "-"
        print(f"| {name} | {format_bytes(really)} | {format_bytes(held)} | {really / held:.3f} | "
              f"{format_bytes(reserved)} | {parts} | {really / full:.2f}x |")


if __name__ == "__main__":
    main()
