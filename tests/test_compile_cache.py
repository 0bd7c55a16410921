"""Compiled steps kept for a later process: what a compile says (reused, stale, missing, saved), the weights in the
cache key of a frozen graph, and the compile's progress line. The reuse itself, a second process that compiles
nothing, is in test_compiled.py (it needs the compiled step that tests there build)."""

from __future__ import annotations

import io

import pytest
import torch
from torch._dynamo.utils import counters

from kvexplore.cli.compile_progress import FIRST, compile_progress, phase_now
from kvexplore.runtime import compile_cache
from kvexplore.runtime.compile_cache import Saved, step_key, watched, weights_fingerprint


class Tiny(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.proj = torch.nn.Linear(4, 3)
        self.register_buffer("table", torch.arange(5.0))


def compile_as(model, saved, hit=0, miss=0, bypass=0, frozen=True):
    """A compile that inductor answers with these cache counts (what ``watched`` reads)."""
    with watched(model, "tiny | float32 | 64 slots | max-autotune", frozen, saved) as out:
        c = counters["inductor"]
        c["fxgraph_cache_hit"] += hit
        c["fxgraph_cache_miss"] += miss
        c["fxgraph_cache_bypass"] += bypass
    return out["note"]


def test_by_default_the_fastest_step_is_compiled_and_the_note_says_why_it_is_not_kept(tmp_path, monkeypatch):
    """Packed oneDNN products are the fastest step here and inductor's cache refuses them: the default."""
    import torch._inductor.config as inductor

    monkeypatch.delenv(compile_cache.REUSE, raising=False)
    with watched(Tiny(), "k", True, Saved(tmp_path / "c.json")):
        assert inductor.post_grad_custom_post_pass is None  # no fingerprint: nothing will be kept
    note = compile_as(Tiny(), Saved(tmp_path / "c.json"), bypass=1)
    assert "its linear weights are packed for oneDNN" in note and "KVEXPLORE_COMPILE_REUSE=1 keeps the step" in note
    assert Saved(tmp_path / "c.json").get("tiny | float32 | 64 slots | max-autotune") is None


def test_a_compile_says_whether_it_saved_reused_or_rebuilt_its_step(tmp_path, monkeypatch):
    monkeypatch.setattr(compile_cache, "inductor_cache_dir", lambda: "/cache")
    monkeypatch.setenv(compile_cache.REUSE, "1")
    saved, model = Saved(tmp_path / "compiled.json"), Tiny()
    assert compile_as(model, saved, miss=1) == "compiled and saved in /cache: a later process loads it"
    entry = saved.get("tiny | float32 | 64 slots | max-autotune")
    assert entry["torch"] == torch.__version__ and entry["weights"] == weights_fingerprint(model)
    assert compile_as(model, saved, hit=1).startswith("reused the compiled step an earlier process saved")
    assert "(cleared?): rebuilt" in compile_as(model, saved, miss=1)  # saved before, not found
    with torch.no_grad():
        model.proj.weight[0, 0] += 1
    assert "saved for this model's earlier weights is stale: rebuilt" in compile_as(model, saved, miss=1)
    saved.put("tiny | float32 | 64 slots | max-autotune", {**saved.get("tiny | float32 | 64 slots | max-autotune"),
                                                           "torch": "2.5.0"})
    assert f"saved with torch 2.5.0 is stale (torch {torch.__version__} now): rebuilt" in \
        compile_as(model, saved, miss=1)
    assert saved.get("tiny | float32 | 64 slots | max-autotune")["torch"] == torch.__version__  # rewritten
    assert "not saved for a later process: inductor's cache refused the graph" in compile_as(model, saved, bypass=1)
    assert "FX graph cache took no part (turned off?" in compile_as(model, saved)  # no hit, miss or refusal


def test_a_frozen_graph_has_the_weights_in_its_cache_key(tmp_path, monkeypatch):
    """A frozen graph kept for reuse holds the weights as constants and inductor's key does not cover their values:
    the fingerprint of every parameter and buffer goes into it as a custom pass's uuid (one that changes nothing)."""
    import torch._inductor.config as inductor

    monkeypatch.setenv(compile_cache.REUSE, "1")

    model = Tiny()
    before = weights_fingerprint(model)
    with torch.no_grad():
        model.table[4] = 7.0  # a buffer counts as much as a parameter
    assert weights_fingerprint(model) != before
    seen = {}
    with watched(model, "k", True, Saved(tmp_path / "c.json")):
        seen["pass"] = inductor.post_grad_custom_post_pass
    assert seen["pass"].uuid() == weights_fingerprint(model) and seen["pass"](None) is None
    assert inductor.post_grad_custom_post_pass is None  # only during the compile
    with watched(model, "k", False, Saved(tmp_path / "c.json")):  # weights as graph inputs: their shapes key it
        assert inductor.post_grad_custom_post_pass is None


def test_the_step_key_names_model_dtype_capacity_and_mode(tiny):
    assert step_key(tiny, 96, "max-autotune").endswith("| float32 | 96 slots | max-autotune")


def test_a_home_that_cannot_be_written_still_gives_the_note(tmp_path):
    (tmp_path / "file").write_text("")
    saved = Saved(tmp_path / "file" / "compiled.json")  # a file where the folder should be
    saved.put("k", {"torch": "x"})
    assert saved.get("k") is None


def test_the_progress_line_names_the_phase_after_the_last_one_finished():
    metrics = {"aot_collect_metadata": [0.1]}
    start = {"aot_collect_metadata": 1}  # ended in an earlier compile: not this one's
    assert phase_now(metrics, start) == FIRST
    metrics["aot_collect_metadata"].append(0.2)
    assert phase_now(metrics, start) == "functionalizing and freezing the graph"
    metrics["GraphLowering.run"] = [1.0]
    assert phase_now(metrics, start) == "autotuning the matrix products, generating the kernels"
    stream = io.StringIO()
    with compile_progress(stream, every=0.01):
        import time
        time.sleep(0.05)
    assert "compiling the decode step: tracing the step [00:00]" in stream.getvalue()
