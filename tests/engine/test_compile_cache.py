"""Compiled graphs kept for a later process: what a compile says (loaded, saved, stale, missing, not saved), the key
of a saved graph, what a whole-step compile says about inductor's cache, and the compile's progress line. The
reuse itself, a second process that compiles nothing, is in test_compiled.py (it needs a compiled step)."""

from __future__ import annotations

import io

import pytest
import torch
from torch._dynamo.utils import counters

from kvexplore.fast.progress import FIRST, compile_progress, phase_now
from kvexplore.fast import artifacts, compile_cache, regional
from kvexplore.fast.artifacts import Saved, graph_key, note, step_key

STEP = "tiny | float32 | 64 slots | regional"


def test_a_compile_says_whether_it_loaded_saved_or_rebuilt_its_graphs(tmp_path, monkeypatch):
    saved = Saved(tmp_path)
    assert note(saved, STEP, ["a", "b"], built=2, stored=True) == \
        f"compiled and saved in {tmp_path}: a later process loads it"
    entry = saved.get(STEP)
    assert entry["torch"] == torch.__version__ and entry["files"] == ["a", "b"]
    assert note(saved, STEP, ["a", "b"], built=0, stored=True).startswith(
        f"loaded the compiled graphs an earlier process saved ({tmp_path}): nothing compiled")
    assert "was not in" in note(saved, STEP, ["a", "b"], built=2, stored=True)  # saved before, its files gone
    assert "another version of the model's layer code, config or shapes" in \
        note(saved, STEP, ["a", "c"], built=1, stored=True)
    saved.put(STEP, {**saved.get(STEP), "torch": "2.5.0"})
    assert f"the step saved with torch 2.5.0 is stale (torch {torch.__version__} now): rebuilt and saved" == \
        note(saved, STEP, ["a", "c"], built=2, stored=True)
    assert saved.get(STEP)["torch"] == torch.__version__  # rewritten
    saved.put(STEP, {**saved.get(STEP), "machine": "AVX2, 7 threads"})
    assert "(the step saved before was built for AVX2, 7 threads; each is kept)" in \
        note(saved, STEP, ["a", "c"], built=2, stored=True)
    assert "not saved for a later process" in note(saved, STEP, ["a"], built=1, stored=False)


def test_a_home_that_cannot_be_written_still_gives_the_note(tmp_path):
    (tmp_path / "file").write_text("")
    saved = Saved(tmp_path / "file")  # a file where the folder should be
    assert not saved.put("k", {"torch": "x"}) and saved.get("k") is None
    assert note(saved, STEP, ["a"], built=1, stored=True).startswith("compiled; not saved for a later process")


def test_the_saved_folder_is_kvexplore_home_unless_kvexplore_compiled_says_otherwise(tmp_path, monkeypatch):
    monkeypatch.setenv("KVEXPLORE_HOME", str(tmp_path / "home"))
    monkeypatch.delenv("KVEXPLORE_COMPILED", raising=False)
    assert Saved().folder == tmp_path / "home" / "compiled"
    monkeypatch.setenv("KVEXPLORE_COMPILED", str(tmp_path / "graphs"))
    assert Saved().folder == tmp_path / "graphs"


def test_a_graph_key_changes_with_the_code_the_shapes_the_threads_and_the_options():
    def f(x):
        return torch.relu(x) * 2

    def g(x):
        return torch.relu(x) * 3

    fx, gx = torch.fx.symbolic_trace(f), torch.fx.symbolic_trace(g)
    x = torch.zeros(4, 8)
    key = graph_key(fx, [x], {"size_asserts": False})
    assert key == graph_key(torch.fx.symbolic_trace(f), [torch.ones(4, 8)], {"size_asserts": False})  # values: no
    assert key != graph_key(gx, [x], {"size_asserts": False})  # another constant baked into the code
    assert key != graph_key(fx, [torch.zeros(4, 9)], {"size_asserts": False})
    assert key != graph_key(fx, [torch.zeros(8, 4).t()], {"size_asserts": False})  # strides
    assert key != graph_key(fx, [x], {})
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(threads + 1)
        assert key != graph_key(fx, [x], {"size_asserts": False})  # the kernels are built for a number of threads
    finally:
        torch.set_num_threads(threads)


def test_a_graph_that_cannot_be_read_is_compiled_again(tmp_path):
    saved = Saved(tmp_path)
    assert artifacts.load(saved, "missing") is None
    saved.file("broken").write_bytes(b"not an artifact")
    assert artifacts.load(saved, "broken") is None


def test_the_step_key_names_model_dtype_capacity_and_mode(tiny):
    assert step_key(tiny, 96, "regional").endswith("| float32 | 96 slots | regional")


def whole_step_note(hit=0, miss=0, bypass=0):
    """What a whole-step compile says when inductor's cache answers with these counts."""
    with compile_cache.watched() as out:
        c = counters["inductor"]
        c["fxgraph_cache_hit"] += hit
        c["fxgraph_cache_miss"] += miss
        c["fxgraph_cache_bypass"] += bypass
    return out["note"]


def test_a_whole_step_compile_says_what_inductors_cache_did(monkeypatch):
    monkeypatch.setattr(compile_cache, "inductor_cache_dir", lambda: "/cache")
    assert whole_step_note(hit=1) == "reused the compiled step an earlier process left in inductor's cache (/cache)"
    assert "frozen into the graph and packed for oneDNN" in whole_step_note(bypass=1)
    assert whole_step_note(miss=1).startswith("compiled and kept in inductor's cache (/cache)")
    assert "took no part (turned off?" in whole_step_note()


def test_the_progress_line_names_the_phase_after_the_last_one_finished(monkeypatch):
    metrics = {"aot_collect_metadata": [0.1]}
    start = {"aot_collect_metadata": 1}  # ended in an earlier compile: not this one's
    assert phase_now(metrics, start) == FIRST
    metrics["aot_collect_metadata"].append(0.2)
    assert phase_now(metrics, start) == "functionalizing and freezing the graph"
    metrics["GraphLowering.run"] = [1.0]
    assert phase_now(metrics, start) == "autotuning the matrix products, generating the kernels"
    monkeypatch.setattr(regional.PROGRESS, "phase", "compiling layer 0 (one graph for every layer)")
    assert phase_now(metrics, start) == "compiling layer 0 (one graph for every layer)"  # the regional step's own
    monkeypatch.setattr(regional.PROGRESS, "phase", "")
    stream = io.StringIO()
    with compile_progress(stream, every=0.01):
        import time
        time.sleep(0.05)
    assert "compiling the decode step: tracing the step [00:00]" in stream.getvalue()


@pytest.mark.parametrize("out", [64, 70])
def test_blocked_products_equal_linear(out):
    """The regional step's products: a blocked copy of the weight (the last block filled with zero rows where the
    output is not a multiple of 16) gives F.linear's output, for one row and several."""
    from kvexplore.fast.blocked import BLOCK, BlockedLinear

    torch.manual_seed(0)
    lin = torch.nn.Linear(48, out)
    blocked = BlockedLinear(lin.weight, lin.bias)
    assert blocked.blocks.shape == (-(-out // BLOCK), 48, BLOCK)
    for x in (torch.randn(1, 1, 48), torch.randn(2, 3, 48)):
        assert torch.allclose(blocked(x), lin(x), atol=1e-5)
    assert blocked.bias is lin.bias  # the module's own
