"""Speculative decoding (issue 28), the tokens it gives: on every cache kind and architecture greedy drafting gives
plain greedy's tokens for every drafter (a matrix, then prompts, draft lengths and cache sizes drawn by hypothesis,
with page boundaries, ring wraps, evictions and flushes inside drafts); with sampling the tokens are distributed as
the target's. What a verification leaves behind (the cache after a take-back, records, rewinds, undo, refusals,
failures) is test_speculative_take_backs.py's."""

from __future__ import annotations

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import kvexplore
from kvexplore.errors import SettingsError
from kvexplore.speculation import speculative
from kvexplore.runtime.sampling import filtered_probs
from speculative_reference import (ARCHS, KINDS, N, REFUSED, draft_model, greedy, load, lookup_prompt, make,
                                   perturbed)
from helpers import no_cache_logits

EXACT = ("preallocated", "concat", "none", "paged")  # caches that hold every position as written
# Qwen3-Next with random weights never continues a passage it has seen (no prompt among dozens tried got a draft
# accepted): prompt lookup's take-backs are still checked there, the draft model's acceptances too
LOOKUP_MISSES = {"qwen3next"}
RINGS = {"gemma3", "gemma4", "gptoss"}  # architectures with sliding layers (window 8): a draft wraps the ring


def drafters(zoo, name):
    return {"prompt-lookup": "prompt-lookup", "self:1": "self:1", "model": draft_model(zoo, name)}


def crossed_drafters(zoo, name: str, kind: str) -> dict:
    """The draft model on every architecture and cache kind, and prompt lookup or self-drafting in turn (a Latin
    square over the architectures and kinds): every architecture meets both on some kinds and every kind on some
    architectures, at three runs a pair instead of four. On the pre-allocated cache prompt lookup runs on every
    architecture whose prompt lookup gets acceptances (asserted), self-drafting on the other."""
    out = drafters(zoo, name)
    lookup = (list(ARCHS).index(name) + list(KINDS).index(kind)) % 2 == 0
    if kind == "preallocated":
        lookup = name not in LOOKUP_MISSES
    del out["self:1" if lookup else "prompt-lookup"]
    return out


def expected_take_backs(name: str, kind: str) -> set[str]:
    """The ways of taking drafts back that a run of ``N`` tokens must show for ``kind`` on ``name``."""
    if kind == "none":
        return {"nothing"}
    want = set()
    if kind in ("sink", "quantized") or name in RINGS:
        want.add("recompute")  # an eviction, a flush, a wrapped ring: rolled back, written again
    if name not in RINGS and kind in ("preallocated", "concat", "paged", "evict"):
        want.add("truncate")  # a recurrent state (qwen3next) restored from the verification's per-position checkpoint
    return want


# -- 1. greedy drafting gives plain greedy's tokens ------------------------------------------------------------------

@pytest.mark.long  # 49 architectures x caches
@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("name", ARCHS)
def test_greedy_drafting_gives_plain_greedy_tokens(zoo, name, kind):
    model = load(zoo, name)
    if (name, kind) in REFUSED:
        with pytest.raises(SettingsError, match=REFUSED[name, kind]):
            make(model, kind)
        return
    prompt = lookup_prompt(zoo, name, N)
    plain = greedy(model, make(model, kind), prompt, N)
    seen, runs = set(), {}
    for label, draft in crossed_drafters(zoo, name, kind).items():
        gen = greedy(model, make(model, kind), prompt, N, draft=draft, draft_tokens=4)
        spec = gen.speculation
        assert gen.tokens == plain.tokens, (label, gen.generated_tokens, plain.generated_tokens)
        assert len(gen.history) == N + 1
        runs[label] = spec
        seen |= {v.take_back for v in spec.verifications if v.rolled_back or not gen.cache.stores}
        rejected = [v for v in spec.verifications if v.accepted < len(v.drafted)]
        drafts = label != "prompt-lookup" or kind in EXACT or name not in LOOKUP_MISSES  # it had drafts to check
        assert rejected and spec.drafted > spec.accepted or not drafts, label
        if gen.cache.stores:
            assert spec.rolled_back == sum(len(v.drafted) - v.accepted for v in spec.verifications)
            assert spec.rolled_back > 0 or not drafts
        else:
            assert spec.rolled_back == 0 and {v.take_back for v in spec.verifications} == {"nothing"}
    # the draft model gets drafts accepted and rejected; so does prompt lookup where the tokens are plain decoding's
    # with every position held exactly (the prompt was chosen on the pre-allocated cache's tokens)
    assert runs["model"].accepted > 0
    if kind in EXACT and name not in LOOKUP_MISSES and "prompt-lookup" in runs:
        assert runs["prompt-lookup"].accepted > 0
    assert expected_take_backs(name, kind) <= seen, seen


