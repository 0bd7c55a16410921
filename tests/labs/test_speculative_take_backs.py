"""Speculative decoding (issue 28), what a verification leaves behind, on every cache kind and architecture: after
every take-back the cache equals one that never saw the rejected drafts; records, rewinds, undo and refusals; a failed
verification changes nothing; recurrent states given back from a checkpoint or recomputed alike; the memory report of
a verification's pass. The tokens themselves (greedy and sampled) are test_speculative_tokens.py's."""

from __future__ import annotations

import pytest
import torch

import kvexplore
from kvexplore.errors import SettingsError
from speculative_reference import (ARCHS, KINDS, N, REFUSED, cache_state, differences, draft_model, greedy, load,
                                   lookup_prompt, make)

TRUNCATED = 3e-5  # see follow(): 1e-5 for attention alone; states run the delta rule token by token here


# -- 1. after every take-back the cache is one that never saw the rejected drafts -------------------------------------

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
            # (a fork holds pages of its own)
            assert gen.cache.pool.free_blocks == ref.pool.free_blocks or check is not None
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



# -- 2. records, rewinds, undo, refusals --------------------------------------------------------------------------

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
        assert how != "truncate" or gen.cache.inspect.crop_error(length) is None  # else recomputed, to keep the journal
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


# -- 3. a verification that fails changes nothing ---------------------------------------------------------------------

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
        for x, y in zip(a.states.read(layer), b.states.read(layer)):
            assert torch.allclose(x, y, atol=1e-5)
    with pytest.raises(SettingsError, match="speculation.states must be one of checkpoint, recompute, got 'keep'"):
        runs["checkpoint"].speculation.states = "keep"


def test_the_verification_keeps_the_memory_report_of_its_pass(tiny):
    """A verification's records report memory after the take-back; ``pass_memory`` is the pass's own: ``k + 1``
    positions written by ``narrow(2, pos, k + 1)`` on the pre-allocated cache, nothing copied or allocated."""
    from kvexplore.caches.memory import kv_bytes
    from kvexplore.speculation.drafters import Draft, Drafter

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
