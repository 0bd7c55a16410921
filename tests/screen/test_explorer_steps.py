"""The explorer stepping without a browser: Prefill, Step and Run move the cache's write window, Rewind marks
slots stale, a cache that fills sits its lane out, a failing or refused step touches no lane, the end of sequence."""

from __future__ import annotations

import pytest
import torch

# first: importing it skips this module without the notebook extra (plotly, ipywidgets)
from explorer_support import CODE, PROMPT, click, explorer, slot_row, slot_rows
from explorer_support import model  # noqa: F401  (the fixture)

import kvexplore


def test_prefill_and_step_move_the_write_window_one_slot(model):
    ex = explorer(model)
    ex.controls["prompt"].value = PROMPT
    click(ex, "prefill")
    assert ex.error == ""
    n_prompt = len(ex.lane.generator.prompt_tokens)
    row = slot_row(ex)
    assert [i for i, c in enumerate(row) if c == CODE["written"]] == list(range(n_prompt))  # prefill wrote the prompt
    for k in range(3):
        click(ex, "step")
        row = slot_row(ex)
        pos = n_prompt + k  # the token chosen by the previous step is written now
        assert [i for i, c in enumerate(row) if c == CODE["written"]] == [pos]
        assert [i for i, c in enumerate(row) if c == CODE["read"]] == list(range(pos))
        assert row[pos + 1:] == [CODE["free"]] * (len(row) - pos - 1)
        title = ex.figures["cache_map"].plot_layout.title.text
        assert f"write narrow(2, {pos}, 1) · read narrow(2, 0, {pos + 1})" in title
        assert f"step {k + 1}" in ex.controls["status"].value
    # every layer row is the same slot map
    assert all([int(v) for v in r] == row for r in slot_rows(ex))
    assert len(slot_rows(ex)) == model.config.num_layers


def test_run_rewind_marks_stale_and_token_strip_follows(model):
    ex = explorer(model, prompt=PROMPT)
    ex.controls["run_n"].value = 5
    click(ex, "run")
    assert len(ex.lane.history) == 6
    strip = ex.controls["tokens"].value
    assert strip.count('class="kvx-tok') == len(ex.lane.generator.tokens)
    assert "candidates:" in strip and "position" in strip
    assert ex.controls["progress"].layout.display == "none"
    ex.controls["rewind_n"].value = 2
    click(ex, "rewind")
    row = slot_row(ex)
    assert row.count(CODE["stale"]) == 2
    assert row.count(CODE["written"]) == 0
    assert "after a rewind (2 stale)" in ex.figures["cache_map"].plot_layout.title.text
    assert ex.controls["tokens"].value.count('class="kvx-tok') == len(ex.lane.generator.tokens)
    click(ex, "step")  # the next write reuses the first stale slot
    row = slot_row(ex)
    assert row.count(CODE["stale"]) == 1 and row.count(CODE["written"]) == 1


def test_errors_are_shown_and_change_nothing(model):
    ex = explorer(model, strategies=("preallocated", "paged"), max_seq_len=16, prompt="Call me Ishmael.")
    before = {n: (list(l.generator.tokens), l.cache.length) for n, l in ex.lanes.items()}
    ex.controls["run_n"].value = 50
    click(ex, "run")  # stops when every cache is full
    assert "cache full" in ex.error and "cache full" in ex.controls["error"].value
    after = {n: (list(l.generator.tokens), l.cache.length) for n, l in ex.lanes.items()}
    assert len({tuple(t) for t, _ in after.values()}) == 1  # both filled at the same token
    assert all(lane.full is None for lane in ex.lanes.values())  # the refused step marked nothing
    full = after["preallocated"]
    click(ex, "step")
    assert {n: (list(l.generator.tokens), l.cache.length) for n, l in ex.lanes.items()} == after
    ex.controls["prompt"].value = "   "
    click(ex, "prefill")
    assert "prompt is empty" in ex.controls["error"].value
    assert (list(ex.lane.generator.tokens), ex.lane.cache.length) == full
    ex.controls["rewind_n"].value = 99
    click(ex, "rewind")
    assert "cannot rewind 99" in ex.error
    click(ex, "reset")
    assert ex.error == "" and ex.controls["error"].value == ""
    assert before  # the explorer started from a prefilled state


