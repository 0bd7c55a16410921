"""CUDA checks for kvexplore: about 6 minutes on one H200 (356 s on 2026-12-04), 2 minutes on the CPU.

    python benchmarks/gpu_check.py                  # on a CUDA machine
    python benchmarks/gpu_check.py --device cpu     # debug: the same code paths on the CPU, small and quick
    python benchmarks/gpu_check.py --skip-speed     # parity + memory only

Exit codes: 0 every check passed, 1 some check failed, 2 no CUDA device (one line printed, nothing run).

(a) Parity. Random-weight checkpoints built with transformers (``_common.PARITY_CASES``: Llama with GQA,
    Qwen2 with q/k/v biases, Llama with tied embeddings, Mistral with a 16-token sliding window; norm weights
    and biases perturbed). For each case and dtype (float32, bfloat16) kvexplore on the device runs a prompt
    as one prefill and then feeds a fixed continuation token by token through a PreallocatedCache (teacher
    forcing: the same ids for everyone, so sequences never diverge); the logits of every position are
    compared with
      - kvexplore on the CPU in float32, same procedure (the reference), and
      - transformers on the device in the same dtype, one full forward over the whole sequence.
    transformers-on-device vs the CPU reference is printed as well, to show the error level of the dtype.
    float32 passes with max |diff| <= 1e-4 * max(1, max|ref logit|) (TF32 matmuls are switched off).
    bfloat16 passes when max |diff| <= tol and every top-1 disagreement is a near tie (the reference's logits
    of the two tokens differ by at most tol), where tol = 0.05 * max|ref logit|, or, against the float32
    reference, twice transformers' own bfloat16 error if that is larger (random weights amplify bf16 rounding).
(b) Decode speed, kvexplore vs transformers ``generate`` on the device, both shapes of decode_speed.py, in
    bfloat16 and float32 (the same measurement as benchmarks/decode_speed.py; see its docstring).
(c) Memory. ``torch.cuda.memory_stats()`` around a PreallocatedCache: allocated-bytes delta at creation vs
    ``cache.inspect.reserved_bytes`` vs the ``kvexplore.kv_bytes`` formula, reserved bytes, inactive-split bytes and
    allocation retries before, after creation, and after a 256-token generation; also whether the cache
    storage stayed in place (same data pointers) and whether allocated memory grew during generation.
(d) Strategies. Every kind in ``kvexplore.caches.STRATEGIES`` on the tiny model for the same generation:
    greedy tokens equal the pre-allocated cache's for exact kinds, bytes copied, and what the allocator did
    inside the caches' writes (``record.memory.cuda``): 0 allocated per decode step for the pre-allocated
    cache, a new storage allocated and the old one freed per step (as its own bookkeeping says, rounded to the
    allocator's 512-byte blocks) for the concatenating one.
(e) Readiness, for every cache kind in float32, bfloat16 and float16 on the device: greedy and sampled runs
    (sampling is reproducible from its seed), a full trace (cache, attention, qkv) that leaves the logits bit
    for bit as they are untraced, the explorer's views of every lane built after steps, a rewind and a fork,
    and the host syncs of an untraced decode step, counted by torch's own sync debug mode (at most 2), with
    the RoPE tables still float32 after ``.to(bfloat16)``.
(f) Compiled decoding (``Generator(compile=True)``; on CUDA the step is a CUDA graph, ``mode="reduce-overhead"``):
    the same greedy tokens as eager in float32, the compile time, replayed tokens/s against eager, and the
    allocator's allocations per replayed step. (b) also times the compiled engine against transformers'
    static cache with its own torch.compile recipe.

Speed fails below 1.0x transformers. The last line is the one-line summary.

A summary with one line per check comes last.
"""

from __future__ import annotations

import argparse
import math
import sys
import tempfile
import time
import traceback
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

from _common import (PARITY_CASES, SHAPES, build_checkpoint, build_parity_checkpoint, dtype_name, load_hf,
                     prompt_ids)
from gpu_readiness import check_readiness
from gpu_speed import check_graph_replay, check_speed

import kvexplore

FP32_TOL = 1e-4  # times max(1, max |ref logit|)
BF16_REL_TOL = 0.05  # of max |ref logit|, for the max diff and for what counts as a near tie

