"""Prefill and decode apart: the decode side must read the pages it is sent as the prefill side laid them out, layer
by layer; the handoff check compares the decode side's keys and values, position by position, with the prefill
side's. Both bugs run two real processes (:class:`~kvexplore.distributed.Disaggregated`), each planted as a pair
whose decode side reads the bytes its own way (a subclass naming a planted reading)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from ..distributed.handoff import PageLayout
from ..errors import SettingsError
from ..distributed.ranks import Disaggregated
from .catalog import Bug, register
from .runs import Run, text_ids

TEXT = ("Call me Ishmael. Some years ago, never mind how long precisely, having little or no money in my purse, I "
        "thought I would sail about a little and see the watery part of the world")
STEPS = 8


def own_order(sender: PageLayout, receiver: PageLayout, layers: int, convert: bool):
    """The planted reading of ``pd-order-assumed``: no handshake, the bytes read in the decode side's own order."""
    return lambda layer: (receiver.order, sender.block(layer))


def first_block_length(sender: PageLayout, receiver: PageLayout, layers: int, convert: bool):
    """The planted reading of ``pd-one-block-length``: every layer read with the first layer's block length."""
    return lambda layer: (sender.order, sender.block(0))


class OwnOrderPair(Disaggregated):
    reading = f"{__name__}:own_order"


class OneBlockLengthPair(Disaggregated):
    reading = f"{__name__}:first_block_length"


@dataclass
class HandoffReport:
    """The handoff check: the first layer and position where the decode side's keys or values differ from what the
    prefill side computed (``step`` 0: the prompt's transfer), or none."""

    diverged: bool
    layer: int | None = None
    position: int | None = None
    what: str | None = None
    step: int | None = None
    hint: str = ""
    max_diff: float = 0.0

    def summary(self) -> str:
        if not self.diverged:
            return "the decode side holds every position as the prefill side computed it (every layer, keys and values)"
        return (f"first divergence at the prompt's transfer, layer {self.layer}, position {self.position}: the decode "
                f"side's {self.what} differ from the prefill side's by up to {self.max_diff:.3g}. {self.hint}")


def compare(sent: list, got: list) -> HandoffReport:
    for layer, (a, b) in enumerate(zip(sent, got)):
        for what, x, y in (("keys", a[0], b[0]), ("values", a[1], b[1])):
            differ = (x != y).any(dim=-1).any(dim=0).nonzero()
            if len(differ):
                return HandoffReport(True, layer, int(differ[0]), what, 0, max_diff=float((x - y).abs().max()),
                                     hint="the decode side read the transferred blocks with another layout than the "
                                          "prefill side wrote them in: exchange the layouts and read the sender's")
    return HandoffReport(False)


def _no_records():
    raise SettingsError("a run of two rank processes keeps no step records, so it has no replay page yet: run "
                        "kvexplore bugs run NAME without --html (the handoff check names the layer and position)")


def scenario(pair: type, prefill: PageLayout, decode: PageLayout):
    """``run`` and ``check`` of a handoff bug: the pair of ``pair`` (planted) or kvexplore's (fixed: the decode side
    reads the sender's layout, converting where it differs) on these layouts."""

    def make(model: Any, planted: bool) -> Disaggregated:
        cls = pair if planted else Disaggregated
        return cls(model.source, prefill, decode, max_seq_len=96, convert=not planted)

    checked: dict[tuple[int, bool], HandoffReport] = {}  # the check made on a run's own pair, right after its transfer

    def run(model: Any, planted: bool) -> Run:
        prompt = text_ids(model, TEXT)
        with make(model, planted) as ranks:
            logits = [ranks.prefill(prompt)[-1]]
            checked[id(model), planted] = compare(ranks.positions("prefill"), ranks.positions("decode"))
            tokens = [int(logits[-1].argmax())]
            while len(tokens) < STEPS:
                logits.append(ranks.decode(tokens[-1]))
                tokens.append(int(logits[-1].argmax()))
            return Run(planted, "step", [[t] for t in tokens], [row[None] for row in logits],
                       [len(prompt) - 1 + s for s in range(STEPS)], prompt, ranks.describe(),
                       notes=[f"prefill side: {prefill.describe()}; decode side: {decode.describe()}"],
                       replay=_no_records)

    def check(model: Any, planted: bool) -> HandoffReport:
        """The handoff check: the decode side's keys and values right after the prompt's transfer against the
        prefill side's (made on the pair of the last run of this model, or on a pair of its own)."""
        if (id(model), planted) in checked:
            return checked.pop((id(model), planted))
        with make(model, planted) as ranks:
            ranks.prefill(text_ids(model, TEXT))
            return compare(ranks.positions("prefill"), ranks.positions("decode"))

    return run, check


_order_run, _order_check = scenario(OwnOrderPair, PageLayout("tokens-first", 16), PageLayout("heads-first", 16))
register(Bug(
    name="pd-order-assumed", engine="vLLM (NixlConnector, prefill and decode apart)",
    reference="vllm-project/vllm#46204", url="https://github.com/vllm-project/vllm/issues/46204",
    area="prefill and decode apart",
    summary="The connector forced one KV layout (heads-first) on both sides while the model's attention wrote "
            "tokens-first blocks, so the decode side read every transferred block with its head and token axes "
            "permuted. Planted as a decode side that reads the bytes in its own block order without asking the "
            "prefill side's; the prefill side sends tokens-first blocks of 16, the decode side lays out "
            "heads-first blocks of 16.",
    invariant="the decode side reads each transferred block as the prefill side wrote it (block order and block "
              "length, layer by layer): the two exchange their layouts first, and convert or refuse",
    symptom="every request served apart answers garbage from its first token, while the same model on one machine "
            "is right; nothing raises",
    checker="handoff", run=_order_run, check=_order_check))

_length_run, _length_check = scenario(OneBlockLengthPair, *(PageLayout("heads-first", 16, {3: 32, 4: 32, 5: 32}),) * 2)
register(Bug(
    name="pd-one-block-length", engine="vLLM (NixlConnector, prefill and decode apart)",
    reference="vllm-project/vllm#57661", url="https://github.com/vllm-project/vllm/issues/57661",
    area="prefill and decode apart",
    summary="A hybrid model's layer groups had different block lengths but shared a storage base; the connector "
            "registered the base once with the first group's block length, so the other group's blocks were "
            "transferred truncated and misaligned. Planted as a decode side that reads every layer with layer 0's "
            "block length, while layers 3-5 were sent in blocks of 32 and layers 0-2 in blocks of 16.",
    invariant="each layer's blocks are read with that layer's own block length (a hybrid model's groups differ)",
    symptom="garbled output served apart, only for models whose layers differ in block length; no error",
    checker="handoff", run=_length_run, check=_length_check))

