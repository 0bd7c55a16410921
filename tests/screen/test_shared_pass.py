"""The explorer's lanes share one prefill pass where their caches read back exactly what they were given
(kvexplore.explorer.shared_pass): every lane then holds, records and draws what its own pass would have given, bit for
bit; a cache that reads back anything else (a quantized cache) or asks for more (a recurrent state) computes its own."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from kvexplore.explorer import shared_pass
from kvexplore.explorer.session import Session

PROMPT = ("Call me Ishmael. Some years ago, never mind how long precisely, having little or no money in my purse, and "
          "nothing particular to interest me on shore, I thought I would sail about a little and see the watery part "
          "of the world.")
STRATEGIES = ("preallocated", "concat", "paged", "none", "quantized", "sink", "evict", "evict@snap")
OPTIONS = {"paged": {"block_size": 8}, "sink": {"window": 16, "sinks": 2},
           "evict": {"press": "knorm", "compression_ratio": 0.5},
           "evict@snap": {"press": "snapkv", "press_options": {"window": 8}, "decode_every": 4}}


def _alone(monkeypatch):
    """Every lane computes its own pass (what the explorer did before passes were shared)."""
    def record(generator, prompt, force, source):
        generator.prefill(prompt, force=force)
        return shared_pass.Pass(source=source)  # not shareable: nothing was recorded

    monkeypatch.setattr(shared_pass, "record", record)


def _same(a, b, path="") -> None:
    """``a`` and ``b`` equal in every tensor, array and value (NaN equal to NaN), named by ``path`` where not."""
    if isinstance(a, torch.Tensor):
        assert (isinstance(b, torch.Tensor) and a.shape == b.shape
                and torch.equal(a.nan_to_num(-7), b.nan_to_num(-7))), path
    elif isinstance(a, np.ndarray):
        assert a.shape == b.shape and np.array_equal(a, b, equal_nan=a.dtype.kind == "f"), path
    elif isinstance(a, dict):
        assert a.keys() == b.keys(), path
        for k in a:
            _same(a[k], b[k], f"{path}[{k!r}]")
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b), path
        for i, (x, y) in enumerate(zip(a, b)):
            _same(x, y, f"{path}[{i}]")
    else:
        assert a == b, path


def _state(session: Session) -> dict:
    """What each lane holds, recorded and will draw after its prefill and two steps (the pointers of its reads and
    the times left out: those differ between any two runs)."""
    out = {}
    for name, lane in session.lanes.items():
        cache, store = lane.cache, lane.tracer.history
        out[name] = {
            "tokens": lane.generator.tokens,
            "records": [(r.token_id, r.prob, [(c.token_id, c.prob) for c in r.top], r.cache_length, r.memory.held,
                         r.memory.written_bytes, r.memory.reserved_bytes, r.memory.allocated_bytes)
                        for r in lane.history],
            "events": [[(e.layer, e.write, e.read, e.read_shape, e.view) for e in r.trace.events]
                       for r in lane.history],
            "slots": [[(s.positions, s.states) for s in r.trace.layer_slots] for r in lane.history],
            "reads": [[list(r.trace.reads_of(i)) for i in range(cache.config.num_layers)] for r in lane.history],
            "storage": [[t.clone() for t in cache.inspect.storage(i)] for i in range(cache.config.num_layers)],
            "norms": lane.tracer.norms, "logprobs": lane.tracer.last_logprobs,
            "store": {k: v for k, v in vars(store).items()
                      if isinstance(v, (torch.Tensor, np.ndarray, dict, list, int))},
            "attention": [r.trace.attention_raw(0) for r in lane.history if r.trace.has_attention(0)],
            "kl": lane.kl_at, "top1": lane.top1_at,
        }
    return out


def _run(model, strategies, options, prompt=PROMPT):
    session = Session(model, strategies, max_seq_len=96, strategy_options=options)
    session.prefill(prompt)
    shared = {name: lane.shared_pass for name, lane in session.lanes.items()}
    for _ in range(2):
        session.step()
    return session, shared


def test_lanes_that_share_the_prefill_pass_hold_record_and_draw_what_their_own_pass_gives(trained, monkeypatch):
    shared_session, shared = _run(trained, STRATEGIES, OPTIONS)
    # the quantized cache's prefill reads the keys as computed (it quantizes what it stores); a sink cache whose ring
    # is shorter than the prompt reads a window of it: it computes its own pass
    assert shared == {"preallocated": None, "concat": "preallocated", "paged": "preallocated", "none": "preallocated",
                      "quantized": "preallocated", "sink": None, "evict": "preallocated", "evict@snap": "preallocated"}
    with monkeypatch.context() as m:
        _alone(m)
        alone_session, alone = _run(trained, STRATEGIES, OPTIONS)
    assert set(alone.values()) == {None}
    _same(_state(shared_session), _state(alone_session))
    # a lane's time is the shared pass's and its own cache's work, never less than the pass it shares
    ref = shared_session.lanes["preallocated"].history[0].forward_s
    assert all(shared_session.lanes[n].history[0].forward_s >= ref for n, s in shared.items() if s)


def test_a_reference_that_reads_a_window_computes_alone_and_the_next_lane_records_the_pass(trained):
    session, shared = _run(trained, ("sink", "preallocated", "paged"),
                           {"paged": {"block_size": 8}, "sink": {"window": 16}})
    assert shared == {"sink": None, "preallocated": None, "paged": "preallocated"}


def test_sliding_layers_longer_than_their_window_share_the_pass(zoo, monkeypatch):
    model = zoo.load("gemma3", layers=3, sliding_window=8, layer_types=["sliding_attention", "sliding_attention",
                                                                         "full_attention"])
    strategies, options = ("preallocated", "paged", "sink"), {"paged": {"block_size": 8}, "sink": {"window": 64}}
    prompt = list(range(5, 45))  # 40 positions: five windows
    session, shared = _run(model, strategies, options, prompt)
    assert shared == {"preallocated": None, "paged": "preallocated", "sink": "preallocated"}
    with monkeypatch.context() as m:
        _alone(m)
        alone, _ = _run(model, strategies, options, prompt)
    _same(_state(session), _state(alone))


def test_a_lane_whose_cache_reads_back_other_keys_is_rolled_back_and_computes_its_own(trained, monkeypatch):
    from kvexplore.caches.strategies.paged import PagedCache

    write = PagedCache.write

    def off_by_a_little(self, layer, pos, k, v, queries=None):
        k_all, v_all = write(self, layer, pos, k, v, queries)
        return (k_all + 1e-3, v_all) if layer == 1 else (k_all, v_all)

    monkeypatch.setattr(PagedCache, "write", off_by_a_little)
    session, shared = _run(trained, ("preallocated", "paged"), {"paged": {"block_size": 8}})
    assert shared == {"preallocated": None, "paged": None}
    assert session.lanes["paged"].cache.length == len(session.tokens) - 1
    assert session.lanes["paged"].history[0].step == 0 and len(session.lanes["paged"].history) == 3


def test_a_failure_in_a_reusing_lane_is_raised_and_leaves_every_lane_empty(trained, monkeypatch):
    session = Session(trained, ("preallocated", "concat"), max_seq_len=96)
    real = shared_pass.Reusing.__call__

    def failing(self, *args, **kw):
        raise MemoryError("no room for the second lane")

    monkeypatch.setattr(shared_pass.Reusing, "__call__", failing)
    with pytest.raises(MemoryError):
        session.prefill(PROMPT)
    assert list(session.lanes) == ["preallocated", "concat"]
    assert all(not lane.generator.tokens and lane.cache.length == 0 for lane in session.lanes.values())
    monkeypatch.setattr(shared_pass.Reusing, "__call__", real)
    session.prefill(PROMPT)
    assert session.lanes["concat"].shared_pass == "preallocated"
