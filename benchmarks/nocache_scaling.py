"""Per-token decode step time without a cache (NoCache) vs with a PreallocatedCache, as the context grows.

    python benchmarks/nocache_scaling.py                          # 24M shape, contexts 64,256,512,1024, cpu fp32
    python benchmarks/nocache_scaling.py --shape 135M --contexts 64,256 --reps 3

A random-weight Llama checkpoint of ``--shape`` is built with transformers, saved to a temporary folder and
loaded with ``kvexplore.load``. For each context C one generator per cache is prefilled with the same C-1
random prompt ids, so the sequence holds C tokens; then a timed ``g.step()`` decodes the next token:

* PreallocatedCache: the step feeds 1 token at position C-1 and attends over the C cached positions;
* NoCache: the step feeds all C tokens at position 0 (keys and values recomputed for the whole sequence).

Each repetition times ``--steps`` consecutive steps (contexts C .. C+steps-1) and then ``rewind``s them, so
every repetition measures the same positions. Repetitions alternate no-cache / preallocated (interleaved)
after an untimed warm-up; the table shows medians of the per-step time and the ratio no-cache/preallocated,
next to C/30 for comparison (a rough "linear in C" yardstick). The script checks that the no-cache step time
grows with the context and that both caches pick the same greedy tokens.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

import torch

from _common import (DTYPES, SHAPES, OtherLoad, build_checkpoint, dtype_name, median, now, prompt_ids, spread,
                     wait_quiet)

import kvexplore


def time_steps(g: kvexplore.Generator, steps: int) -> tuple[float, list[int]]:
    """Seconds per step over ``steps`` steps (then rewound), and the tokens those steps chose."""
    dev = g.model.device
    t0 = now(dev)
    records = g.run(steps, stop_at_eos=False)
    t1 = now(dev)
    g.rewind(steps)
    return (t1 - t0) / steps, [r.token_id for r in records]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--shape", default="24M", choices=sorted(SHAPES))
    ap.add_argument("--contexts", default="64,256,512,1024", help="comma separated sequence lengths")
    ap.add_argument("--reps", type=int, default=7)
    ap.add_argument("--steps", type=int, default=2, help="decode steps timed per repetition")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--dtype", default="float32", choices=sorted(DTYPES))
    ap.add_argument("--threads", type=int, default=2, help="torch.set_num_threads")
    ap.add_argument("--wait-quiet", type=float, default=0.0, metavar="SECONDS",
                    help="before each repetition wait up to this long for other processes to go idle (Linux)")
    args = ap.parse_args(argv)
    contexts = sorted(int(c) for c in args.contexts.split(",") if c.strip())
    if not contexts or contexts[0] < 2 or args.reps < 1 or args.steps < 1:
        ap.error("contexts must be >= 2, --reps and --steps >= 1")
    torch.set_num_threads(args.threads)
    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        print("nocache_scaling: --device cuda but torch sees no CUDA device")
        return 2
    dtype = DTYPES[args.dtype]
    t_start = time.perf_counter()
    print(f"torch {torch.__version__}, kvexplore {kvexplore.__version__}, shape {args.shape}, {dtype_name(dtype)} on "
          f"{device}, threads {torch.get_num_threads()}, contexts {contexts}, {args.reps} interleaved reps x "
          f"{args.steps} steps")

    with tempfile.TemporaryDirectory(prefix="kvx-nocache-") as tmp:
        build_checkpoint(args.shape, Path(tmp), seed=0, max_positions=max(4096, contexts[-1] + args.steps))
        model = kvexplore.load(tmp, dtype=dtype, device=device)
    vocab = model.config.vocab_size
    warm = kvexplore.Generator(model, kvexplore.PreallocatedCache(model.config, 64, dtype=dtype, device=device))
    warm.prefill(prompt_ids(32, vocab))
    warm.run(16, stop_at_eos=False)  # one-time costs (allocator, kernel selection) before anything is timed
    load = OtherLoad()
    rows = []
    for ctx in contexts:
        prompt = prompt_ids(ctx - 1, vocab, seed=ctx)
        pre = kvexplore.Generator(model, kvexplore.PreallocatedCache(model.config, ctx + args.steps, dtype=dtype,
                                                                     device=device))
        none = kvexplore.Generator(model, kvexplore.NoCache(model.config, dtype=dtype, device=device))
        pre.prefill(prompt)
        none.prefill(prompt)
        assert pre.position == none.position == ctx, (pre.position, none.position, ctx)
        _, pre_toks = time_steps(pre, args.steps)  # warm-up
        _, none_toks = time_steps(none, args.steps)
        t_none, t_pre = [], []
        for _ in range(args.reps):
            wait_quiet(args.wait_quiet)
            load.start()
            t, toks = time_steps(none, args.steps)
            t_none.append(t)
            assert toks == none_toks
            t, toks = time_steps(pre, args.steps)
            t_pre.append(t)
            load.stop()
            assert toks == pre_toks
        same = pre.tokens == none.tokens and pre_toks == none_toks
        rows.append((ctx, median(t_none), median(t_pre), same, t_none, t_pre))
        print(f"  context {ctx:5d}: no-cache {median(t_none) * 1e3:9.2f} ms/step ({spread(t_none)}), preallocated "
              f"{median(t_pre) * 1e3:7.2f} ms/step ({spread(t_pre)}), same greedy tokens: {same}", flush=True)

    print(f"\nper-token decode step time, medians of {args.reps} reps ({args.shape}, {dtype_name(dtype)}, {device}):")
    print(f"  {'context':>7} {'no-cache ms':>12} {'prealloc ms':>12} {'ratio':>8} {'context/30':>11}  tokens")
    for ctx, tn, tp, same, _, _ in rows:
        print(f"  {ctx:7d} {tn * 1e3:12.2f} {tp * 1e3:12.2f} {tn / tp:7.1f}x {ctx / 30:11.1f}  "
              f"{'same' if same else 'DIFFER'}")
    nocache = [r[1] for r in rows]
    grows = all(b > a for a, b in zip(nocache, nocache[1:]))
    growth = nocache[-1] / nocache[0] if len(rows) > 1 else float("nan")
    prealloc_growth = rows[-1][2] / rows[0][2] if len(rows) > 1 else float("nan")
    print(f"  no-cache step time grows with the context: {'yes' if grows else 'NO'} "
          f"(x{growth:.1f} from {contexts[0]} to {contexts[-1]}; preallocated x{prealloc_growth:.2f})")
    print(f"  {load.summary()}" + ("  -- WARNING: timings disturbed by other processes" if load.busy else ""))
    print(f"  total {time.perf_counter() - t_start:.0f}s")
    return 0 if grows and all(r[3] for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
