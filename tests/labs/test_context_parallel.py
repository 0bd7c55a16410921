"""Context parallel decoding on ``torch.distributed`` (gloo, real processes on the loopback address): position ``p``
on rank ``(p // interleave) % cp``, each rank attending over what it holds and the shares merged by log-sum-exp; the
same greedy tokens as one process and the logits within 1e-5 of their range, each rank holding exactly its positions
and their bytes, sliding layers reading their window on every rank."""

from __future__ import annotations

import pytest
import torch

import kvexplore
from kvexplore.caches.memory import kv_bytes
from kvexplore.distributed import ContextParallel, Layout
from distributed_support import PROMPT, assert_same_run, greedy, parallel


@pytest.mark.parametrize("cp, interleave, rank, first", [
    (2, 1, 0, [0, 2, 4, 6]), (2, 1, 1, [1, 3, 5, 7]), (3, 16, 1, list(range(16, 32)) + [64, 65]),
    (3, 16, 2, list(range(32, 48)) + [80]),
])
def test_the_layout_puts_runs_of_interleave_positions_on_the_ranks_in_turn(cp, interleave, rank, first):
    layout = Layout(cp, interleave, rank)
    assert layout.positions(0, 100)[:len(first)] == first
    assert all(layout.held_before(n) == len(layout.positions(0, n)) for n in range(0, 200, 7))
    assert sum(Layout(cp, interleave, r).held_before(1000) for r in range(cp)) == 1000


def test_a_layout_or_model_the_merge_cannot_take_is_refused_before_any_process_starts():
    with pytest.raises(kvexplore.SettingsError, match="cp must be a whole number of ranks, 1 or more, got 0"):
        ContextParallel("tiny", 0)
    with pytest.raises(kvexplore.SettingsError, match="interleave must be a whole number of positions"):
        ContextParallel("tiny", 2, interleave=0)


@pytest.mark.long  # 2 and 3 rank processes, 48 steps each (about 15 s)
@pytest.mark.parametrize("cp, interleave", [(2, 1), (3, 1), (2, 16), (3, 16)])
def test_context_parallel_tiny_gives_one_process_tokens_and_each_rank_its_positions(cp, interleave):
    model = kvexplore.load("tiny")
    length = len(PROMPT) + 48
    want = greedy(model, PROMPT, 48)
    with ContextParallel("tiny", cp, interleave=interleave, max_seq_len=length) as ranks:
        assert_same_run(parallel(ranks, PROMPT, 48), want)
        memory = ranks.memory()
        for rank, m in enumerate(memory):
            layout = Layout(cp, interleave, rank)
            assert m["positions"] == layout.positions(0, length - 1)  # the last token is chosen, not yet written
            assert m["held_bytes"] == m["reachable_bytes"] == kv_bytes(model.config, layout.held_before(length))
        assert sum(m["held_bytes"] for m in memory) == want[2].inspect.memory_report().held_bytes
        assert ranks.traffic[0].calls == 2 * model.config.num_layers * 48  # an output and its lse, every layer


@pytest.mark.long  # a zoo Gemma 3 over real processes (about 6 s)
def test_sliding_layers_read_their_window_on_every_rank(zoo):
    folder, _ = zoo.checkpoint("gemma3", layers=4, heads=4, kv_heads=1, sliding_window=6)
    model = kvexplore.load(folder)
    prompt = [t % 300 for t in PROMPT[:12]]  # longer than the window: the sliding layers drop keys
    want = greedy(model, prompt, 24)
    with ContextParallel(str(folder), 3, interleave=2, max_seq_len=36) as ranks:
        assert_same_run(parallel(ranks, prompt, 24), want)


def test_the_merge_is_attention_over_every_key():
    """The log-sum-exp merge of shares, worked by hand on random scores: equal to one softmax over all keys."""
    torch.manual_seed(0)
    scores, values = torch.randn(5, 12), torch.randn(12, 8)
    want = torch.softmax(scores, -1) @ values
    parts = [torch.arange(12)[r::3] for r in range(3)]
    outs = [torch.softmax(scores[:, p], -1) @ values[p] for p in parts]
    lses = torch.stack([torch.logsumexp(scores[:, p], -1, keepdim=True) for p in parts])
    share = torch.exp(lses - lses.amax(0))
    torch.testing.assert_close((share * torch.stack(outs)).sum(0) / share.sum(0), want)
