"""The bug zoo (kvexplore.bugs): every catalogued bug reproduces on the tiny model (the broken run parts from its fixed
twin by a wrong token or a logit difference above 1e-2), the bug's checker flags the broken run naming where, and
passes the fixed twin; the checkers also catch three bugs planted here only, that the catalogue does not hold."""

from __future__ import annotations

import re

import pytest
import torch

import kvexplore
import kvexplore.bugs as bugs
from kvexplore.bugs.runs import LOGIT_TOL
from kvexplore.caches.layers.paged_layer import PagePool, PageTable
from kvexplore.caches.layers.preallocated_layer import PreallocatedLayer
from kvexplore.caches.strategies.paged import PagedCache
from kvexplore.caches.strategies.preallocated import PreallocatedCache
from kvexplore.diagnosis.speculation import check_speculation
from kvexplore.errors import SettingsError

NAMES = [b.name for b in bugs.catalog()]
# the bugs of prefill and decode apart run two rank processes each (several seconds): the slow tier's
RUNS = [b.name if b.area != "prefill and decode apart" else pytest.param(b.name, marks=pytest.mark.long)
        for b in bugs.catalog()]
REFERENCE = re.compile(r"^([\w.-]+/[\w.-]+#\d+|(kvexplore )?commit [0-9a-f]{7,})")


@pytest.fixture(scope="module")
def tiny():
    return bugs.models.zoo_model("tiny")


def test_the_catalogue_covers_every_area_with_a_public_reference_and_an_invariant():
    entries = bugs.catalog()
    assert len(entries) >= 12, [b.name for b in entries]
    assert {b.area for b in entries} == set(bugs.AREAS)
    assert [b.area for b in entries] == sorted((b.area for b in entries), key=bugs.AREAS.index)
    for b in entries:
        fields = b.as_dict()
        assert all(fields[k] for k in ("name", "engine", "reference", "summary", "invariant", "symptom")), b
        assert REFERENCE.match(b.reference), b.reference
        assert b.url.startswith("https://") or "commit" in b.reference, b.url  # this project's: a commit
        assert "Planted" in b.summary or "planted" in b.summary, b.summary  # says how the zoo models it


@pytest.mark.parametrize("name", RUNS)
def test_each_bug_reproduces_and_its_checker_catches_it_and_passes_the_fixed_twin(name):
    r = bugs.reproduce(name)
    d = r.first_divergence
    assert d is not None, r.explain()
    assert d.broken_token != d.fixed_token or (d.max_diff is not None and d.max_diff > LOGIT_TOL), str(d)
    assert r.doctor.diverged, r.explain()
    assert not r.fixed_doctor.diverged, r.explain()
    assert r.caught
    report = r.doctor
    if r.bug.checker == "speculation":
        assert report.verification is not None and report.step is not None
        assert report.layer is not None or report.what == "logits"
    else:
        assert report.layer is not None, r.explain()  # the first divergent layer named
        if r.bug.checker == "pool":
            assert report.request is not None and report.block is not None
        else:
            assert report.step is not None
    assert report.hint
    # the two runs agree before the divergence, token for token
    assert r.broken.chosen[: d.index] == r.fixed.chosen[: d.index] if r.broken.unit == "step" else \
        r.broken.tokens[: d.index] == r.fixed.tokens[: d.index]
    assert r.seconds < 20
    text = r.explain()
    assert r.bug.reference in text and r.bug.invariant in text and "first divergence" in text


def test_the_fixed_twin_runs_kvexplores_own_classes_and_the_broken_one_a_zoo_subclass():
    r = bugs.reproduce("rejected-drafts-stay")
    broken, fixed = r.broken.subject.cache, r.fixed.subject.cache
    assert type(fixed) is kvexplore.ConcatCache
    assert isinstance(broken, kvexplore.ConcatCache) and type(broken).__module__ == "kvexplore.bugs.speculation"
    # the speculative runs: the fixed one is plain greedy decoding token for token
    plain = kvexplore.Generator(r.model, kvexplore.make_cache("concat", r.model))
    plain.prefill(r.fixed.prompt)
    plain.run(len(r.fixed.chosen) - 1, stop_at_eos=False)
    assert plain.generated_tokens == r.fixed.chosen


def test_a_bug_of_ones_own_is_registered_listed_and_removed(tiny):
    rope = bugs.get("rope-position-zero")
    mine = bugs.Bug(**{**{f: getattr(rope, f) for f in rope.__dataclass_fields__}, "name": "my-rope"})
    try:
        bugs.register(mine)
        assert "my-rope" in [b.name for b in bugs.catalog()]
        assert bugs.reproduce("my-rope").caught
        with pytest.raises(SettingsError, match="already registered"):
            bugs.register(mine.__class__(**{**mine.as_dict(), "run": mine.run, "check": mine.check,
                                                    "summary": "another"}))
    finally:
        bugs.unregister("my-rope")
    with pytest.raises(SettingsError, match="built in"):
        bugs.unregister("rope-position-zero")
    with pytest.raises(SettingsError, match="no bug named 'nope'.*rope-position-zero"):
        bugs.reproduce("nope")


