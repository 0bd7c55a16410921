"""gpu_check.py section (e), readiness: every cache kind in float32, bfloat16 and float16 on the device, traced and
untraced logits bit for bit, sampling reproducible from its seed, rewind and fork, host syncs per untraced decode
step (torch's own sync debug mode), RoPE tables, and the explorer's views over every lane (see docs/cuda.md)."""

from __future__ import annotations

import traceback

import torch

from _common import dtype_name, prompt_ids

import kvexplore


def teacher_forced(model, kind: str, ids: list[int], tracer=None) -> torch.Tensor:
    """Logits of every position after the first 8, fed one at a time (the whole prefix each time without a cache)."""
    cache = kvexplore.make_cache(kind, model, max_seq_len=len(ids) + 8)
    dev, out = model.device, []
    steps = [(0, n) for n in range(8, len(ids) + 1)] if kind == "none" else \
        [(0, 8)] + [(p, p + 1) for p in range(8, len(ids))]
    for start, end in steps:
        if tracer is not None:
            tracer.begin_step(cache, start, end - start)
        out.append(model(torch.tensor([ids[start:end]], device=dev), cache, start, tracer=tracer,
                         last_only=True)[0, -1])
        if tracer is not None:
            tracer.end_step(cache)
    return torch.stack(out)


def syncs_per_step(gen, steps: int = 8) -> float:
    """Host syncs of untraced decode steps, as torch's CUDA sync debug mode counts them (its warnings)."""
    import warnings

    torch.cuda.synchronize()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        try:
            gen.run(steps, stop_at_eos=False)
        finally:
            torch.cuda.set_sync_debug_mode("default")
    return sum("synchroniz" in str(w.message) for w in caught) / steps


def check_readiness(device: torch.device, record) -> None:
    """``record(name, passed, detail)``: gpu_check's result line."""
    print(f"\n(e) readiness on {device}: every cache kind, traced and sampled, the explorer, in three dtypes")
    ids = prompt_ids(40, 300, seed=3)
    for dtype in (torch.float32, torch.bfloat16, torch.float16):
        model = kvexplore.load("tiny", dtype=dtype, device=device)
        for kind in kvexplore.caches.STRATEGIES:
            name = f"ready {kind} {dtype_name(dtype)}"
            try:
                plain = teacher_forced(model, kind, ids)
                traced = teacher_forced(model, kind, ids, kvexplore.Tracer(capture={"cache", "attention", "qkv"}))
                same = torch.equal(plain, traced)
                runs = []
                for _ in range(2):
                    g = kvexplore.Generator(model, kvexplore.make_cache(kind, model, max_seq_len=96),
                                            temperature=0.9, top_p=0.95, seed=5)
                    g.prefill(ids[:12])
                    g.run(16, stop_at_eos=False)
                    runs.append(g.tokens)
                g.rewind(3)
                g.fork().step()
                detail = (f"traced logits {'identical to' if same else 'DIFFER from'} untraced "
                          f"(max |diff| {(plain - traced).abs().max().item():.3g}); sampling "
                          f"{'reproducible' if runs[0] == runs[1] else 'NOT reproducible'}; rewind and fork ran")
                ok = same and runs[0] == runs[1] and bool(torch.isfinite(plain).all())
                if device.type == "cuda":
                    per_step = syncs_per_step(_primed(model, kind, ids))
                    detail += f"; {per_step:.1f} host syncs per untraced decode step (torch's sync debug mode)"
                    ok = ok and per_step <= 2
                record(name, ok, detail)
            except Exception as e:
                traceback.print_exc()
                record(name, False, f"raised {type(e).__name__}: {e}")
        rope = kvexplore.load("tiny", device=device).to(dtype).rotary.inv_freq.dtype
        record(f"ready rope tables {dtype_name(dtype)}", rope == torch.float32, f"inv_freq {rope} after .to({dtype})")
    try:
        model = kvexplore.load("tiny", dtype=torch.bfloat16, device=device)
        ex = kvexplore.Explorer(model, strategies=tuple(kvexplore.caches.STRATEGIES), max_seq_len=64)
        ex.session.prefill("Call me Ishmael. Some years ago")
        for _ in range(4):
            ex.session.step()
        drawn = 0
        for lane in ex.session.lanes:
            ex.controls["lane"].value = lane
            drawn += len(ex.specs())
        ex.session.rewind(2)
        ex.session.fork()
        drawn += len(ex.specs())
        record("ready explorer bfloat16", True, f"{drawn} figure specs built over {len(ex.session.lanes)} lanes "
                                                f"after 4 steps, a rewind and a fork")
    except Exception as e:
        traceback.print_exc()
        record("ready explorer bfloat16", False, f"raised {type(e).__name__}: {e}")


def _primed(model, kind: str, ids: list[int]):
    g = kvexplore.Generator(model, kvexplore.make_cache(kind, model, max_seq_len=96))
    g.prefill(ids[:12])
    g.step()
    return g
