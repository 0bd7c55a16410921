"""Cache strategies side by side: decode tokens/s, bytes copied / allocated / freed per step, peak RSS added.

    python benchmarks/strategies.py                                  # tiny and SmolLM2, contexts 64..1024
    python benchmarks/strategies.py --models tiny --contexts 512 --kinds preallocated,concat

Each (model, strategy, context) runs in a fresh process so that peak memory is its own: the model is loaded,
the peak-RSS mark is reset (``/proc/self/clear_refs``), the cache is made for context + steps positions, a
prompt of ``context`` tokens is prefilled and ``--steps`` greedy decode steps are timed. Bytes per step come
from the caches' own memory reports (exact counts, checked against formulas in the tests); "peak RSS added" is
the process's peak resident memory after the run minus its resident memory before the cache was made (the
prefill's activations included); "RSS held" is the resident memory after the run (and ``malloc_trim``, which
returns freed activation memory to the system) minus that before the cache,
next to the analytic cache size ``2 * layers * kv_heads * head_dim * 4 bytes * tokens``.

Expected on CPU: concat copies and frees at least 10x more bytes per step than pre-allocated at context 512
(pre-allocated copies nothing); pre-allocated RSS held within 1.2x of the analytic size.
"""

from __future__ import annotations

import argparse
import ctypes
import json
import multiprocessing as mp
import statistics
import time
from pathlib import Path

# strategy options beyond make_cache's sizing (sink: the ring is sized to the run, so nothing is evicted here)
OPTIONS = {"paged": {"block_size": 16}, "quantized": {"bits": 8}}


def _rss_kib(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    return 0


def run_one(model_name: str, kind: str, context: int, steps: int, threads: int) -> dict:
    import torch

    import kvexplore

    torch.set_num_threads(threads)
    model = kvexplore.load(model_name)
    prompt = [int(i) for i in torch.randint(3, model.config.vocab_size, (context,),
                                            generator=torch.Generator().manual_seed(0))]
    warm = kvexplore.Generator(model, kvexplore.make_cache("none", model))  # first-call kernel and thread set-up
    warm.prefill(prompt[:64])
    warm.step()
    del warm
    ctypes.CDLL("libc.so.6").malloc_trim(0)
    Path("/proc/self/clear_refs").write_text("5")  # reset the peak-RSS mark (Linux)
    rss_before = _rss_kib("VmRSS")
    cache = kvexplore.make_cache(kind, model, max_seq_len=context + steps + 1, **OPTIONS.get(kind, {}))
    gen = kvexplore.Generator(model, cache)
    gen.prefill(prompt)
    times, copied, allocated, freed, written = [], [], [], [], []
    for _ in range(steps):
        t0 = time.perf_counter()
        record = gen.step()
        times.append(time.perf_counter() - t0)
        m = record.memory
        copied.append(m.copied_bytes), allocated.append(m.allocated_bytes), freed.append(m.freed_bytes)
        written.append(m.written_bytes)
    peak_added = (_rss_kib("VmHWM") - rss_before) * 1024
    ctypes.CDLL("libc.so.6").malloc_trim(0)  # hand freed activations back, so what stays is what is live
    held = (_rss_kib("VmRSS") - rss_before) * 1024
    tokens = context + steps
    return dict(model=model_name, kind=kind, context=context, tok_s=1 / statistics.median(times),
                copied=statistics.mean(copied), allocated=statistics.mean(allocated), freed=statistics.mean(freed),
                written=statistics.mean(written), peak_added=peak_added, held=held,
                reserved=cache.inspect.reserved_bytes,
                analytic=kvexplore.kv_bytes(model.config, tokens, 1, model.dtype))


def _child(queue: mp.Queue, args: tuple) -> None:
    queue.put(run_one(*args))


def isolated(*args) -> dict:
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    proc = ctx.Process(target=_child, args=(queue, args))
    proc.start()
    proc.join()
    if proc.exitcode != 0 or queue.empty():
        raise RuntimeError(f"benchmark run {args} failed (exit code {proc.exitcode}); see the traceback above")
    return queue.get()


def main() -> None:
    import kvexplore

    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--models", default="tiny,smollm2-135m")
    ap.add_argument("--kinds", default=",".join(kvexplore.caches.STRATEGIES))
    ap.add_argument("--contexts", default="64,256,512,1024")
    ap.add_argument("--steps", type=int, default=16)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--json", type=Path, help="also write the rows here")
    args = ap.parse_args()
    rows = []
    mib = 2 ** 20
    print(f"{'model':13} {'strategy':12} {'context':>7} {'tok/s':>8} {'written/step':>13} {'copied/step':>12} "
          f"{'alloc/step':>11} {'freed/step':>11} {'reserved':>10} {'peak RSS+':>10} {'RSS held':>10} {'analytic':>10}")
    for model_name in args.models.split(","):
        for context in [int(c) for c in args.contexts.split(",")]:
            for kind in args.kinds.split(","):
                steps = args.steps if kind != "none" or context <= 256 else max(4, args.steps // 4)
                r = isolated(model_name, kind, context, steps, args.threads)
                rows.append(r)
                print(f"{model_name:13} {kind:12} {context:7d} {r['tok_s']:8.1f} {r['written'] / 1024:10.1f} KiB "
                      f"{r['copied'] / mib:8.2f} MiB {r['allocated'] / mib:7.2f} MiB {r['freed'] / mib:7.2f} MiB "
                      f"{r['reserved'] / mib:6.1f} MiB {r['peak_added'] / mib:6.1f} MiB {r['held'] / mib:6.1f} MiB "
                      f"{r['analytic'] / mib:6.1f} MiB",
                      flush=True)
    print()
    for model_name in args.models.split(","):
        by = {(r["kind"], r["context"]): r for r in rows if r["model"] == model_name}
        pre, cat = by.get(("preallocated", 512)), by.get(("concat", 512))
        if pre and cat:
            moved = lambda r: r["copied"] + r["freed"]  # noqa: E731
            ratio = moved(cat) / max(moved(pre), 1)
            print(f"{model_name}: at context 512 concat copies+frees {moved(cat) / mib:.2f} MiB per step, "
                  f"pre-allocated {moved(pre) / mib:.2f} MiB ({'inf' if moved(pre) == 0 else f'{ratio:.0f}x'}; "
                  f"expected >= 10x)")
            print(f"{model_name}: pre-allocated at context 512: RSS held after the run {pre['held'] / mib:.2f} MiB = "
                  f"{pre['held'] / pre['analytic']:.2f}x the analytic cache size {pre['analytic'] / mib:.2f} MiB "
                  f"(expected within 1.2x); peak RSS added, prefill activations included, "
                  f"{pre['peak_added'] / mib:.2f} MiB")
    if args.json:
        args.json.write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
