"""Long contexts in the explorer: traced prefill against the model alone, peak memory, Step time, held bytes.

    python benchmarks/long_context.py                                  # SmolLM2-135M, 128..4096 tokens, 1 thread
    python benchmarks/long_context.py --threads 1,2 --lengths 1024,4096
    python benchmarks/long_context.py --model gemma3-shape             # random weights of Gemma 3 270M's shape
    python benchmarks/long_context.py --skip-prefill --profile         # cProfile of a Step + snapshot + every view

Every measurement runs in its own process (a clean peak resident set, read as ``ru_maxrss``):

1. **Prefill**, per length and thread count: ``Generator.prefill`` without a tracer (the model alone, pre-allocated
   cache) against ``Session.prefill`` with one lane: the explorer's tracer, its bounded attention store
   (:mod:`kvexplore.explorer.attention_store`) filled from the prefill's rows in chunks -- interleaved in one process,
   the fastest of ``--reps`` each (a busy machine only slows runs down). Then one run each of the model alone, one
   lane and two lanes (``preallocated`` and ``paged``) in its own process for the peak RSS (and the peak added over
   the loaded model).
2. **Step**, at 512 and at the longest length: the server side of a Step with two lanes -- ``Session.step`` (median
   of ``--steps``), then a snapshot and every registered view built from it (what a refresh computes) -- and the
   ratio between the two lengths (target: at most 2x).
3. **Held bytes** after ``--held-steps`` steps (at 512 tokens): the attention store's bytes and what the records and
   tracers allocated during the steps (``tracemalloc``, which sees numpy arrays and Python objects), per step.

The model is ``smollm2-135m`` (converted once, see MODELS in the docs) or ``gemma3-shape``: a random-weight Gemma 3
of 270M's shape (18 layers, hidden 640, 4 heads and 1 KV head of 256, window 512, vocabulary 262,144), built once
under ``~/.cache/kvexplore-bench``.
"""

from __future__ import annotations

import argparse
import json
import resource
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch

TEXT = Path(__file__).resolve().parent.parent / "tests" / "data" / "moby_dick_chapter_1.txt"
GEMMA_DIR = Path.home() / ".cache" / "kvexplore-bench" / "gemma3-270m-shape"


def load(name: str):
    import kvexplore

    if name != "gemma3-shape":
        return kvexplore.load(name)
    if not (GEMMA_DIR / "config.json").exists():
        import transformers

        transformers.utils.logging.disable_progress_bar()
        config = transformers.Gemma3TextConfig(
            vocab_size=262144, hidden_size=640, intermediate_size=2048, num_hidden_layers=18, num_attention_heads=4,
            num_key_value_heads=1, head_dim=256, sliding_window=512, max_position_embeddings=32768,
            query_pre_attn_scalar=256, rope_theta=1e6, rope_local_base_freq=1e4, sliding_window_pattern=6,
            bos_token_id=2, eos_token_id=1, pad_token_id=0, tie_word_embeddings=True)
        torch.manual_seed(0)
        model = transformers.Gemma3ForCausalLM(config).float().eval()
        GEMMA_DIR.mkdir(parents=True, exist_ok=True)
        model.save_pretrained(GEMMA_DIR)
    return kvexplore.load(GEMMA_DIR)


def ids_for(model, n: int) -> list[int]:
    tok = model.tokenizer
    ids = tok.encode(TEXT.read_text()) if tok is not None else []
    if len(ids) < n:  # repeat the text (or random ids without a tokenizer)
        g = torch.Generator().manual_seed(0)
        ids = ids * (n // max(len(ids), 1) + 1) if ids else torch.randint(3, model.config.vocab_size, (n,),
                                                                          generator=g).tolist()
    return ids[:n]


def rss_mb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


# -- children ------------------------------------------------------------------------------------------------
def _prefill(model, mode: str, ids: list[int]) -> None:
    from kvexplore import Generator, make_cache
    from kvexplore.explorer.session import Session

    n = len(ids)
    if mode == "alone":
        Generator(model, make_cache("preallocated", model, max_seq_len=n + 8)).prefill(ids)
    else:
        lanes = ("preallocated",) if mode == "traced" else ("preallocated", "paged")
        Session(model, lanes, max_seq_len=n + 8).prefill(ids)


