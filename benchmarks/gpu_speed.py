"""gpu_check.py's speed checks: (b) decode speed against transformers on the device, with the cost of reading the
allocator's counters, and (f) the compiled step replayed. ``record(name, passed, detail)`` is gpu_check's result
line (passed None: information only)."""

from __future__ import annotations

import time
import traceback
from pathlib import Path
from types import SimpleNamespace

import torch

from _common import build_checkpoint, dtype_name, prompt_ids

import kvexplore


# -- (b) decode speed ------------------------------------------------------------------------------------
def check_speed(device: torch.device, dtypes: list[torch.dtype], shapes: list[str], tmp: Path, args, record,
                speeds: list[str]) -> None:
    """Both engines of kvexplore against transformers' on each shape and dtype; ``speeds`` gets each ratio for the
    summary line."""
    import decode_speed

    # on CUDA all four engines (the compiled ones capture CUDA graphs); the CPU debug run skips transformers'
    # static+compile, whose compile alone would take longer than the rest of the run
    engines = list(decode_speed.ENGINES) if device.type == "cuda" else ["eager", "compiled", "hf"]
    print(f"\n(b) decode speed on {device}: {args.new_tokens} new tokens after a {args.prompt_len}-id prompt, "
          f"{args.reps} interleaved reps, engines {', '.join(engines)}")
    opts = SimpleNamespace(new_tokens=args.new_tokens, prompt_len=args.prompt_len, reps=args.reps,
                           wait_quiet=0.0, diff_check=False, engines=engines)
    bandwidth = decode_speed.read_bandwidth(device)
    for shape in shapes:
        for dtype in dtypes:
            name = f"decode {shape} {dtype_name(dtype)}"
            try:
                r = decode_speed.bench_shape(shape, opts, device, dtype, tmp / f"speed-{shape}", bandwidth)
                tps, ratios = r["tps"], r["ratios"]
                eager = ratios[("eager", "hf")]
                speeds.append(f"{shape} {dtype_name(dtype)} {eager:.2f}x")
                detail = (f"kvexplore {tps['eager']:.1f} tok/s vs transformers {tps['hf']:.1f} tok/s = {eager:.2f}x "
                          f"(CPU target {decode_speed.TARGETS.get((shape, 'eager', 'hf'))}x), greedy tokens "
                          f"{'identical' if r['same'] else 'differ'}")
                record(name, eager >= 1.0 if device.type == "cuda" else None, detail + " [fails below 1.0x]")
                against = "hf-static" if "hf-static" in tps else "hf"
                fast = ratios[("compiled", against)]
                speeds.append(f"compiled {shape} {dtype_name(dtype)} {fast:.2f}x {against}")
                record(f"compiled {name}", fast >= 1.0 if device.type == "cuda" else None,
                       f"kvexplore compiled {tps['compiled']:.1f} tok/s ({tps['compiled'] / r['bound']:.0%} of the "
                       f"bandwidth bound) vs {decode_speed.NAMES[against]} {tps[against]:.1f} tok/s = {fast:.2f}x "
                       f"[fails below 1.0x]")
            except Exception as e:
                traceback.print_exc()
                record(name, False, f"raised {type(e).__name__}: {e}")
            if device.type == "cuda":
                torch.cuda.empty_cache()
    counters_overhead(device, tmp / f"speed-{shapes[0]}", args, record)


def check_graph_replay(device: torch.device, tmp: Path, args, record) -> None:
    """The compiled step replayed: the same greedy tokens as eager (float32), and what the allocator does per
    replayed step (CUDA graphs: nothing but the logits handed out)."""
    print(f"\n(f) compiled decoding on {device}: the step compiled once, then replayed")
    folder = tmp / "speed-24M"
    if not (folder / "config.json").exists():
        build_checkpoint("24M", folder, seed=0)
    for dtype in (torch.float32, torch.bfloat16):
        model = kvexplore.load(folder, dtype=dtype, device=device)
        prompt = prompt_ids(args.prompt_len, model.config.vocab_size)
        n = max(16, args.new_tokens)
        runs = {}
        for compile in (False, True):
            cache = kvexplore.PreallocatedCache(model.config, len(prompt) + 2 * n + 1, dtype=dtype, device=device)
            cache.allocator = None
            gen = kvexplore.Generator(model, cache, compile=compile)
            gen.prefill(prompt)
            gen.run(n, stop_at_eos=False)  # compiles (and captures the graph) on the first step
            counts = torch.cuda.memory_stats(device).get("allocation.all.allocated", 0) if device.type == "cuda" else 0
            t0 = time.perf_counter()
            gen.run(n, stop_at_eos=False)
            dt = time.perf_counter() - t0
            after = torch.cuda.memory_stats(device).get("allocation.all.allocated", 0) if device.type == "cuda" else 0
            runs[compile] = (gen.generated_tokens, dt, (after - counts) / n, gen.compile_s)
        (e_tok, e_dt, e_alloc, _), (c_tok, c_dt, c_alloc, c_s) = runs[False], runs[True]
        same = e_tok == c_tok
        name = f"compiled step {dtype_name(dtype)}"
        record(f"{name}: greedy tokens", same if dtype == torch.float32 else None,
               f"{'identical to' if same else 'differ from'} eager over {2 * n} steps"
               + ("" if dtype == torch.float32 else " (bfloat16: compiled kernels may round differently; info only)"))
        record(f"{name}: replay", None,
               f"compiled in {c_s:.1f} s; {n / c_dt:.1f} tok/s replayed vs {n / e_dt:.1f} eager = {e_dt / c_dt:.2f}x; "
               f"allocations per step {c_alloc:.1f} compiled vs {e_alloc:.1f} eager (CUDA allocator counts)")
        if device.type == "cuda":
            torch.cuda.empty_cache()


def counters_overhead(device: torch.device, folder: Path, args, record) -> None:
    """Decode time with the allocator's counters read around every cache write (the default) vs not read."""
    import decode_speed

    if device.type != "cuda" or not (folder / "config.json").exists():
        return  # off CUDA there are no counters to read
    model = kvexplore.load(folder, dtype=torch.bfloat16, device=device)
    prompt = prompt_ids(args.prompt_len, model.config.vocab_size)
    runs = {True: [], False: []}
    for _ in range(max(2, args.reps)):
        for on in (True, False):
            runs[on].append(decode_speed.run_kvexplore(model, prompt, args.new_tokens, allocator=on)[1])
    with_c, without = sorted(runs[True])[len(runs[True]) // 2], sorted(runs[False])[len(runs[False]) // 2]
    record("decode: allocator counters read per cache write", None,
           f"{with_c / without:.2f}x the decode time without them ({with_c * 1e3:.1f} vs {without * 1e3:.1f} ms for "
           f"{args.new_tokens - 1} steps); set cache.allocator = None to skip them")
