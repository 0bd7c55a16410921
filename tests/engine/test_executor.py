"""The executor contract is all the Generator needs: a minimal executor defined here (the eager model wrapped, its
calls counted) runs prefill, steps, a rewind that replays past a sliding ring, fork and a traced step through the
Generator with the very tokens and logits of the eager model, and a model that is no executor is refused."""

from __future__ import annotations

import pytest
import torch

import kvexplore
from kvexplore.models.executor import Executor, as_executor
from helpers import no_cache_logits

PROMPT = "Call me Ishmael. Some years ago"


class Counting(Executor):
    """The contract's abstract members and nothing else: the eager model's pass, its caches, its default cache."""

    def __init__(self, model) -> None:
        self.inner, self.calls = model, []
        self.config, self.tokenizer, self.source = model.config, model.tokenizer, "counting"

    device = property(lambda self: self.inner.device)
    dtype = property(lambda self: self.inner.dtype)

    def __call__(self, ids, cache, pos, tracer=None, last_only=False, keep_undo=False):
        self.calls.append((pos, ids.shape[1]))
        return self.inner(ids, cache, pos, tracer=tracer, last_only=last_only, keep_undo=keep_undo)

    def check_cache(self, cache) -> None:
        if not isinstance(cache, kvexplore.KVCache):
            raise kvexplore.SettingsError(f"Counting runs kvexplore caches, got {type(cache).__name__}")

    def default_cache(self):
        return kvexplore.make_cache("preallocated", self.inner, 64)


def logits_of(gen):
    return [[(c.token_id, c.prob) for c in r.top] for r in gen.history]


def test_a_minimal_executor_generates_the_eager_models_tokens_and_logits(tiny):
    ex = Counting(tiny)
    gen = kvexplore.Generator(ex, top_candidates=8)
    eager = kvexplore.Generator(tiny, kvexplore.make_cache("preallocated", tiny, 64), top_candidates=8)
    assert gen.model is ex and gen.executor is ex and isinstance(gen.cache, kvexplore.PreallocatedCache)
    for g in (gen, eager):
        g.prefill(PROMPT)
        g.run(12, stop_at_eos=False)
    assert gen.tokens == eager.tokens
    assert logits_of(gen) == logits_of(eager)  # the same passes: bit for bit
    prompt = len(gen.prompt_tokens)
    assert ex.calls == [(0, prompt)] + [(prompt + i, 1) for i in range(12)]  # one pass per step, nothing else
    gen.rewind(5)
    eager.rewind(5)
    gen.run(5, stop_at_eos=False)
    eager.run(5, stop_at_eos=False)
    assert gen.tokens == eager.tokens and logits_of(gen) == logits_of(eager)
    twin = gen.fork()
    assert twin.executor is ex and twin.run(2, stop_at_eos=False)
    assert gen.history.meta["model"]["name"] == "counting"


def test_a_traced_step_through_the_minimal_executor_records_attention(tiny):
    gen = kvexplore.Generator(Counting(tiny), tracer=kvexplore.Tracer(capture={"cache", "attention"}))
    eager = kvexplore.Generator(tiny, kvexplore.make_cache("preallocated", tiny, 64),
                                tracer=kvexplore.Tracer(capture={"cache", "attention"}))
    for g in (gen, eager):
        g.prefill(PROMPT)
        g.step()
    assert gen.history[-1].trace.has_attention(0)
    assert torch.equal(gen.history[-1].trace.attention_raw(0), eager.history[-1].trace.attention_raw(0))


def test_a_rewind_past_the_ring_replays_through_the_executor_and_matches_recomputation(zoo):
    model = zoo.load("gemma3", layers=6, sliding_window=4)
    ex = Counting(model)
    gen = kvexplore.Generator(ex, kvexplore.make_cache("preallocated", model, 64))
    ids = torch.randint(3, model.config.vocab_size, (6,), generator=torch.Generator().manual_seed(1)).tolist()
    gen.prefill(ids)
    gen.run(12, stop_at_eos=False)
    kept = gen.tokens[:-5]
    assert gen.cache.inspect.needs_replay(len(kept) - 1)
    ex.calls.clear()
    gen.rewind(5)
    assert ex.calls == [(0, len(kept) - 1)]  # one pass over the kept tokens, through the contract
    assert gen.tokens == kept and gen.cache.length == len(kept) - 1
    record = gen.step()
    full = no_cache_logits(model, kept, last=True).softmax(-1)
    assert record.prob == pytest.approx(float(full[record.token_id]), abs=1e-5)  # the replayed cache is exact
    before = (list(gen.tokens), gen.cache.length, [t.clone() for t in gen.cache.inspect.storage(0)])
    inner = ex.inner
    ex.inner = lambda *a, **k: (_ for _ in ()).throw(RuntimeError("boom"))  # a replay that fails changes nothing
    try:
        with pytest.raises(RuntimeError, match="boom"):
            gen.rewind(6)
    finally:
        ex.inner = inner
    assert (gen.tokens, gen.cache.length) == before[:2]
    assert all(torch.equal(a, b) for a, b in zip(gen.cache.inspect.storage(0), before[2]))


def test_an_executor_without_a_compiled_step_decodes_eager_and_says_why(tiny):
    with pytest.warns(UserWarning, match="Counting has no compiled decode step"):
        gen = kvexplore.Generator(Counting(tiny), compile=True)
    gen.prefill(PROMPT)
    gen.run(3, stop_at_eos=False)
    assert gen.compile_s is None and not gen.compiled_step(1) and "Counting" in gen.compile_note


def test_the_executor_refuses_a_cache_it_cannot_run_and_a_model_that_is_none(tiny):
    with pytest.raises(kvexplore.SettingsError, match="Counting runs kvexplore caches, got str"):
        kvexplore.Generator(Counting(tiny), "preallocated")
    with pytest.raises(kvexplore.SettingsError, match="cache must be a KVCache .*got dict"):
        kvexplore.Generator(tiny, {})
    with pytest.raises(kvexplore.SettingsError, match="model must be a kvexplore Model .*Executor, got str"):
        kvexplore.Generator("tiny")
    assert as_executor(tiny).model is tiny and kvexplore.Generator(tiny).model is tiny


class NoQueries(kvexplore.PreallocatedCache):
    """A cache of one's own whose ``write`` takes no queries, as notebook 07 writes its subclasses."""

    def write(self, layer, pos, k, v):
        return super().write(layer, pos, k, v)


def test_a_cache_whose_write_takes_no_queries_runs_as_its_strategy(trained):
    plain = kvexplore.Generator(trained, kvexplore.make_cache("preallocated", trained, 64))
    own = kvexplore.Generator(trained, NoQueries(trained.config, max_seq_len=64))
    for gen in (plain, own):
        gen.prefill(PROMPT)
        gen.run(6)
    assert own.tokens == plain.tokens
    assert logits_of(own) == logits_of(plain)
