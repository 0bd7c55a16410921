"""PrefixPool: hit counts worked out by hand for both policies (shared prompt shorter and longer than a block,
divergence mid-block, multi-turn with generated tokens, a template that rewrites an earlier turn, eviction in a pool
too small, a hybrid model's state checkpoints), the reason of every miss, exact logits against from-scratch runs, the
pool's readable state and events, and bad input leaving the pool as it was.

Token ids are written out (the prompts are lists of ids; answers are replayed with ``response=``), so every count
below follows from the ids and the block size alone."""

from __future__ import annotations

import pytest
import torch

import kvexplore
from kvexplore.prefix.frames import WRITTEN

POLICIES = ("hash", "radix")
BS = 4


def ids(start: int, n: int) -> list[int]:
    return list(range(start, start + n))


def kinds(result) -> list[tuple[str, int, int]]:
    return [(m.kind, m.start, m.end) for m in result.misses]


def check_accounting(result) -> None:
    """Every prompt position is a hit or explained by exactly one miss, in order."""
    assert result.hit_tokens + result.recomputed_tokens == len(result.prompt)
    at = result.hit_tokens
    for m in result.misses:
        assert m.start == at and m.end > m.start, result.misses
        at = m.end
    assert at == len(result.prompt)


@pytest.fixture(params=POLICIES)
def policy(request):
    return request.param


def test_shared_prompt_shorter_than_a_block_shares_nothing_and_says_why(tiny, policy):
    pool = kvexplore.PrefixPool(tiny, num_blocks=16, block_size=BS, policy=policy)
    system = [7, 8, 9]  # 3 tokens: less than one block of 4
    a = pool.serve(system + ids(100, 5), response=[5])
    b = pool.serve(system + ids(200, 5), response=[5])
    # 8 tokens: the floor is (8 - 1) // 4 = 1 block; the second block holds the last token and is always computed
    assert (a.hit_tokens, b.hit_tokens) == (0, 0)
    assert kinds(a) == [("first-seen", 0, 4), ("partial-block", 4, 8)]
    assert kinds(b) == [("shorter-than-block", 0, 4), ("partial-block", 4, 8)]
    assert "the first 3 tokens are the same as request 0's, fewer than one block of 4" in b.misses[0].reason
    assert b.misses[0].request == 0 and b.bytes_shared == 0
    for r in (a, b):
        check_accounting(r)


def test_shared_prompt_longer_than_a_block_hits_its_whole_blocks(tiny, policy):
    pool = kvexplore.PrefixPool(tiny, num_blocks=16, block_size=BS, policy=policy)
    system = ids(1, 10)  # 10 tokens: two whole blocks (0..7) and two tokens of the third
    pool.serve(system + ids(100, 6), response=[5])
    b = pool.serve(system + ids(200, 6), response=[5])
    # 16 tokens: floor (16 - 1) // 4 = 3 blocks; blocks 0 and 1 hit; block 2 (8..11) differs at token 10
    assert (b.hit_tokens, b.recomputed_tokens) == (8, 8)
    assert kinds(b) == [("diverged", 8, 12), ("partial-block", 12, 16)]
    assert "diverged at token 10 (inside block 2)" in b.misses[0].reason
    assert b.hit_blocks == b.blocks[:2] and b.bytes_shared == 2 * pool.page_bytes
    layers, kv, hd = tiny.config.num_layers, tiny.config.num_kv_heads, tiny.config.head_dim
    assert pool.page_bytes == 2 * layers * kv * BS * hd * 4  # keys and values, float32
    check_accounting(b)


def test_divergence_mid_block_stops_the_hit_at_the_block_before(tiny, policy):
    pool = kvexplore.PrefixPool(tiny, num_blocks=16, block_size=BS, policy=policy)
    a = ids(1, 20)
    b = a[:13] + [99] + a[14:]  # token 13 differs: it sits in block 3 (12..15)
    pool.serve(a, response=[5])
    r = pool.serve(b, response=[5])
    assert r.hit_tokens == 12  # blocks 0, 1, 2
    assert kinds(r) == [("diverged", 12, 16), ("partial-block", 16, 20)]
    assert "this request has" in r.misses[0].reason and "(id 99)" in r.misses[0].reason
    assert "(id 14)" in r.misses[0].reason  # request 0's token at 13 was id 14
    check_accounting(r)


