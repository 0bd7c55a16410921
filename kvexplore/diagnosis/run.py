"""The doctor's loop: a greedy run through the cache under test, each step checked against a recomputation."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from ..errors import KVExploreError, SettingsError
from ..core.settings import integer
from ..trace.diff import tolerance_for
from .compare import columns, departures, first_departure
from .hints import hint
from .kept import KeptPasses
from .passes import HFPasses, KVPasses, LayerPass
from .report import DoctorReport

DEFAULT_PROMPT = "The capital of France is"


def doctor(model: Any, tokenizer: Any = None, prompt: str | list[int] = DEFAULT_PROMPT, steps: int = 64,
           cache: Any = None, tolerance: float | None = None, max_seq_len: int | None = None) -> DoctorReport:
    """Run ``steps`` greedy steps of ``model`` through ``cache`` and compare every cached pass with a full
    recomputation (a fresh cache over the whole sequence): the logits, and per layer the keys and values
    attention read, the recurrent state and the layer's output.

    ``model``: a transformers model, a kvexplore Model, or a folder or named model (loaded with transformers for
    a transformers ``cache``, with kvexplore otherwise). ``cache``: a transformers cache name (``"dynamic"``,
    ``"static"``, ... see :data:`kvexplore.hf.HF_CACHES`) or object (any ``Cache``, e.g. your subclass); for a
    kvexplore model a strategy name (``"preallocated"``, ``"paged"``, ...) or a KVCache. ``tolerance``: relative,
    by default 1e-4 in float32, 5e-3 in float16, 3e-2 in bfloat16.
    """
    from .. import hf
    from ..caches.base import KVCache
    from ..caches.strategies.evict import EvictCache
    from ..caches.factory import STRATEGIES, make_cache
    from ..formats.loading import load
    from ..models.model import Model

    steps = integer(steps, "steps", 1, 100_000, " (how many tokens to check)")
    if isinstance(model, (str, Path)):
        kvexplore_cache = isinstance(cache, KVCache) or (isinstance(cache, str) and cache in STRATEGIES)
        model = load(model) if kvexplore_cache else hf.load_hf(model)
    if hf.is_hf_model(model):
        model = hf.wrap(model, tokenizer)
    if not isinstance(model, (hf.HFModel, Model)):
        raise SettingsError(f"model must be a transformers model, a kvexplore Model, or a folder or named model; got "
                            f"{type(model).__name__}")
    if isinstance(model, hf.HFModel) and tokenizer is not None and model.tokenizer is None:
        model.tokenizer = hf.model.as_tokenizer(tokenizer, model.config)
    ids = token_ids(prompt, model.tokenizer, model.config.vocab_size)
    slots = max_seq_len or len(ids) + steps
    if isinstance(model, hf.HFModel):
        if cache is None or isinstance(cache, str):
            name = (cache or "dynamic").removeprefix("hf:")
            if why := hf.available(name, model.device.type):
                raise SettingsError(why)
            from ..hf.caches import make_hf_cache

            label, cache = name, make_hf_cache(name, model.hf, slots)
        elif not hf.is_hf_cache(cache):
            raise SettingsError(f"cache must be a transformers cache name ({', '.join(hf.HF_CACHES)}) or a "
                                f"transformers Cache object, got {type(cache).__name__}")
        else:
            label = type(cache).__name__
        passes = HFPasses(model, cache)
    else:
        if cache is None or isinstance(cache, str):
            label = cache or "preallocated"
            cache = make_cache(label, model, max_seq_len=slots)
        elif not isinstance(cache, KVCache):
            raise SettingsError(f"cache must be a kvexplore strategy name ({', '.join(STRATEGIES)}) or a KVCache, got "
                                f"{type(cache).__name__}")
        else:
            label = cache.kind
        passes = (KeptPasses if isinstance(cache, EvictCache) else KVPasses)(model, cache)
    dtype = str(model.dtype).removeprefix("torch.")
    tol = tolerance_for(dtype) if tolerance is None else float(tolerance)
    name = getattr(model, "source", "") or type(model).__name__
    return _run(passes, ids, steps, tol, label, Path(name).name if name else "model", dtype)


def _run(passes, ids: list[int], steps: int, tol: float, label: str, name: str, dtype: str) -> DoctorReport:
    tokens, worst = list(ids), None
    report = DoctorReport(False, 0, tol, label, name, dtype)
    report.reference = getattr(passes, "reference_name", report.reference)
    with torch.inference_mode():
        for step in range(steps):
            feed, pos = (tokens, 0) if step == 0 else (tokens[-1:], len(tokens) - 1)
            try:
                got = passes.cached(feed, pos)
            except KVExploreError:
                raise
            except Exception as e:  # the cache under test broke the forward pass: that is a finding of its own
                raise SettingsError(f"the cached forward pass failed at step {step} ({type(e).__name__}: {e}); "
                                    f"the cache cannot run this model as it is") from e
            ref = passes.reference(tokens)
            position = len(tokens) - 1
            report.steps = step + 1
            bounds = passes.bounds(ref)
            if bounds is not None:  # a lossy-by-design cache has just lost something: judged against its scheme
                return _by_design(report, passes, got, ref, bounds, step, position, tol, tokens)
            found = departures(got, ref, position)
            first = first_departure(found, tol)
            if first is not None:
                report.diverged, report.step, report.layer, report.position = True, step, first.layer, first.position
                report.max_diff, report.what, report.departures = first.max_diff, first.what, found
                report.hint = hint(first, got, ref, passes, len(ids), position, tol)
                report.tokens = tokens
                return report
            top = max(found, key=lambda d: d.relative)
            if worst is None or top.relative > worst.relative:
                worst = top
            tokens.append(int(got.logits.argmax()))
    report.worst, report.tokens = worst, tokens
    return report


def _by_design(report: DoctorReport, passes, got, ref, bounds, step: int, position: int, tol: float,
               tokens: list[int]) -> DoctorReport:
    """The first step at which a lossy-by-design cache (the quantized one) lost precision: the keys attention read may
    differ from the recomputation's by the scheme's bound at each element (half a quantization step) and no more than
    the tolerance beyond it. A cache lossy from its first write is judged in the prefill against the keys each layer
    wrote. Past this step the outputs part by design: the check stops here."""
    report.tokens, report.lossy, report.step = tokens, passes.cache.inspect.what_it_did(), step
    report.scheme_error = report.scheme_bound = 0.0
    for layer, (g, r, bound) in enumerate(zip(got.layers, ref.layers, bounds)):
        if g.keys is None or r.keys is None:
            continue
        gi, ri, pos = columns(LayerPass(positions=[p for p in g.positions if p < position]), r)
        if g.keys.shape[-1] != r.keys.shape[-1] or not pos:
            continue
        if g.written is not None:  # a prefill that stored lossy at once: an earlier layer's loss has already moved
            # these keys from the recomputation's, so they are judged against what this layer wrote (positions 0..)
            own = None if (lossy := passes.cache.quantization) is None else lossy.error_bound(layer, *g.written)
            target, bound = g.written[0][:, pos], None if own is None else own[0][:, pos]
        else:
            target, bound = r.keys[:, ri], None if bound is None else bound[:, ri]
        diff = (g.keys[:, gi] - target).abs()
        allowed = bound if bound is not None else torch.zeros_like(diff)
        excess = (diff - allowed).clamp_min(0).amax(dim=(0, 2))  # per column
        report.scheme_error = max(report.scheme_error, float(diff.max()))
        report.scheme_bound = max(report.scheme_bound, float(allowed.max()))
        top = float(excess.max())
        rel = top / max(float(r.keys.abs().max()), 1e-6)
        if rel > tol and not report.diverged:
            at = pos[int(excess.argmax())]
            report.diverged, report.layer, report.position, report.max_diff, report.what = True, layer, at, top, "keys"
            report.hint = (f"layer {layer}'s keys at position {at} are {top:.3g} further from the recomputation's "
                           f"than the scheme allows (half a quantization step of their group): the cache reads "
                           f"something other than its quantization gives; a bug in the cache, not its designed loss")
    return report


def token_ids(prompt: str | list[int], tokenizer, vocab: int) -> list[int]:
    if isinstance(prompt, str):
        if tokenizer is None:
            raise SettingsError("a text prompt needs a tokenizer: pass tokenizer=..., or give token ids")
        ids = tokenizer.encode(prompt)
        if tokenizer.add_bos:
            ids = [tokenizer.bos_id, *ids]
    elif isinstance(prompt, (list, tuple, range)) or isinstance(prompt, torch.Tensor):
        values = prompt.tolist() if isinstance(prompt, torch.Tensor) else list(prompt)
        ids = [integer(i, f"prompt token {n}") for n, i in enumerate(values)]
    else:
        raise SettingsError(f"prompt must be text or token ids, got {type(prompt).__name__}")
    if not ids:
        raise SettingsError("the prompt is empty: give at least one token")
    if bad := [i for i in ids if not 0 <= i < vocab]:
        raise SettingsError(f"prompt token id {bad[0]} is outside the vocabulary (0..{vocab - 1})")
    return ids
