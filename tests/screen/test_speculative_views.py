"""A speculative lane in the explorer: one Step is one verification on the lane that drafts and as many tokens on
every other lane (aligned token by token, greedy tokens equal), the doctor's check after each take-back, the
Speculation view's bars and lines equal the generator's own counts, the cache map marks the drafted slots the
pre-allocated cache left behind, and a rewind across verifications keeps every lane aligned."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

pytest.importorskip("plotly", reason="the notebook extra is not installed: pip install -e '.[notebook,dev]'")
pytest.importorskip("ipywidgets")

import kvexplore  # noqa: E402
from kvexplore.errors import SettingsError  # noqa: E402
from kvexplore.explorer.lanes import split_options  # noqa: E402
from kvexplore.views import cache_map, speculation  # noqa: E402
from kvexplore.views.palette import SLOT_CLASSES  # noqa: E402
from kvexplore.views.registry import TABS, VIEWS, replayed  # noqa: E402

# a passage quoted again: prompt lookup finds drafts, the trained tiny model accepts some and rejects others
PROMPT = ("The whale swam under the ship while the crew slept, and the sea was calm. The whale swam under the ship "
          "while the crew slept, and the sea was calm. The whale swam")
SPEC = {"draft": "prompt-lookup", "draft_tokens": 4}
STEPS = 8


@pytest.fixture(scope="module")
def ex(trained):
    """The plain pre-allocated reference, a pre-allocated lane that drafts, a sink lane that drafts (its take-back
    recomputes) and a paged lane that follows the reference; per Step, every lane's token count."""
    ex = kvexplore.Explorer(trained, strategies=["preallocated", "preallocated@spec", "sink@spec", "paged"],
                            max_seq_len=128, strategy_options={
                                "preallocated@spec": SPEC, "sink@spec": {"window": 8, "sinks": 2, **SPEC},
                                "paged": {"block_size": 4}})
    ex.prefill(PROMPT)
    ex.counts = []
    for _ in range(STEPS):
        ex.step()
        ex.counts.append({name: len(lane.generator.tokens) for name, lane in ex.lanes.items()})
    return ex


def test_options_split_between_the_cache_and_the_generator():
    assert split_options({"draft": "prompt-lookup", "draft_tokens": 3, "block_size": 8}) == (
        {"block_size": 8}, {"draft": "prompt-lookup", "draft_tokens": 3})


def test_a_bad_draft_option_is_refused_naming_it(trained):
    with pytest.raises(SettingsError, match="draft_tokens"):
        kvexplore.Explorer(trained, strategies=["preallocated", "preallocated@spec"],
                           strategy_options={"preallocated@spec": {"draft": "prompt-lookup", "draft_tokens": 0}})


def test_a_step_is_one_verification_and_every_lane_takes_as_many_tokens(ex):
    spec = ex.lanes["preallocated@spec"].generator.speculation
    assert ex.lanes["preallocated@spec"].follows is False and ex.lanes["paged"].follows is True
    before = len(ex.session.prompt_tokens) + 1
    gained = []
    for counts in ex.counts:
        assert len(set(counts.values())) == 1, counts  # aligned by token after every Step
        gained.append(counts["preallocated"] - before)
        before = counts["preallocated"]
    # the Steps that verified gave the verification's tokens, the others one token
    verified = {v.first_step + len(v.tokens) - 1: len(v.tokens) for v in spec.verifications}
    steps = np.cumsum(gained) + 0  # the step number of each Step's last token
    assert gained == [verified.get(int(s), 1) for s in steps]
    assert any(v.accepted for v in spec.verifications) and any(v.rolled_back for v in spec.verifications)
    assert max(gained) > 1
    tokens = ex.lanes["preallocated"].generator.tokens
    assert ex.lanes["preallocated@spec"].generator.tokens == tokens  # greedy: the same tokens
    assert ex.lanes["paged"].generator.tokens == tokens
    assert ex.lanes["paged"].forced_at == set(range(len(ex.lanes["paged"].history)))