def test_a_full_lane_sits_out_the_steps_and_the_others_go_on(model):
    """A cache that fills stops its own lane, not the class: the others step on (after the reference stopped, each
    on its own tokens, compared with nothing), the page says which lane sits out and what to do, and a Rewind
    gives it room again."""
    opts = {"paged": {"block_size": 8}, "sink": {"sinks": 1, "window": 6}}
    ex = explorer(model, strategies=("preallocated", "sink", "paged"), max_seq_len=16, grow=False,
                  strategy_options=opts, prompt=list(range(10, 20)))
    ex.run(12)
    ref, sink, paged = (ex.lanes[n] for n in ("preallocated", "sink", "paged"))
    assert ex.error == "" and ref.full is not None and paged.full is not None and sink.full is None
    assert len(ref.generator.tokens) == len(paged.generator.tokens) == 17  # the 16 slots and the newest token
    assert all(r.token_id == r.top[0].token_id for r in sink.history[7:])  # greedy: its own choices after
    assert len(sink.history) == 13 and len(sink.cache.evicted_positions) > 0
    # fed the reference's tokens and compared with it while it stepped, then neither
    assert sink.forced_at == set(range(7)) and sorted(sink.kl_at) == list(range(7))
    notice = ex.controls["error"].value
    assert "kvx-notice" in notice and "preallocated (all 16 slots, at step 6)" in notice
    assert "paged (all 16 slots, at step 6)" in notice and "Rewind gives it room again" in notice
    assert "kvexplore app --max-seq-len N" in notice
    ex.controls["lane"].value = "preallocated"
    assert "full: sits out the steps since step 6" in ex.controls["status"].value
    ex.rewind(2)
    assert ref.full is None and paged.full is None and ex.controls["error"].value == ""
    ex.step()  # the reference and paged step again, paged fed the reference's token; the sink on its own
    assert (len(ref.history), len(sink.history), len(paged.history)) == (6, 12, 6)
    assert 5 in paged.forced_at and 11 not in sink.forced_at and 11 not in sink.kl_at


def test_a_lane_failing_mid_step_rewinds_the_others(model, monkeypatch):
    ex = explorer(model, strategies=("preallocated", "concat", "quantized"), prompt=PROMPT)
    ex.run(2)
    state = {n: list(l.generator.tokens) for n, l in ex.lanes.items()}
    lengths = {n: l.cache.length for n, l in ex.lanes.items()}

    def broken(*a, **k):
        raise RuntimeError("simulated failure in the quantized cache")

    monkeypatch.setattr(ex.lanes["quantized"].cache, "write", broken)
    with pytest.raises(RuntimeError, match="simulated"):
        ex.step()
    assert {n: list(l.generator.tokens) for n, l in ex.lanes.items()} == state
    assert {n: l.cache.length for n, l in ex.lanes.items()} == lengths
    monkeypatch.undo()
    ex.step()
    assert len({tuple(l.generator.tokens) for l in ex.lanes.values()}) == 1


def test_buttons_are_disabled_while_a_step_runs(model, monkeypatch):
    ex = explorer(model, strategies=("preallocated",), prompt=PROMPT)
    seen = []
    real = ex.session.step

    def spy():
        seen.append([b.disabled for b in ex._buttons])
        with pytest.raises(RuntimeError, match="still running"):
            ex.step()  # a second operation while one runs is refused, not interleaved
        return real()

    monkeypatch.setattr(ex.session, "step", spy)
    click(ex, "step")
    assert seen == [[True] * len(ex._buttons)]
    assert not any(b.disabled for b in ex._buttons)
    assert len(ex.lane.history) == 2


def test_sink_lane_refuses_a_rewind_into_evicted_positions(model):
    ex = explorer(model, strategies=("preallocated", "sink"), max_seq_len=64,
                  strategy_options={"sink": {"sinks": 2, "window": 12}}, prompt="Call me Ishmael.")
    ex.run(14)
    tokens = {n: list(l.generator.tokens) for n, l in ex.lanes.items()}
    ex.controls["lane"].value = "sink"
    assert "evicted" in ex.figures["cache_map"].plot_layout.title.text
    with pytest.raises(ValueError, match="evicted"):
        ex.rewind(14)  # back to position 6, but 2..7 were evicted
    assert {n: list(l.generator.tokens) for n, l in ex.lanes.items()} == tokens
    ex.rewind(1)
    assert all(len(l.generator.tokens) == len(tokens["sink"]) - 1 for l in ex.lanes.values())


def test_lanes_step_in_a_rotating_order(model):
    ex = explorer(model, strategies=("preallocated", "concat", "paged"), prompt=PROMPT)
    orders = []
    for _ in range(3):
        orders.append([lane.name for lane in ex.session.step_order()])
        ex.step()
    assert orders == [["preallocated", "concat", "paged"], ["preallocated", "paged", "concat"],
                      ["preallocated", "concat", "paged"]]


def test_forced_tokens_are_checked(model):
    gen = kvexplore.Generator(model)
    with pytest.raises(ValueError, match="outside the vocabulary"):
        gen.prefill(PROMPT, force=10 ** 6)
    record = gen.prefill(PROMPT, force=7)
    assert record.token_id == 7 and gen.tokens[-1] == 7
    with pytest.raises(ValueError, match="outside the vocabulary"):
        gen.step(force=-1)
    assert gen.tokens[-1] == 7 and len(gen.history) == 1


def test_a_step_refused_because_every_cache_is_full_touches_no_lane(model):
    """Found in review: the paged pool had already moved when the step was refused."""
    from kvexplore.explorer import Session

    s = Session(model, ("paged", "preallocated"), max_seq_len=16, grow=False)
    s.prefill(list(range(10, 20)))
    while True:
        try:
            s.step()
        except kvexplore.CacheFullError:
            break
    paged = s.lanes["paged"].cache
    before = (paged.length, paged.inspect.slot_view().states, [lane.full for lane in s.lanes.values()])
    with pytest.raises(kvexplore.CacheFullError):
        s.step()
    assert (paged.length, paged.inspect.slot_view().states, [lane.full for lane in s.lanes.values()]) == before


