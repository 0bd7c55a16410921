"""Speculative decoding's speed against plain greedy decoding, measured side by side in one run (issue 28, item 5).

    python benchmarks/speculative_speed.py                 # SmolLM2-135M float32, 3 prompts, 3 interleaved rounds
    python benchmarks/speculative_speed.py --tokens 64 --rounds 1   # quicker

Each prompt gives the model something prompt lookup can find: a passage of Moby-Dick (kvexplore/data/texts) to
copy, the same passage to edit (through the chat template), and a Python function to repeat with one change. For
every prompt and round, each configuration generates ``--tokens`` tokens from the same prefilled prompt: plain
greedy (the baseline), prompt lookup with k = 3, 5 and 8 (n-grams of 3 down to 1, the default) and with k = 5 on
n-grams of 3 and 2 only, and self-speculation with the first L layers (L = 15, 24 of 30).
The order of the configurations rotates every round, so none is always timed first or last on a shared machine;
times are the generator's own (kvexplore.runtime.clock: wall time less the time the thread waited for a CPU), and
every speculative run's tokens are checked equal to plain greedy's. The table gives the median tokens per second
over the rounds, the speed-up against plain greedy measured in the same round (median of the per-round ratios),
the acceptance (accepted / drafted) and the tokens per forward pass of the target.
Results go to docs/img/speculative_speed.json; the markdown table is printed (docs/benchmarks.md holds it).
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


def run_one(model, ids: list[int], draft, k: int, tokens: int):
    import kvexplore

    from kvexplore.runtime.drafters import PromptLookup

    if draft == "lookup-2":  # no single-token matches: n-grams of 3, then 2
        draft = PromptLookup(max_ngram=3, min_ngram=2)
    cache = kvexplore.make_cache("preallocated", model, max_seq_len=len(ids) + tokens + 16)
    gen = kvexplore.Generator(model, cache, draft=draft, draft_tokens=max(k, 1)) if draft else \
        kvexplore.Generator(model, cache)
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
    args = p.parse_args()
    import torch

    import kvexplore

    torch.set_num_threads(args.threads)
    model = kvexplore.load(args.model)
    results = []
    for name, ids in prompts(model.tokenizer).items():
        runs: dict[str, list[dict]] = {label: [] for label, _, _ in CONFIGS}
        run_one(model, ids, None, 0, 4)  # warm the shapes up
        for r in range(args.rounds):
            order = CONFIGS[r % len(CONFIGS):] + CONFIGS[:r % len(CONFIGS)]
            for label, draft, k in order:
                runs[label].append(run_one(model, ids, draft, k, args.tokens))
        base = runs["plain greedy"]
        for label, draft, k in CONFIGS:
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
    OUT.write_text(json.dumps({"model": args.model, "tokens": args.tokens, "rounds": args.rounds,
                               "threads": args.threads, "results": results}, indent=1))
    print("\n| prompt | configuration | tokens/s | speed-up vs greedy | acceptance | tokens per pass | same tokens |")
    print("|---|---|---:|---:|---:|---:|---|")
    for r in results:
        acc = "" if r["acceptance"] is None else f"{r['acceptance']:.0%}"
        print(f"| {r['prompt']} ({r['prompt_tokens']} tokens) | {r['config']} | {r['tok_s']:.1f} | "
              f"{r['speedup']:.2f}x | {acc} | {r['tokens_per_pass']:.2f} | {'yes' if r['same_tokens'] else 'NO'} |")


if __name__ == "__main__":
    main()