def test_the_comparison_reads_the_row_that_chose_the_newest_token(ex):
    lane = ex.lanes["preallocated@spec"]
    assert lane.last.verification is not None or lane.generator.speculation.verifications
    kl = [k for k in lane.kl if k is not None]
    assert kl and max(kl) < 1e-4  # the same model and an exact cache: its distributions are the reference's


def test_the_doctor_checked_every_take_back(ex):
    lane = ex.lanes["preallocated@spec"]
    took = {v.index for v in lane.generator.speculation.verifications if v.rolled_back}
    assert took and set(lane.checkups) == took
    assert all(c.clean and "clean" in c.text for c in lane.checkups.values()), [c.text for c in lane.checkups.values()]
    # a lane that drafts but is not the pace lane drafts at most what the pace lane's Step gave
    sink = ex.lanes["sink@spec"].generator.speculation
    assert all(len(v.drafted) < 4 for v in sink.verifications)


def test_a_take_back_by_recompute_is_checked_against_the_strategy_prefilled_again(trained):
    """The sink lane as the pace lane: its drafts evict, so its take-back is a rollback and a recompute (the view
    says why); the doctor finds the cache departs from a full recomputation as a sink cache does, and equals the
    same strategy prefilled again with the kept tokens."""
    ex = kvexplore.Explorer(trained, strategies=["preallocated", "sink@spec"], max_seq_len=128,
                            strategy_options={"sink@spec": {"window": 8, "sinks": 2, **SPEC}})
    ex.prefill(PROMPT)
    for _ in range(STEPS):
        ex.step()
    lane = ex.lanes["sink@spec"]
    spec = lane.generator.speculation
    assert {v.take_back for v in spec.verifications if v.rolled_back} == {"recompute"}
    assert set(lane.checkups) == {v.index for v in spec.verifications if v.rolled_back}
    assert all(c.clean and "take-back is exact" in c.text for c in lane.checkups.values())
    ex.controls["lane"].value = "sink@spec"
    title = ex.specs(["speculation"])["speculation"].layout["title"]["text"].replace("<br>", " ")
    assert "recompute" in title and "evicted" in title  # Verification.why


def test_the_view_is_a_tab_replayed_for_the_lanes_that_draft(ex):
    assert "speculation" in TABS and VIEWS["speculation"].replay == "lane"
    runs = ex.session.runs()
    assert VIEWS["speculation"].drawn_for(runs["preallocated@spec"])
    assert not VIEWS["speculation"].drawn_for(runs["paged"])
    assert "speculation" in [v.name for v in replayed(runs)[0]]


def test_the_view_draws_the_generators_counts(ex):
    ex.controls["lane"].value = "preallocated@spec"
    fig = ex.specs(["speculation"])["speculation"]
    spec = ex.lanes["preallocated@spec"].generator.speculation
    last = {v.first_step + len(v.tokens) - 1: v for v in spec.verifications}
    acc, rej = fig.trace("accepted"), fig.trace("rejected")
    assert [int(x) for x in acc["x"]] == sorted(last)
    assert [int(y) for y in acc["y"]] == [last[s].accepted for s in sorted(last)]
    assert [int(y) for y in rej["y"]] == [len(last[s].drafted) - last[s].accepted for s in sorted(last)]
    tok = fig.trace("tokens per pass")
    history = ex.lanes["preallocated@spec"].history
    ends = [r.step for r in history[1:] if r.verification is None] + sorted(last)
    assert [int(x) for x in tok["x"]] == sorted(ends)
    assert sum(tok["y"]) == len(history) - 1  # each pass's tokens, every generated token once
    mean = fig.trace("mean so far")
    assert mean["y"][-1] == pytest.approx((len(history) - 1) / len(ends))
    title = fig.layout["title"]["text"].replace("<br>", " ")
    assert f"{spec.drafter.name}, 4 per verification" in title
    assert f"{spec.drafted} drafted, {spec.accepted} accepted" in title
    assert "doctor:" in title and "left stale" in title  # the pre-allocated layer's way, in words
    ex.controls["lane"].value = "paged"
    note = ex.specs(["speculation"])["speculation"].layout["annotations"][0]["text"]
    assert "does not draft" in note


