"""What a pressed ``evict`` cache holds and reads: the bytes of the compacting and the masking storage, the slot
views of each layer and head, the key each column of attention read, a batch of two pressed as each sequence alone,
and a press while decoding that fills the evicted slots in place."""

from __future__ import annotations

import pytest
import torch

from evict_reference import Recorder
from evict_support import OPTS, evict, tokens
from evict_support import models  # noqa: F401  (the fixture)


# -- bytes -----------------------------------------------------------------------------------------------------------

def test_compact_storage_holds_the_kept_positions_plus_the_stated_headroom(models):
    """Per pressed layer: reserved bytes = (kept positions over heads + overhead slots) x bytes per position and
    head, the overhead being ``headroom`` slots per head plus the padding of heads that keep fewer than the most;
    the memory report's used and analytic bytes = kept positions over heads x bytes per position and head."""
    model = models("mha")
    n, headroom = 30, 5
    ids = tokens(n + 3, seed=8)
    cache = evict(model, compression_ratio=0.5, heads="adaptive", headroom=headroom)
    before = evict(model, compression_ratio=0.0, headroom=headroom)
    model(ids[:, :n], before, 0)
    model(ids[:, :n], cache, 0)
    hd = model.config.head_dim
    per = 2 * hd * 4  # key + value, float32, one position of one head
    report = cache.inspect.memory_report()
    assert report.freed_bytes > 0
    for l in cache.full_layers:
        counts = [len(p) for p in cache.eviction.kept_positions(l)]
        assert sum(counts) == 4 * 15 and len(set(counts)) > 1
        k, v = cache.inspect.storage(l)
        assert k.shape[2] == v.shape[2] == max(counts) + headroom  # the storage really shrank ...
        assert before.inspect.storage(l)[0].shape[2] == n + headroom  # ... from what the unpressed prompt needs
        overhead = 4 * (max(counts) + headroom) - sum(counts)
        assert cache.eviction.overhead_slots(l) == overhead
        assert cache.layers[l].memory(cache.length).reserved_bytes == (sum(counts) + overhead) * per
        mem = report.layers[l]
        assert mem.logical_bytes == mem.analytic_bytes == sum(counts) * per
    kept = cache.eviction.kept_positions
    assert report.analytic_bytes == sum(len(p) for l in cache.full_layers for p in kept(l)) * per
    layers = [cache.layers[l].memory(cache.length) for l in cache.full_layers]
    assert cache.inspect.reserved_bytes == sum(m.reserved_bytes for m in layers)
    slots = cache.inspect.storage(0)[0].shape[2]
    for p in range(n, n + 3):  # decoding writes in place while the headroom lasts
        model(ids[:, p:p + 1], cache, p)
        assert cache.inspect.storage(0)[0].shape[2] == slots
        assert cache.inspect.memory_report().allocations == 0


def test_mask_storage_keeps_every_slot_and_frees_nothing(models):
    model = models("gqa2")
    ids = tokens(20, seed=9)
    cache = evict(model, compression_ratio=0.5, storage="mask", max_seq_len=48)
    model(ids, cache, 0)
    per = 2 * model.config.head_dim * 4
    report = cache.inspect.memory_report()
    assert report.freed_bytes == 0
    for l in cache.full_layers:
        assert cache.inspect.storage(l)[0].shape[2] == 48
        assert cache.layers[l].memory(cache.length).reserved_bytes == 48 * 2 * per
        assert cache.eviction.overhead_slots(l) == 2 * 48 - 2 * 10
        assert report.layers[l].logical_bytes == 2 * 10 * per  # what it attends to, not what it holds
    assert cache.inspect.reserved_bytes == 2 * 48 * 2 * per


# -- batches, views and reads ----------------------------------------------------------------------------------------

@pytest.mark.parametrize("storage,press", [("compact", "snapkv"), ("mask", "snapkv"), ("compact", "tova"),
                                           ("compact", "h2o")])
def test_a_batch_of_two_is_pressed_as_each_sequence_alone(models, storage, press):
    """Adaptive budgets, re-rotation and presses while decoding: each sequence's kept sets, rotations and logits as
    if it ran alone (the rows of a compact storage hold different counts per head)."""
    model = models("gqa2")
    ids = torch.cat([tokens(24, seed=17), tokens(24, seed=18)])
    options = dict(press=press, press_options=OPTS.get(press), heads="adaptive", positions="rerotate",
                   storage=storage, decode_every=3, headroom=2)
    both = evict(model, batch_size=2, **options)
    got = torch.cat([model(ids[:, :14], both, 0), *(model(ids[:, p:p + 1], both, p) for p in range(14, 24))], 1)
    for b in range(2):
        alone = evict(model, **options)
        want = torch.cat([model(ids[b:b + 1, :14], alone, 0),
                          *(model(ids[b:b + 1, p:p + 1], alone, p) for p in range(14, 24))], 1)
        assert (got[b] - want[0]).abs().max() < 1e-4
        for l in alone.full_layers:
            assert both.eviction.kept_positions(l, batch=b) == alone.eviction.kept_positions(l)
            assert both.eviction.rope_positions(l, batch=b) == alone.eviction.rope_positions(l)
    assert both.eviction.kept_positions(0, batch=0) != both.eviction.kept_positions(0, batch=1)