def test_self_drafting_through_shared_layers_and_a_draft_model_of_first_layers(zoo):
    """Gemma 4's self-draft of 5 layers includes a layer that reads an earlier layer's cache; a draft model made of
    the target's first layers (its own Model) drafts like self:L."""
    model = load(zoo, "gemma4")
    prompt = lookup_prompt(zoo, "gemma4", N)
    plain = greedy(model, make(model, "preallocated"), prompt, N)
    a = greedy(model, make(model, "preallocated"), prompt, N, draft="self:5", draft_tokens=3)
    b = greedy(model, make(model, "paged"), prompt, N, draft=model.first_layers(5), draft_tokens=3)
    assert a.tokens == b.tokens == plain.tokens
    assert a.speculation.accepted > 0 and a.speculation.rolled_back > 0
    assert a.speculation.counts() == b.speculation.counts()  # the same drafts, the same acceptances


def test_a_quantized_verification_reads_what_one_token_steps_read(zoo):
    """A pass of several tokens that pushes blocks out of the residual: each query reads every position as its own
    one-token step would have (quantized below that step's frontier, full precision above), so the verification's
    logits are plain decoding's (they differed by up to 8e-3 when the chunk read its whole flush dequantized); a
    traced verification records those key columns."""
    model = load(zoo, "llama")
    tokens = [1] + [(7 * i * i + 3 * i + 11) % 300 + 3 for i in range(34)]
    for start, size in [(14, 2), (14, 5), (20, 5), (25, 3), (29, 6)]:
        chunk, steps = make(model, "quantized"), make(model, "quantized")
        for c in (chunk, steps):
            model(torch.tensor([tokens[:start]]), c, 0)
        got = model(torch.tensor([tokens[start:start + size]]), chunk, start)[0]
        want = torch.stack([model(torch.tensor([[tokens[p]]]), steps, p)[0, -1] for p in range(start, start + size)])
        assert (got - want).abs().max() < 5e-5 and chunk.quantized_upto == steps.quantized_upto > 0
        q = chunk.quantized_upto
        flushed = q > (start - 4) // 4 * 4
        first = (start - 4) // 4 * 4 if start >= 8 else 0
        assert chunk.inspect.read_positions(0) == ([*range(q), *range(first, start + size)]
                                                   if flushed else list(range(start + size)))
    tracer = kvexplore.Tracer(capture={"cache", "attention"})
    gen = kvexplore.Generator(model, make(model, "quantized"), tracer=tracer, draft=draft_model(zoo, "llama"))
    gen.prefill(tokens[:10])
    gen.run(12)
    plain = greedy(model, make(model, "quantized"), tokens[:10], 12)
    assert gen.tokens == plain.tokens


# -- 2. hypothesis: prompts, k and cache sizes, with a page boundary and a ring wrap inside drafts --------------------

def crosses(v, size: int) -> bool:
    """Whether the positions a verification wrote (pos .. pos + written - 1) cross a multiple of ``size``."""
    return v.pos // size != (v.pos + v.written - 1) // size


