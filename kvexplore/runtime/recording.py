"""A step's :class:`~kvexplore.StepRecord`, made from the logits the executor returned and the token chosen: the
likely candidates with their text, the chosen token's probability, the timings, the cache's memory after the pass and
what the tracer recorded."""

from __future__ import annotations

import sys
import time
from typing import Any

import torch

from ..caches.inspector import lossy_by_design
from ..trace.records import Candidate, StepRecord

PREFILL, DECODE = "prefill", "decode"  # a record's kind: the pass over the prompt, or a step after it


def step_record(logits: torch.Tensor, token: int, *, step: int, first: bool, pos: int, feed: int, context: list[int],
                executor: Any, cache: Any, top_candidates: int, forward_s: float, sampled_at: float,
                tracer: Any = None) -> StepRecord:
    """The record of a step that fed ``feed`` tokens at ``pos`` and chose ``token`` from ``logits`` (vocab,) on the
    host. ``first``: the prefill's record (step 0); ``context``: the tokens the new text follows (for its
    spelling); ``sampled_at``: ``perf_counter()`` when the forward pass ended (sampling time runs from there)."""
    probs = logits.softmax(-1)
    top_p, top_i = probs.topk(min(top_candidates, probs.shape[-1]))
    tok = executor.tokenizer
    # interned: a token's text recurs in every record that chose or listed it (a long run holds one copy)
    text = (lambda i: sys.intern(tok.token_text(i, context))) if tok is not None else (lambda i: sys.intern(str(i)))
    top = [Candidate(int(i), text(int(i)), float(p)) for p, i in zip(top_p.tolist(), top_i.tolist())]
    eos = eos_ids(executor)
    return StepRecord(step=0 if first else step, kind=PREFILL if first else DECODE, token_id=token,
                      text=text(token), position=pos + feed, input_len=feed, cache_length=cache.length,
                      prob=float(probs[token]), top=top, forward_s=forward_s,
                      sample_s=time.perf_counter() - sampled_at, is_eos=token in eos,
                      memory=cache.inspect.memory_report(), trace=None if tracer is None else tracer.end_step(cache))


def eos_ids(executor: Any) -> list[int]:
    """The end-of-sequence token ids: the tokenizer's, else the model config's."""
    tok = executor.tokenizer
    return list(tok.eos_ids if tok is not None else executor.config.eos_token_id)


def run_meta(executor: Any, cache: Any, ids: list[int]) -> dict:
    """What a saved trace carries besides its records: the prompt, the strategy, the model's shape."""
    ex = executor
    c, tok = ex.config, ex.tokenizer
    return {"prompt_ids": list(ids),
            "prompt_texts": [tok.token_text(t, ids[:i]) if tok is not None else str(t) for i, t in enumerate(ids)],
            "kind": cache.kind, "lossy": lossy_by_design(cache), "dtype": str(ex.dtype).removeprefix("torch."),
            "device": str(ex.device),
            "model": {"name": ex.source or "", "num_layers": c.num_layers, "num_heads": c.num_heads,
                      "num_kv_heads": c.num_kv_heads, "gqa_groups": c.gqa_groups,
                      "attention_sinks": bool(c.attention_sinks)}}