@pytest.mark.parametrize("storage", ["compact", "mask"])
def test_the_slot_views_show_each_layers_and_heads_own_kept_positions(models, storage):
    """What the cache map draws: every pressed layer's own slots (the layers keep different positions), each head's
    own, evicted slots shown as such in the masking storage."""
    model = models("gqa2")
    ids = tokens(20, seed=26)
    cache = evict(model, compression_ratio=0.5, storage=storage)
    model(ids, cache, 0)
    assert cache.eviction.kept_positions(0) != cache.eviction.kept_positions(1)
    views = cache.inspect.slot_views()
    for l in cache.full_layers:
        assert views[l] == cache.inspect.slot_view(l)  # head 0
        for h, kept in enumerate(cache.eviction.kept_positions(l)):
            view = cache.layers[l].positions(cache.length).slots(h)
            assert sorted(p for p, st in zip(view.positions, view.states) if st == "filled") == kept
            evicted = view.states.count("evicted")
            assert evicted == (20 - len(kept) if storage == "mask" else 0)


class ReadRecorder(Recorder):
    """Also the keys each layer's attention read (the last pass's)."""

    def __init__(self) -> None:
        super().__init__()
        self.read: dict[int, torch.Tensor] = {}

    def hook(self, name: str, t: torch.Tensor):
        if name.endswith("attn.cache_read"):
            self.read[int(name.split(".")[1])] = t[0].detach().clone()
        return super().hook(name, t)


@pytest.mark.parametrize("storage", ["compact", "mask"])
def test_read_positions_name_the_key_in_every_column_attention_read(models, storage):
    """Per layer and head, the position in each key column the last step read (a press after the step moved the
    slots since): the column holds that position's key; -1 only where the head holds nothing."""
    model = models("gqa2")
    ids = tokens(24, seed=27)
    cache = evict(model, heads="adaptive", storage=storage, decode_every=2)
    rec = ReadRecorder()
    model(ids[:, :16], cache, 0, tracer=rec)
    for p in range(16, 24):
        model(ids[:, p:p + 1], cache, p, tracer=rec)
        assert len(cache.eviction.press_events) == 1 + (p - 15) // 2
        for l in cache.full_layers:
            by_head, read, keys = cache.eviction.read_positions_by_head(l), rec.read[l], rec.keys(l)
            assert cache.inspect.read_positions(l) == by_head[0] and all(len(h) == read.shape[1] for h in by_head)
            for h, positions in enumerate(by_head):
                held = [j for j, q in enumerate(positions) if q >= 0]
                assert torch.equal(read[h, held], keys[h, [positions[j] for j in held]])
                if storage == "compact":
                    assert held == list(range(len(held)))  # the padding after a head's own slots
                else:
                    assert positions == list(range(p + 1))
    reads = {cache.inspect.read_group(l) for l in cache.full_layers}
    assert len(reads) == len(cache.full_layers)  # each layer's own (a tracer keeps one list per group)


# -- in place --------------------------------------------------------------------------------------------------------

def test_a_press_while_decoding_fills_the_evicted_slots_in_place_and_rolls_back_exactly(trained):
    """A press while decoding on storage already of its size moves only the kept slots past the new count into the
    evicted ones (no new storage, a few slots copied); a rollback of that step puts every slot back."""
    c = evict(trained, press="h2o", compression_ratio=0.5, decode_every=4)  # evicts old slots, not only new ones
    ids = tokens(30)
    trained(ids[:, :20], c, 0)
    for p in range(20, 23):
        trained(ids[:, p:p + 1], c, p)
    layer = c.layers[0]
    before, storage = c.clone(), layer.k.data_ptr()
    logits = trained(ids[:, 23:24], c, 23, keep_undo=True)  # the fourth token: a press back to 10 per head
    assert [e.reason for e in c.eviction.press_events][-1] == "decode" and layer.k.data_ptr() == storage
    assert all(len(h) == 10 for h in c.eviction.kept_positions(0))
    per_slot = 2 * trained.config.head_dim * 4
    most = 4 * trained.config.num_kv_heads * per_slot * trained.config.num_layers
    assert 0 < c.inspect.memory_report().copied_bytes <= most
    assert c.inspect.memory_report().allocated_bytes == 0
    c.rollback()
    for i in c.full_layers:
        assert c.eviction.kept_positions(i) == before.eviction.kept_positions(i)
        got, want = c.layers[i].held_slots(), before.layers[i].held_slots()
        for g, w in zip(got, want):
            assert torch.equal(g, w)
    again = trained(ids[:, 23:24], c, 23)
    assert torch.equal(again, logits)