def test_multi_turn_hits_through_the_generated_tokens(tiny, policy):
    pool = kvexplore.PrefixPool(tiny, num_blocks=16, block_size=BS, policy=policy)
    p1, r1 = ids(1, 10), ids(150, 5)
    t1 = pool.serve(p1, response=r1)
    # turn 1 wrote its prompt and its answer but the last token: 10 + 4 = 14 positions, 3 whole blocks cached
    assert t1.generated == r1 and len(t1.cached_blocks) == 3
    t2 = pool.serve(p1 + r1 + ids(250, 6), response=[5])
    # 21 tokens, floor 20 // 4 = 5 blocks: 3 blocks hit (12 tokens, through two answer tokens), where the prompt
    # alone (10 tokens) would give 2 blocks
    assert t2.hit_tokens == 12
    assert kinds(t2) == [("partial-block", 12, 20), ("partial-block", 20, 21)]
    assert "request 0 wrote tokens up to position 13 only, inside block 3" in t2.misses[0].reason
    check_accounting(t2)


def test_a_turn_that_ends_on_a_block_boundary_says_its_last_token_was_never_written(tiny, policy):
    pool = kvexplore.PrefixPool(tiny, num_blocks=16, block_size=BS, policy=policy)
    p1, r1 = ids(1, 10), ids(150, 7)  # writes 10 + 6 = 16 positions: exactly 4 blocks
    pool.serve(p1, response=r1)
    t2 = pool.serve(p1 + r1 + ids(250, 6), response=[5])
    assert t2.hit_tokens == 16
    assert kinds(t2)[0] == ("first-seen", 16, 20)
    assert "the last token it generated is never written" in t2.misses[0].reason


STRIP_THINKING = (
    "{% for m in messages %}{% if m['role'] == 'assistant' and not loop.last %}"
    "{% set c = m['content'].split('</think>')[-1] %}{% else %}{% set c = m['content'] %}{% endif %}"
    "<|{{ m['role'] }}|>\n{{ c }}\n{% endfor %}{% if add_generation_prompt %}<|assistant|>\n{% endif %}")
KEEP_THINKING = STRIP_THINKING.replace("split('</think>')[-1]", "split('</think>')[-1] if false else m['content']")


