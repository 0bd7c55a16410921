"""Decode speed on the quantized cache against the full-precision pre-allocated cache, side by side in one run
(issue 41, item 8: a step on packed 4-bit within 1.5x of the float32 step at 1,024 tokens on the CPU).

    python benchmarks/quant_speed.py                                  # SmolLM2-135M, 1,024 tokens, one thread
    python benchmarks/quant_speed.py --context 4096 --threads 2
    python benchmarks/quant_speed.py --model gemma3-270m

Every cache is prefilled with the same ``--context`` tokens of Moby-Dick's chapter 4 (kvexplore/data/texts), then
the model's forward pass is timed one token at a time (``model(token, cache, pos)``: the step a ``Generator`` runs,
without sampling or records), ``--steps`` steps a round. Rounds are interleaved (every cache once per round, the
order rotating), so a machine that drifts slows them alike; each cache's figure is its best round's mean step, and
the ratio is against the pre-allocated float32 cache's. A quantized cache reads its stored blocks back every step
(unpack the codes, scale, add the zero point, undo a rotation or turn pre-RoPE keys): that is what the ratio prices.
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

import torch

import kvexplore

TEXT = Path(kvexplore.__file__).parent / "data" / "texts" / "moby_dick_chapter_4.txt"
CACHES = {
    "pre-allocated float32": ("preallocated", {}),
    "KIVI 8-bit": ("quantized", dict(bits=8)),
    "KIVI 4-bit": ("quantized", dict(bits=4)),
    "KIVI K 2-bit, V 4-bit": ("quantized", dict(key_bits=2, value_bits=4)),
    "KIVI 2-bit": ("quantized", dict(bits=2)),
    "KIVI 3-bit": ("quantized", dict(bits=3)),
    "llama.cpp q8_0": ("quantized", dict(k_type="q8_0", v_type="q8_0")),
    "llama.cpp q4_0": ("quantized", dict(k_type="q4_0", v_type="q4_0")),
    "4-bit, K per token, Hadamard": ("quantized", dict(bits=4, key_axis="token", rotate="hadamard")),
    "4-bit, pre-RoPE K + 1% outliers": ("quantized", dict(bits=4, pre_rope_keys=True, outliers=0.01)),
}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--context", type=int, default=1024)
    ap.add_argument("--steps", type=int, default=8, help="timed steps per cache and round")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--threads", type=int, default=1)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    torch.set_grad_enabled(False)
    model = kvexplore.load(args.model, dtype=torch.float32)
    ids = model.tokenizer.encode(TEXT.read_text())
    if len(ids) < args.context + args.steps:
        raise SystemExit(f"the text has {len(ids)} tokens: use --context of at most {len(ids) - args.steps}")
    capacity = args.context + args.steps
    caches = {}
    for name, (kind, options) in CACHES.items():
        try:
            caches[name] = kvexplore.make_cache(kind, model, max_seq_len=capacity, **options)
        except kvexplore.KVExploreError as e:
            print(f"{name}: {e}")
            continue
        model(torch.tensor([ids[:args.context]]), caches[name], 0, last_only=True)
    best = {name: float("inf") for name in caches}
    names = list(caches)
    for r in range(args.rounds):
        for name in names[r % len(names):] + names[:r % len(names)]:
            cache = caches[name]
            pos = cache.length
            t0 = time.perf_counter()
            for i in range(args.steps):
                model(torch.tensor([[ids[pos + i]]]), cache, pos + i)
            best[name] = min(best[name], (time.perf_counter() - t0) / args.steps)
            cache.truncate(args.context)  # every round starts at the same length
    base = best["pre-allocated float32"]
    print(f"{args.model}, float32, {args.context} tokens, {args.threads} thread(s); best of {args.rounds} interleaved "
          f"rounds of {args.steps} steps")
    print("| cache | bytes held | ms a step | vs float32 |\n|---|---:|---:|---:|")
    for name, cache in caches.items():
        print(f"| {name} | {cache.inspect.reserved_bytes / 2 ** 20:.1f} MiB | {best[name] * 1e3:.1f} | "
              f"**{best[name] / base:.2f}x** |")


if __name__ == "__main__":
    main()
