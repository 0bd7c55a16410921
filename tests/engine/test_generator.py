"""The step-wise generator: exact strategies agree, rewind regenerates, sampling is seeded, failures change nothing."""

import pytest
import torch

import kvexplore

from kvexplore import CacheFullError, Generator, NoCache, PreallocatedCache

PROMPT = "Call me Ishmael. Some years ago"


def snapshot(gen):
    keys = [gen.cache.key(i).clone() for i in range(gen.model.config.num_layers)] if hasattr(gen.cache, "key") else []
    return (gen.tokens, list(gen.history), gen.cache.length, gen._rng.get_state().clone(), keys)


def assert_unchanged(gen, before):
    tokens, history, length, rng, keys = before
    assert gen.tokens == tokens and gen.history == history and gen.cache.length == length
    assert torch.equal(gen._rng.get_state(), rng)
    assert all(torch.equal(gen.cache.key(i), k) for i, k in enumerate(keys))


def test_no_cache_and_preallocated_give_identical_tokens(tiny):
    runs = {}
    for name, cache in {"none": NoCache(tiny.config), "preallocated": PreallocatedCache(tiny.config, 64)}.items():
        gen = Generator(tiny, cache)
        first = gen.prefill(PROMPT)
        records = [first, *gen.run(30, stop_at_eos=False)]
        runs[name] = (gen.tokens, [r.input_len for r in records], [r.prob for r in records])
    prompt_len = len(tiny.tokenizer.encode(PROMPT)) + 1
    assert runs["none"][0] == runs["preallocated"][0] and len(runs["none"][0]) == prompt_len + 31
    assert runs["none"][1] == [prompt_len + i for i in range(31)]  # no cache: the whole sequence every step
    assert runs["preallocated"][1] == [prompt_len] + [1] * 30  # cached: one token per step
    assert runs["none"][2] == pytest.approx(runs["preallocated"][2], abs=1e-5)


def test_records(tiny):
    gen = Generator(tiny, PreallocatedCache(tiny.config, 64), top_candidates=4)
    first = gen.prefill(PROMPT)
    prompt = [tiny.tokenizer.bos_id, *tiny.tokenizer.encode(PROMPT)]
    assert gen.prompt_tokens == prompt and gen.tokens == prompt + [first.token_id]
    assert (first.kind, first.step, first.position, first.input_len, first.cache_length) == (
        "prefill", 0, len(prompt), len(prompt), len(prompt))
    second = gen.step()
    assert (second.kind, second.step, second.position, second.input_len, second.cache_length) == (
        "decode", 1, len(prompt) + 1, 1, len(prompt) + 1)
    assert len(second.top) == 4 and second.top[0].token_id == second.token_id  # greedy takes the top candidate
    assert second.prob == pytest.approx(second.top[0].prob)
    assert [c.prob for c in second.top] == sorted((c.prob for c in second.top), reverse=True)
    assert second.elapsed_s >= second.forward_s > 0
    assert gen.text == tiny.tokenizer.decode(gen.generated_tokens)
    assert ("".join(r.text for r in gen.history)
            == tiny.tokenizer.decode(gen.tokens)[len(tiny.tokenizer.decode(prompt)):])


@pytest.mark.parametrize("sampling", [{}, {"temperature": 0.9, "top_k": 20, "seed": 7}])
def test_rewind_then_regenerate_gives_the_same_tokens(tiny, sampling):
    gen = Generator(tiny, PreallocatedCache(tiny.config, 64), **sampling)
    gen.prefill(PROMPT)
    gen.run(20, stop_at_eos=False)
    tokens, probs = gen.tokens, [r.prob for r in gen.history]
    gen.rewind(8)
    assert gen.tokens == tokens[:-8] and len(gen.history) == 13 and gen.cache.length == len(tokens) - 9
    gen.run(8, stop_at_eos=False)
    assert gen.tokens == tokens
    assert [r.prob for r in gen.history] == pytest.approx(probs, abs=1e-5)
    gen.rewind(len(gen.history))  # back to the bare prompt
    assert gen.tokens == gen.prompt_tokens
    gen.run(21, stop_at_eos=False)
    assert gen.tokens == tokens


def test_seeded_sampling_is_reproducible_and_differs_from_greedy(tiny):
    def sample(seed, **kw):
        gen = Generator(tiny, PreallocatedCache(tiny.config, 64), temperature=1.0, seed=seed, **kw)
        gen.prefill(PROMPT)
        gen.run(20, stop_at_eos=False)
        return gen.generated_tokens

    greedy = Generator(tiny, PreallocatedCache(tiny.config, 64))
    greedy.prefill(PROMPT)
    greedy.run(20, stop_at_eos=False)
    assert sample(1) == sample(1)
    assert sample(1) != sample(2) and sample(1) != greedy.generated_tokens
    assert sample(3, top_k=1) == greedy.generated_tokens  # top-1 sampling is greedy
    assert sample(4, top_p=1e-6) == greedy.generated_tokens  # so is a vanishing nucleus


