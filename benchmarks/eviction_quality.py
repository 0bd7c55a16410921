"""Eviction quality, measured the way the KV-compression literature reports it (issue 27, item 5).

    python benchmarks/eviction_quality.py frontier     # presses x budgets, quantized and sink caches: quality vs bytes
    python benchmarks/eviction_quality.py passkey      # passkey grid (depth x length): uncompressed, then per press
    python benchmarks/eviction_quality.py passkey --quant --tag _quant   # ... per quantized cache of the frontier
    python benchmarks/eviction_quality.py questions    # one context, two questions: compressed once vs per question
    python benchmarks/eviction_quality.py report       # the tables (markdown) and the figure from the saved results

Each part saves its results as JSON next to the figure (``docs/img/eviction_*.json``); ``report`` reads them and
writes ``docs/img/eviction_frontier.html`` (plotly; an SVG/PNG when kaleido is installed) and prints the tables
of docs/benchmarks.md. Frontier runs split across processes (``--kinds ... --tag _quant``) are drawn together.
Model: SmolLM2-135M in float32 (``--model gemma3-270m`` for Gemma 3 270M's frontier and passkey grid).

frontier: the first ``--context`` tokens of Moby-Dick's chapter 4 (kvexplore/data/texts) as context, the next
``--continuation`` tokens teacher-forced (kvexplore.compression.quality): KL(full || compressed) per token and
mean, top-1 agreement, perplexity, the full cache's attention mass on kept keys; bytes held at the end against the
full cache. Sink caches are sized to hold what an evicting cache of each budget holds at the end (sinks + window
= kept + continuation - 1).
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
IMG = ROOT / "docs" / "img"
PRESSES = ("knorm", "snapkv", "tova", "h2o", "streaming", "keydiff")
RATIOS = (0.25, 0.5, 0.75, 0.9)
# (kind, name, make_cache options): llama.cpp's cache types (keys and values the same type, and q8_0 keys with q4_0
# values), KIVI's cache at its widths, and KVQuant's recipe on KIVI's cache (pre-RoPE keys, 1% outliers kept exact)
QUANT_SCHEMES = (
    *(("llama.cpp", f"K {t}, V {t}", dict(k_type=t, v_type=t)) for t in ("q8_0", "q5_1", "q5_0", "q4_1", "q4_0")),
    ("llama.cpp", "K q8_0, V q4_0", dict(k_type="q8_0", v_type="q4_0")),
    *(("KIVI", f"K {kb}-bit, V {vb}-bit", dict(key_bits=kb, value_bits=vb))
      for kb, vb in ((8, 8), (4, 4), (4, 2), (3, 3), (2, 2))),
    *(("KVQuant", f"{b}-bit, pre-RoPE K, 1% outliers", dict(key_bits=b, value_bits=b, pre_rope_keys=True,
                                                             outliers=0.01)) for b in (4, 3, 2)),
)


def _load(name: str, threads: int):
    import torch

    import kvexplore

    torch.set_num_threads(threads)
    return kvexplore.load(name, accept_license=True) if name.startswith("gemma") else kvexplore.load(name)


def frontier(args) -> list[dict]:
    import kvexplore
    from kvexplore.compression.quality import compression_quality, full_cache, full_reference

    model = _load(args.model, args.threads)
    text = (ROOT / "kvexplore/data/texts/moby_dick_chapter_4.txt").read_text()
    ids = model.tokenizer.encode(text)
    ctx, cont = ids[:args.context], ids[args.context:args.context + args.continuation]
    t0 = time.perf_counter()
    ref = full_reference(model, ctx, cont)
    print(f"reference: {time.perf_counter() - t0:.1f} s, perplexity {ref.perplexity:.2f}", flush=True)
    head = dict(model=args.model, context=len(ctx), continuation=len(cont), full_used_bytes=ref.used_bytes,
                full_reserved_bytes=ref.reserved_bytes, full_perplexity=ref.perplexity)
    configs: list[tuple[str, str, float | None, object]] = [("full", "full", 0.0, full_cache)]
    for press in PRESSES:
        for r in RATIOS:
            configs.append(("evict", press, r, lambda m, n, p=press, r=r: kvexplore.make_cache(
                "evict", m, max_seq_len=n, press=p, compression_ratio=r)))
    for bits in (8, 4):
        configs.append(("quantized", f"{bits}-bit", None, lambda m, n, b=bits: kvexplore.make_cache(
            "quantized", m, max_seq_len=n, bits=b)))
    for kind, name, options in QUANT_SCHEMES:  # issue 41: every quantization scheme on the same frontier
        configs.append((kind, name, None, lambda m, n, o=options: kvexplore.make_cache(
            "quantized", m, max_seq_len=n, **o)))
    for r in RATIOS:
        slots = int(len(ctx) * (1 - r)) + len(cont) - 1
        configs.append(("sink", f"sinks 4 + window {slots - 4}", r, lambda m, n, s=slots: kvexplore.make_cache(
            "sink", m, sinks=4, window=s - 4)))
    if args.decode:
        configs.append(("evict decode", "knorm every 32", 0.5, lambda m, n: kvexplore.make_cache(
            "evict", m, max_seq_len=n, press="knorm", compression_ratio=0.5, decode_every=32)))
    rows = []
    for kind, name, ratio, factory in configs:
        if args.kinds and kind not in args.kinds.split(","):
            continue
        t = time.perf_counter()
        q = compression_quality(model, ctx, cont, factory, ref)
        row = dict(kind=kind, name=name, ratio=ratio, seconds=time.perf_counter() - t, **q.row(),
                   mass_per_layer=list(q.attention_mass.values()), kl=q.kl)
        rows.append(row)
        print(f"{kind:10s} {name:26s} r={ratio} KL {q.kl_mean:.4f} top1 {q.top1:.3f} ppl {q.perplexity:.2f} "
              f"mass {q.attention_mass_mean:.3f} used {q.used_fraction:.3f} ({row['seconds']:.1f} s)", flush=True)
        save(args, [head, *rows])  # as it goes: a long run stopped early keeps what it measured
    return [head, *rows]


def passkey_grid(args) -> list[dict]:
    import kvexplore
    from kvexplore.compression.passkey import haystack, passkey

    model = _load(args.model, args.threads)
    lengths = [int(x) for x in args.lengths.split(",")]
    depths = [float(x) for x in args.depths.split(",")]
    presses = [p for p in (args.presses if args.presses is not None else ",".join(PRESSES)).split(",") if p]
    runs = [("full", None, False)] * (not args.no_full) + [(p, args.ratio, inside) for p in presses
                                                           for inside in (False, True)]
    schemes = {f"{kind} {name}": options for kind, name, options in QUANT_SCHEMES}
    if args.quant:  # the quantized caches instead of the presses (a quantized cache compresses no question)
        runs = [("full", None, False)] * (not args.no_full) + [(name, None, False) for name in schemes
                                                               if not args.only or args.only in name]
    rows = []
    for press, ratio, inside in runs:
        for length in lengths:
            for depth in depths:
                hay = haystack(model.tokenizer, length, depth, seed=length * 100 + int(depth * 100))
                factory = None if press == "full" else (lambda m, n, o=schemes[press]: kvexplore.make_cache(
                    "quantized", m, max_seq_len=n, **o)) if press in schemes else (
                    lambda m, n, p=press: kvexplore.make_cache("evict", m, max_seq_len=n, press=p,
                                                               compression_ratio=ratio))
                t = time.perf_counter()
                a = passkey(model, hay, question_in_context=inside, **({} if factory is None else dict(
                    factory=factory)))
                rows.append(dict(model=args.model, press=press, ratio=ratio, question_in_context=inside,
                                 length=length, tokens=len(hay.ids), depth=depth, key=hay.key, answer=a.text,
                                 passed=a.passed, needle=a.coverage["needle"], seconds=time.perf_counter() - t))
                print(f"{press:9s} q_in={inside!s:5s} {length:5d} {depth:.2f} {a.passed!s:5s} {a.text!r} needle "
                      f"{a.coverage['needle']:.2f} ({rows[-1]['seconds']:.1f} s)", flush=True)
                save(args, rows)
    return rows


# The two-question demonstration: a Moby-Dick passage with two facts planted far apart.
FACT_1 = "The harpooneer's dog was named Rover."
FACT_2 = "The key to the sea chest was hidden under the blue blanket."
QUESTIONS = [(" Question: What was the harpooneer's dog named? Answer: The harpooneer's dog was named", FACT_1,
              "Rover"),
             (" Question: Where was the key to the sea chest hidden? Answer: The key was hidden under the",
              FACT_2, "blue blanket")]


def questions(args) -> list[dict]:
    from kvexplore.compression.passkey import two_questions

    model = _load(args.model, args.threads)
    text = (ROOT / "kvexplore/data/texts/moby_dick_chapter_4.txt").read_text()
    paragraphs = [p for p in text.split("\n") if p.strip()]
    body = " ".join(paragraphs[:6])
    words = body.split(" ")
    cut = len(words) // 8
    context = " ".join(words[:cut] + [FACT_1] + words[cut:len(words) - cut] + [FACT_2] + words[len(words) - cut:])
    rows = []
    for press, aware in ((p, "snapkv") for p in (args.presses or "knorm,keydiff,snapkv").split(",")):
        t = time.perf_counter()
        for qa in two_questions(model, context, QUESTIONS, press=press, query_aware_press=aware,
                                compression_ratio=args.ratio, max_new_tokens=6):
            if qa.mode == "full" and any(r["mode"] == "full" and r["question"] == qa.question for r in rows):
                continue
            rows.append(dict(model=args.model, press=press if qa.mode == "once" else aware if qa.mode != "full"
                             else "full", mode=qa.mode, ratio=args.ratio, question=qa.question,
                             fact=next(f for q, f, _ in QUESTIONS if q == qa.question),
                             expected=next(e for q, _, e in QUESTIONS if q == qa.question), answer=qa.answer.text,
                             passed=qa.answer.passed, coverage=qa.answer.coverage,
                             context_tokens=len(model.tokenizer.encode(context))))
            print(rows[-1], flush=True)
        print(f"{press}: {time.perf_counter() - t:.1f} s", flush=True)
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("part", choices=("frontier", "passkey", "questions", "report"))
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--context", type=int, default=1000)
    parser.add_argument("--continuation", type=int, default=128)
    parser.add_argument("--decode", action="store_true", help="frontier: add knorm pressing every 32 tokens")
    parser.add_argument("--kinds", default="", help="frontier: only these kinds (full,evict,quantized,sink,llama.cpp,"
                                                    "KIVI,KVQuant,...)")
    parser.add_argument("--lengths", default="256,512,1024,2048")
    parser.add_argument("--depths", default="0,0.25,0.5,0.75,1")
    parser.add_argument("--presses", default=None, help="default: all (passkey), knorm,keydiff,snapkv (questions)")
    parser.add_argument("--ratio", type=float, default=0.5)
    parser.add_argument("--no-full", action="store_true", help="passkey: skip the uncompressed grid")
    parser.add_argument("--quant", action="store_true", help="passkey: the quantized caches of the frontier instead "
                                                              "of the presses")
    parser.add_argument("--only", default="", help="passkey --quant: only the schemes whose name holds this")
    parser.add_argument("--tag", default="", help="suffix of the results file (runs split across processes)")
    args = parser.parse_args()
    if args.part == "report":
        from eviction_report import report

        report(IMG)
        return
    t = time.perf_counter()
    rows = {"frontier": frontier, "passkey": passkey_grid, "questions": questions}[args.part](args)
    out = save(args, rows)
    print(f"{out.relative_to(ROOT)}: {len(rows)} rows in {time.perf_counter() - t:.0f} s")


def save(args, rows: list[dict]) -> Path:
    IMG.mkdir(parents=True, exist_ok=True)
    model = "" if args.model == "smollm2-135m" else "_" + args.model
    out = IMG / f"eviction_{args.part}{model}{args.tag}.json"
    out.write_text(json.dumps(rows, indent=1))
    return out


if __name__ == "__main__":
    main()
