"""Quality of a compressed cache against the full one (kvexplore.compression.quality) and answers after compression
(kvexplore.compression.passkey): the trained tiny model, plus one check on the real SmolLM2."""

from pathlib import Path

import pytest
import torch

import kvexplore
from kvexplore.errors import SettingsError
from kvexplore.compression.quality import (compression_quality, full_cache, full_reference, kept_context,
                                           largest_write)
from kvexplore.compression.passkey import NEEDLE, QUESTION, haystack, passkey, token_span, two_questions

TEXT = (Path(kvexplore.__file__).parent / "data" / "texts" / "moby_dick_chapter_4.txt").read_text()


@pytest.fixture(scope="module")
def text_ids(trained):
    ids = trained.tokenizer.encode(TEXT)
    return ids[:240], ids[240:272]


@pytest.fixture(scope="module")
def reference(trained, text_ids):
    return full_reference(trained, *text_ids)


def evict(press="snapkv", ratio=0.5, **options):
    return lambda m, n: kvexplore.make_cache("evict", m, max_seq_len=n, press=press, compression_ratio=ratio,
                                             **options)


def test_full_cache_against_itself_is_exact(trained, text_ids, reference):
    for factory in (full_cache, evict(ratio=0.0), evict("knorm", ratio=0.0)):
        q = compression_quality(trained, *text_ids, factory, reference)
        assert q.kl_mean == 0 and max(q.kl) == 0 and len(q.kl) == len(text_ids[1])
        assert q.top1 == 1.0 and q.perplexity == pytest.approx(q.full_perplexity, rel=1e-6)
        assert set(q.attention_mass) == set(range(trained.config.num_layers))
        assert all(m == pytest.approx(1.0, abs=1e-6) for m in q.attention_mass.values())
        assert not q.stepwise


def test_quality_falls_as_the_press_keeps_less(trained, text_ids, reference):
    ctx, cont = text_ids
    rows = [compression_quality(trained, ctx, cont, evict("snapkv", r), reference) for r in (0.25, 0.5, 0.9)]
    kl = [q.kl_mean for q in rows]
    mass = [q.attention_mass_mean for q in rows]
    assert 0 < kl[0] < kl[1] < kl[2] and 1 > mass[0] > mass[1] > mass[2] > 0
    assert rows[-1].top1 < 1.0
    per_position = kvexplore.kv_bytes(trained.config, 1)
    for r, q in zip((0.25, 0.5, 0.9), rows):  # the compact storage holds the kept context and the continuation
        assert q.used_bytes == (int(len(ctx) * (1 - r)) + len(cont) - 1) * per_position
        assert q.full_used_bytes == (len(ctx) + len(cont) - 1) * per_position
        assert q.used_fraction == q.used_bytes / q.full_used_bytes


def test_attention_mass_of_a_sink_cache_by_hand(trained, text_ids, reference):
    """The sink cache evicts as the continuation is fed (token by token, so what each query read is seen): query t
    reads the sinks and the last ``window`` positions; the share is recomputed here from those sets, not from the
    cache."""
    ctx, cont = text_ids
    sinks, window = 4, 100
    q = compression_quality(trained, ctx, cont, lambda m, n: kvexplore.make_cache("sink", m, sinks=sinks,
                                                                                  window=window), reference)
    assert q.stepwise and 0 < q.kl_mean and q.attention_mass_mean < 1
    C = len(ctx)
    for layer, share in q.attention_mass.items():
        a = reference.mass[layer]  # (kv_heads, rows, C)
        kept = torch.zeros_like(a, dtype=torch.bool)
        for t in range(a.shape[1]):  # row t: the query of position C + t reads positions C + t - window + 1 ...
            kept[:, t, :sinks] = True
            kept[:, t, max(sinks, C + t - window + 1):] = True
        assert share == pytest.approx(float((a * kept).sum() / a.sum()), abs=1e-6)


def test_decode_time_eviction_feeds_token_by_token(trained, text_ids, reference):
    ctx, cont = text_ids
    q = compression_quality(trained, ctx, cont, evict("knorm", 0.5, decode_every=8), reference)
    once = compression_quality(trained, ctx, cont, evict("knorm", 0.5), reference)
    assert q.stepwise and not once.stepwise
    assert q.attention_mass_mean < once.attention_mass_mean  # presses while decoding drop more of the context
    cache = kvexplore.make_cache("sink", trained, sinks=4, window=60)
    assert largest_write(cache, 0, 200) == 200  # a sink cache takes writes that evict (each query masked)


