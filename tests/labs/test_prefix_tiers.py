"""Offload tiers under a prefix pool (host memory, then files), and the pool's memory as vLLM's hybrid manager holds it:
blocks keep their bytes across a demotion and a promotion, every move is counted, the events carry each medium, and a
hybrid model's sliding layers keep exactly the blocks a real vLLM 0.32 kept (kvexplore/data/vllm_engine)."""

from __future__ import annotations

import json

import pytest
import torch

import kvexplore
from kvexplore.prefix.events.recorded import FOLDER
from kvexplore.prefix import Offload
from kvexplore.prefix.events import KVEventReplay, read_kv_events
from kvexplore.prefix.events.schema import Removed, Stored
from kvexplore.prefix.events.vllm_hashes import vllm_block_hashes
from kvexplore.prefix.index import block_hashes
from kvexplore.prefix.tiers import NVME_GEN4, PCIE4_X16, page_data

BS = 8
DATA = FOLDER


def _ids(seed: int, n: int = 33) -> list[int]:
    return torch.randint(5, 200, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


@pytest.fixture
def tiered(tiny, tmp_path):
    """A pool of 6 pages over 2 host blocks and 4 disk files; request A (4 full blocks) then B evict A's blocks
    1..3, which go to the host and on to disk."""
    pool = kvexplore.PrefixPool(tiny, num_blocks=6, block_size=BS, reuse="uncached-first",
                                offload=Offload(host_blocks=2, disk_blocks=4, directory=tmp_path / "tier"))
    a = pool.serve(_ids(0), max_new_tokens=2)
    saved = {pool.index.hash_of(p): page_data(pool.pool, p) for p in a.blocks[:4]}
    b = pool.serve(_ids(1), max_new_tokens=2)
    return pool, a, b, saved


def test_an_evicted_block_keeps_its_bytes_down_the_tiers_and_back(tiered, tiny):
    pool, a, b, saved = tiered
    t = pool.tiers
    chain = block_hashes(a.prompt, BS)[:4]
    assert b.evicted == 3 and [t.medium_of(h) for h in chain] == [None, "CPU", "CPU", "STORAGE"]  # the tail went first
    for h in chain[1:]:  # the host's rows and the disk's files hold the very bytes the pages held
        if t.medium_of(h) == "CPU":
            row = next(r for r, blk in t._host.values() if blk.hash == h)
            assert torch.equal(t.host[row], saved[h])
        else:
            assert t.file_of(h).read_bytes() == saved[h].numpy().tobytes()
    again = pool.serve(a.prompt, max_new_tokens=2, keep_logits=True)
    assert again.hit_tokens == 32 and again.hit_tiers == {"GPU": 1, "CPU": 2, "STORAGE": 1}
    for page, h in zip(again.blocks[:4], chain):  # promoted: the same bytes in (new) pages, cached again
        assert pool.index.hash_of(page) == h and torch.equal(page_data(pool.pool, page), saved[h])
    ref = kvexplore.PrefixPool(tiny, num_blocks=16, block_size=BS)
    ref.serve(a.prompt, max_new_tokens=2)
    same = ref.serve(a.prompt, max_new_tokens=2, keep_logits=True)  # all on the device: the same computation
    assert same.hit_tokens == 32 and torch.equal(again.logits, same.logits) and again.generated == same.generated


def test_bytes_and_moves_are_exact_and_time_is_modelled_from_the_named_links(tiered, tiny):
    pool, a, b, _ = tiered
    c = tiny.config
    page = c.num_layers * 2 * c.num_kv_heads * BS * c.head_dim * 4  # every layer's keys and values, float32
    t = pool.tiers
    assert pool.page_bytes == page and t.host_bytes == 2 * page and t.host.nbytes == 2 * page
    assert t.disk_bytes == page * len(list(t.directory.glob("*.kvblock")))
    assert all(f.stat().st_size == page for f in t.directory.glob("*.kvblock"))
    copies = [m for m in b.moves if m.target]
    assert [(m.source, m.target) for m in copies] == [("GPU", "CPU"), ("GPU", "CPU"), ("CPU", "STORAGE"),
                                                      ("GPU", "CPU")]
    assert all(m.nbytes == page for m in copies)
    assert copies[0].seconds == pytest.approx(page / 31.5e9) and copies[2].seconds == pytest.approx(page / 7.45e9)
    assert b.modelled_seconds == pytest.approx(sum(m.seconds for m in copies))
    assert "Samsung 990 PRO" in NVME_GEN4.source and "PCI Express Base Specification 4.0" in PCIE4_X16.source
    assert pool.tier_counts() == {"CPU": {"blocks": 2, "capacity": 2, "bytes": 2 * page},
                                  "STORAGE": {"blocks": 1, "capacity": 4, "bytes": page}}
    frame = pool.frames()[-1]
    assert frame.meta["tiers"] == pool.tier_counts()
    assert any("copied CPU → STORAGE" in n and "µs modelled (NVMe PCIe 4.0 SSD)" in n for n in frame.notes)
    assert "4 block moves" in b.explain() and "modelled" in b.explain()


def test_the_events_carry_each_medium_and_the_reader_draws_every_tier(tiered):
    pool, a, b, _ = tiered
    pool.serve(a.prompt, max_new_tokens=2)
    batches = pool.kv_events()
    media = [(e["type"], e["medium"]) for e in batches[1]["events"]]
    assert media[0] == ("BlockRemoved", "GPU") and media[-1] == ("BlockStored", "GPU")
    assert {("BlockStored", "CPU"), ("BlockStored", "STORAGE"), ("BlockRemoved", "CPU")} <= set(media)
    replay = KVEventReplay()
    for batch in batches:
        replay.feed(batch)
    assert [k[1] for k in replay.caches()] == ["CPU", "GPU", "STORAGE"]
    for medium in ("CPU", "STORAGE"):
        last = replay.frames(medium=medium)[-1]
        held = last.count("held") + last.count("written")
        assert held == len(pool.tiers.blocks(medium))
        # a tier's block whose parent is in the pages or another tier stays reachable (a lookup continues there)
        assert all(n.reachable for n in last.tree if n.state != "evicted")
    disk_notes = [n for f in replay.frames(medium="STORAGE") for n in f.notes if n.startswith("stored")]
    assert any(", a block held in GPU:" in n or ", a block held in CPU:" in n for n in disk_notes), disk_notes
    assert not any("does not hold" in n for n in disk_notes), disk_notes


def test_a_block_dropped_from_the_last_tier_is_a_miss_that_says_so(tiny, tmp_path):
    pool = kvexplore.PrefixPool(tiny, num_blocks=6, block_size=BS, reuse="uncached-first",
                                offload=Offload(host_blocks=1, directory=tmp_path))
    a = pool.serve(_ids(0), max_new_tokens=2)
    pool.serve(_ids(1), max_new_tokens=2)
    again = pool.serve(a.prompt, max_new_tokens=2)
    assert again.hit_tokens == 16 and again.hit_tiers == {"GPU": 1, "CPU": 1}  # blocks 3, 2, then 1 went to the
    # one host row: 3 and 2 were dropped
    assert again.misses[0].kind == "evicted" and "then dropped from the CPU tier at request 1" in again.misses[0].reason


def test_bad_offload_settings_are_refused_naming_the_fix(tiny):
    with pytest.raises(kvexplore.SettingsError, match="neither host_blocks nor disk_blocks"):
        Offload()
    with pytest.raises(kvexplore.SettingsError, match=r"Offload\(host_blocks=...\) is a number of blocks.*-1"):
        Offload(host_blocks=-1)
    with pytest.raises(kvexplore.SettingsError, match="with the hash policy.*policy 'radix'"):
        kvexplore.PrefixPool(tiny, num_blocks=8, block_size=BS, policy="radix", offload=Offload(host_blocks=2))


def _vllm_held(events, group: int) -> set[bytes]:
    held: set[bytes] = set()
    for e in events:
        if isinstance(e, Stored) and e.group == group:
            held.update(e.hashes)
        elif isinstance(e, Removed) and e.group == group:
            held.difference_update(e.hashes)
    return held


@pytest.mark.parametrize("name", ["gemma3-2", "gemma3-4"])
def test_the_sliding_layers_hold_after_each_request_what_vllms_sliding_groups_held(name, zoo):
    """After each request of a recorded Gemma 3 run, the pages whose sliding-window share the pool counts as held are
    the blocks vLLM's five sliding groups held cached (its events), and the pool's memory leaves the others out. vLLM
    publishes a block that the request's last decode steps filled with the next step's batch (request D's block 21
    comes with "A again"'s), so a request may hold blocks its own batch has not told yet; the next batch has them."""
    folder = DATA / name
    run = json.loads((folder / "run.json").read_text())
    replay = read_kv_events(folder / "events.kvev")
    batches = [rec.batch.events for rec in replay.history]
    assert len(batches) == len(run["requests"])  # one batch per request
    sliding = {e.group for events in batches for e in events
               if isinstance(e, Stored) and e.extra.get("kv_cache_spec_kind") == "sliding_window"}
    assert len(sliding) == 5
    answers = [r["tokens"] for r in run["vllm_results"]]
    used = sorted({t for seq in run["requests"] + answers for t in seq})
    rank = {t: i for i, t in enumerate(used)}
    model = zoo.load("gemma3", layers=6, sliding_window=512, max_position_embeddings=2048,
                     vocab_size=max(len(used), 512))
    pool = kvexplore.PrefixPool(model, num_blocks=400, block_size=32, retention_interval=run["retention_interval"],
                                reuse="uncached-first")
    pool.tokenizer = None
    to_vllm: dict[bytes, bytes] = {}
    late = 0
    for k, (ids, answer) in enumerate(zip(run["requests"], answers)):
        written = ids + answer[:-1]
        to_vllm.update(zip(block_hashes([rank[t] for t in written], 32), vllm_block_hashes(written, 32)))
        pool.serve([rank[t] for t in ids], response=[rank[t] for t in answer])
        kept = {to_vllm[pool.index.hash_of(p)] for p in pool.sliding_kept()}
        told = sum(batches[: k + 1], ())
        coming = {h for e in (batches[k + 1] if k + 1 < len(batches) else ()) if isinstance(e, Stored)
                  for h in e.hashes}
        for g in sliding:
            held = _vllm_held(told, g)
            assert held <= kept and kept - held <= coming, (k, g)
        late += len(kept - _vllm_held(told, min(sliding)))
        mem = pool.memory()
        assert mem["vllm"] == (mem["pages"] // pool.page_bytes) * mem["full_share"] + len(kept) * mem["sliding_share"]
    assert all(_vllm_held(sum(batches, ()), g) == kept for g in sliding)  # at the end, every batch told
    assert late == (1 if name == "gemma3-4" else 0)
    # interval 0 frees most sliding shares; 1,024 keeps a tail of 16 in every 32 blocks, and these requests' blocks
    # all fall in kept tails or before where a request resumed
    expected = (10, True) if name == "gemma3-2" else (0, False)
    assert (mem["sliding_freed_blocks"], mem["vllm"] < mem["pages"]) == expected