def test_a_rewind_drops_a_forks_comparison_figures_from_the_abandoned_path(model):
    """Found in review: a fork kept the figures it had compared on a path that a rewind abandoned."""
    from kvexplore.explorer import Session

    s = Session(model, ("preallocated", "sink"), max_seq_len=64, strategy_options={"sink": {"sinks": 1, "window": 6}})
    s.prefill(list(range(10, 16)))
    for _ in range(6):
        s.step()
    fork = s.fork("sink")
    s.rewind(5)
    assert all(k < len(fork.history) for k in fork.kl_at)
    for _ in range(6):
        s.step()
    ref = s.reference.generator.tokens
    for r, kl in zip(fork.history, fork.kl):
        if kl is not None:
            assert fork.generator.tokens[: r.position] == ref[: r.position]  # compared only on the same context


def test_without_a_cache_a_decode_step_keeps_only_its_newest_attention_row(model):
    """Found in review: the lane without a cache kept each decode step's whole T x S attention matrix."""
    from kvexplore.explorer import Session

    s = Session(model, ("preallocated", "none"), max_seq_len=64)
    s.prefill(PROMPT)
    for _ in range(20):
        s.step()
    none, pre = s.lanes["none"].tracer.history.nbytes, s.lanes["preallocated"].tracer.history.nbytes
    assert none == pre
    last = s.lanes["none"].last.trace
    assert torch.allclose(last.attention(0)[-1], s.lanes["preallocated"].last.trace.attention(0)[-1], atol=1e-5)


def test_rewinding_every_generated_token_leaves_the_prompt_and_step_continues_from_it(model):
    """Found in review: after the rewind the status says nothing is generated yet, and Step runs without an error."""
    ex = explorer(model, strategies=("preallocated",), prompt=PROMPT)
    ex.run(2)
    ex.rewind(3)
    assert "nothing generated yet" in ex.controls["status"].value
    ex.step()
    assert len(ex.lane.history) == 1 and ex.error == ""


@pytest.mark.long  # the fast tier's heaviest (1-3 s): every strategy to the end of sequence
def test_status_and_map_title_give_one_slot_figure_and_the_end_of_sequence(model):
    """The status line and the cache map's title count the same slots (the first full layer's physical slots) for
    every strategy, the sequence's limit in positions named as positions where it differs; at the end-of-sequence
    token the status says the model has finished and that Step goes on, and after it how long ago it ended."""
    import re

    ex = explorer(model, strategies=("preallocated", "concat", "paged", "quantized", "sink", "evict", "none"),
                  max_seq_len=40, strategy_options={"paged": {"block_size": 16}, "sink": {"sinks": 2, "window": 14},
                                                    "quantized": {"residual": 8}},
                  prompt=PROMPT)
    ex.run(12)
    seen = {}
    for lane in ex.lanes:
        ex.controls["lane"].value = lane
        status = re.sub(r"<[^>]+>", "", ex.controls["status"].value)  # the text on screen (its hover aside)
        title = ex.figures["cache_map"].plot_layout.title.text
        view = ex.lanes[lane].cache.inspect.slot_view()
        held, total = re.search(r"step 12 · (\d+)/(\d+) slots held", title).groups()
        assert (int(held), int(total)) == (view.held, len(view.states))
        seen[lane] = status
        if total != "0":
            assert f"cache holds {held} of {total} slots" in status
        else:
            assert "cache keeps no slots" in status
    assert "of 48 slots · sequence limit 40 positions" in seen["paged"]  # 3 pages of 16 slots
    assert "holds 16 of 16 slots" in seen["sink"] and "limit" not in seen["sink"]  # 2 sinks + a 14-slot ring
    assert "unbounded" not in "".join(seen.values())
    # the end of sequence: a token this prompt's greedy run produces is made to count as one
    first = explorer(model, strategies=("preallocated",), prompt=PROMPT)
    first.run(6)
    tokens = [r.token_id for r in first.lane.history]
    eos = model.tokenizer.eos_ids
    model.tokenizer.eos_ids = [tokens[3]]
    try:
        ex = explorer(model, strategies=("preallocated",), prompt=PROMPT)
        ex.run(6)  # stops at the end of sequence
        ended = ex.lane.history[-1]
        assert ended.is_eos and ended.token_id == tokens[3] and tokens.index(tokens[3]) == len(ex.lane.history) - 1
        assert "end of sequence: the model has finished (press Continue to go on past it)" in \
            ex.controls["status"].value
        assert ex.controls["step"].description == "Continue" and "past it" in ex.controls["step"].tooltip
        click(ex, "step")
        assert ex.controls["step"].description == "Step"
        assert ex.lane.history[-2] is ended and not ex.lane.history[-1].is_eos
        ended = ended.step
        assert f"past the end of sequence (step {ended} ended it)" in ex.controls["status"].value
    finally:
        model.tokenizer.eos_ids = eos