# -- bugs the catalogue does not hold, planted here: the checkers find them too ----------------------------------------
class EarlyReuse(PagePool):
    """A page handed out again while a block table still maps it (a page freed early, reused): the sequence's third
    page is its first one."""

    def take(self) -> int:
        page = super().take()
        return 0 if page == 2 else page


class TwiceTurned(PreallocatedLayer):
    """Keys rotated again by their position when stored: RoPE applied twice."""

    rotary = None

    def write(self, step, k, v):
        turned = self.rotary.turn(k, torch.arange(step.pos, step.pos + k.shape[2]).expand(k.shape[:3]))
        return super().write(step, turned, v)


class TwiceTurnedCache(PreallocatedCache):
    def __init__(self, model, max_seq_len: int) -> None:
        self.rotary = model.rotary
        super().__init__(model.config, max_seq_len)

    def full_layer(self, spec):
        layer = TwiceTurned(spec, self.batch_size, self.dtype, self.device, self.capacity)
        layer.rotary = self.rotary
        return layer


class ReleasesAKeptPage(PageTable):
    """A take-back that gives the page holding the last kept positions back to the pool while the block table still
    maps it: the next page taken is that page again."""

    def truncate(self, n: int, counters) -> None:
        super().truncate(n, counters)
        if n % self.block_size:
            for table in self.tables:
                if self.pool.refcount[table[-1]] == 1:
                    self.pool.release(table[-1])


def test_the_doctor_finds_a_page_reused_while_mapped(tiny):
    cache = PagedCache(tiny.config, block_size=8, pool=EarlyReuse(len(tiny.config.layer_types), 8, 8))
    report = kvexplore.doctor(tiny, prompt=list(range(5, 14)), steps=16, cache=cache)
    assert report.diverged and report.layer == 0 and report.what in ("keys", "values")
    assert report.step == 8 and report.position < 8  # the third page's first write lands on positions 0..7
    assert report.hint


def test_the_doctor_finds_a_rotation_applied_twice(tiny):
    report = kvexplore.doctor(tiny, prompt=list(range(5, 14)), steps=4, cache=TwiceTurnedCache(tiny, 32))
    assert report.diverged and report.step == 0 and report.layer == 0 and report.what == "keys"
    assert "rotat" in report.hint or "RoPE" in report.hint, report.hint


def test_the_speculation_check_finds_a_take_back_that_drops_a_kept_page(tiny):
    cache = PagedCache(tiny.config, max_seq_len=128, block_size=4)
    cache.table.__class__ = ReleasesAKeptPage
    gen = kvexplore.Generator(tiny, cache, draft="prompt-lookup", draft_tokens=4)
    text = bugs.windows.SPEC_TEXT
    report = check_speculation(gen, bugs.runs.text_ids(tiny, text), steps=24)
    assert report.diverged and report.layer is not None and report.verification is not None, report
    assert "take-back" in report.hint
    clean = kvexplore.Generator(tiny, PagedCache(tiny.config, max_seq_len=128, block_size=4), draft="prompt-lookup",
                                draft_tokens=4)
    assert not check_speculation(clean, bugs.runs.text_ids(tiny, text), steps=24).diverged


def test_bugs_list_and_run_on_the_command_line(capsys):
    import json

    from kvexplore.cli.commands import main

    assert main(["bugs", "list"]) == 0
    out = capsys.readouterr().out
    assert all(name in out for name in NAMES) and all(f"\n{area}\n" in out for area in bugs.AREAS)
    assert f"{len(NAMES)} bugs" in out
    assert main(["bugs", "list", "--json"]) == 0
    entries = json.loads(capsys.readouterr().out)
    assert [e["name"] for e in entries] == NAMES and all(e["invariant"] and e["reference"] for e in entries)
    assert main(["bugs", "run", "hash-forgets-prefix"]) == 0
    out = capsys.readouterr().out
    assert "first divergence: request 1" in out and "pool on the broken run: first divergence" in out
    assert main(["bugs", "run", "nope"]) == 1
    assert "no bug named 'nope'" in capsys.readouterr().err


def test_docs_bugs_md_has_one_entry_per_bug_with_its_reference_symptom_and_invariant():
    from pathlib import Path

    text = (Path(__file__).resolve().parents[2] / "docs" / "bugs.md").read_text()
    for b in bugs.catalog():
        entry = text.split(f"#### `{b.name}`", 1)
        assert len(entry) == 2, f"docs/bugs.md has no entry for {b.name}"
        body = entry[1].split("####", 1)[0]
        assert b.reference in body and b.symptom in body and b.invariant in body and b.summary in body, b.name
