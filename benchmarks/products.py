"""A decoding step's matrix products alone: one row times every weight matrix of a model, with torch's own kernels
and with kvexplore's compiled one-row kernel (kvexplore.fast.kernels), interleaved in one run.

    python benchmarks/products.py                       # SmolLM2-135M's shapes, random weights, 2 threads
    python benchmarks/products.py --model tiny --threads 1

The weights are random, in the model's shapes (its q, k, v, o, gate, up and down projections per layer and the
output head), float32 on the CPU. Each engine multiplies a random row by every matrix in layer order, as a decode
step does; repetitions rotate the engines and the medians are printed with min..max, in ms per step, beside the
read bandwidth they reach (every weight byte read once). Engines:

* ``F.linear``: torch's ``F.linear`` on row-major ``[out, in]`` weights (MKL's matrix-vector product);
* ``F.linear, column-major``: the same on weights stored transposed (what ``kvexplore.load`` did before the kernel,
  and still does where the kernel cannot be built);
* ``kernel``: kvexplore's one-row product kernel on the row-major weights (the default for eager decoding).
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
import torch.nn.functional as F


def shapes(model: str) -> list[tuple[int, int]]:
    """Every product of one decode step of ``model``'s config, in order: (out, in)."""
    import kvexplore
    c = kvexplore.load(model).config if model != "smollm2-135m" else None
    if c is None:  # SmolLM2-135M without loading it: its config's numbers
        d, f, heads, kv_heads, hd, layers, vocab = 576, 1536, 9, 3, 64, 30, 49152
    else:
        d, f, heads, kv_heads, hd = c.hidden_size, c.intermediate_size, c.num_heads, c.num_kv_heads, c.head_dim
        layers, vocab = c.num_layers, c.vocab_size
    layer = [(heads * hd, d), (kv_heads * hd, d), (kv_heads * hd, d), (d, heads * hd), (f, d), (f, d), (d, f)]
    return layer * layers + [(vocab, d)]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="smollm2-135m", help="whose shapes (tiny, smollm2-135m)")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--reps", type=int, default=15)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)

    from kvexplore.fast import kernels as products

    g = torch.Generator().manual_seed(0)
    weights = [torch.randn(out, width, generator=g) * 0.02 for out, width in shapes(args.model)]
    column = [w.t().contiguous().t() for w in weights]
    rows = {w.shape[1]: torch.randn(1, w.shape[1], generator=g) for w in weights}
    products.prepare()
    print(f"{args.model}'s shapes: {len(weights)} products, {sum(w.numel() for w in weights) / 1e6:.1f}M weights, "
          f"{args.threads} threads; the kernel: {products.status()}")
    engines = {"F.linear": lambda: [F.linear(rows[w.shape[1]], w) for w in weights],
               "F.linear, column-major": lambda: [F.linear(rows[w.shape[1]], w) for w in column]}
    if products.KERNELS.get() is not None:
        engines["kernel"] = lambda: [products.linear(rows[w.shape[1]], w) for w in weights]
    with torch.inference_mode():
        want = engines["F.linear"]()
        for name, run in engines.items():
            err = max((a - b).abs().max().item() for a, b in zip(run(), want))
            print(f"  {name}: largest difference from F.linear {err:.2e}")
        times: dict[str, list[float]] = {name: [] for name in engines}
        names = list(engines)
        for rep in range(args.reps):
            for name in names[rep % len(names):] + names[: rep % len(names)]:
                t0 = time.perf_counter()
                engines[name]()
                times[name].append(1000 * (time.perf_counter() - t0))
    gb = sum(w.numel() * 4 for w in weights) / 1e9
    base = statistics.median(times["F.linear"])
    for name, ts in times.items():
        med = statistics.median(ts)
        print(f"  {name:<24} {med:7.2f} ms ({min(ts):.2f}..{max(ts):.2f})  {gb / med * 1000:5.1f} GB/s  "
              f"{base / med:4.2f}x F.linear")


if __name__ == "__main__":
    main()
