"""Sessions shared without a kernel: the HTML replay, and the diff of two traces."""

from __future__ import annotations

import re

import pytest

import kvexplore
from kvexplore.cli import commands as cli
from kvexplore.replay import frames, save_html, snapshot_at

pytest.importorskip("plotly", reason="the notebook extra is not installed: pip install -e '.[notebook,dev]'")

FULL = {"cache", "attention", "qkv", "memory", "timing"}
PROMPT = "Call me Ishmael. Some years ago"


@pytest.fixture(scope="module")
def model(trained):
    return trained


def run(model, kind="preallocated", steps=30, tracer=None, **kw):
    g = kvexplore.Generator(model, kvexplore.make_cache(kind, model, max_seq_len=96, **kw),
                            tracer=tracer or kvexplore.Tracer(capture=FULL))
    g.prefill(PROMPT)
    g.run(steps - 1, stop_at_eos=False)
    return g.history


class Perturbed(kvexplore.Tracer):
    """Records everything, and at one step adds ``delta`` to the keys one layer stores."""

    def __init__(self, step, layer, delta=0.05):
        super().__init__(capture=FULL)
        self.at, self.delta, self.steps = (step, layer), delta, -1

    def begin_step(self, cache, pos, q_len):
        self.steps += 1
        super().begin_step(cache, pos, q_len)

    def hook(self, name, t):
        super().hook(name, t)
        if self.steps == self.at[0] and name == f"layers.{self.at[1]}.attn.cache_write":
            return t + self.delta
        return None


# -- the trace carries what a replay and a diff need --------------------------------------------------------
def test_a_saved_trace_keeps_the_run_meta(model, tmp_path):
    h = run(model, steps=3)
    back = kvexplore.load_trace(h.save(tmp_path / "r.kvtrace"))
    assert back.meta == h.meta
    assert back.meta["kind"] == "preallocated" and back.meta["model"]["num_layers"] == model.config.num_layers
    assert len(back.meta["prompt_texts"]) == h[0].input_len


# -- the diff --------------------------------------------------------------------------------------------------
def test_two_identical_runs_do_not_diverge(model):
    d = kvexplore.diff_traces(run(model), run(model))
    assert not d.diverged and d.step is None and d.layer is None and d.max_diff == 0
    assert d.summary().startswith("no divergence in 30 steps")
    assert set(d.compared) == {"keys", "values", "attention", "probability"}


def test_a_planted_divergence_is_found_at_its_step_and_layer(model, tmp_path):
    clean = run(model)
    planted = run(model, tracer=Perturbed(17, 3))
    d = kvexplore.diff_traces(clean, planted)
    assert d.diverged and (d.step, d.layer) == (17, 3) and d.first.what == "attention"
    assert d.summary().startswith("first divergence at step 17, layer 3")
    assert d.max_diff > d.tolerance
    # the same through saved traces and the command (exit 1 when they part, 0 when they agree)
    a, b = clean.save(tmp_path / "a.kvtrace"), planted.save(tmp_path / "b.kvtrace")
    assert kvexplore.diff_traces(a, b).step == 17
    assert cli.main(["diff", str(a), str(b)]) == 1
    assert cli.main(["diff", str(a), str(a)]) == 0


def test_diff_of_strategies_that_agree_and_of_runs_that_part(model):
    assert not kvexplore.diff_traces(run(model), run(model, "paged", block_size=8)).diverged  # exact strategies
    lossy = kvexplore.diff_traces(run(model), run(model, "quantized", bits=4, group_size=8, residual=8))
    assert lossy.diverged and lossy.first.what in ("keys", "values", "attention", "probability")


def test_diff_bad_input_exits_2(model, tmp_path, capsys):
    a = run(model, steps=3).save(tmp_path / "a.kvtrace")
    g = kvexplore.Generator(model, tracer=kvexplore.Tracer(capture=FULL))
    g.prefill("A different prompt altogether")
    other = g.history.save(tmp_path / "other.kvtrace")
    assert cli.main(["diff", str(a), str(other)]) == 2
    assert "different prompts" in capsys.readouterr().err
    assert cli.main(["diff", str(a), str(tmp_path / "missing.kvtrace")]) == 2
    (tmp_path / "junk.kvtrace").write_bytes(b"not a trace")
    assert cli.main(["diff", str(a), str(tmp_path / "junk.kvtrace")]) == 2
    with pytest.raises(kvexplore.SettingsError, match="tolerance"):
        kvexplore.diff_traces(a, a, tolerance=-1)