def test_a_template_that_strips_thinking_breaks_the_multi_turn_match(trained, policy):
    turn1 = [{"role": "user", "content": "Tell me about the sea."}]
    answer = "<think>The user wants the sea.</think>The sea is wide."
    turn2 = turn1 + [{"role": "assistant", "content": answer}, {"role": "user", "content": "And the moon?"}]
    # the answer as the turn-2 rendering tokenizes it (encoded alone, its first piece would differ), 11 tokens
    rounds = {}
    for name, template in (("keep", KEEP_THINKING), ("strip", STRIP_THINKING)):
        pool = kvexplore.PrefixPool(trained, num_blocks=64, block_size=BS, policy=policy)
        prompt1 = pool.serve(turn1, max_new_tokens=0, chat_template=template).prompt
        full = pool.serve(turn2, max_new_tokens=0, chat_template=KEEP_THINKING).prompt
        assert full[: len(prompt1)] == prompt1
        pool = kvexplore.PrefixPool(trained, num_blocks=64, block_size=BS, policy=policy)
        t1 = pool.serve(turn1, response=full[len(prompt1): len(prompt1) + 11], chat_template=template)
        rounds[name] = (t1, pool.serve(turn2, response=[5], chat_template=template))
    t1, kept = rounds["keep"]
    # kept thinking: turn 2 renders turn 1's prompt and answer as they were written (10 answer tokens are written,
    # the 11th is never fed), so it hits every whole block of them
    prompt1 = len(t1.prompt)
    assert kept.hit_tokens == (prompt1 + 10) // BS * BS, kept.explain()
    _, stripped = rounds["strip"]
    # stripped: the rendered history differs from the written one from the answer's first token on
    common = next(i for i, (a, b) in enumerate(zip(stripped.prompt, t1.prompt + t1.generated)) if a != b)
    assert common >= prompt1 - 1
    assert stripped.hit_tokens == (common // BS) * BS < kept.hit_tokens
    assert stripped.misses[0].kind == "template", stripped.explain()
    assert f"at token {common}" in stripped.misses[0].reason
    check_accounting(stripped)


def small_pool_sequence(pool):
    a, b, c = ids(1, 9), ids(100, 9), ids(200, 5)
    r = [pool.serve(a, response=[5]), pool.serve(b, response=[5]), pool.serve(c, response=[5]),
         pool.serve(a, response=[5])]
    return r


def test_a_pool_too_small_evicts_by_each_policys_rule(tiny):
    """Six pages of 4. A (9 tokens) takes pages 0, 1, 2 and caches blocks A0, A1 (page 2 holds its ninth token,
    uncached); gone back tail first. With ``reuse="fifo"`` (vLLM before 0.32) the free queue is then 3 4 5 2 1 0; B
    takes 3, 4, 5 the same way: queue 2 1 0 5 4 3. C (5 tokens) needs two pages: the queue's front, page 2 (free),
    then page 1, evicting A1 although page 5 (free, uncached) waits further back. vLLM 0.32's queue (the default)
    puts uncached pages first: 2 3 4 5 1 0 after A, 4 5 1 0 3 2 after B, so C takes 4 and 5 and evicts nothing; the
    radix policy takes free pages first (2, 5) and evicts nothing either. So A again hits 4 tokens under fifo (A0;
    A1 evicted at request 2) and 8 under the others."""
    fifo = small_pool_sequence(kvexplore.PrefixPool(tiny, num_blocks=6, block_size=BS, policy="hash", reuse="fifo"))
    hashed = small_pool_sequence(kvexplore.PrefixPool(tiny, num_blocks=6, block_size=BS, policy="hash"))
    radix = small_pool_sequence(kvexplore.PrefixPool(tiny, num_blocks=6, block_size=BS, policy="radix"))
    assert [r.hit_tokens for r in fifo] == [0, 0, 0, 4]
    assert [r.hit_tokens for r in hashed] == [r.hit_tokens for r in radix] == [0, 0, 0, 8]
    assert [r.evicted for r in fifo] == [0, 0, 1, 1]
    assert [r.evicted for r in hashed] == [r.evicted for r in radix] == [0, 0, 0, 0]
    assert fifo[2].blocks == [2, 1] and hashed[2].blocks == [4, 5] and radix[2].blocks == [2, 5]
    hashed = fifo  # the misses of an eviction, in words
    assert kinds(hashed[3])[0] == ("evicted", 4, 8)
    assert "was cached by request 0, then evicted under pressure at request 2" in hashed[3].misses[0].reason
    assert "(1 block," in hashed[3].explain() and "(4 tokens)" in str(hashed[3].misses[0])
    for r in hashed + radix:
        check_accounting(r)


def test_radix_evicts_the_least_recently_used_leaf_whole(tiny):
    pool = kvexplore.PrefixPool(tiny, num_blocks=6, block_size=BS, policy="radix")
    a, b = ids(1, 9), ids(100, 9)
    pool.serve(a, response=[5]), pool.serve(b, response=[5])
    pool.serve(a, response=[5])  # A used again: B is now the least recently used leaf
    r = pool.serve(ids(200, 13), response=[5])  # 4 pages: 2 free uncached (2, 5), then a whole leaf: B's
    assert r.evicted == 2 and r.hit_tokens == 0
    assert pool.serve(a, response=[5]).hit_tokens == 8
    again = pool.serve(b, response=[5])
    assert again.hit_tokens == 0 and again.misses[0].kind == "evicted"


def test_hash_eviction_can_leave_unreachable_blocks(tiny):
    pool = kvexplore.PrefixPool(tiny, num_blocks=6, block_size=BS, policy="hash")
    pool.serve(ids(1, 9), response=[5])  # pages 0 1 2; queue after: 3 4 5 2 1 0
    pool.serve(ids(100, 21), response=[5])  # 6 pages: takes 3 4 5 2 1 0, evicting A1 (page 1) and A0 (page 0)
    frame = pool.frames()[-1]
    assert {b.slot for b in frame.blocks if b.evicted} == {0, 1}
    assert frame.count(WRITTEN) == 6


def model_state(pool, layer):
    return pool.cache.states.read(layer)


def test_hybrid_model_reuses_state_only_where_it_was_checkpointed(zoo, policy):
    model = zoo.load("qwen3_next")
    a = ids(1, 14)  # "ends": the state is saved at 12 (the prompt's floor, also where its written tokens end)
    results = {}
    for where in ("ends", "blocks"):
        pool = kvexplore.PrefixPool(model, num_blocks=32, block_size=BS, policy=policy, checkpoint_states=where)
        pool.serve(a, response=[5])
        results[where] = (pool.serve(a[:10] + ids(200, 6), response=[5]),  # shares 10: blocks 0, 1 cached
                          pool.serve(a[:13] + ids(150, 2), response=[5]))  # shares 13: blocks 0, 1, 2 cached
        results.setdefault("pool", pool)
    (mid, end), (mid_b, end_b) = results["ends"], results["blocks"]
    assert (mid.hit_tokens, end.hit_tokens) == (0, 12)
    assert kinds(mid)[0] == ("no-state-checkpoint", 0, 8)
    assert "state was saved at no position of this prefix" in mid.misses[0].reason
    assert ("diverged", 8, 12) in kinds(mid)
    assert (mid_b.hit_tokens, end_b.hit_tokens) == (8, 12)
    # the bytes shared: three blocks of the two attention layers, and the two linear-attention layers' state
    pool = results["pool"]
    state = sum(t.nbytes for layer in (0, 2) for t in model_state(pool, layer))
    assert end.bytes_shared == 3 * pool.page_bytes + state


@pytest.mark.parametrize("arch", ["llama", "qwen3_next", "gemma3", "gpt_oss", "gemma4"])
def test_shared_blocks_give_the_logits_of_a_request_computed_from_scratch(zoo, arch, policy):
    """Sliding-window layers (window 8 in the zoo's Gemma 3, gpt-oss and Gemma 4, all shorter than the 30-token
    prompts) are paged like full ones, each query reading its window; Gemma 4's shared layers read their source's.
    Every sliding block stays cached (``retention_interval=None``, vLLM's dense retention) so that the second
    request resumes inside the first one's prompt."""
    model = zoo.load(arch) if arch != "llama" else zoo.load("llama", heads=4, kv_heads=2)
    g = torch.Generator().manual_seed(3)
    a = torch.randint(0, model.config.vocab_size, (30,), generator=g).tolist()
    b = a[:21] + torch.randint(0, model.config.vocab_size, (9,), generator=g).tolist()
    pool = kvexplore.PrefixPool(model, num_blocks=40, block_size=BS, policy=policy, checkpoint_states="blocks",
                                retention_interval=None)
    pool.serve(a, max_new_tokens=4)
    shared = pool.serve(b, max_new_tokens=6, keep_logits=True)
    assert shared.hit_tokens == 20
    # a page: keys and values of every full and sliding layer (shared and linear-attention layers store none)
    assert pool.page_bytes == sum(2 * s.kv_heads * BS * s.head_dim * 4 for s in pool.cache.plan if s.full or s.ring)
    fresh = kvexplore.PrefixPool(model, num_blocks=40, block_size=BS, policy=policy).serve(
        b, max_new_tokens=6, keep_logits=True)
    assert fresh.hit_tokens == 0 and shared.generated == fresh.generated
    torch.testing.assert_close(shared.logits, fresh.logits, atol=1e-5, rtol=0)
    # and against the model over a pre-allocated cache fed the prompt and the answer in one pass (summed in another
    # order than token by token, and the delta rule in chunks of another size): within 1e-4
    cache = kvexplore.make_cache("preallocated", model, max_seq_len=64)
    seq = b + shared.generated[:-1]
    logits = model(torch.tensor([seq]), cache, 0)[0, len(b) - 1:].float()
    torch.testing.assert_close(shared.logits, logits, atol=1e-4, rtol=0)


def test_an_edited_answer_is_not_blamed_on_the_template(trained):
    pool = kvexplore.PrefixPool(trained, num_blocks=64, block_size=BS)
    turn1 = [{"role": "user", "content": "Tell me about the sea."}]
    t1 = pool.serve(turn1, max_new_tokens=12, chat_template=KEEP_THINKING)
    edited = turn1 + [{"role": "assistant", "content": "Something else entirely."},
                      {"role": "user", "content": "And the moon?"}]
    t2 = pool.serve(edited, response=[5], chat_template=KEEP_THINKING)
    assert t2.misses[0].kind == "diverged", t2.explain()
    assert "this conversation's copy of that answer is not the text it generated; edited?" in t2.misses[0].reason
    assert t2.hit_tokens == len(t1.prompt) // BS * BS
