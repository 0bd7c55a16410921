"""Plain greedy decoding through a cache, keeping every step's logits: the reference the speculation check and the
bug zoo compare with."""

from __future__ import annotations

from typing import Any

import torch


def greedy(model: Any, cache: Any, prompt: list[int], steps: int) -> tuple[list[int], list[torch.Tensor]]:
    """``steps`` tokens after ``prompt`` (one pass for the prompt, then one per token) through ``cache``: the tokens
    chosen and each step's logits (float32, on the host)."""
    tokens, chosen, logits = list(prompt), [], []
    with torch.inference_mode():
        for step in range(steps):
            feed, pos = (tokens, 0) if step == 0 else (tokens[-1:], len(tokens) - 1)
            row = model(torch.tensor([feed]), cache, pos, last_only=True)[0, -1].float().cpu()
            token = int(row.argmax())
            chosen.append(token)
            logits.append(row)
            tokens.append(token)
    return chosen, logits