# -- the replay ------------------------------------------------------------------------------------------------
def test_replay_frames_are_the_explorer_views_of_each_step(model):
    runs = {"preallocated": run(model, steps=12), "concat": run(model, "concat", steps=12)}
    all_frames, store = frames(runs, layer=2, head=3)
    assert len(all_frames) == 12
    assert set(all_frames[5]["figures"]) == {"cache_map:preallocated", "attention:preallocated", "cache_map:concat",
                                            "attention:concat", "memory"}
    # a frame's attention bar is the trace's attention of that step, in physical slot order
    from kvexplore.views import attention

    snap = snapshot_at(runs, 5, "concat", layer=2, head=3)
    spec = attention.from_snapshot(snap)
    want = runs["concat"][5].trace.physical_attention(2)[-1, 3]
    assert spec.trace("current")["y"].tolist() == pytest.approx(want.tolist())


def test_exported_file_loads_nothing_from_the_network(model, tmp_path):
    path = save_html({"preallocated": run(model, steps=5)}, tmp_path / "demo.html")
    page = path.read_text()
    assert not re.search(r"<(script|link|img|iframe)[^>]+(src|href)\s*=", page, re.I)  # everything inline
    assert not re.search(r"url\(\s*['\"]?https?:", page, re.I)
    assert not re.search(r"@import", page)
    assert page.count("<script") == 3  # plotly.js and the data (both packed), and the player


@pytest.mark.long  # the fast tier's heaviest (1-3 s): the export command
def test_export_command_and_save_html(model, tmp_path, capsys):
    h = run(model, steps=4)
    trace = h.save(tmp_path / "r.kvtrace")
    assert cli.main(["export", str(trace), "-o", str(tmp_path / "r.html")]) == 0
    assert (tmp_path / "r.html").stat().st_size > 1_000_000  # plotly.js is inside
    assert h.save_html(tmp_path / "h.html").exists()
    assert cli.main(["export", str(trace), "-o", str(tmp_path / "x.html"), "--layer", "99"]) == 1
    assert "layer 99 does not exist" in capsys.readouterr().err
    ex = kvexplore.Explorer(model, strategies=("preallocated", "paged"), max_seq_len=64)
    with pytest.raises(kvexplore.StateError, match="prefill first"):
        ex.save_html(tmp_path / "empty.html")
    ex.step()
    ex.step()
    assert ex.save_html(tmp_path / "ex.html").exists()


def test_generate_save_trace_then_export_and_diff(tmp_path, capsys):
    trace = tmp_path / "g.kvtrace"
    assert cli.main(["generate", "tiny", "--prompt", PROMPT, "--max-new-tokens", "6", "--save-trace", str(trace)]) == 0
    assert "trace saved to" in capsys.readouterr().out
    run = kvexplore.load_trace(trace)
    assert len(run) == 6 and run[0].trace.qkv and run[0].trace.attention_layers
    assert cli.main(["export", str(trace), "-o", str(tmp_path / "g.html")]) == 0
    assert cli.main(["diff", str(trace), str(trace), "--html", str(tmp_path / "d.html")]) == 0
    assert "no divergence in 6 steps" in capsys.readouterr().out
    assert (tmp_path / "d.html").exists()



@pytest.mark.long  # a subprocess that imports the package
def test_a_saved_trace_writes_its_replay_after_a_plain_import(model, tmp_path):
    """``History.save_html`` finds its writer (registered by the replay) in a process that only ran
    ``import kvexplore``: trace/ cannot import the replay, so the registration is what makes it work."""
    import subprocess
    import sys

    path = run(model, steps=3).save(tmp_path / "run.kvtrace")
    code = ("import sys, kvexplore; h = kvexplore.load_trace(sys.argv[1]); "
            "print(h.save_html(sys.argv[2]))")
    out = subprocess.run([sys.executable, "-c", code, str(path), str(tmp_path / "run.html")], capture_output=True,
                         text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    page = (tmp_path / "run.html").read_text()
    assert "<html" in page and "plotly" in page.lower()