RESULTS: list[tuple[str, bool | None, str]] = []  # (check, passed (None = info only), detail)
SPEEDS: list[str] = []  # "shape dtype ratio" of each decode-speed run, for the summary line


def record(name: str, passed: bool | None, detail: str) -> None:
    RESULTS.append((name, passed, detail))
    mark = "info" if passed is None else ("PASS" if passed else "FAIL")
    print(f"  [{mark}] {name}: {detail}", flush=True)


# -- (a) parity ------------------------------------------------------------------------------------------
def kvexplore_logits(model, ids: list[int], prompt_len: int) -> torch.Tensor:
    """float32 CPU logits ``[len(ids), vocab]``: prefill ``ids[:prompt_len]``, then one token at a time."""
    cache = kvexplore.PreallocatedCache(model.config, len(ids), dtype=model.dtype, device=model.device)
    dev = model.device
    out = [model(torch.tensor([ids[:prompt_len]], device=dev), cache, 0)[0]]
    for pos in range(prompt_len, len(ids)):
        out.append(model(torch.tensor([[ids[pos]]], device=dev), cache, pos)[0])
    assert cache.length == len(ids)
    return torch.cat(out).float().cpu()


@torch.no_grad()
def hf_logits(model, ids: list[int]) -> torch.Tensor:
    dev = next(model.parameters()).device
    return model(torch.tensor([ids], device=dev)).logits[0].float().cpu()


def compare(got: torch.Tensor, ref: torch.Tensor) -> dict:
    diff = (got - ref).abs()
    scale = ref.abs().max().item()
    top_got, top_ref = got.argmax(-1), ref.argmax(-1)
    disagree = (top_got != top_ref).nonzero().flatten().tolist()
    # how far below the reference's best is the token `got` picked, at each disagreement (in reference logits)
    gaps = [(ref[i, top_ref[i]] - ref[i, top_got[i]]).item() for i in disagree]
    return dict(max=diff.max().item(), mean=diff.mean().item(), scale=scale, rel=diff.max().item() / max(scale, 1e-12),
                agree=1 - len(disagree) / len(ref), n=len(ref), worst_gap=max(gaps, default=0.0),
                finite=bool(torch.isfinite(got).all()))


def verdict(c: dict, dtype: torch.dtype, hf_err: float = 0.0) -> tuple[bool, str]:
    """Pass/fail of one comparison. ``hf_err``: transformers' own max |diff| from the float32 reference in this
    dtype; a low-precision kvexplore may be off by up to twice that (the dtype's error level) if it is larger
    than the fixed relative tolerance."""
    detail = (f"max|diff| {c['max']:.3g} (mean {c['mean']:.2g}, {c['rel'] * 100:.3g}% of max|logit| {c['scale']:.3g}), "
              f"top-1 agree {c['agree'] * 100:.1f}% of {c['n']}")
    if c["agree"] < 1:
        detail += f", worst top-1 gap {c['worst_gap']:.3g}"
    if not c["finite"]:
        return False, detail + ", NON-FINITE logits"
    if dtype == torch.float32:
        tol = FP32_TOL * max(1.0, c["scale"])
        return c["max"] <= tol, detail + f" [tol {tol:.2g}]"
    tol = max(BF16_REL_TOL * c["scale"], 2 * hf_err)
    ok = c["max"] <= tol and c["worst_gap"] <= tol
    why = f"{BF16_REL_TOL} x max|logit|" if tol == BF16_REL_TOL * c["scale"] else "2 x transformers' own error"
    return ok, detail + f" [tol {tol:.3g} = {why}, for max|diff| and near-tie gaps]"


