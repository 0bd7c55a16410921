"""A replay holding several (layer, head) picks, as its page carries them: the first pick's figures in every frame,
and for each other pick only the figures that pick changes (the attention; the cache map and memory lines are the
same at every layer and head), which are the figures the views draw at that pick. The picks travel through
``save_html``, an explorer's and a run's ``save_html`` and ``kvexplore export --pick``; a pick the model lacks is
refused."""

from __future__ import annotations

import base64
import gzip
import json
import re

import numpy as np
import pytest

import kvexplore
from kvexplore.cli import commands as cli
from kvexplore.errors import SettingsError
from kvexplore.explorer.inspect import plain
from kvexplore.replay import frames, save_html
from kvexplore.views.registry import TABS

pytest.importorskip("plotly", reason="the notebook extra is not installed: pip install -e '.[notebook,dev]'")

PROMPT = "Call me Ishmael. Some years ago"


@pytest.fixture(scope="module")
def runs(trained):
    out = {}
    for kind in ("preallocated", "paged"):
        g = kvexplore.Generator(trained, kvexplore.make_cache(kind, trained, max_seq_len=64),
                                tracer=kvexplore.Tracer(capture={"cache", "attention", "memory"}))
        g.prefill(PROMPT)
        g.run(7, stop_at_eos=False)
        out[kind] = g.history
    return out


def packed(path) -> dict:
    """The data a saved page carries (views/page.py: pack), unpacked."""
    found = re.search(r'class="kvx-data">([^<]*)</script>', path.read_text(encoding="utf-8"))
    return json.loads(gzip.decompress(base64.b64decode(found.group(1))))


def decoded(v, arrays: list[dict]):
    """A frame's figure with its array references ({"$a": i, "n": n}) as plain lists."""
    if isinstance(v, list):
        return [decoded(x, arrays) for x in v]
    if isinstance(v, dict):
        if "$a" in v:
            a = arrays[v["$a"]]
            return plain(np.frombuffer(base64.b64decode(a["b64"]), dtype=a["dtype"])[: v["n"]])
        return {k: decoded(x, arrays) for k, x in v.items()}
    return v


def test_the_default_replay_holds_the_one_pick_given(runs, tmp_path):
    data = packed(save_html(runs, tmp_path / "one.html", layer=2, head=3))
    meta = data["meta"]
    assert meta["picks"] == [[2, 3]] and (meta["layer"], meta["head"]) == (2, 3)
    assert meta["tabs"] == list(TABS) and "attention" in meta["tabs"]
    assert meta["model"] == {"layers": 6, "heads": 8}
    assert all("picks" not in f for f in data["frames"])  # nothing more stored than before


def test_another_pick_stores_only_the_figures_it_changes_and_they_are_that_picks(runs, tmp_path):
    data = packed(save_html(runs, tmp_path / "two.html", layer=0, head=0, picks=[(3, 1), (0, 0), (3, 1)]))
    assert data["meta"]["picks"] == [[0, 0], [3, 1]]  # the given pick first, each once
    alone, store = frames(runs, layer=3, head=1)  # what a replay of that pick alone draws
    for step, frame in enumerate(data["frames"]):
        other = frame["picks"]["3,1"]
        assert set(other) == {f"attention:{lane}" for lane in runs}, step  # the cache map and memory are shared
        for key, fig in frame["figures"].items():
            at_pick = decoded(other.get(key, fig), data["arrays"])
            want = decoded(alone[step]["figures"][key], store.arrays)
            assert at_pick == want, (step, key)
        assert decoded(other["attention:paged"], data["arrays"])["layout"]["title"] != \
            decoded(frame["figures"]["attention:paged"], data["arrays"])["layout"]["title"]


@pytest.mark.parametrize("picks, words", [([(6, 0)], "layer 6 does not exist"), ([(0, 8)], "head 8 does not exist"),
                                          ([(1,)], "not a (layer, head) pair"), ([("3", 1)], "not a (layer, head)"),
                                          ([3], "not a (layer, head) pair")])
def test_a_pick_the_model_lacks_is_refused(runs, tmp_path, picks, words):
    with pytest.raises(SettingsError, match=re.escape(words)):
        save_html(runs, tmp_path / "bad.html", picks=picks)
    assert not (tmp_path / "bad.html").exists()


@pytest.mark.long  # 3-5 s: an explorer, and three exports with plotly.js inside
def test_the_explorer_and_the_export_command_take_picks(trained, runs, tmp_path, capsys):
    ex = kvexplore.Explorer(trained, strategies=("preallocated",), max_seq_len=64)
    ex.step()
    ex.step()
    ex.controls["layer"].value, ex.controls["head"].value = 2, 5
    meta = packed(ex.save_html(tmp_path / "ex.html", picks=[(4, 0)]))["meta"]
    assert meta["picks"] == [[2, 5], [4, 0]]  # the explorer's layer and head first
    own = packed(runs["preallocated"].save_html(tmp_path / "h.html", layer=1, head=2, picks=[(4, 0)]))["meta"]
    assert own["picks"] == [[1, 2], [4, 0]]  # a run's own History.save_html takes them too
    trace = runs["paged"].save(tmp_path / "r.kvtrace")
    assert cli.main(["export", str(trace), "-o", str(tmp_path / "x.html"), "--pick", "3,1", "--pick", "5,7"]) == 0
    assert packed(tmp_path / "x.html")["meta"]["picks"] == [[0, 0], [3, 1], [5, 7]]
    assert cli.main(["export", str(trace), "-o", str(tmp_path / "y.html"), "--pick", "9,0"]) == 1
    assert "layer 9 does not exist" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        cli.main(["export", str(trace), "-o", str(tmp_path / "z.html"), "--pick", "three"])
    assert "write a layer and a head, as 3,1" in capsys.readouterr().err