@pytest.mark.long  # the fast tier's heaviest (1-3 s): a binned speculation view
def test_binned_steps_keep_every_count():
    """Wider than the screen, steps are binned: the bars and the tokens sum the same."""
    ex = kvexplore.Explorer("tiny", strategies=["preallocated@spec"], max_seq_len=128,
                            strategy_options={"preallocated@spec": SPEC})
    ex.prefill(PROMPT)
    ex.run(24)
    records = ex.lanes["preallocated@spec"].history
    spec = ex.lanes["preallocated@spec"].generator.speculation
    full = speculation.spec(records, "x")
    binned = speculation.spec(records, "x", max_bins=4)
    assert len(binned.trace("tokens per pass")["x"]) <= 4
    for name in ("accepted", "rejected"):
        assert sum(binned.trace(name)["y"]) == sum(full.trace(name)["y"])
    assert sum(binned.trace("accepted")["y"]) == spec.accepted
    assert "bins of" in binned.layout["xaxis2"]["title"]["text"]


def _verify_with_rejects(ex) -> None:
    """Step until the newest Step was a verification that took positions back."""
    lane = ex.lanes["preallocated@spec"]
    for _ in range(30):
        ex.step()
        spec = lane.generator.speculation
        if lane.last.verification is not None and spec.verifications[-1].rolled_back:
            return
    pytest.fail("no verification took positions back in 30 steps")