def child_prefill(model_name: str, mode: str, n: int, threads: int, reps: int) -> dict:
    """``mode`` "time": the model alone and the explorer with one lane, interleaved ``reps`` times (the fastest of
    each: a shared machine only slows a run down); otherwise one run of ``mode`` for its peak resident set."""
    torch.set_num_threads(threads)
    model = load(model_name)
    ids = ids_for(model, n)
    _prefill(model, "alone", ids[:32])  # warm up
    base = rss_mb()
    if mode != "time":
        t = time.perf_counter()
        _prefill(model, mode, ids)
        return {"s": time.perf_counter() - t, "peak": rss_mb(), "base": base}
    out: dict[str, list[float]] = {"alone": [], "traced": []}
    for rep in range(reps):
        for m in (("alone", "traced") if rep % 2 == 0 else ("traced", "alone")):
            t = time.perf_counter()
            _prefill(model, m, ids)
            out[m].append(time.perf_counter() - t)
    return {m: min(v) for m, v in out.items()}


_STRIP = None


def _views(session):
    from kvexplore.explorer.strip import TokenStrip
    from kvexplore.views import snapshot
    from kvexplore.views.registry import VIEWS

    global _STRIP
    strip = _STRIP = _STRIP or TokenStrip()  # the widget keeps one (it caches the prompt's texts)
    names = list(session.lanes)
    snap = snapshot.take(session, strip, names[0], names[1] if len(names) > 1 else None, 0, 0)
    for name in VIEWS:
        VIEWS[name].build(snap)


def child_step(model_name: str, n: int, threads: int, steps: int, profile: bool) -> dict:
    from kvexplore.explorer.session import Session

    torch.set_num_threads(threads)
    model = load(model_name)
    s = Session(model, ("preallocated", "paged"), max_seq_len=n + steps + 16)
    s.prefill(ids_for(model, n))
    for _ in range(2):
        s.step()
        _views(s)
    from kvexplore import Generator, make_cache

    plain = [Generator(model, make_cache(k, model, max_seq_len=n + steps + 16)) for k in s.lanes]
    for g in plain:  # the same steps untraced: what the model and caches alone take
        g.prefill(ids_for(model, n))
        g.step()
    plain_s = []
    for _ in range(steps):
        t = time.perf_counter()
        for g in plain:
            g.step()
        plain_s.append(time.perf_counter() - t)
    del plain
    step_s, view_s = [], []
    for _ in range(steps):
        t = time.perf_counter()
        s.step()
        m = time.perf_counter()
        _views(s)
        step_s.append(m - t)
        view_s.append(time.perf_counter() - m)
    if profile:
        import cProfile
        import pstats

        pr = cProfile.Profile()
        pr.enable()
        s.step()
        _views(s)
        pr.disable()
        pstats.Stats(pr, stream=sys.stderr).sort_stats("cumtime").print_stats(30)
    return {"step": statistics.median(step_s), "views": statistics.median(view_s),
            "store": s.reference.tracer.store.nbytes, "plain": statistics.median(plain_s)}


def child_held(model_name: str, n: int, threads: int, steps: int) -> dict:
    import tracemalloc

    from kvexplore.explorer.session import Session

    torch.set_num_threads(threads)
    model = load(model_name)
    s = Session(model, ("preallocated", "paged"), max_seq_len=n + steps + 16)
    s.prefill(ids_for(model, n))
    s.step()
    store0 = sum(lane.tracer.store.nbytes for lane in s.lanes.values())
    tracemalloc.start()
    before = tracemalloc.take_snapshot()
    for _ in range(steps):
        s.step()
    after = tracemalloc.take_snapshot()
    grown = sum(d.size_diff for d in after.compare_to(before, "filename"))
    tracemalloc.stop()
    store1 = sum(lane.tracer.store.nbytes for lane in s.lanes.values())
    return {"grown": grown, "store0": store0, "store1": store1, "steps": steps}


