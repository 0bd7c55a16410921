"""Choosing the next token from logits: greedy, or temperature / top-k / top-p sampling with a seeded RNG."""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch
from ..errors import StepError
from ..core.settings import integer, real


@dataclass(frozen=True)
class SamplingSettings:
    """``temperature == 0`` means greedy (argmax); otherwise sample after top-k then top-p filtering."""

    temperature: float = 0.0
    top_k: int | None = None
    top_p: float | None = None

    def __post_init__(self) -> None:
        # checked (and normalised to float / int) here, so a step never finds out mid-way
        object.__setattr__(self, "temperature", real(self.temperature, "temperature", minimum=0, hint=" (0 = greedy)"))
        if self.top_k is not None:
            object.__setattr__(self, "top_k", integer(self.top_k, "top_k", minimum=1, hint=" (or None for no limit)"))
        if self.top_p is not None:
            object.__setattr__(self, "top_p", real(self.top_p, "top_p", above=0, maximum=1,
                                                   hint=" (or None for no limit)"))

    @property
    def greedy(self) -> bool:
        return self.temperature == 0


def sampling_setting(name: str) -> property:
    """A generator attribute that reads ``sampling.<name>`` and sets it through a new, checked SamplingSettings."""
    def get(self: object):
        return getattr(self._sampling, name)

    def set_(self: object, value) -> None:
        self._sampling = replace(self._sampling, **{name: value})  # __post_init__ checks the new value

    return property(get, set_, doc=f"``sampling.{name}``; setting it checks the value first (SettingsError)")


def filtered_probs(logits: torch.Tensor, settings: SamplingSettings) -> torch.Tensor:
    """Probabilities ``[vocab]`` (float32) the sampler draws from: tempered, top-k and top-p applied."""
    logits = logits.float() / settings.temperature
    if settings.top_k is not None and settings.top_k < logits.shape[-1]:
        keep = torch.topk(logits, settings.top_k).indices  # exactly k, even when values tie
        logits = torch.full_like(logits, float("-inf")).scatter(-1, keep, logits.gather(-1, keep))
    probs = logits.softmax(-1)
    if settings.top_p is not None and settings.top_p < 1:
        sorted_probs, order = probs.sort(descending=True, stable=True)
        before = sorted_probs.cumsum(-1) - sorted_probs  # mass of strictly more likely tokens
        drop = before >= settings.top_p  # keep the smallest prefix whose mass reaches top_p
        probs = probs.scatter(-1, order, sorted_probs.masked_fill(drop, 0.0))
        probs = probs / probs.sum()
    return probs


def choose(logits: torch.Tensor, settings: SamplingSettings, rng: torch.Generator) -> int:
    """Pick one token id from ``logits`` ``[vocab]``; a StepError if they hold NaN or cannot be sampled."""
    if settings.greedy:
        token = int(logits.argmax())
        if logits[token].isnan():  # argmax returns a NaN when there is one
            raise StepError(_nan_logits(logits))
        return token
    probs = filtered_probs(logits, settings).cpu()
    if not bool(torch.isfinite(probs).all()) or not float(probs.sum()) > 0:
        cause = _nan_logits(logits) if bool(logits.isnan().any()) else (
            f"the logits divided by temperature={settings.temperature} overflow float32, so there is no "
            f"distribution to sample from; use a larger temperature, or 0 for greedy")
        raise StepError(cause)
    return int(torch.multinomial(probs, 1, generator=rng))


def _nan_logits(logits: torch.Tensor) -> str:
    n = int(logits.isnan().sum())
    return (f"the model's logits hold {n} NaN value{'s' * (n > 1)}: its weights or activations are not finite "
            f"(a checkpoint loaded with allow_nonfinite=True, or a float16 overflow); nothing was changed")
