"""Quality of a compressed cache against the full one, measured the way the KV-compression literature reports it:
KL, top-1 agreement, perplexity, attention mass on the kept keys and bytes held (docs/eviction.md, "Measuring
quality"). The passkey test and the two-question demonstration: :mod:`.passkey`."""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch

from ..caches.base import KVCache
from ..caches.factory import make_cache
from ..errors import SettingsError
from ..models.model import Model

CacheFactory = Callable[[Model, int], KVCache]


@dataclass
class Reference:
    """The full cache's run: ``logprobs`` ``(T, vocab)`` predicting each continuation token, the attention of the
    continuation's queries over the context per full layer (``mass[layer]`` ``(kv_heads, T - 1, context)``, summed
    over each KV head's query heads), and its bytes at the end."""

    context: int
    logprobs: torch.Tensor
    mass: dict[int, torch.Tensor]
    used_bytes: int
    reserved_bytes: int
    perplexity: float


@dataclass
class Quality:
    """One compressed cache against the full one (docs/eviction.md, "Measuring quality")."""

    kl: list[float]
    top1: float
    perplexity: float
    full_perplexity: float
    attention_mass: dict[int, float]
    used_bytes: int
    reserved_bytes: int
    full_used_bytes: int
    full_reserved_bytes: int
    stepwise: bool  # the continuation went in several writes (token by token), not one
    kl_mean: float = field(init=False)
    attention_mass_mean: float = field(init=False)

    def __post_init__(self) -> None:
        self.kl_mean = sum(self.kl) / len(self.kl)
        masses = list(self.attention_mass.values())
        self.attention_mass_mean = sum(masses) / len(masses) if masses else float("nan")

    @property
    def used_fraction(self) -> float:
        return self.used_bytes / self.full_used_bytes

    @property
    def reserved_fraction(self) -> float:
        return self.reserved_bytes / self.full_reserved_bytes

    def row(self) -> dict:
        return dict(kl_mean=self.kl_mean, kl_max=max(self.kl), top1=self.top1, perplexity=self.perplexity,
                    full_perplexity=self.full_perplexity, attention_mass=self.attention_mass_mean,
                    used_bytes=self.used_bytes, reserved_bytes=self.reserved_bytes,
                    used_fraction=self.used_fraction, reserved_fraction=self.reserved_fraction,
                    stepwise=self.stepwise)


def full_cache(model: Model, max_seq_len: int) -> KVCache:
    return make_cache("preallocated", model, max_seq_len=max_seq_len)


def check_ids(ids: Sequence[int], name: str, model: Model, minimum: int = 1) -> list[int]:
    """``ids`` as a list of ints inside the vocabulary, at least ``minimum`` of them (else a clear error)."""
    if isinstance(ids, (str, bytes)) or not isinstance(ids, Sequence | torch.Tensor):
        raise SettingsError(f"{name} must be a list of token ids (model.tokenizer.encode(text)), got "
                            f"{type(ids).__name__}")
    out = [int(i) for i in (ids.tolist() if isinstance(ids, torch.Tensor) else ids)]
    if len(out) < minimum:
        raise SettingsError(f"{name} needs at least {minimum} token{'s' * (minimum != 1)}, got {len(out)}")
    bad = [i for i in out if not 0 <= i < model.config.vocab_size]
    if bad:
        raise SettingsError(f"{name} has token id {bad[0]} outside the vocabulary (0..{model.config.vocab_size - 1})")
    return out


def presses_while_decoding(cache: KVCache) -> bool:
    return cache.eviction is not None and cache.eviction.pressplan.decode_every is not None


def evicts_as_it_writes(cache: KVCache) -> bool:
    """Whether ``cache`` drops positions as it writes (the sink cache): the queries of one write then read different
    positions, so what each read is seen only when the continuation goes in token by token."""
    return cache.inspect.evicts_on_write


def largest_write(cache: KVCache, pos: int, n: int) -> int:
    """The most of ``n`` tokens at ``pos`` that ``cache`` accepts in one write (it may refuse several tokens that
    would evict, as a sink cache does); at least 1."""
    def accepts(m: int) -> bool:
        try:
            cache.check_write(pos, m, 1)
        except SettingsError as e:
            if m == 1:
                raise e
            return False
        return True

    if accepts(n):
        return n
    accepts(1)  # raises when even one token is refused (the cache's own error)
    lo, hi = 1, n - 1
    while lo < hi:
        mid = (lo + hi + 1) // 2
        lo, hi = (mid, hi) if accepts(mid) else (lo, mid - 1)
    return lo


def feed(model: Model, cache: KVCache, ids: list[int], pos: int, stepwise: bool = False, every: bool = True,
         before: Callable[[int, int], None] | None = None,
         after: Callable[[int, int], None] | None = None) -> torch.Tensor:
    """Write ``ids`` at ``pos`` in the largest writes ``cache`` accepts (one token at a time with ``stepwise``);
    ``before(pos, n)`` and ``after(pos, n)`` run around each write. Returns the logits ``(len(ids), vocab)``, or
    only the last row's ``(1, vocab)`` when ``every`` is False."""
    out, i = [], 0
    while i < len(ids):
        n = 1 if stepwise else largest_write(cache, pos + i, len(ids) - i)
        if before is not None:
            before(pos + i, n)
        logits = model(torch.tensor([ids[i:i + n]]), cache, pos + i, last_only=not every)[0]
        if after is not None:
            after(pos + i, n)
        out.append(logits)
        i += n
    return torch.cat(out) if every else out[-1]


