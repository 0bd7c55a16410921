"""Prefill and decode apart on ``torch.distributed`` (gloo, two real processes on the loopback address): the prefill
side computes the prompt and sends its pages, the decode side installs them and continues; the decode side's cache
equals one process's position by position, what crossed is counted, and a layout mismatch (block order, block length,
a hybrid model's layers at another block length) is refused by both sides naming both layouts, before anything is
computed or sent."""

from __future__ import annotations

import math

import pytest
import torch

import kvexplore
from kvexplore.distributed import Disaggregated, PageLayout
from kvexplore.distributed.handoff import check_layouts, from_blocks, to_blocks, tokens_of
from distributed_support import PROMPT, greedy, parallel


@pytest.mark.parametrize("order", ["heads-first", "tokens-first"])
def test_blocks_read_back_with_their_own_layout_are_the_tensor_and_with_the_other_are_not(order):
    x = torch.randn(2, 20, 8)  # (kv_heads, positions, head_dim)
    blocks = to_blocks(x, 16, order)
    assert blocks.shape == ((2, 2, 16, 8) if order == "heads-first" else (2, 16, 2, 8))
    assert torch.equal(from_blocks(blocks, 20, order), x)
    other = "tokens-first" if order == "heads-first" else "heads-first"
    as_other = blocks.reshape((2, 16, 2, 8) if order == "heads-first" else (2, 2, 16, 8))  # the same bytes
    garbled = from_blocks(as_other, 20, other)
    assert garbled.shape == x.shape and not torch.equal(garbled, x)  # another tensor (vLLM #22663)


@pytest.mark.parametrize("sender, receiver, why", [
    (PageLayout("tokens-first", 16), PageLayout("heads-first", 16),
     "the block order differs (tokens-first against heads-first)"),
    (PageLayout("heads-first", 16), PageLayout("heads-first", 8), "the block length of 4 layers differs (layer 0: 16 "
                                                                  "against 8)"),
    (PageLayout("heads-first", 16, {1: 32, 3: 32}), PageLayout("heads-first", 16),
     "the block length of 2 layers differs (layer 1: 32 against 16)"),
])
def test_a_layout_mismatch_is_refused_naming_both_layouts(sender, receiver, why):
    with pytest.raises(kvexplore.SettingsError) as refused:
        check_layouts(sender, receiver, layers=4)
    text = str(refused.value)
    assert f"the prefill side sends {sender.describe()}; the decode side reads {receiver.describe()}: {why}" in text
    check_layouts(sender, sender, layers=4)  # one layout on both sides: nothing to refuse


def test_a_layout_is_checked_when_made():
    with pytest.raises(kvexplore.SettingsError, match="page order 'rows-first' is not one of heads-first"):
        PageLayout("rows-first")
    with pytest.raises(kvexplore.SettingsError, match="a block length is a whole number of positions, 1 or more"):
        PageLayout("heads-first", 0)
    assert PageLayout("tokens-first", 16, {5: 32}).describe() == "tokens-first blocks of 16 (layer 5: blocks of 32)"


@pytest.mark.long  # two rank processes (about 6 s)
@pytest.mark.parametrize("layout", [PageLayout("heads-first", 16), PageLayout("tokens-first", 8)])
def test_the_decode_side_continues_from_the_pages_it_was_sent_as_one_process_would(layout):
    model = kvexplore.load("tiny")
    want = greedy(model, PROMPT, 24, "paged", block_size=layout.block_size)
    with Disaggregated("tiny", layout, layout, max_seq_len=64) as pair:
        assert parallel(pair, PROMPT, 24)[1] == want[1]
        sent, got = pair.handoff, pair.received
        c = model.config
        pages = c.num_layers * 2 * math.ceil(len(PROMPT) / layout.block_size)  # every layer, keys and values
        assert (sent.positions, sent.pages, got.pages) == (len(PROMPT), pages, pages)
        assert sent.bytes == got.bytes == pages * c.num_kv_heads * layout.block_size * c.head_dim * 4
        mine = pair.positions()
        assert len(mine) == c.num_layers
        for layer, (k, v) in enumerate(mine):  # position by position, every layer: one process's paged cache
            want_k, want_v = tokens_of(want[2], layer, want[2].length)
            assert torch.equal(k, want_k) and torch.equal(v, want_v)
        assert f"the prompt's transfer: {len(PROMPT)} positions in {pages} pages" in pair.describe()


@pytest.mark.long  # two rank processes (about 5 s)
def test_a_mismatch_between_the_sides_is_refused_before_anything_is_computed_and_the_pair_goes_on():
    with Disaggregated("tiny", PageLayout("tokens-first", 16), PageLayout("heads-first", 16), max_seq_len=64) as pair:
        with pytest.raises(kvexplore.SettingsError, match=r"every rank refused 'handoff', and each kept its cache as "
                                                          r"it was: SettingsError: the prefill side sends tokens-first "
                                                          r"blocks of 16; the decode side reads heads-first blocks"):
            pair.prefill(PROMPT)
        assert pair.alive and [m["length"] for m in pair.memory()] == [0, 0]
        pair.layouts = (PageLayout("heads-first", 16), PageLayout("heads-first", 16))
        assert pair.prefill(PROMPT).shape == (len(PROMPT), kvexplore.load("tiny").config.vocab_size)


@pytest.mark.long  # two rank processes (about 5 s)
def test_a_decode_side_that_converts_reads_the_senders_layout_whatever_its_own():
    model = kvexplore.load("tiny")
    want = greedy(model, PROMPT, 16)
    with Disaggregated("tiny", PageLayout("tokens-first", 16), PageLayout("heads-first", 8), max_seq_len=64,
                       convert=True) as pair:
        assert parallel(pair, PROMPT, 16)[1] == want[1]
        sent, got = pair.positions("prefill"), pair.positions("decode")
        for (k, v), (k2, v2) in zip(sent, got):
            assert torch.equal(k[:, :len(PROMPT)], k2[:, :len(PROMPT)]) and torch.equal(v[:, :len(PROMPT)],
                                                                                      v2[:, :len(PROMPT)])
