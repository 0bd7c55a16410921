"""kvexplore.hf and the cache doctor: transformers models stepped through their own Cache classes, watched, and
checked against recomputation; bugs planted in small Cache subclasses found at the right step and layer."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch

import kvexplore
from kvexplore import hf
from helpers import ARCHITECTURES
import doctor_plants as plants

transformers = pytest.importorskip("transformers")

PROMPT = plants.PROMPT


class FailsAtLogits(kvexplore.Tracer):
    """Fails after the forward pass, while the step is being recorded."""

    def hook(self, name, t):
        if name == "logits":
            raise RuntimeError("boom")
        return super().hook(name, t)


def build(arch: str, **extra):
    if arch == "gpt2":
        config = transformers.GPT2Config(vocab_size=300, n_embd=64, n_layer=3, n_head=4, n_positions=256,
                                         bos_token_id=1, eos_token_id=2)
        torch.manual_seed(0)
        return transformers.GPT2LMHeadModel(config).eval()
    cfg_cls, model_cls, defaults = ARCHITECTURES[arch]
    kwargs = dict(vocab_size=300, hidden_size=64, intermediate_size=128, num_hidden_layers=4, num_attention_heads=4,
                  num_key_value_heads=2, max_position_embeddings=512, bos_token_id=1, eos_token_id=2)
    kwargs.update(defaults, **extra)
    torch.manual_seed(0)
    return getattr(transformers, model_cls)(getattr(transformers, cfg_cls)(**kwargs)).eval()


ARCHS = ["gpt2", "llama", "qwen3", "gemma3", "qwen3_next"]


@pytest.fixture(scope="module")
def models(zoo):
    return lambda arch: zoo.get(("transformers", arch), lambda: build(arch))


def reference_tokens(module, prompt, n):
    module.generation_config.eos_token_id = None
    with torch.no_grad():
        out = module.generate(torch.tensor([prompt]), max_new_tokens=n, do_sample=False, pad_token_id=0)
    return out[0, len(prompt):].tolist()


def storage_bytes(hf_cache) -> int:
    """Every tensor the transformers cache holds, each storage once, read here independently of kvexplore.hf."""
    seen = {}
    for layer in hf_cache.layers:
        stack = list(vars(layer).values())
        while stack:
            v = stack.pop()
            if isinstance(v, dict):
                stack.extend(v.values())
            elif isinstance(v, tuple):
                stack.extend(v)
            elif isinstance(v, torch.Tensor) and v.dim() >= 2 and v.numel():
                seen[v.untyped_storage().data_ptr()] = v.untyped_storage().nbytes()
    return sum(seen.values())


@pytest.mark.sampled
@pytest.mark.parametrize("kind", ["hf:dynamic", "hf:static"])
@pytest.mark.parametrize("arch", ARCHS)
def test_greedy_tokens_match_generate_and_bytes_match_the_storage(models, arch, kind):
    module = models(arch)
    want = reference_tokens(module, PROMPT, 32)
    model = hf.wrap(module)
    gen = kvexplore.Generator(model, kvexplore.make_cache(kind, model, 64))
    gen.prefill(PROMPT)
    for _ in range(31):
        record = gen.step()
        m = record.memory
        assert m.reserved_bytes == storage_bytes(gen.cache.hf)
        assert m.length == record.position == len(gen.tokens) - 1
        for layer in m.layers:  # what the slots hold equals the formula, for every layer that holds positions
            if layer.kind in ("full", "sliding"):
                assert layer.logical_bytes == layer.analytic_bytes
    assert gen.generated_tokens == want


def test_a_generator_given_the_transformers_module_runs_it_through_hfmodel(models):
    """The executor adapter registered by kvexplore.hf: a bare transformers module becomes an HFModel (the
    Generator's executor and model) on the default hf:dynamic cache, and generates what ``generate`` does; a
    kvexplore cache is refused, naming the transformers caches."""
    module = models("llama")
    gen = kvexplore.Generator(module)
    assert isinstance(gen.executor, hf.HFModel) and gen.model is gen.executor and gen.executor.hf is module
    assert gen.cache.kind == "hf:dynamic"
    gen.prefill(PROMPT)
    gen.run(11, stop_at_eos=False)
    assert gen.generated_tokens == reference_tokens(module, PROMPT, 12)
    with pytest.raises(kvexplore.SettingsError,
                       match=r"cache must be a transformers cache \(kvexplore.hf.make_cache\)"):
        kvexplore.Generator(module, kvexplore.PreallocatedCache(gen.executor.config, 16))
    with pytest.warns(UserWarning, match="HFModel has no compiled decode step"):
        kvexplore.Generator(module, compile=True)
    with pytest.raises(kvexplore.SettingsError, match=r"PrefixPool pages kvexplore's own models .*cache must be a "
                                                      r"transformers cache"):
        kvexplore.PrefixPool(module, num_blocks=8)


@pytest.mark.parametrize("arch", ["llama", "gemma3", "qwen3_next"])
def test_a_dynamic_cache_moves_every_step_and_a_static_one_never(models, arch):
    model = hf.wrap(models(arch))
    dyn = kvexplore.Generator(model, kvexplore.make_cache("hf:dynamic", model))
    sta = kvexplore.Generator(model, kvexplore.make_cache("hf:static", model, 64))
    for gen in (dyn, sta):
        gen.prefill(PROMPT)
    full = next(i for i, layer in enumerate(dyn.cache.hf.layers) if type(layer).__name__ == "DynamicLayer")
    d_moves, s_ptrs = 0, set()
    for _ in range(12):
        before = dyn.cache.hf.layers[full].keys.data_ptr()
        rd, rs = dyn.step(), sta.step()
        d_moves += dyn.cache.hf.layers[full].keys.data_ptr() != before  # (a freed address may come back later)
        s_ptrs.add(sta.cache.hf.layers[full].keys.data_ptr())
        held = rd.memory.layers[full].held
        pos_bytes = rd.memory.layers[full].logical_bytes // held
        assert rd.memory.layers[full].copied_bytes == (held - 1) * pos_bytes  # a torch.cat copies what it held
        assert rd.memory.allocations > 0 and rs.memory.allocations == 0 and rs.memory.allocated_bytes == 0
        assert rs.memory.layers[full].copied_bytes == 0 and rs.memory.layers[full].written_bytes == pos_bytes
        assert rs.trace is None
    assert d_moves == 12 and len(s_ptrs) == 1
    slots = sta.cache.inspect.slot_view(full)
    assert len(slots.positions) == 64 and slots.count("filled") == len(sta.tokens) - 1
    assert dyn.cache.inspect.slot_view(full).layout.moved and not slots.layout.moved


def test_gemma3_static_sliding_layers_roll_and_the_roll_is_counted_as_copies(models):
    model = hf.wrap(models("gemma3"))
    gen = kvexplore.Generator(model, kvexplore.make_cache("hf:static", model, 64))
    gen.prefill(PROMPT)
    for _ in range(10):
        record = gen.step()
    sliding = record.memory.layers[0]
    assert sliding.kind == "sliding" and sliding.held == 8
    assert sliding.copied_bytes == 7 * sliding.logical_bytes // 8  # 7 positions moved one slot left in place
    assert gen.cache.inspect.slot_view(0).positions == list(range(len(gen.tokens) - 9, len(gen.tokens) - 1))


@pytest.mark.parametrize("kind", ["hf:dynamic", "hf:static"])
def test_rewind_fork_and_a_failed_step_leave_everything_as_it_was(models, kind):
    model = hf.wrap(models("gemma3"))
    gen = kvexplore.Generator(model, kvexplore.make_cache(kind, model, 64))
    gen.prefill(PROMPT)
    gen.run(15, stop_at_eos=False)
    want = gen.generated_tokens
    gen.rewind(9)  # past the sliding layers' window: replayed
    gen.run(9, stop_at_eos=False)
    assert gen.generated_tokens == want
    twin = gen.fork()
    assert twin.cache.hf is not gen.cache.hf
    twin.run(3, stop_at_eos=False)
    assert len(gen.tokens) + 3 == len(twin.tokens)
    before = [t.clone() for layer in gen.cache.hf.layers for t in (layer.keys, layer.values)]
    tokens, length = gen.tokens, gen.cache.length
    gen.tracer = FailsAtLogits()
    with pytest.raises(RuntimeError, match="boom"):
        gen.step()
    after = [t for layer in gen.cache.hf.layers for t in (layer.keys, layer.values)]
    assert gen.tokens == tokens and gen.cache.length == length and len(gen.history) == 16
    assert all(torch.equal(a, b) for a, b in zip(before, after))
    gen.tracer = None
    assert gen.step().token_id == twin.tokens[len(tokens)]


@pytest.mark.parametrize("kind", ["hf:dynamic", "hf:static"])
def test_a_replay_that_fails_leaves_the_transformers_cache_as_it_was(models, kind):
    """A rewind past the sliding window replays the kept tokens (HFModel.replay, the executor's): when that pass
    fails, the generator, its cache object and the transformers cache inside are untouched; the same rewind then
    succeeds and regenerates the same tokens."""
    model = hf.wrap(models("gemma3"))
    gen = kvexplore.Generator(model, kvexplore.make_cache(kind, model, 64))
    gen.prefill(PROMPT)
    gen.run(15, stop_at_eos=False)
    want, inner, length = gen.generated_tokens, gen.cache.hf, gen.cache.length
    before = [t.clone() for layer in inner.layers for t in (layer.keys, layer.values)]
    model.forward = lambda *a, **k: (_ for _ in ()).throw(RuntimeError("boom"))
    try:
        with pytest.raises(RuntimeError, match="boom"):
            gen.rewind(9)
    finally:
        del model.forward
    assert gen.generated_tokens == want and gen.cache.length == length and gen.cache.hf is inner
    assert all(torch.equal(a, b) for a, b in zip(before, (t for l in inner.layers for t in (l.keys, l.values))))
    gen.rewind(9)
    assert gen.cache.length == len(gen.tokens) - 1 and gen.cache.hf is not inner
    gen.run(9, stop_at_eos=False)
    assert gen.generated_tokens == want


def test_transformers_fp8_cache_holds_a_byte_per_element_and_the_doctor_calls_it_lossy(models):
    module = models("llama")
    model = hf.wrap(module)
    gen = kvexplore.Generator(model, kvexplore.make_cache("hf:quantized", model))
    gen.prefill(PROMPT)
    for _ in range(6):
        record = gen.step()
        assert record.memory.reserved_bytes == storage_bytes(gen.cache.hf)
        layer = record.memory.layers[0]
        assert layer.logical_bytes == layer.held * 2 * 2 * 16 * 1  # k and v, 2 kv heads of 16, float8: 1 byte
        assert layer.analytic_bytes == 4 * layer.logical_bytes  # the formula counts the model's float32
    report = kvexplore.doctor(module, prompt=PROMPT, steps=8, cache="quantized")
    assert report.diverged and report.what == "keys" and "lower precision" in report.hint, report.summary()


def test_attention_is_recorded_from_eager_attention(models):
    module = models("llama")
    model = hf.wrap(module)
    tracer = kvexplore.Tracer(capture={"cache", "attention"})
    gen = kvexplore.Generator(model, kvexplore.make_cache("hf:static", model, 32), tracer=tracer)
    gen.prefill(PROMPT)
    record = gen.step()
    rows = record.trace.attention(1)
    assert rows.shape == (1, 4, len(PROMPT) + 1)
    assert torch.allclose(rows.sum(-1), torch.ones(1, 4), atol=1e-5)
    assert record.trace.events[0].view and record.trace.events[0].read == (0, len(PROMPT) + 1)
    assert module.config._attn_implementation != "eager"  # eager only for the traced pass


@pytest.mark.sampled
@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("cache", ["dynamic", "static"])
def test_the_doctor_finds_nothing_on_unmodified_models(models, arch, cache):
    report = kvexplore.doctor(models(arch), prompt=PROMPT, steps=24, cache=cache)
    assert not report.diverged and report.steps == 24, report.summary()
    assert report.worst.relative < 1e-4
    assert report.summary().startswith("no divergence in 24 steps")


@pytest.mark.parametrize("cache", ["preallocated", "paged", "concat", "sink"])
def test_the_doctor_runs_on_kvexplore_models(tiny, cache):
    report = kvexplore.doctor(tiny, steps=20, cache=cache)
    assert not report.diverged, report.summary()


def test_the_doctor_sees_a_sink_cache_drop_positions(tiny):
    cache = kvexplore.make_cache("sink", tiny, max_seq_len=12, sinks=2)
    report = kvexplore.doctor(tiny, prompt=[1, 5, 9, 20], steps=20, cache=cache)
    assert report.diverged and report.what == "output" and report.step is not None
    assert "did not read" in report.hint


PLANTS = {
    "off by one": ("llama", lambda m: plants.OffByOne(), PROMPT, (1, 0), "position off by one"),
    "keys before RoPE": ("llama", lambda m: plants.KeysBeforeRope(m), PROMPT, (0, 0), "keys stored before RoPE"),
    "values are keys": ("llama", lambda m: plants.ValuesAreKeys(m, 2, 10), PROMPT, (4, 2), "keys where the values go"),
    "late write": ("llama", lambda m: plants.LateWrite(m, 40, 11), PROMPT, (5, 0), "stale or skipped slot"),
    "half window": ("gemma3", lambda m: plants.HalfWindow(m), PROMPT[:3], (2, 0), "window applied twice"),
}


@pytest.mark.parametrize("name", list(PLANTS))
def test_the_doctor_finds_each_planted_bug_at_its_step_and_layer(name):
    arch, plant, prompt, (step, layer), words = PLANTS[name]
    module = build(arch)
    report = kvexplore.doctor(module, prompt=prompt, steps=16, cache=plant(module))
    assert report.diverged and (report.step, report.layer) == (step, layer), report.summary()
    assert words in report.hint, report.hint
    assert report.max_diff > 1e-2 and report.position is not None
    assert report.summary().startswith(f"first divergence at step {step}, layer {layer}")


def test_the_doctor_finds_a_missing_rope_offset_in_patched_rotary():
    module = build("qwen3")
    plants.missing_rope_offset(module)
    report = kvexplore.doctor(module, prompt=PROMPT, steps=8)
    assert (report.step, report.layer, report.position) == (1, 0, len(PROMPT))
    assert "missing RoPE offset" in report.hint


def test_the_doctor_refuses_bad_input_clearly(models):
    module = models("llama")
    with pytest.raises(kvexplore.SettingsError, match="unknown transformers cache 'nope'"):
        kvexplore.doctor(module, prompt=PROMPT, cache="nope")
    with pytest.raises(kvexplore.SettingsError, match="needs a tokenizer"):
        kvexplore.doctor(module, prompt="text")
    with pytest.raises(kvexplore.SettingsError, match="outside the vocabulary"):
        kvexplore.doctor(module, prompt=[1, 999])
    with pytest.raises(kvexplore.SettingsError, match="offloaded cache"):
        kvexplore.doctor(module, prompt=PROMPT, cache="offloaded")


@pytest.fixture(scope="module")
def folder(zoo):
    return zoo.checkpoint("llama", layers=2)[0]


def run_cli(capsys, *args):
    """``kvexplore ARGS`` in this process: (exit status, stdout, stderr)."""
    from kvexplore.cli import main

    code = main(list(args))
    out = capsys.readouterr()
    return code, out.out, out.err


def test_doctor_command_exit_status(folder, capsys):
    code, out, err = run_cli(capsys, "doctor", str(folder), "--steps", "8")
    assert code == 0, err
    assert "no divergence in 8 steps" in out
    code, out, _ = run_cli(capsys, "doctor", str(folder), "--steps", "8", "--cache", "hf:quantized")  # fp8 keys depart
    assert code == 1 and "first divergence at step" in out
    code, out, _ = run_cli(capsys, "doctor", str(folder), "--steps", "8", "--cache", "paged")
    assert code == 0 and "cache paged" in out
    code, _, err = run_cli(capsys, "doctor", str(folder / "missing"), "--steps", "8")
    assert code == 2 and "error" in err
    code, _, err = run_cli(capsys, "doctor", str(folder), "--cache", "nope")
    assert code == 2 and "unknown transformers cache" in err


@pytest.mark.long  # imports transformers in a subprocess
def test_doctor_command_in_its_own_process(folder):
    """The smoke test of the real command: a process of its own, its exit status and its report."""
    clean = subprocess.run([sys.executable, "-m", "kvexplore.cli", "doctor", str(folder), "--steps", "8"],
                           capture_output=True, text=True, timeout=300)
    assert clean.returncode == 0, clean.stderr
    assert "no divergence in 8 steps" in clean.stdout


def test_the_explorer_runs_transformers_caches_beside_kvexplore_strategies(folder):
    module = transformers.AutoModelForCausalLM.from_pretrained(folder).eval()
    ex = kvexplore.Explorer(module, folder, strategies=("hf:dynamic", "hf:static", "preallocated"), max_seq_len=48)
    ex.step()
    for _ in range(6):
        ex.step()
    tokens = {name: lane.generator.tokens for name, lane in ex.lanes.items()}
    assert len(set(map(tuple, tokens.values()))) == 1
    rows = {r[0].split()[0]: r for r in ex.compare_rows()}
    assert float(rows["preallocated"][3]) < 1e-6  # KL from the transformers lane: the same weights
    for name in ("hf:dynamic", "hf:static"):
        ex.controls["lane"].value = name
        specs = ex.specs()
        assert all(specs[v].traces for v in ("cache_map", "attention", "memory"))
        slots = ex.lane.cache.inspect.slot_view(0)
        if name == "hf:static":
            assert len(slots.positions) == 48 and not slots.layout.moved
        else:
            assert len(slots.positions) == len(ex.session.tokens) - 1 and slots.layout.moved
    ex.rewind(2)
    ex.fork()
    assert "hf:static fork 1" in ex.lanes


def test_the_explorer_shows_an_architecture_kvexplore_does_not_implement(models):
    module = models("gpt2")
    ex = kvexplore.Explorer(module)
    ex.session.prefill(PROMPT)
    ex.step()
    assert list(ex.lanes) == ["hf:dynamic", "hf:static"] and ex.specs()["cache_map"].traces
    with pytest.raises(kvexplore.SettingsError, match="kvexplore does not implement GPT2LMHeadModel"):
        kvexplore.Explorer(module, strategies=("hf:dynamic", "preallocated"))


@pytest.mark.sampled
@pytest.mark.parametrize("kind", ["hf:dynamic", "hf:static"])
@pytest.mark.parametrize("arch", ["llama", "gemma3", "qwen3_next"])
def test_speculative_decoding_on_transformers_caches_gives_plain_greedy_tokens(models, arch, kind):
    """Prompt lookup on transformers' own caches: full layers are cut by transformers' crop, sliding and state layers
    rolled back and recomputed; the tokens are plain greedy decoding's."""
    model = hf.wrap(models(arch))
    prompt = [*PROMPT, *PROMPT[:6], *PROMPT, *PROMPT[:6]]
    plain = kvexplore.Generator(model, kvexplore.make_cache(kind, model, 96))
    plain.prefill(prompt)
    plain.run(24, stop_at_eos=False)
    spec = kvexplore.Generator(model, kvexplore.make_cache(kind, model, 96), draft="prompt-lookup", draft_tokens=4)
    spec.prefill(prompt)
    spec.run(24, stop_at_eos=False)
    assert spec.tokens == plain.tokens and spec.speculation.drafted > 0
    ways = {v.take_back for v in spec.speculation.verifications if v.rolled_back}
    assert ways <= ({"truncate"} if arch == "llama" else {"recompute"})


def test_a_rolled_back_static_step_puts_the_layers_counters_back(models):
    """transformers' static layers count their length in a tensor they update in place: a rollback restores it, so
    the next step writes where the kept sequence ends (it wrote past the taken-back slots before)."""
    model = hf.wrap(models("llama"))
    gen, ref = (kvexplore.Generator(model, kvexplore.make_cache("hf:static", model, 64)) for _ in range(2))
    gen.prefill(PROMPT)
    ref.prefill(PROMPT)
    gen.step(keep_undo=True)
    gen.undo_step()
    assert [gen.step().token_id for _ in range(4)] == [ref.step().token_id for _ in range(4)]
    assert [c.prob for c in gen.history[-1].top] == [c.prob for c in ref.history[-1].top]