def test_the_cache_map_draws_the_drafted_slots_taken_back(trained):
    ex = kvexplore.Explorer(trained, strategies=["preallocated", "preallocated@spec"], max_seq_len=128,
                            strategy_options={"preallocated@spec": SPEC})
    ex.prefill(PROMPT)
    _verify_with_rejects(ex)
    ex.controls["lane"].value = "preallocated@spec"
    lane = ex.lanes["preallocated@spec"]
    v = lane.generator.speculation.verifications[-1]
    heat = ex.specs(["cache_map"])["cache_map"].traces[0]
    x, y, z = (np.asarray(heat[k]) for k in ("x", "y", "z"))
    back = set(range(v.pos + v.kept, v.pos + v.written))
    for layer in range(ex.model.config.num_layers):
        row = {int(s): SLOT_CLASSES[int(c)] for s, c in zip(x[y == layer], z[y == layer])}
        assert {s for s, c in row.items() if c == "taken back"} == back, layer
        assert all(lane.cache.inspect.slot_views()[layer].states[s] == "stale" for s in back)  # left behind, not read
    assert "taken back" in [t["name"] for t in ex.specs(["cache_map"])["cache_map"].traces]
    # binned (more slots on screen than columns), a bin holding a taken-back slot shows it first
    binned = cache_map.from_snapshot(dataclasses.replace(ex.snapshot(), max_bins=8)).traces[0]
    bx, bz = np.asarray(binned["x"]), np.asarray(binned["z"])
    size = 128 // 8
    assert {int(b) // size for b in bx[bz == SLOT_CLASSES.index("taken back")]} == {s // size for s in back}
    attention = ex.specs(["attention"])["attention"]
    ex.controls["lane"].value = "preallocated"  # the plain lane wrote the kept tokens one by one: nothing back
    heat = ex.specs(["cache_map"])["cache_map"].traces[0]
    assert SLOT_CLASSES.index("taken back") not in set(np.asarray(heat["z"]).tolist())
    # the attention drawn is the newest token's (the rejected drafts' rows went with them), as the plain lane's
    plain = ex.specs(["attention"])["attention"]
    assert attention.layout["title"]["text"] == plain.layout["title"]["text"]
    np.testing.assert_allclose(np.asarray(attention.trace("current")["y"], dtype=float),
                               np.asarray(plain.trace("current")["y"], dtype=float), atol=1e-5)


def test_a_rewind_across_verifications_keeps_the_lanes_aligned(trained):
    ex = kvexplore.Explorer(trained, strategies=["preallocated@spec", "preallocated", "sink"], max_seq_len=128,
                            strategy_options={"preallocated@spec": SPEC, "sink": {"window": 16, "sinks": 2}})
    ex.prefill(PROMPT)
    ex.run(10)
    lane = ex.lanes["preallocated@spec"]
    spec = lane.generator.speculation
    assert spec.verifications, "the reference drafted"
    v = next((v for v in spec.verifications if len(v.tokens) > 1), None)
    assert v is not None, "a verification accepted a draft"
    cut = len(lane.history) - (v.first_step + 1)  # back into the middle of that verification
    before = spec.verifications[:v.index]
    ex.rewind(cut)
    counts = {name: len(l.generator.tokens) for name, l in ex.lanes.items()}
    assert len(set(counts.values())) == 1
    assert spec.verifications == before and all(i < v.index for i in lane.checkups)
    ex.step()
    ex.step()
    tokens = {name: l.generator.tokens for name, l in ex.lanes.items()}
    assert tokens["preallocated"] == tokens["preallocated@spec"] and len(tokens["sink"]) == len(tokens["preallocated"])
    plain = kvexplore.Generator(trained, kvexplore.make_cache("preallocated", trained, max_seq_len=128))
    plain.prefill(PROMPT)
    plain.run(len(tokens["preallocated"]) - len(plain.tokens))
    assert plain.tokens == tokens["preallocated@spec"]


def test_a_long_way_is_cut_in_the_title_and_whole_in_the_details(ex):
    """The panel beside the cache map is short: the title keeps at most its lines, the hover has every word."""
    snap = ex.snapshot()
    lane = snap.lanes["preallocated@spec"]
    way = "the drafted slots " + "are left behind " * 30 + "and nothing is copied"
    info = dataclasses.replace(lane.speculation, ways={"PreallocatedLayer": way})
    fig = speculation.spec(lane.history, lane.kind, info)
    title = fig.layout["title"]["text"]
    assert title.count("<br>") + 1 <= speculation.TITLE_LINES and "… (details)" in title
    assert title.split("<br>")[-1].startswith("doctor:")  # the verdict stays
    details = next(a for a in fig.layout["annotations"] if a.get("hovertext"))
    assert "and nothing is copied" in details["hovertext"].replace("<br>", " ")


def test_a_lane_that_fails_after_the_verification_leaves_every_lane_as_it_was(trained, monkeypatch):
    """Every operation succeeds on all lanes or changes none: the pace lane's verification is taken back when a
    lane stepping after it fails, and the next Step gives what it would have given."""
    ex = kvexplore.Explorer(trained, strategies=["preallocated@spec", "preallocated", "paged"], max_seq_len=128,
                            strategy_options={"preallocated@spec": SPEC})
    ex.prefill(PROMPT)
    ex.step()
    lanes = ex.lanes

    def state():
        return {n: (list(l.generator.tokens), l.cache.length, len(l.generator.speculation.verifications)
                    if l.generator.speculation else None) for n, l in lanes.items()}

    before = state()
    real = lanes["paged"].generator.step
    calls = []

    def failing(*args, **kwargs):  # the paged lane fails on its second token of the Step
        calls.append(1)
        if len(calls) == 2:
            raise RuntimeError("a lane failed")
        return real(*args, **kwargs)

    for _ in range(20):  # until a Step gives the pace lane more than one token
        calls.clear()
        monkeypatch.setattr(lanes["paged"].generator, "step", failing)
        try:
            ex.step()
        except RuntimeError:
            assert state() == before
            break
        monkeypatch.undo()
        before = state()
    else:
        pytest.fail("no verification gave more than one token")
    monkeypatch.undo()
    ex.step()
    assert len({len(l.generator.tokens) for l in lanes.values()}) == 1
    assert lanes["paged"].generator.tokens == lanes["preallocated@spec"].generator.tokens
