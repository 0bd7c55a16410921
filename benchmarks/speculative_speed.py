"""Speculative decoding's speed against plain greedy decoding, measured side by side in one run (issue 28, item 5).

    python benchmarks/speculative_speed.py                 # SmolLM2-135M float32, 3 prompts, 3 interleaved rounds
    python benchmarks/speculative_speed.py --tokens 64 --rounds 1   # quicker
    python benchmarks/speculative_speed.py --only "greedy,k=5" --prompts copy,code   # some configurations and prompts
    python benchmarks/speculative_speed.py --no-kernels             # both sides on F.linear instead

Each prompt gives the model something prompt lookup can find: a passage of Moby-Dick (kvexplore/data/texts) to
copy, the same passage to edit (through the chat template), and a Python function to repeat with one change. For
every prompt and round, each configuration generates ``--tokens`` tokens from the same prefilled prompt: plain
greedy (the baseline), prompt lookup with k = 3, 5 and 8 (n-grams of 3 down to 1, the default) and with k = 5 on
n-grams of 3 and 2 only, and self-speculation with the first L layers (L = 15, 24 of 30). Every configuration,
plain greedy included, runs with the product kernels on (``Generator(..., kernels=True)``: a decoding step's one row
and a verification's k + 1 rows on ``kvexplore.fast.kernels``), as the explorer and ``kvexplore generate`` do;
``--no-kernels`` runs every one on ``F.linear`` instead. The order of the configurations rotates every round, so
none is always timed first or last on a shared machine;
times are the generator's own (kvexplore.runtime.clock: wall time less the time the thread waited for a CPU), and
every speculative run's tokens are checked equal to plain greedy's. The table gives the median tokens per second
over the rounds, the speed-up against plain greedy measured in the same round (median of the per-round ratios),
the acceptance (accepted / drafted) and the tokens per forward pass of the target. Each round prints every
configuration's tokens per second beside its speed-up against plain greedy in that round, as it goes.
Results go to docs/img/speculative_speed.json (a run of every configuration and prompt only); the markdown table
is printed (docs/benchmarks.md holds it).
"""

from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
OUT = ROOT / "docs" / "img" / "speculative_speed.json"
CONFIGS = [("plain greedy", None, 0), ("prompt lookup, k=3", "prompt-lookup", 3),
           ("prompt lookup, k=5", "prompt-lookup", 5), ("prompt lookup, k=8", "prompt-lookup", 8),
           ("prompt lookup, n-grams 2-3, k=5", "lookup-2", 5),
           ("self:15, k=3", "self:15", 3), ("self:24, k=3", "self:24", 3)]
CODE = '''def moving_average(values, window):
    """The mean of each run of `window` consecutive values."""
    if window <= 0:
        raise ValueError("window must be positive")
    out = []
    total = sum(values[:window])
    out.append(total / window)
    for i in range(window, len(values)):
        total += values[i] - values[i - window]
        out.append(total / window)
    return out
'''


def prompts(tok) -> dict[str, list[int]]:
    text = (ROOT / "kvexplore/data/texts/moby_dick_chapter_4.txt").read_text()
    passage = " ".join(text[2000:3300].split())
    return {
        "copy a passage": tok.encode(f"Original paragraph:\n{passage}\n\nThe same paragraph, copied exactly:\n"),
        "edit a passage (chat)": tok.encode_chat([{"role": "user", "content":
                                                   f"Rewrite this paragraph in the present tense:\n\n{passage}"}]),
        "repeat code with a change": tok.encode(f"{CODE}\n\n# The same function, with `window` renamed to `size`:\n"),
    }


