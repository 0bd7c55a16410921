"""What the distributed tests share: a prompt, one process's greedy run (its logits, tokens and cache), the same run
over rank processes, and the comparison of the two."""

from __future__ import annotations

import torch

import kvexplore
from kvexplore.distributed import Ranks

PROMPT = [1, 409, 390, 398, 3557, 287, 30, 2261, 1091, 3025, 5, 17, 99, 1500, 42, 7, 300, 12, 64, 88]


def greedy(model, prompt, n, cache="preallocated", **options):
    """One process: the logits of the prompt's pass and of each decode step, and the n greedy tokens."""
    cache = kvexplore.make_cache(cache, model, max_seq_len=len(prompt) + n, **options)
    with torch.no_grad():
        logits = [model(torch.tensor([prompt]), cache, 0)[0]]
        tokens = [int(logits[-1][-1].argmax())]
        while len(tokens) < n:
            logits.append(model(torch.tensor([[tokens[-1]]]), cache, cache.length)[0, -1])
            tokens.append(int(logits[-1].argmax()))
    return logits, tokens, cache


def parallel(ranks: Ranks, prompt, n):
    """The same run over rank processes: its logits and tokens (the order :func:`assert_same_run` takes)."""
    tokens, logits = ranks.greedy(prompt, n)
    return logits, tokens


def assert_same_run(got, want):
    """The same greedy tokens, and every logit within 1e-5 of the logits' range: the all-reduce adds the ranks'
    partial sums in another order than one process's product, which float32 rounds apart by about as much as one
    process run with 1 thread against 2 (SmolLM2: 6.3e-5 against 5.7e-5, max |logit| 35; Gemma 3 270M: 2.8e-4
    against 3.2e-4, max |logit| 75; docs/distributed.md)."""
    (got_logits, got_tokens), (want_logits, want_tokens, _) = got, want
    assert got_tokens == want_tokens
    scale = max(float(w.abs().max()) for w in want_logits)
    worst = max(float((g - w).abs().max()) for g, w in zip(got_logits, want_logits))
    assert worst <= 1e-5 * scale, f"logits {worst:.2e} apart, over 1e-5 of their range {scale:.1f}"