def run_child(args: list[str]) -> dict:
    out = subprocess.run([sys.executable, __file__, "--child", *args], capture_output=True, text=True)
    if out.returncode != 0:
        raise RuntimeError(f"child {args} failed:\n{out.stderr[-3000:]}")
    if out.stderr.strip():
        print(out.stderr, file=sys.stderr)
    return json.loads(out.stdout.strip().splitlines()[-1])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--lengths", default="128,1024,2048,4096")
    ap.add_argument("--threads", default="1")
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--reps", type=int, default=3, help="prefill timings: the fastest of this many, interleaved")
    ap.add_argument("--held-steps", type=int, default=200)
    ap.add_argument("--skip-prefill", action="store_true")
    ap.add_argument("--skip-step", action="store_true")
    ap.add_argument("--skip-held", action="store_true")
    ap.add_argument("--profile", action="store_true")
    ap.add_argument("--child", nargs="+")
    args = ap.parse_args()
    if args.child:
        kind, *rest = args.child
        if kind == "prefill":
            res = child_prefill(rest[0], rest[1], int(rest[2]), int(rest[3]), int(rest[4]))
        elif kind == "step":
            res = child_step(rest[0], int(rest[1]), int(rest[2]), int(rest[3]), rest[4] == "1")
        else:
            res = child_held(rest[0], int(rest[1]), int(rest[2]), int(rest[3]))
        print(json.dumps(res))
        return
    lengths = [int(x) for x in args.lengths.split(",")]
    threads = [int(x) for x in args.threads.split(",")]
    load(args.model)  # convert / build once, outside the measurements
    print(f"# {args.model}: long contexts in the explorer")
    if not args.skip_prefill:
        print("\n| tokens | threads | model alone | explorer, 1 lane | ratio | explorer, 2 lanes (one run) "
              "| peak RSS: alone / 1 lane / 2 lanes (added over the loaded model) |")
        print("|---|---|---|---|---|---|---|")
        for n in lengths:
            for th in threads:
                t = run_child(["prefill", args.model, "time", str(n), str(th), str(args.reps)])
                r = {m: run_child(["prefill", args.model, m, str(n), str(th), "1"])
                     for m in ("alone", "traced", "traced2")}
                peaks = " / ".join(f"{r[m]['peak']:.0f} MB (+{r[m]['peak'] - r[m]['base']:.0f})"
                                   for m in ("alone", "traced", "traced2"))
                print(f"| {n:,} | {th} | {t['alone']:.2f} s | {t['traced']:.2f} s | {t['traced'] / t['alone']:.2f}x "
                      f"| {r['traced2']['s']:.2f} s ({r['traced2']['s'] / 2 / r['alone']['s']:.2f}x per lane) "
                      f"| {peaks} |", flush=True)
    if not args.skip_step:
        print("\n| tokens | threads | Session.step, 2 lanes | the same steps untraced | snapshot + every view "
              "| attention store (1 lane) |")
        print("|---|---|---|---|---|---|")
        res = {}
        for n in sorted({512, max(lengths)}):
            for th in threads:
                res[n, th] = r = run_child(["step", args.model, str(n), str(th), str(args.steps),
                                            "1" if args.profile and n == max(lengths) else "0"])
                print(f"| {n:,} | {th} | {r['step'] * 1e3:.0f} ms | {r['plain'] * 1e3:.0f} ms "
                      f"| {r['views'] * 1e3:.0f} ms | {r['store'] / 2**20:.1f} MiB |", flush=True)
        for th in threads:
            lo, hi = res[512, th], res[max(lengths), th]
            print(f"\nStep at {max(lengths):,} / at 512 ({th} thread{'s' * (th > 1)}): {hi['step'] / lo['step']:.2f}x "
                  f"(target <= 2x); with the views {(hi['step'] + hi['views']) / (lo['step'] + lo['views']):.2f}x; "
                  f"the untraced steps {hi['plain'] / lo['plain']:.2f}x; what tracing adds "
                  f"{(hi['step'] - hi['plain']) * 1e3:.0f} ms against {(lo['step'] - lo['plain']) * 1e3:.0f} ms")
    if not args.skip_held:
        r = run_child(["held", args.model, "512", str(threads[0]), str(args.held_steps)])
        print(f"\nHeld after {r['steps']} steps at 512 tokens (2 lanes): the records and tracers allocated "
              f"{r['grown'] / 1024:.0f} KiB ({r['grown'] / r['steps'] / 1024:.1f} KiB per step); the attention "
              f"stores {r['store0'] / 2**20:.1f} -> {r['store1'] / 2**20:.1f} MiB")


if __name__ == "__main__":
    main()