def check_parity(device: torch.device, dtypes: list[torch.dtype], tmp: Path, prompt_len: int, decode_len: int) -> None:
    print(f"\n(a) parity: prefill {prompt_len} + {decode_len} single-token decode steps (PreallocatedCache)")
    for case in PARITY_CASES:
        folder = tmp / f"parity-{case}"
        try:
            build_parity_checkpoint(case, folder)
            ref_model = kvexplore.load(folder, dtype=torch.float32, device="cpu")
            vocab = ref_model.config.vocab_size
            ids = prompt_ids(prompt_len + decode_len, vocab, seed=7)
            ref = kvexplore_logits(ref_model, ids, prompt_len)
            hf_cpu = hf_logits(load_hf(folder, torch.float32, "cpu"), ids)
            c = compare(ref, hf_cpu)
            ok, detail = verdict(c, torch.float32)
            record(f"parity {case} cpu float32 kvexplore vs transformers", ok, detail)
            for dtype in dtypes:
                name = f"parity {case} {device.type} {dtype_name(dtype)}"
                model = kvexplore.load(folder, dtype=dtype, device=device)
                got = kvexplore_logits(model, ids, prompt_len)
                hf = load_hf(folder, dtype, device)
                hf_dev = hf_logits(hf, ids)
                hf_c = compare(hf_dev, ref)
                _, detail = verdict(hf_c, dtype)
                record(f"{name}: (transformers {device.type} vs kvexplore cpu float32: the dtype's error level)",
                       None, detail.split(" [")[0])
                ok, detail = verdict(compare(got, ref), dtype, hf_err=hf_c["max"])
                record(f"{name}: kvexplore vs kvexplore cpu float32", ok, detail)
                ok, detail = verdict(compare(got, hf_dev), dtype)
                record(f"{name}: kvexplore vs transformers {device.type}", ok, detail)
                del model, hf
        except Exception as e:  # keep going: one broken case should not hide the others
            traceback.print_exc()
            record(f"parity {case}", False, f"raised {type(e).__name__}: {e}")


# -- (c) memory ------------------------------------------------------------------------------------------
STAT_KEYS = {
    "allocated": "allocated_bytes.all.current",
    "reserved": "reserved_bytes.all.current",
    "inactive_split": "inactive_split_bytes.all.current",
    "alloc_retries": "num_alloc_retries",
    "peak_allocated": "allocated_bytes.all.peak",
}


def mem(device: torch.device) -> dict:
    if device.type != "cuda":
        return {}
    torch.cuda.synchronize(device)
    stats = torch.cuda.memory_stats(device)
    return {k: stats.get(v, 0) for k, v in STAT_KEYS.items()}


def fmt(stats: dict) -> str:
    if not stats:
        return "n/a (not CUDA)"
    return ", ".join(f"{k} {v:,}" if "retries" in k else f"{k} {v / 2**20:.2f} MiB" for k, v in stats.items())