def test_kept_context_is_the_kept_positions(trained, text_ids):
    ctx, _ = text_ids
    cache = evict("knorm", 0.5)(trained, len(ctx) + 4)
    trained(torch.tensor([ctx]), cache, 0)
    mask = kept_context(cache, 2, len(ctx))
    assert mask.shape == (trained.config.num_kv_heads, len(ctx))
    assert [torch.nonzero(row).flatten().tolist() for row in mask] == cache.eviction.kept_positions(2)


def test_bad_input_is_refused(trained, text_ids, reference):
    ctx, cont = text_ids
    with pytest.raises(SettingsError, match="continuation needs at least 2 tokens"):
        compression_quality(trained, ctx, cont[:1], full_cache)
    with pytest.raises(SettingsError, match="list of token ids"):
        compression_quality(trained, "some text", cont, full_cache)
    with pytest.raises(SettingsError, match="outside the vocabulary"):
        compression_quality(trained, [0, 10 ** 6], cont, full_cache)
    with pytest.raises(SettingsError, match="factory must be a function"):
        compression_quality(trained, ctx, cont, "evict")
    with pytest.raises(SettingsError, match="reference was run on 240 context"):
        compression_quality(trained, ctx[:100], cont, full_cache, reference)
    with pytest.raises(SettingsError, match="not a kvexplore cache"):
        compression_quality(trained, ctx, cont, lambda m, n: object(), reference)
    tok = trained.tokenizer
    with pytest.raises(SettingsError, match="depth must be a fraction"):
        haystack(tok, 256, 1.5)
    with pytest.raises(SettingsError, match="too short for the intro and the needle"):
        haystack(tok, 20, 0.5)
    with pytest.raises(SettingsError, match="key must be digits"):
        haystack(tok, 256, 0.5, key="abc")
    with pytest.raises(SettingsError, match="not in the context"):
        token_span(tok, "The sea was calm.", "a whale")


@pytest.mark.parametrize("depth", [0.0, 0.25, 0.5, 0.75, 1.0])
def test_haystack_puts_the_key_at_its_depth(trained, depth):
    tok = trained.tokenizer
    hay = haystack(tok, 400, depth, seed=3)
    needle = tok.encode(NEEDLE.format(key=hay.key))
    start, end = hay.needle
    assert hay.ids[start:end] == needle and len(hay.key) == 5 and hay.key.isdigit()
    longest = max(len(tok.encode(" " + s)) for s in ("The grass is green.", "The sky is blue.",
                                                      "There and back again.", "Here we go.", "The sun is yellow."))
    assert 400 - longest < len(hay.ids) <= 400
    assert abs(start - depth * (len(hay.ids) - len(needle))) <= max(longest, 40)
    assert hay.question == tok.encode(QUESTION)
    assert haystack(tok, 400, depth, key="12345").needle[1] - haystack(tok, 400, depth, key="12345").needle[0] == \
        len(tok.encode(NEEDLE.format(key="12345")))


def test_passkey_answer_and_needle_coverage(trained):
    hay = haystack(trained.tokenizer, 200, 0.5)
    full = passkey(trained, hay)
    assert full.coverage["needle"] == 1.0 and full.passed == (hay.key in "".join(filter(str.isdigit, full.text)))
    streaming = passkey(trained, hay, evict("streaming", 0.8), question_in_context=False)
    assert streaming.coverage["needle"] < 1.0  # sinks and the recent end only: the needle in the middle is gone


def test_two_questions(trained):
    context = " ".join(TEXT.split(" ")[:150])
    words = TEXT.split(" ")
    facts = [(" Q: what?", words[5] + " " + words[6], "Zq"),
             (" Q: who?", " ".join(words[140:143]), words[141])]
    rows = two_questions(trained, context, facts, press="knorm", compression_ratio=0.6, max_new_tokens=3)
    assert [r.mode for r in rows] == ["full", "once", "per question"] * 2
    assert set(rows[0].answer.coverage) == {facts[0][1], facts[1][1], words[141]}  # the answer's tokens too
    assert all(v == 1.0 for r in rows if r.mode == "full" for v in r.answer.coverage.values())
    once = [r.answer.coverage for r in rows if r.mode == "once"]
    assert once[0] == once[1] and any(v < 1 for v in once[0].values())  # compressed once, for both questions
    tok = trained.tokenizer
    ids = tok.encode(context)
    for _, fact, _ in facts:
        start, end = token_span(tok, context, fact)
        assert fact.strip() in tok.decode(ids[start:end]) and fact.strip() not in tok.decode(ids[start + 1:end])


@pytest.mark.smollm2
def test_smollm2_finds_the_pass_key_uncompressed_and_loses_it_compressed():
    model = kvexplore.load("smollm2-135m")
    hay = haystack(model.tokenizer, 512, 0.5, key="73914")
    assert passkey(model, hay).passed
    lost = passkey(model, hay, evict("streaming", 0.9))
    assert not lost.passed and lost.coverage["needle"] == 0.0