def run_one(model, ids: list[int], draft, k: int, tokens: int, kernels: bool = True):
    import kvexplore

    from kvexplore.speculation.drafters import PromptLookup

    if draft == "lookup-2":  # no single-token matches: n-grams of 3, then 2
        draft = PromptLookup(max_ngram=3, min_ngram=2)
    cache = kvexplore.make_cache("preallocated", model, max_seq_len=len(ids) + tokens + 16)
    gen = kvexplore.Generator(model, cache, draft=draft, draft_tokens=max(k, 1), kernels=kernels) if draft else \
        kvexplore.Generator(model, cache, kernels=kernels)
    gen.prefill(ids)
    records = gen.run(tokens, stop_at_eos=False)
    spec = gen.speculation
    plain = [r for r in records if r.verification is None]  # plain steps (no draft found, or no drafter)
    verifications = spec.verifications if spec else []
    passes = len(verifications) + len(plain)
    seconds = sum(v.draft_s + v.verify_s + v.take_back_s for v in verifications) + sum(r.forward_s for r in plain)
    return {"tokens": gen.generated_tokens, "seconds": seconds, "passes": passes,
            "drafted": spec.drafted if spec else 0, "accepted": spec.accepted if spec else 0}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="smollm2-135m")
    p.add_argument("--tokens", type=int, default=128)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--no-kernels", action="store_true", help="every configuration on F.linear (kernels=False)")
    p.add_argument("--only", default="", help="comma-separated parts of configuration names to run (plain greedy "
                                               "always runs)")
    p.add_argument("--prompts", default="", help="comma-separated parts of prompt names to run (default: all)")
    args = p.parse_args()
    import torch

    import kvexplore

    torch.set_num_threads(args.threads)
    model = kvexplore.load(args.model)
    kernels = not args.no_kernels
    configs = [c for c in CONFIGS if c[1] is None or not args.only
               or any(part.strip() in c[0] for part in args.only.split(","))]
    chosen = {name: ids for name, ids in prompts(model.tokenizer).items()
              if not args.prompts or any(part.strip() in name for part in args.prompts.split(","))}
    results = []
    for name, ids in chosen.items():
        runs: dict[str, list[dict]] = {label: [] for label, _, _ in configs}
        for label, draft, k in configs:  # warm up: the shapes, and the kernels of a verification's rows
            run_one(model, ids, draft, k, 4, kernels)
        for r in range(args.rounds):
            order = configs[r % len(configs):] + configs[:r % len(configs)]
            for label, draft, k in order:
                runs[label].append(run_one(model, ids, draft, k, args.tokens, kernels))
            base = runs["plain greedy"][-1]["seconds"]
            print(f"{name}, round {r + 1}: " + ", ".join(
                f"{label} {args.tokens / runs[label][-1]['seconds']:.1f} tok/s "
                f"({base / runs[label][-1]['seconds']:.2f}x)" for label, _, _ in configs), flush=True)
        base = runs["plain greedy"]
        for label, draft, k in configs:
            rs = runs[label]
            same = all(x["tokens"] == base[0]["tokens"] for x in rs)
            speedups = [b["seconds"] / x["seconds"] for x, b in zip(rs, base)]
            row = {"prompt": name, "prompt_tokens": len(ids), "config": label, "same_tokens": same,
                   "tok_s": statistics.median(args.tokens / x["seconds"] for x in rs),
                   "speedup": statistics.median(speedups), "speedups": speedups,
                   "acceptance": (sum(x["accepted"] for x in rs) / max(1, sum(x["drafted"] for x in rs)))
                   if draft else None,
                   "tokens_per_pass": statistics.median(args.tokens / x["passes"] for x in rs)}
            results.append(row)
            print(json.dumps({k: v for k, v in row.items() if k != "speedups"}), flush=True)
    if not args.only and not args.prompts:
        OUT.write_text(json.dumps({"model": args.model, "tokens": args.tokens, "rounds": args.rounds,
                                   "threads": args.threads, "kernels": kernels, "results": results}, indent=1))
    print("\n| prompt | configuration | tokens/s | speed-up vs greedy | acceptance | tokens per pass | same tokens |")
    print("|---|---|---:|---:|---:|---:|---|")
    for r in results:
        acc = "" if r["acceptance"] is None else f"{r['acceptance']:.0%}"
        print(f"| {r['prompt']} ({r['prompt_tokens']} tokens) | {r['config']} | {r['tok_s']:.1f} | "
              f"{r['speedup']:.2f}x | {acc} | {r['tokens_per_pass']:.2f} | {'yes' if r['same_tokens'] else 'NO'} |")


if __name__ == "__main__":
    main()