def check_memory(device: torch.device, dtypes: list[torch.dtype], shape: str, capacity: int, gen_tokens: int,
                 tmp: Path) -> None:
    print(f"\n(c) memory: PreallocatedCache({shape}, capacity {capacity}) and a {gen_tokens}-token generation")
    folder = tmp / f"speed-{shape}"
    if not (folder / "config.json").exists():
        build_checkpoint(shape, folder, seed=0)
    for dtype in dtypes:
        name = f"memory {shape} {dtype_name(dtype)}"
        try:
            model = kvexplore.load(folder, dtype=dtype, device=device)
            # warm-up with a throwaway cache: one-time allocations (cuBLAS workspace ...) happen here, not below
            warm = kvexplore.Generator(model, kvexplore.PreallocatedCache(model.config, 24, dtype=dtype, device=device))
            warm.prefill(prompt_ids(16, model.config.vocab_size))
            warm.run(4, stop_at_eos=False)
            del warm
            if device.type == "cuda":
                torch.cuda.empty_cache()
                torch.cuda.reset_peak_memory_stats(device)
            before = mem(device)
            cache = kvexplore.PreallocatedCache(model.config, capacity, dtype=dtype, device=device)
            after_alloc = mem(device)
            formula = kvexplore.kv_bytes(model.config, capacity, 1, dtype)
            per_tensor = math.prod(cache.key(0).shape) * cache.key(0).element_size()
            rounded = 2 * model.config.num_layers * (-(-per_tensor // 512) * 512)  # allocator rounds to 512 B
            ptrs = [cache.key(i).data_ptr() for i in range(model.config.num_layers)]
            print(f"    before cache:       {fmt(before)}")
            print(f"    after cache alloc:  {fmt(after_alloc)}")
            print(f"    reserved bytes {cache.inspect.reserved_bytes:,} B, kv_bytes formula {formula:,} B "
                  f"(2 x {model.config.num_layers} layers x {model.config.num_kv_heads} kv heads x "
                  f"{model.config.head_dim} head_dim x {cache.key(0).element_size()} B x {capacity} positions)")
            record(f"{name}: cache.inspect.reserved_bytes == kv_bytes formula", cache.inspect.reserved_bytes == formula,
                   f"{cache.inspect.reserved_bytes:,} vs {formula:,} B")
            if after_alloc:
                delta = after_alloc["allocated"] - before["allocated"]
                record(f"{name}: allocated delta at cache creation == reserved_bytes", delta in (formula, rounded),
                       f"delta {delta:,} B vs reserved_bytes {formula:,} B (allocator-rounded {rounded:,} B); "
                       f"allocator reserved {after_alloc['reserved'] - before['reserved']:+,} B")
                torch.cuda.reset_peak_memory_stats(device)
            g = kvexplore.Generator(model, cache)
            prompt = prompt_ids(16, model.config.vocab_size)
            g.prefill(prompt)
            g.run(gen_tokens - 1, stop_at_eos=False)
            after_gen = mem(device)
            print(f"    after generation:   {fmt(after_gen)}")
            in_place = ptrs == [cache.key(i).data_ptr() for i in range(model.config.num_layers)]
            record(f"{name}: cache storage stayed in place during generation", in_place,
                   f"{len(g.generated_tokens)} tokens generated, cache length {cache.length}/{capacity}")
            if after_gen:
                grew = after_gen["allocated"] - after_alloc["allocated"]
                transient = after_gen["peak_allocated"] - after_alloc["allocated"]
                record(f"{name}: allocated memory did not grow during generation", grew <= 0,
                       f"allocated {grew:+,} B after vs before generation; peak transient {transient / 2**20:.2f} MiB; "
                       f"inactive_split {after_gen['inactive_split'] / 2**20:.2f} MiB; "
                       f"alloc retries {after_gen['alloc_retries']}")
            del g, cache, model
        except Exception as e:
            traceback.print_exc()
            record(name, False, f"raised {type(e).__name__}: {e}")


# -- (d) every cache strategy: exact tokens, copies and the allocator ------------------------------------
def check_strategies(device: torch.device, gen_tokens: int) -> None:
    """Each strategy of kvexplore.caches.STRATEGIES on the tiny model: greedy tokens equal the pre-allocated
    cache's (exact kinds), bytes copied per step, and the CUDA allocator deltas the memory reports carry."""
    print(f"\n(d) cache strategies on {device}: tiny model, {gen_tokens} greedy tokens each")
    model = kvexplore.load("tiny", dtype=torch.float32, device=device)
    prompt = "Call me Ishmael. Some years ago"
    reference = None
    for kind in kvexplore.caches.STRATEGIES:
        name = f"strategy {kind}"
        try:
            options = {"window": gen_tokens + 64} if kind == "sink" else {}
            gen = kvexplore.Generator(model, kvexplore.make_cache(kind, model, max_seq_len=gen_tokens + 64, **options))
            gen.prefill(prompt)
            records = gen.run(gen_tokens - 1, stop_at_eos=False)
            if reference is None:
                reference = gen.tokens
            copied = sum(r.memory.copied_bytes for r in records)
            steps = records[1:]  # past the first decode step (one-time scratch buffers)
            alloc = sum(r.memory.cuda.get("allocated_bytes", 0) for r in steps)
            freed = sum(r.memory.cuda.get("freed_bytes", 0) for r in steps)
            own = sum(r.memory.allocated_bytes for r in steps)
            frag = max((r.memory.cuda_now.get("inactive_split_bytes", 0) for r in records), default=0)
            detail = (f"copied {copied / 2**20:.2f} MiB over {len(records)} steps; in the cache's writes the allocator "
                      f"allocated {alloc:,} B and freed {freed:,} B (the cache's own count: {own:,} B allocated); "
                      f"largest inactive split {frag:,} B; cache reserved {gen.cache.inspect.reserved_bytes:,} B")
            if device.type == "cuda" and kind == "preallocated":
                record(f"{name}: allocates nothing per decode step", alloc == 0 and freed == 0, detail)
            if device.type == "cuda" and kind == "concat":
                rounded = sum(2 * gen.model.config.num_layers * 512 + r.memory.allocated_bytes for r in steps)
                record(f"{name}: allocates and frees its storage every step", own <= alloc <= rounded and freed > 0,
                       detail)
            # lossy by design (quantized, or a cache that presses out positions): its tokens are shown, not judged
            exact = kind != "quantized" and gen.cache.eviction is None
            lossy = gen.cache.inspect.what_it_did()
            record(name, gen.tokens == reference if exact else None, detail + (f"; {lossy}" if lossy else ""))
        except Exception as e:
            traceback.print_exc()
            record(name, False, f"raised {type(e).__name__}: {e}")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--device", default="cuda", help="cuda (default) or cpu for a quick debug run of the same code")
    ap.add_argument("--skip-parity", action="store_true")
    ap.add_argument("--skip-speed", action="store_true")
    ap.add_argument("--skip-memory", action="store_true")
    ap.add_argument("--skip-readiness", action="store_true")
    ap.add_argument("--shapes", default=None, help="decode-speed shapes (default 24M,135M; cpu debug: 24M)")
    ap.add_argument("--new-tokens", type=int, default=None, help="decode speed: tokens per run (default 64; cpu 8)")
    ap.add_argument("--prompt-len", type=int, default=32)
    ap.add_argument("--reps", type=int, default=None, help="decode speed repetitions (default 5; cpu 1)")
    ap.add_argument("--gen-tokens", type=int, default=None, help="memory check generation (default 256; cpu 32)")
    args = ap.parse_args(argv)

    device = torch.device(args.device)
    if device.type == "cuda":
        if not torch.cuda.is_available():
            print(f"gpu_check: no CUDA device available (torch {torch.__version__}, CUDA build "
                  f"{torch.version.cuda or 'none'}); nothing checked")
            return 2
        device = torch.empty(0, device=device).device
        torch.backends.cuda.matmul.allow_tf32 = False  # fp32 parity means real fp32 matmuls
        torch.backends.cudnn.allow_tf32 = False
    elif device.type != "cpu":
        print(f"gpu_check: unsupported device {args.device!r}")
        return 2
    debug = device.type == "cpu"
    if debug:
        torch.set_num_threads(max(1, min(4, torch.get_num_threads())))
    shapes = (args.shapes or ("24M" if debug else "24M,135M")).split(",")
    args.new_tokens = args.new_tokens or (8 if debug else 64)
    args.reps = args.reps or (1 if debug else 5)
    gen_tokens = args.gen_tokens or (32 if debug else 256)
    dtypes = [torch.float32, torch.bfloat16]

    import transformers
    where = torch.cuda.get_device_name(device) if device.type == "cuda" else "CPU (debug run)"
    print(f"gpu_check on {device} ({where}); torch {torch.__version__} (CUDA {torch.version.cuda}), "
          f"transformers {transformers.__version__}, kvexplore {kvexplore.__version__}")
    t0 = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="kvx-gpu-check-") as tmp:
        tmp = Path(tmp)
        if not args.skip_parity:
            check_parity(device, dtypes, tmp, prompt_len=24, decode_len=24 if debug else 40)
        if not args.skip_speed:
            check_speed(device, dtypes, [s for s in shapes if s in SHAPES], tmp, args, record, SPEEDS)
        if not args.skip_memory:
            check_memory(device, dtypes, "24M" if debug else "135M", capacity=max(512, gen_tokens + 64),
                         gen_tokens=gen_tokens, tmp=tmp)
            check_strategies(device, gen_tokens)
        if not args.skip_readiness:
            check_readiness(device, record)
        if not args.skip_speed:
            check_graph_replay(device, tmp, args, record)

    failed = [r for r in RESULTS if r[1] is False]
    passed = [r for r in RESULTS if r[1] is True]
    print(f"\nsummary ({device}, {time.perf_counter() - t0:.0f}s): {len(passed)} passed, {len(failed)} failed, "
          f"{sum(r[1] is None for r in RESULTS)} info")
    for name, ok, detail in RESULTS:
        mark = "info" if ok is None else ("PASS" if ok else "FAIL")
        if ok is not True or name.startswith("decode"):
            print(f"  {mark:4} {name}: {detail}")
        else:
            print(f"  {mark:4} {name}")
    speed = f"; kvexplore/transformers decode {', '.join(SPEEDS)}" if SPEEDS else ""
    print(f"gpu_check: {'ALL PASSED' if not failed else f'{len(failed)} CHECK(S) FAILED'} ({len(passed)} of "
          f"{len(passed) + len(failed)} checks passed on {device} in {time.perf_counter() - t0:.0f}s{speed})")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
