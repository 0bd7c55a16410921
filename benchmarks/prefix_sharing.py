"""Prefix sharing's effect on the time to the first token, measured side by side in one run (issue 29).

    python benchmarks/prefix_sharing.py                      # SmolLM2-135M float32, system prompts of 512 and 2,048
    python benchmarks/prefix_sharing.py --system 256 --questions 2   # quicker

A long system prompt (a passage of Moby-Dick, kvexplore/data/texts) is followed by several users' questions, each
through SmolLM2's chat template; every request generates ``--tokens`` tokens. Three ways to serve the same requests,
interleaved request by request so that none is always timed first on a shared machine:

* **cold**: each request on a fresh pool (no prefix cache, what a server without prefix caching computes);
* **hash** and **radix**: one pool per policy, warmed by the first request, then serving the others from its blocks.

For each, the median seconds to the first token (the prompt's missed positions computed, from
``ServeResult.prompt_seconds``), the hit rate (hit tokens / prompt tokens), and the speed-up against cold measured on
the same request. Every warm answer is checked equal to the cold one (greedy). The bookkeeping of a request (the
lookup, the explanations, the frame of the pool) is timed apart: ``seconds - prompt_seconds - decoding``.
Results go to docs/img/prefix_sharing.json; the markdown table is printed (docs/benchmarks.md holds it).
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch

import kvexplore

ROOT = Path(__file__).resolve().parents[1]
OUT = ROOT / "docs" / "img" / "prefix_sharing.json"
QUESTIONS = ["Who is Queequeg?", "What does Ishmael think of the harpooneer?", "Where does the story happen?",
             "Summarise the passage in one sentence.", "What is the mood of this chapter?",
             "Name two objects in the room."]


def system_prompt(tok, tokens: int) -> str:
    text = " ".join((ROOT / "kvexplore/data/texts/moby_dick_chapter_4.txt").read_text().split())
    words = text.split(" ")
    lo, hi = 1, len(words)
    while lo < hi:  # the longest run of words whose tokens fit
        mid = (lo + hi + 1) // 2
        lo, hi = (mid, hi) if len(tok.encode(" ".join(words[:mid]))) <= tokens else (lo, mid - 1)
    return "Answer questions about this passage.\n\n" + " ".join(words[:lo])


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="smollm2-135m")
    p.add_argument("--system", type=int, nargs="+", default=[512, 2048], help="system prompt lengths (tokens)")
    p.add_argument("--questions", type=int, default=4)
    p.add_argument("--tokens", type=int, default=8)
    p.add_argument("--block-size", type=int, default=16)
    args = p.parse_args()
    torch.set_num_threads(2)
    model = kvexplore.load(args.model)
    tok, rows = model.tokenizer, []
    for n in args.system:
        system = system_prompt(tok, n)
        chats = [[{"role": "system", "content": system}, {"role": "user", "content": q}]
                 for q in (QUESTIONS * 2)[: args.questions + 1]]
        blocks = 4 * (n // args.block_size + 64)
        warm = {pol: kvexplore.PrefixPool(model, num_blocks=blocks, block_size=args.block_size, policy=pol)
                for pol in ("hash", "radix")}
        for pool in warm.values():
            pool.serve(chats[0], max_new_tokens=args.tokens)
        times: dict[str, list[float]] = {"cold": [], "hash": [], "radix": []}
        hits: dict[str, list[float]] = {"hash": [], "radix": []}
        books: list[float] = []
        for i, chat in enumerate(chats[1:]):
            order = ["cold", "hash", "radix"][i % 3:] + ["cold", "hash", "radix"][: i % 3]
            answers = {}
            for way in order:
                pool = warm.get(way) or kvexplore.PrefixPool(model, num_blocks=blocks, block_size=args.block_size)
                t0 = time.perf_counter()
                r = pool.serve(chat, max_new_tokens=args.tokens)
                total = time.perf_counter() - t0
                times[way].append(r.prompt_seconds)
                answers[way] = r.generated
                if way != "cold":
                    hits[way].append(r.hit_rate)
                    books.append(total - r.seconds)
            assert answers["hash"] == answers["cold"] == answers["radix"], answers
        prompt_tokens = len(kvexplore.PrefixPool(model, num_blocks=blocks).serve(chats[1], max_new_tokens=0).prompt)
        row = {"system tokens": n, "prompt tokens": prompt_tokens, "block size": args.block_size,
               "cold s": statistics.median(times["cold"])}
        for pol in ("hash", "radix"):
            row[f"{pol} s"] = statistics.median(times[pol])
            row[f"{pol} hit rate"] = statistics.median(hits[pol])
            row[f"{pol} speed-up"] = statistics.median(c / w for c, w in zip(times["cold"], times[pol]))
        row["bookkeeping s"] = statistics.median(books)
        rows.append(row)
        print(row, flush=True)
    OUT.parent.mkdir(parents=True, exist_ok=True)
    OUT.write_text(json.dumps(rows, indent=1))
    print("\n| system prompt | prompt tokens | cold TTFT | hash TTFT (hit rate) | radix TTFT (hit rate) | speed-up |")
    print("|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['system tokens']} | {r['prompt tokens']} | {r['cold s']:.2f} s | {r['hash s']:.3f} s "
              f"({r['hash hit rate']:.0%}) | {r['radix s']:.3f} s ({r['radix hit rate']:.0%}) | "
              f"{r['hash speed-up']:.1f}x / {r['radix speed-up']:.1f}x |")


if __name__ == "__main__":
    main()
