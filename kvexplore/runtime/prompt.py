"""A prompt as token ids: text through the model's tokenizer (with its bos token when it expects one), or ids taken
as they are, each checked against the vocabulary before anything runs."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch

from ..core.settings import integer
from ..errors import SettingsError


def prompt_ids(prompt: str | Sequence[int] | torch.Tensor, tokenizer: Callable[[], Any], vocab_size: int) -> list[int]:
    """``prompt`` (text, a list of ids or a 1-D integer tensor) as a non-empty list of ids below ``vocab_size``.
    ``tokenizer()`` gives the tokenizer for text (and raises, naming the fix, when there is none)."""
    if isinstance(prompt, str):
        tok = tokenizer()
        ids = ([tok.bos_id] if tok.add_bos else []) + tok.encode(prompt)
    elif isinstance(prompt, torch.Tensor):
        if prompt.dim() != 1:
            raise SettingsError(f"prompt ids must be one sequence (1-D), got shape {tuple(prompt.shape)}")
        if prompt.is_floating_point() or prompt.is_complex() or prompt.dtype == torch.bool:
            raise SettingsError(f"prompt ids must be an integer tensor, got {prompt.dtype}")
        ids = [int(i) for i in prompt.tolist()]
    elif isinstance(prompt, (list, tuple, range)):
        ids = [integer(i, f"prompt token {n}") for n, i in enumerate(prompt)]
    else:
        raise SettingsError(f"prompt must be text (str) or token ids (a list of ints or a 1-D tensor), got "
                            f"{type(prompt).__name__}")
    if not ids:
        raise SettingsError("the prompt is empty: give at least one token (empty text encodes to nothing "
                            "for a model without a bos token)")
    bad = [i for i in ids if not 0 <= i < vocab_size]
    if bad:
        raise SettingsError(f"prompt token id {bad[0]} is outside the vocabulary (0..{vocab_size - 1})")
    return ids
