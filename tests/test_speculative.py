"""Speculative decoding (issue 28) on every cache kind and architecture: greedy drafting gives plain greedy's tokens
for every drafter; after every take-back the cache equals one that never saw the rejected drafts; with sampling the
tokens are distributed as the target's; records, rewinds, undo and refusals; a failed verification changes nothing."""

from __future__ import annotations

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import kvexplore
from kvexplore.errors import SettingsError
from kvexplore.runtime import speculative
from kvexplore.runtime.sampling import filtered_probs
from speculative_reference import (ARCHS, KINDS, cache_state, differences, draft_model, greedy, load, lookup_prompt,
                                   make, perturbed)
from helpers import no_cache_logits

N = 16  # tokens per run
REFUSED = {("deepseek", "quantized"): "latent", ("deepseek", "evict"): "latent",
           ("deepseek32", "quantized"): "latent", ("deepseek32", "evict"): "latent"}
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
        assert chunk.read_positions(0) == ([*range(q), *range((start - 4) // 4 * 4 if start >= 8 else 0, start + size)]
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


TRUNCATED = 3e-5  # see follow(): 1e-5 for attention alone; states run the delta rule token by token here


# -- 3. after every take-back the cache is one that never saw the rejected drafts -------------------------------------

def follow(model, gen, ref, steps: int, atol: float = 0.0, check=None):
    """Step ``gen`` (one verification each) and feed ``ref`` (a cache of the same kind) only what each kept, as one
    pass at the verification's position; after every step both caches hold the same positions with the same keys,
    values, codes and states: bit for bit while every take-back recomputed (the kept tokens are written by the
    same pass the reference makes), within ``TRUNCATED`` once a verification was truncated (its kept positions
    were computed by a pass of ``k + 1`` rows, the reference's by one of fewer: float32 matrix products of other
    shapes round differently in the last bits; a linear-attention state restored from a checkpoint was computed token
    by token, the reference's in chunks of five or more, which reaches the next layers' keys at about 1e-5)."""
    model(torch.tensor([gen.tokens[:gen.cache.length]]), ref, 0)  # the prefill's chunk
    truncated = False
    for _ in range(steps):
        gen.step()
        kept = gen.tokens[ref.length:gen.cache.length]
        if kept:
            model(torch.tensor([kept]), ref, ref.length)
        assert ref.length == gen.cache.length
        truncated |= any(v.take_back == "truncate" for v in gen.speculation.verifications)
        assert differences(cache_state(gen.cache), cache_state(ref), TRUNCATED if truncated else 0.0) == []
        if hasattr(ref, "block_tables"):  # as many pages as the reference, the drafted ones back in the pool
            assert len(gen.cache.block_tables[0]) == len(ref.block_tables[0])
            assert gen.cache.free_blocks == ref.free_blocks or check is not None  # (a fork holds pages of its own)
        if check is not None:
            check(gen)
    return gen.speculation


@pytest.mark.sampled
@pytest.mark.parametrize("kind", [k for k in KINDS if k != "none"])
@pytest.mark.parametrize("name", ARCHS)
def test_after_every_take_back_the_cache_never_saw_the_rejected_drafts(zoo, name, kind):
    model = load(zoo, name)
    if (name, kind) in REFUSED:
        pytest.skip(f"{kind} refuses {name} (asserted in the greedy test)")
    prompt = lookup_prompt(zoo, name, N)
    gen = kvexplore.Generator(model, make(model, kind), draft=draft_model(zoo, name), draft_tokens=4)
    gen.prefill(prompt)
    spec = follow(model, gen, make(model, kind), 8)
    assert spec.rolled_back > 0
    assert spec.accepted > 0 or kind == "evict"  # the pressed target agrees less with the draft model


def test_take_backs_leave_a_forked_prefix_and_its_reference_counts_alone(zoo):
    model = load(zoo, "llama")
    prompt = lookup_prompt(zoo, "llama", N)
    cache = make(model, "paged", block_size=3)
    gen = kvexplore.Generator(model, cache, draft=draft_model(zoo, "llama"), draft_tokens=5)
    gen.prefill(prompt)
    gen.run(2)
    twin = gen.fork()
    shared = list(cache.block_tables[0][:cache.length // 3 + (cache.length % 3 > 0)])
    before_twin = cache_state(twin.cache)
    pool = cache.pool
    counts = {p: pool.refcount[p] for p in shared}
    assert all(c == 2 for c in counts.values())

    def pages_untouched(g):
        table = g.cache.block_tables[0]
        # the fully shared pages stay in the table with both sharers; a partly filled last page was copied on write
        full = shared[:len(shared) - (twin.cache.length % 3 > 0)]
        assert table[:len(full)] == full and all(pool.refcount[p] == 2 for p in full)
        assert differences(cache_state(twin.cache), before_twin) == []  # the fork never sees the drafts

    spec = follow(model, gen, make(model, "paged", block_size=3), 8, check=pages_untouched)
    assert spec.rolled_back > 0 and any(v.take_back == "truncate" for v in spec.verifications)


# -- 4. sampling: the tokens are distributed as the target's ---------------------------------------------------------

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


# -- 5. records, rewinds, undo, refusals --------------------------------------------------------------------------

def test_records_say_what_each_verification_drafted_and_kept(zoo):
    model = load(zoo, "llama")
    prompt = lookup_prompt(zoo, "llama", N)
    plain = greedy(model, make(model, "preallocated"), prompt, N)
    gen = kvexplore.Generator(model, make(model, "preallocated"), draft=draft_model(zoo, "llama"), draft_tokens=3)
    gen.prefill(prompt)
    records = gen.run(N)
    assert len(records) == N and records == gen.history[1:]
    assert gen.tokens == plain.tokens
    spec = gen.speculation
    assert spec.counts() and len(spec.counts()) == len(spec.verifications)
    for i, r in enumerate(records):
        assert r.position == len(prompt) + 1 + i and r.token_id == gen.tokens[len(prompt) + 1 + i]
    for v in spec.verifications:
        rs = gen.history[v.first_step:v.first_step + len(v.tokens)]
        assert [r.token_id for r in rs] == v.tokens and v.written == len(v.drafted) + 1
        assert [r.verification for r in rs] == [v.index] * len(rs)
        assert [r.draft_token for r in rs] == (v.drafted + [None])[:len(rs)]
        assert [r.drafted for r in rs] == [i < len(v.drafted) for i in range(len(rs))]
        assert [r.accepted for r in rs] == [i < v.accepted for i in range(len(rs))]
        assert v.kept == v.accepted + 1 == len(v.tokens) and v.rolled_back == len(v.drafted) - v.accepted
        assert all(r.input_len == v.written and r.trace is rs[-1].trace for r in rs)
        assert all(r.cache_length == v.pos + v.kept for r in rs)  # after the take-back
        assert rs[0].position == v.pos + 1
    plain_steps = [r for r in records if r.verification is None]
    assert all(not r.drafted and not r.accepted and r.draft_token is None for r in plain_steps)
    assert sum(r.accepted for r in records) == spec.accepted
    assert sum(r.drafted for r in records) == spec.accepted + sum(v.accepted < len(v.drafted)
                                                                   for v in spec.verifications)


@pytest.mark.sampled
@pytest.mark.parametrize("kind", ["preallocated", "paged", "quantized"])  # sink: see the report (plain rewinds too)
@pytest.mark.parametrize("name", ["llama", "gemma3", "qwen3next"])
def test_rewinding_into_a_verification_then_running_again_gives_plain_greedy(zoo, name, kind):
    model = load(zoo, name)
    prompt = lookup_prompt(zoo, name, N)
    plain = greedy(model, make(model, kind), prompt, N)
    gen = kvexplore.Generator(model, make(model, kind), draft=draft_model(zoo, name), draft_tokens=4)
    gen.prefill(prompt)
    gen.run(N // 2)
    v = next(v for v in reversed(gen.speculation.verifications) if len(v.tokens) > 1)
    back = len(gen.history) - (v.first_step + 1)  # keep the verification's first token only
    gen.rewind(back)
    assert all(w.first_step + len(w.tokens) <= len(gen.history) for w in gen.speculation.verifications)
    gen.run(N + 1 - len(gen.history))
    assert gen.tokens == plain.tokens


@pytest.mark.sampled
@pytest.mark.parametrize("kind", ["preallocated", "paged", "sink", "quantized"])
@pytest.mark.parametrize("name", ["llama", "gemma3", "qwen3next"])
def test_undo_step_takes_a_verification_back_exactly(zoo, name, kind):
    model = load(zoo, name)
    prompt = lookup_prompt(zoo, name, N)
    gen = kvexplore.Generator(model, make(model, kind), draft=draft_model(zoo, name), draft_tokens=4)
    gen.prefill(prompt)
    gen.run(6)
    undone = set()
    for _ in range(6):
        before = (gen.tokens, list(gen.history), gen._rng.get_state(), cache_state(gen.cache.clone()),
                  len(gen.speculation.verifications))
        length = gen.cache.length
        gen.step(keep_undo=True)
        how = None
        if len(gen.speculation.verifications) > before[4]:
            how = gen.speculation.verifications[-1].take_back
            undone.add(how)
        assert how != "truncate" or gen.cache.crop_error(length) is None  # else recomputed, to keep the journal
        gen.undo_step()
        assert gen.tokens == before[0] and list(gen.history) == before[1]
        assert torch.equal(gen._rng.get_state(), before[2]) and len(gen.speculation.verifications) == before[4]
        assert differences(cache_state(gen.cache), before[3]) == []
        gen.step()  # move on
    assert undone


def test_sampled_verifications_rewind_and_undo_to_the_rng_before_the_draft(zoo):
    model = load(zoo, "llama")
    gen = kvexplore.Generator(model, make(model, "preallocated"), temperature=1.0, seed=5,
                              draft=draft_model(zoo, "llama", noise=0.3))
    gen.prefill([1, 5, 6, 7])
    gen.run(12)
    tokens, v = gen.tokens, gen.speculation.verifications[-1]
    back = len(gen.history) - v.first_step
    gen.rewind(back)  # to the start of the last verification: drafted and drawn again, the same tokens
    gen.run(back)
    assert gen.tokens == tokens
    before = gen._rng.get_state()
    gen.step(keep_undo=True)
    gen.undo_step()
    assert torch.equal(gen._rng.get_state(), before)


def test_bad_settings_are_refused_naming_the_fix(zoo, tiny):
    model = tiny
    cache = make(model, "preallocated")
    for draft, k, message in [("lookup", 4, "not a drafter: give 'prompt-lookup'"), ("self:x", 4, "L must be a whole"),
                              ("self:0", 4, "1..1"), ("self:2", 4, "the target has 2"),
                              ("prompt-lookup", 0, "draft_tokens"),
                              ("prompt-lookup", 65, "draft_tokens"), ("prompt-lookup", 2.5, "draft_tokens"),
                              (42, 4, "draft must be 'prompt-lookup', 'self:L', a draft model or a Drafter")]:
        with pytest.raises(SettingsError, match=message):
            kvexplore.Generator(model, cache, draft=draft, draft_tokens=k)
    other = zoo.load("llama", heads=4, kv_heads=2, vocab_size=400, tokenizer=False)
    with pytest.raises(SettingsError, match="vocabulary has 400 tokens and the target's 320"):
        kvexplore.Generator(model, cache, draft=other)
    with pytest.raises(SettingsError, match="decode_every=4.*decode_every=None"):
        kvexplore.Generator(model, make(model, "evict", decode_every=4), draft="prompt-lookup")
    assert cache.length == 0  # nothing was written
    gen = kvexplore.Generator(model, cache)  # the cache still serves a plain generator
    gen.prefill([1, 5, 6])
    assert cache.length == 3


# -- 6. a verification that fails changes nothing ---------------------------------------------------------------------

class FailingVerification(kvexplore.Tracer):
    """A tracer whose hook raises part-way through the layers of a verification pass (several query rows)."""

    armed = False

    def begin_step(self, cache, pos, q_len):
        self.q_len = q_len
        return super().begin_step(cache, pos, q_len)

    def hook(self, name, t):
        if self.armed and self.q_len > 1 and name == "layers.1.attn.q":
            raise RuntimeError("hook failed")
        return super().hook(name, t)


def snapshot(gen):
    return (gen.tokens, list(gen.history), gen._rng.get_state(), cache_state(gen.cache.clone()), gen.cache.length,
            [dict(c) for c in gen.speculation.counts()])


def assert_unchanged(gen, before):
    after = snapshot(gen)
    assert after[0] == before[0] and after[1] == before[1] and torch.equal(after[2], before[2])
    assert differences(after[3], before[3]) == [] and after[4] == before[4] and after[5] == before[5]


@pytest.mark.sampled
@pytest.mark.parametrize("fail", ["verification", "recompute", "hook"])
@pytest.mark.parametrize("kind", ["preallocated", "paged", "sink", "quantized"])
def test_a_failed_verification_leaves_everything_as_it_was(zoo, kind, fail, monkeypatch):
    """The verification pass raises after it wrote and committed (or a hook raises half-way through its layers), or
    the recompute pass raises after the rollback: tokens, history, RNG, counts and cache are as before the step, and
    the same step run again gives plain greedy's tokens. Sampling, so the RNG has something to restore."""
    model = load(zoo, "gemma3")
    prompt = lookup_prompt(zoo, "gemma3", N)
    tracer = FailingVerification() if fail == "hook" else None
    gen = kvexplore.Generator(model, make(model, kind), temperature=1.0, seed=3, draft=draft_model(zoo, "gemma3"),
                              draft_tokens=4, tracer=tracer)
    gen.prefill(prompt)
    if tracer is not None:
        tracer.armed = True
    twin = kvexplore.Generator(model, make(model, kind), temperature=1.0, seed=3, draft=draft_model(zoo, "gemma3"),
                               draft_tokens=4)
    twin.prefill(prompt)
    cls, real, calls, armed = type(gen.executor), type(gen.executor).__call__, [], [True]

    def failing(self, ids, cache, pos, tracer=None, last_only=False, keep_undo=False):
        out = real(self, ids, cache, pos, tracer=tracer, last_only=last_only, keep_undo=keep_undo)
        if self is gen.executor:
            what = "verification" if not last_only else "recompute" if "verification" in calls else "plain"
            calls.append(what)
            if armed[0] and what == fail:
                raise RuntimeError(f"{fail} failed")
        return out

    monkeypatch.setattr(cls, "__call__", failing)
    failures = 0
    while len(gen.history) < 60 and failures < 2:
        before = snapshot(gen)
        calls.clear()
        try:
            gen.step()
        except RuntimeError as e:
            assert str(e) == f"{fail} failed"
            failures += 1
            assert_unchanged(gen, before)
            armed[0] = False
            if tracer is not None:
                tracer.armed = False
            gen.step()  # the same step again
            armed[0] = True
            if tracer is not None:
                tracer.armed = True
        twin.step()
        assert gen.tokens == twin.tokens
        assert differences(cache_state(gen.cache), cache_state(twin.cache)) == []
    assert failures


@pytest.mark.long  # the fast tier's heaviest (1-3 s): drafting through recurrent states
def test_recurrent_states_checkpoint_or_recompute_alike(zoo):
    """Qwen3-Next's linear-attention states give back rejected drafts from the checkpoint the verification kept
    after each position (no second pass), or by rolling back and recomputing: the same tokens as plain greedy, the
    same states within float32 rounding, and only the recomputing run makes a second pass."""
    model = load(zoo, "qwen3next")
    prompt = lookup_prompt(zoo, "qwen3next", N)
    plain = greedy(model, make(model, "preallocated"), prompt, N)
    runs = {}
    for states in ("checkpoint", "recompute"):
        gen = kvexplore.Generator(model, make(model, "preallocated"), draft=draft_model(zoo, "qwen3next"),
                                  draft_tokens=4)
        gen.speculation.states = states
        gen.prefill(prompt)
        gen.run(N, stop_at_eos=False)
        assert gen.tokens == plain.tokens and gen.speculation.rolled_back > 0
        runs[states] = gen
    ways = {s: {v.take_back for v in g.speculation.verifications if v.rolled_back} for s, g in runs.items()}
    assert ways == {"checkpoint": {"truncate"}, "recompute": {"recompute"}}
    a, b = runs["checkpoint"].cache, runs["recompute"].cache
    for layer in (s.index for s in a.plan if s.recurrent):
        for x, y in zip(a.read_state(layer), b.read_state(layer)):
            assert torch.allclose(x, y, atol=1e-5)
    with pytest.raises(SettingsError, match="speculation.states must be one of checkpoint, recompute, got 'keep'"):
        runs["checkpoint"].speculation.states = "keep"


def test_the_verification_keeps_the_memory_report_of_its_pass(tiny):
    """A verification's records report memory after the take-back; ``pass_memory`` is the pass's own: ``k + 1``
    positions written by ``narrow(2, pos, k + 1)`` on the pre-allocated cache, nothing copied or allocated."""
    from kvexplore.caches.memory import kv_bytes
    from kvexplore.runtime.drafters import Draft, Drafter

    class Fives(Drafter):
        def propose(self, tokens, k, sampling, rng):
            return Draft([5] * k)

    gen = kvexplore.Generator(tiny, kvexplore.make_cache("preallocated", tiny, max_seq_len=64), draft=Fives(),
                              draft_tokens=4)
    gen.prefill([1, 2, 3])
    record = gen.step()
    v = gen.speculation.verifications[-1]
    m = v.pass_memory
    assert m.written_bytes == kv_bytes(tiny.config, 5) and m.copied_bytes == m.allocated_bytes == 0
    assert m.length == 3 + 5 and record.memory.length == gen.cache.length == 3 + v.kept
    if v.rolled_back:  # cut back: the record's report is the truncate's, which writes nothing
        assert v.take_back == "truncate" and record.memory.written_bytes == 0