def test_top_k_and_top_p_restrict_the_draw(tiny):
    gen = Generator(tiny, PreallocatedCache(tiny.config, 256), temperature=2.0, top_k=3, seed=0, top_candidates=3)
    gen.prefill(PROMPT)
    for r in gen.run(40, stop_at_eos=False):
        assert r.token_id in [c.token_id for c in r.top]
    gen = Generator(tiny, PreallocatedCache(tiny.config, 256), temperature=1.0, top_p=0.5, seed=0, top_candidates=50)
    gen.prefill(PROMPT)
    for r in gen.run(40, stop_at_eos=False):
        mass_before = sum(c.prob for c in r.top if c.prob > r.prob)
        assert mass_before < 0.5 + 1e-6  # the drawn token is inside the smallest set reaching half the mass


def test_reset_and_prefill_start_over(tiny):
    gen = Generator(tiny, PreallocatedCache(tiny.config, 64), temperature=1.0, seed=5)
    gen.prefill(PROMPT)
    gen.run(10)
    tokens = gen.tokens
    gen.reset()
    assert gen.tokens == [] and gen.history == [] and gen.cache.length == 0
    gen.prefill(PROMPT)
    gen.run(10)
    assert gen.tokens == tokens
    gen.prefill("Numbers such as")  # a new prompt replaces the old sequence without a reset
    assert gen.cache.length == len(gen.prompt_tokens) and len(gen.history) == 1


def test_cache_full_leaves_generator_and_cache_as_they_were(tiny):
    gen = Generator(tiny, PreallocatedCache(tiny.config, 12))
    gen.prefill([1, 5, 6, 7, 8, 9, 10, 11, 12, 13])
    gen.run(2, stop_at_eos=False)
    before = snapshot(gen)
    with pytest.raises(CacheFullError, match="cache full: 12 of 12 slots used and this write needs 1 more"):
        gen.step()
    assert_unchanged(gen, before)
    with pytest.raises(CacheFullError):
        gen.prefill(list(range(3, 20)))
    assert_unchanged(gen, before)
    gen.rewind(1)  # the documented way out
    assert gen.step().token_id == before[0][-1]


def test_bad_input_leaves_everything_unchanged(tiny):
    gen = Generator(tiny, PreallocatedCache(tiny.config, 32))
    with pytest.raises(RuntimeError, match=r"call prefill\(prompt\) first"):
        gen.step()
    gen.prefill(PROMPT)
    before = snapshot(gen)
    with pytest.raises(ValueError, match=r"prompt token id 99999 is outside the vocabulary \(0..\d+\)"):
        gen.prefill([1, 99999])
    with pytest.raises(ValueError, match="the prompt is empty"):
        gen.prefill([])
    with pytest.raises(ValueError, match=r"cannot rewind 5 tokens: 1 have been generated \(0 <= n <= 1\)"):
        gen.rewind(5)
    with pytest.raises(ValueError, match=r"n must be at least 0 \(the number of steps\), got -1"):
        gen.run(-1)
    assert_unchanged(gen, before)
    with pytest.raises(ValueError, match=r"temperature must be >= 0 \(0 = greedy\), got -1.0"):
        Generator(tiny, PreallocatedCache(tiny.config, 8), temperature=-1)
    with pytest.raises(ValueError, match=r"top_p must be > 0 and <= 1 \(or None for no limit\), got 1.5"):
        Generator(tiny, PreallocatedCache(tiny.config, 8), top_p=1.5)
    with pytest.raises(ValueError, match="the generator drives one sequence but the cache has batch_size=2"):
        Generator(tiny, PreallocatedCache(tiny.config, 8, batch_size=2))


def test_a_cache_written_behind_the_generators_back_is_caught(tiny):
    cache = PreallocatedCache(tiny.config, 64)
    gen = Generator(tiny, cache)
    gen.prefill("Call me")
    tiny(torch.tensor([[5, 6, 7, 8, 9, 10, 11, 12]]), cache, cache.length)  # someone else writes
    with pytest.raises(RuntimeError, match="the cache was written by something else"):
        gen.step()