@settings(max_examples=12, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(prompt=st.lists(st.integers(3, 40), min_size=1, max_size=12), k=st.integers(1, 6),
       block=st.integers(1, 5), use_model=st.booleans())
def test_paged_drafts_across_page_boundaries_give_plain_greedy(zoo, prompt, k, block, use_model):
    model = load(zoo, "llama")
    draft = draft_model(zoo, "llama") if use_model else "prompt-lookup"
    plain = greedy(model, make(model, "preallocated"), [1, *prompt], 12)
    gen = greedy(model, make(model, "paged", block_size=block), [1, *prompt], 12, draft=draft, draft_tokens=k)
    assert gen.tokens == plain.tokens
    pool = gen.cache.pool
    assert len(pool.free) + sum(1 for r in pool.refcount if r) == pool.num_blocks  # nothing leaked
    assert gen.cache.block_tables[0] == [p for p in gen.cache.block_tables[0] if pool.refcount[p] == 1]
    assert len(gen.cache.block_tables[0]) == -(-gen.cache.length // block)  # drafted pages went back
    long = [v for v in gen.speculation.verifications if v.written > block]  # these cross a page boundary
    assert all(crosses(v, block) for v in long)
    if use_model and block <= k:  # the draft model drafts k tokens (fewer only for the run's last tokens)
        assert long


@pytest.mark.long  # the fast tier's heaviest (1-3 s): drafting through rings
@settings(max_examples=10, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(prompt=st.lists(st.integers(3, 40), min_size=1, max_size=12), k=st.integers(1, 6),
       window=st.sampled_from([3, 5, 8]))
def test_ring_wraps_inside_drafts_give_plain_greedy(zoo, prompt, k, window):
    """Gemma 3 with a ring of ``window`` slots: drafts of the (perturbed) draft model wrap it."""
    model = zoo.load("gemma3", layers=3, sliding_window=window)
    draft = zoo.get(("speculative ring draft", window), lambda: perturbed(model))
    plain = greedy(model, make(model, "preallocated"), [1, *prompt], 14)
    gen = greedy(model, make(model, "preallocated"), [1, *prompt], 14, draft=draft, draft_tokens=k)
    assert gen.tokens == plain.tokens
    spec = gen.speculation
    for v in spec.verifications:
        end, keep = v.pos + v.written, v.pos + v.kept
        if v.rolled_back and end <= window:  # the ring never wrapped: the drafted slots are left stale
            assert v.take_back == "truncate"
        if v.rolled_back and end > window and end >= keep + 2 and keep > window:
            assert v.take_back == "recompute", v  # the draft overwrote slots of positions the kept sequence reads
    if k + 1 > window:  # the draft model's full drafts write more positions than the ring has: they wrap it
        assert any(v.written > window and crosses(v, window) for v in spec.verifications)


@pytest.mark.long  # the fast tier's heaviest (1-3 s): drafting through sinks and quantized caches
@settings(max_examples=12, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(prompt=st.lists(st.integers(3, 40), min_size=1, max_size=14), k=st.integers(1, 6),
       kind=st.sampled_from(["sink", "quantized"]), a=st.sampled_from([1, 2, 4, 8]), b=st.integers(0, 6))
def test_evicting_and_flushing_caches_of_any_size_give_plain_greedy(zoo, prompt, k, kind, a, b):
    """A sink window of ``a + 2`` with ``b`` sinks, or quantized groups of ``a`` with a residual of ``b``."""
    model = load(zoo, "llama")
    options = dict(window=a + 2, sinks=b) if kind == "sink" else dict(group_size=a, residual=b)
    plain = greedy(model, make(model, kind, **options), [1, *prompt], 12)
    gen = greedy(model, make(model, kind, **options), [1, *prompt], 12, draft=draft_model(zoo, "llama"),
                 draft_tokens=k)
    assert gen.tokens == plain.tokens


# -- 3. sampling: the tokens are distributed as the target's ---------------------------------------------------------

def chi_square_p(counts: torch.Tensor, probs: torch.Tensor) -> float:
    """p-value of Pearson's chi-square test of ``counts`` against ``probs`` (categories with probability > 0)."""
    keep = probs > 0
    assert counts[~keep].sum() == 0, "a token the target's filtered distribution excludes was drawn"
    n, expected, counts = counts.sum(), probs[keep] * counts.sum(), counts[keep]
    small = expected < 5  # pooled into one bin, so the chi-square approximation holds
    if small.any():
        expected = torch.cat([expected[~small], expected[small].sum()[None]])
        counts = torch.cat([counts[~small], counts[small].sum()[None]])
    stat = ((counts - expected) ** 2 / expected).sum()
    df = len(expected) - 1
    assert n > 0 and df > 0 and expected.min() >= 5
    return float(torch.special.gammaincc(torch.tensor(df / 2, dtype=torch.float64), stat.double() / 2))


def sample_first_two(gen, context: list[int], forced: int, seeds: range) -> torch.Tensor:
    """For each seed: prefill ``context`` forcing ``forced``, one verification; the (first, second) new tokens."""
    out, gen.totals = [], [0, 0]
    for seed in seeds:
        gen.seed = seed
        gen.prefill(context, force=forced)
        while len(gen.history) < 3:
            gen.step()
        gen.totals[0] += gen.speculation.accepted
        gen.totals[1] += gen.speculation.drafted
        out.append(gen.tokens[len(context) + 1:len(context) + 3])
    return torch.tensor(out)


def sampling_context(model, settings_):
    """A context ``[1, 9, 10, t, 9]`` then 10, after which prompt lookup drafts ``t, 9`` and the target gives ``t``
    a probability between 0.2 and 0.8 (so its drafts are accepted and rejected)."""
    for t in range(3, 300):
        p = filtered_probs(no_cache_logits(model, [1, 9, 10, t, 9, 10], last=True),
                           settings_)
        if 0.2 < p[t] < 0.8:
            return [1, 9, 10, t, 9], 10
    raise AssertionError("no context found")


def target_distributions(model, settings_, context: list[int], forced: int):
    """The target's filtered distribution of the first new token, and of the second (averaged over the first)."""
    seq = [*context, forced]
    p1 = filtered_probs(no_cache_logits(model, seq, last=True), settings_)
    p2 = torch.zeros_like(p1)
    for t in p1.nonzero().flatten().tolist():
        row = no_cache_logits(model, [*seq, t], last=True)
        p2 += p1[t] * filtered_probs(row, settings_)
    return p1.double(), p2.double()


@pytest.mark.long  # thousands of samples
@pytest.mark.parametrize("drafter", ["model", "prompt-lookup"])
def test_sampled_tokens_are_distributed_as_the_targets(zoo, tiny, drafter, monkeypatch):
    """Chi-square over 300 seeds of the first two tokens after a fixed context (temperature 1, top_k 6): equal to
    the target's filtered distribution; the same counts with every draft accepted are clearly rejected (the test
    can see a wrong acceptance rule)."""
    draft = draft_model(zoo, "llama", noise=0.3) if drafter == "model" else "prompt-lookup"
    gen = kvexplore.Generator(tiny, make(tiny, "preallocated"), temperature=1.0, top_k=6, draft=draft,
                              draft_tokens=2)
    context, forced = zoo.get("speculative sampling context", lambda: sampling_context(tiny, gen.sampling))
    p1, p2 = target_distributions(tiny, gen.sampling, context, forced)
    tokens = sample_first_two(gen, context, forced, range(300))
    V = p1.numel()
    assert 0 < gen.totals[0] < gen.totals[1]  # both branches of the rule ran
    assert chi_square_p(torch.bincount(tokens[:, 0], minlength=V).double(), p1) > 1e-3
    assert chi_square_p(torch.bincount(tokens[:, 1], minlength=V).double(), p2) > 1e-3

    def always_accept(logits, draft, sampling, rng):  # the control: a wrong rule (every draft kept)
        return [*draft.tokens, int(torch.multinomial(filtered_probs(logits[len(draft.tokens)], sampling), 1,
                                                     generator=rng))], len(draft.tokens)

    monkeypatch.setattr(speculative, "accept", always_accept)
    wrong = sample_first_two(gen, context, forced, range(200))
    bad = []
    for i, p in enumerate((p1, p2)):
        try:
            bad.append(chi_square_p(torch.bincount(wrong[:, i], minlength=V).double(), p))
        except AssertionError:  # it drew tokens the target never would
            bad.append(0.0)
    assert min(bad) < 1e-6, bad