class _ProbsTap:
    """A tracer that keeps, per full layer, the attention of the step's queries over the first ``context`` keys,
    summed over each KV head's query heads: ``(kv_heads, rows, context)``."""

    def __init__(self, layers: list[int], context: int, kv_heads: dict[int, int]) -> None:
        self.layers, self.context, self.kv_heads = set(layers), context, kv_heads
        self.mass: dict[int, torch.Tensor] = {}

    def wants_attention(self, layer: int) -> bool:
        return layer in self.layers

    def hook(self, name: str, t: torch.Tensor) -> None:
        if name.endswith(".attn.probs"):
            layer = int(name.split(".")[1])
            p = t[0, :, :, :self.context].float()  # (nh, T, C)
            nkv = self.kv_heads[layer]
            self.mass[layer] = p.reshape(nkv, p.shape[0] // nkv, *p.shape[1:]).sum(1).cpu()
        return None


def _nll(logprobs: torch.Tensor, ids: list[int]) -> float:
    return -float(logprobs.gather(1, torch.tensor(ids)[:, None]).mean())


def full_reference(model: Model, context: Sequence[int], continuation: Sequence[int]) -> Reference:
    """Run ``context`` then ``continuation`` (teacher-forced) on the full cache, keeping what
    :func:`compression_quality` compares against (pass it there to compare several caches with one run)."""
    ctx = check_ids(context, "context", model)
    cont = check_ids(continuation, "continuation", model, minimum=2)
    cache = full_cache(model, len(ctx) + len(cont))
    first = model(torch.tensor([ctx]), cache, 0, last_only=True)[0]
    tap = _ProbsTap(cache.full_layers, len(ctx), {s.index: s.kv_heads for s in cache.plan})
    rest = model(torch.tensor([cont[:-1]]), cache, len(ctx), tracer=tap)[0]
    logprobs = torch.log_softmax(torch.cat([first, rest]).float().cpu(), -1)
    return Reference(len(ctx), logprobs, tap.mass, cache.inspect.used_bytes, cache.inspect.reserved_bytes,
                     math.exp(_nll(logprobs, cont)))


def kept_context(cache: KVCache, layer: int, context: int) -> torch.Tensor:
    """``(kv_heads, context)`` bool: which context positions each KV head of ``layer`` holds now."""
    spec = cache.plan[layer]
    out = torch.zeros((spec.kv_heads, context), dtype=torch.bool)
    per_head = (cache.eviction.kept_positions(layer) if cache.eviction is not None
                else [cache.inspect.held_positions_of(layer)] * spec.kv_heads)
    for h, positions in enumerate(per_head):
        out[h, [p for p in positions if p < context]] = True
    return out


def compression_quality(model: Model, context: Sequence[int], continuation: Sequence[int], factory: CacheFactory,
                        reference: Reference | None = None, stepwise: bool | None = None) -> Quality:
    """How far the cache ``factory(model, len(context) + len(continuation))`` makes the model's predictions of
    ``continuation`` after ``context`` from the full cache's (docs/eviction.md, "Measuring quality"). ``stepwise``:
    feed the continuation token by token (default: when the cache presses during decoding or evicts as it writes)."""
    ctx = check_ids(context, "context", model)
    cont = check_ids(continuation, "continuation", model, minimum=2)
    if not callable(factory):
        raise SettingsError(f"factory must be a function (model, max_seq_len) -> cache, e.g. lambda m, n: "
                            f"kvexplore.make_cache('evict', m, max_seq_len=n, press='knorm'), got {factory!r}")
    if reference is None:
        reference = full_reference(model, ctx, cont)
    elif reference.context != len(ctx) or reference.logprobs.shape[0] != len(cont):
        raise SettingsError(f"the reference was run on {reference.context} context and {reference.logprobs.shape[0]}"
                            f" continuation tokens, not {len(ctx)} and {len(cont)}: run full_reference on these ids")
    cache = factory(model, len(ctx) + len(cont))
    if not isinstance(cache, KVCache):
        raise SettingsError(f"factory returned {type(cache).__name__}, not a kvexplore cache")
    C = len(ctx)
    first = feed(model, cache, ctx, 0, every=False)
    stepwise = (presses_while_decoding(cache) or evicts_as_it_writes(cache)) if stepwise is None else bool(stepwise)
    layers = [i for i in reference.mass if i in cache.full_layers]
    kept = {i: torch.zeros_like(reference.mass[i], dtype=torch.bool) for i in layers}
    writes: list[int] = []
    pressed = cache.eviction is not None

    def read(pos: int, n: int) -> None:  # what the queries of this write read of the context
        writes.append(n)
        for i in layers:
            if pressed:  # a press runs after the step's attention: the queries read what was kept before it
                kept[i][:, pos - C:pos - C + n] = kept_context(cache, i, C)[:, None]
            else:  # other caches evict as they write: what the step read, after it
                held = [p for p in cache.inspect.read_positions(i) if p < C]
                kept[i][:, pos - C:pos - C + n, held] = True

    rest = feed(model, cache, cont[:-1], C, stepwise=stepwise, before=read if pressed else None,
                after=None if pressed else read)
    logprobs = torch.log_softmax(torch.cat([first, rest]).float().cpu(), -1)
    full = reference.logprobs
    kl = (full.exp() * (full - logprobs)).sum(-1).clamp_min(0)
    top1 = float((full.argmax(-1) == logprobs.argmax(-1)).float().mean())
    mass = {i: float((reference.mass[i] * kept[i]).sum() / reference.mass[i].sum()) for i in layers}
    inspect = cache.inspect
    return Quality(kl.tolist(), top1, math.exp(_nll(logprobs, cont)), reference.perplexity, mass, inspect.used_bytes,
                   inspect.reserved_bytes, reference.used_bytes, reference.reserved_bytes, len(writes) > 1)