def test_stop_at_eos(tiny):
    eos = tiny.tokenizer.eos_ids
    gen = Generator(tiny, PreallocatedCache(tiny.config, 128))
    gen.prefill(PROMPT)
    free = gen.run(60, stop_at_eos=False)
    target = free[5].token_id
    tiny.tokenizer.eos_ids = [target]  # make a token the model will produce count as end of sequence
    try:
        gen = Generator(tiny, PreallocatedCache(tiny.config, 128))
        gen.prefill(PROMPT)
        records = gen.run(60)
        assert records[-1].token_id == target and records[-1].is_eos and len(records) <= 6
        assert gen.run(5) == []  # never starts past an end-of-sequence token
        assert len(gen.run(3, stop_at_eos=False)) == 3
    finally:
        tiny.tokenizer.eos_ids = eos


def test_fork_continues_independently(tiny):
    gen = Generator(tiny, PreallocatedCache(tiny.config, 64))
    gen.prefill(PROMPT)
    gen.run(5)
    twin = gen.fork()
    assert twin.tokens == gen.tokens and twin.cache is not gen.cache
    a = [r.token_id for r in gen.run(10, stop_at_eos=False)]
    b = [r.token_id for r in twin.run(10, stop_at_eos=False)]
    assert a == b
    twin.rewind(3)
    assert len(gen.tokens) == len(twin.tokens) + 3


def test_chat_template(tiny):
    tok = tiny.tokenizer
    saved = tok.chat_template
    tok.chat_template = ("{% for m in messages %}{{ bos_token if loop.first }}[{{ m['role'] }}] {{ m['content'] }}\n"
                         "{% endfor %}{% if add_generation_prompt %}[assistant] {% endif %}")
    try:
        text = tok.apply_chat_template([{"role": "user", "content": "Call me"}])
        assert text == "<s>[user] Call me\n[assistant] "
        ids = tok.encode_chat([{"role": "user", "content": "Call me"}])
        # the template wrote bos as text: read as the bos token (as transformers does), and not added again
        assert ids == tok.encode(text) and ids[0] == tok.bos_id and ids.count(tok.bos_id) == 1
        gen = Generator(tiny, PreallocatedCache(tiny.config, 64))
        assert gen.prefill_chat([{"role": "user", "content": "Call me"}]).position == len(ids)
    finally:
        tok.chat_template = saved
    with pytest.raises(ValueError, match="has no chat template"):
        tok.apply_chat_template([{"role": "user", "content": "hi"}])


@pytest.mark.parametrize("kind", ["preallocated", "concat", "none", "paged", "quantized", "sink"])
def test_undo_step_takes_the_last_step_back_exactly(tiny, kind):
    from hostile_cases import same_state, state

    options = {"window": 6, "sinks": 2} if kind == "sink" else {}
    gen = Generator(tiny, kvexplore.make_cache(kind, tiny, max_seq_len=80, **options), temperature=0.9, seed=5)
    twin = Generator(tiny, kvexplore.make_cache(kind, tiny, max_seq_len=80, **options), temperature=0.9, seed=5)
    for g in (gen, twin):
        g.prefill([1, 40, 77])
        g.run(8)  # past the sink window: the next step evicts
    before = state(gen)
    gen.step(keep_undo=True)
    gen.undo_step()
    assert same_state(before, state(gen))
    assert gen.step().token_id == twin.step().token_id and same_state(state(gen), state(twin))
    gen.rewind(1)
    with pytest.raises(kvexplore.StateError, match=r"undo_step\(\) takes back only the last step"):
        gen.undo_step()
    gen.step()  # without keep_undo nothing is kept: the concatenating cache holds one storage per layer
    with pytest.raises(kvexplore.StateError, match=r"undo_step\(\) takes back only the last step"):
        gen.undo_step()
    assert gen.cache.book.journal is None


def test_step_clock_takes_off_the_time_other_programs_held_the_cpu(monkeypatch):
    import time as _time

    from kvexplore.runtime import clock

    first = clock.run_delay()
    assert first >= 0.0 and clock.run_delay() >= first  # a thread's wait only grows
    waited = iter([0.0, 0.004])  # 4 ms spent runnable but off the CPU between the two marks
    monkeypatch.setattr(clock, "run_delay", lambda: next(waited))
    t0 = _time.perf_counter()
    mark = clock.now()
    _time.sleep(0.01)
    took = clock.since(mark)
    wall = _time.perf_counter() - t0
    assert wall - 0.004 - 1e-3 <= took <= wall - 0.004 + 1e-9
    monkeypatch.setattr(clock, "run_delay", iter([0.0, 5.0]).__next__)  # more waiting than wall time: never below 0
    assert clock.since(clock.now()) == 0.0
