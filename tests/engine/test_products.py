"""The product kernels (kvexplore.fast.kernels) of one row and of a verification's few, applied to a model from
outside: the same products as F.linear within float32 rounding, taken only where they apply, saved for a later
process, a step's products really run on them once applied and never before, a drafting generator's tokens plain
greedy's, and a plain decode that imports nothing of the compiler. Where they run is chosen per machine (each
width's kernel timed against F.linear): the tests of their numerics force them on (KVEXPLORE_PRODUCTS=kernels), the
tests of the choice give the timing fixed figures (nothing here asserts on a real timing)."""

from __future__ import annotations

import re
import time

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.overrides import TorchFunctionMode

import kvexplore
from kvexplore.fast import kernels as products
from kvexplore.fast import product_kernels, product_timing
from kvexplore.fast.kernels import KernelLinear

with pytest.MonkeyPatch.context() as _env:  # the suite runs on F.linear (tests/conftest.py); these tests force them
    _env.setenv("KVEXPLORE_PRODUCTS", "kernels")
    _REFUSAL = product_kernels.refusal()
pytestmark = pytest.mark.skipif(bool(_REFUSAL), reason=_REFUSAL)


@pytest.fixture(scope="module", autouse=True)
def _forced():
    """The kernels on for every product they take, untimed (the tests of the choice unset it), from the module's
    first fixture on (the suite runs on F.linear: tests/conftest.py)."""
    with pytest.MonkeyPatch.context() as env:
        env.setenv("KVEXPLORE_PRODUCTS", "kernels")
        yield


@pytest.fixture(scope="module")
def kernel():
    assert products.prepare(), products.status()
    return products.KERNELS.get()


@pytest.mark.parametrize("out, width", [(1, 1), (21, 37), (576, 576), (1536, 576), (576, 1536), (49152, 64)])
def test_one_row_equals_f_linear_within_rounding(kernel, out, width):
    g = torch.Generator().manual_seed(out * 7 + width)
    x, w, b = torch.randn(1, 1, width, generator=g), torch.randn(out, width, generator=g), torch.randn(out, generator=g)
    want = F.linear(x, w, b)
    got = products.linear(x, w, b)
    assert got.shape == want.shape == (1, 1, out)
    assert (got - want).abs().max().item() <= 1e-5 * max(1.0, width ** 0.5)
    assert not torch.equal(got, want) or out * width < 100  # another order of sums: it did not fall back


class _Watching(TorchFunctionMode):
    def __torch_function__(self, func, types, args=(), kwargs=None):
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize("rows", [2, 3, 4, 5, 6, 8, 9, 13, products.MAX_ROWS])
@pytest.mark.parametrize("out, width", [(21, 37), (576, 576), (1536, 576), (576, 1536), (49152, 64)])
def test_a_verifications_rows_equal_f_linear_within_rounding(kernel, rows, out, width):
    """k + 1 rows (a verification of k drafts) on the kernel of that many rows: each row's products as F.linear's
    within float32 rounding, and as the one-row kernel's for that row."""
    g = torch.Generator().manual_seed(out * 7 + width + rows)
    x = torch.randn(1, rows, width, generator=g)
    w, b = torch.randn(out, width, generator=g), torch.randn(out, generator=g)
    assert products.takes_kernel(x, w)
    want = F.linear(x, w, b)
    got = products.linear(x, w, b)
    assert got.shape == want.shape == (1, rows, out)
    assert (got - want).abs().max().item() <= 1e-5 * max(1.0, width ** 0.5)
    assert not torch.equal(got, want)  # another order of sums: it did not fall back
    one_by_one = torch.cat([products.linear(x[:, i:i + 1], w, b) for i in range(rows)], dim=1)
    assert (got - one_by_one).abs().max().item() <= 1e-5 * max(1.0, width ** 0.5)


def test_each_count_of_rows_runs_on_its_own_kernel_and_more_on_f_linear(kernel, monkeypatch):
    """1 to MAX_ROWS rows each on the kernel of that count of rows (each weight read once for all of them); above
    MAX_ROWS (a prompt's prefill) F.linear with no kernel."""
    calls = []
    run = products.Kernel.__call__
    monkeypatch.setattr(products.Kernel, "__call__", lambda self, x, w: calls.append((self, x.shape[0])) or
                        run(self, x, w))
    w = torch.randn(50, 40)
    kernels = {}
    for rows in [1, 2, 3, 6, 9, products.MAX_ROWS, products.MAX_ROWS + 1]:
        if rows <= products.MAX_ROWS:
            products.KERNELS.get(40, rows)  # built (and checked on one product) before counting, if it was not yet
        calls.clear()
        x = torch.randn(rows, 40)
        assert torch.allclose(products.linear(x, w), F.linear(x, w), atol=1e-4)
        if rows <= products.MAX_ROWS:
            assert [n for _, n in calls] == [rows]
            kernels[rows] = calls[0][0]
        else:
            assert calls == []
    assert len(set(kernels.values())) == len(kernels) and kernels[1] is kernel
    assert products.MAX_ROWS == 16


@pytest.mark.parametrize("case", ["more rows than a verification", "bfloat16", "gradients", "column-major weight",
                                  "a function mode"])
def test_everything_else_is_f_linear_itself(kernel, case):
    g = torch.Generator().manual_seed(3)
    rows = products.MAX_ROWS + 1 if case == "more rows than a verification" else 1
    x, w = torch.randn(rows, 300, generator=g), torch.randn(200, 300, generator=g)
    if case == "bfloat16":
        x, w = x.bfloat16(), w.bfloat16()
    if case == "gradients":
        w.requires_grad_(True)
    if case == "column-major weight":
        w = w.t().contiguous().t()
    assert not products.takes_kernel(x, w) or case == "a function mode"
    if case == "a function mode":
        with _Watching():
            assert not products.takes_kernel(x, w)
            got = products.linear(x, w)
    else:
        got = products.linear(x, w)
    assert torch.equal(got, F.linear(x, w))


def test_a_step_runs_its_products_on_the_kernels_once_applied_and_keeps_its_tokens(tiny, monkeypatch):
    calls = []
    run = products.Kernel.__call__
    monkeypatch.setattr(products.Kernel, "__call__", lambda self, x, w: calls.append(w.shape) or run(self, x, w))

    def generated(**kernels):
        gen = kvexplore.Generator(tiny, kvexplore.PreallocatedCache(tiny.config, 40), **kernels)
        gen.prefill([1, 5, 9, 2])
        gen.run(11, stop_at_eos=False)
        return gen

    was = products.applied(tiny)  # the shared model: an explorer's lanes may have applied them
    products.remove(tiny)
    plain = generated()
    assert not plain.kernels and calls == [] and not products.applied(tiny)
    assert not any(isinstance(m, KernelLinear) for m in tiny.modules())
    state = {name: t.clone() for name, t in tiny.state_dict().items()}
    layers = tiny.config.num_layers
    # q, k, v, o, gate, up, down per layer and the head, per decode step; the prefill's 4 rows through each layer's
    # seven on the 4-row kernel, and its head on its last row
    steps = 11 * (7 * layers + 1) + 7 * layers + 1
    # build (and check: one product each) every kernel the run takes before counting, whichever test of this process
    # built them first, so that only the run's own products count
    products.apply(tiny, rows=4)
    products.remove(tiny)
    calls.clear()
    try:
        fast = generated(kernels=True)
        assert fast.kernels and products.applied(tiny)
        assert len(calls) == steps
        assert fast.generated_tokens == plain.generated_tokens and len(plain.generated_tokens) == 12
        assert tiny.state_dict().keys() == state.keys()  # the same names and values, laid out row-major
        assert all(torch.equal(t, state[name]) and t.is_contiguous() for name, t in tiny.state_dict().items())
    finally:
        products.remove(tiny)
    assert not products.applied(tiny) and not any(isinstance(m, KernelLinear) for m in tiny.modules())
    again = generated()
    assert again.generated_tokens == plain.generated_tokens and len(calls) == steps
    if was:
        products.apply(tiny)


@pytest.mark.parametrize("k", [3, 5, 8])
def test_a_drafting_generators_tokens_are_plain_greedys_with_the_kernels_on(trained, k, monkeypatch):
    """Prompt lookup with k drafts on the packaged tiny model, kernels on: the kernels of 2 to k + 1 rows are built
    with the generator, its verifications' rows run on them, and it gives plain greedy's tokens (kernels on and
    off)."""
    prompt = "The cat sat on the mat. The dog sat on the log. The cat sat on the mat. The dog sat"

    def greedy(**options):
        gen = kvexplore.Generator(trained, kvexplore.PreallocatedCache(trained.config, 128), **options)
        gen.prefill(prompt)
        gen.run(24, stop_at_eos=False)
        return gen

    was = products.applied(trained)
    products.remove(trained)
    try:
        off = greedy()
        on = greedy(kernels=True)
        rows = []
        run = products.Kernel.__call__
        monkeypatch.setattr(products.Kernel, "__call__", lambda self, x, w: rows.append(x.shape[0]) or run(self, x, w))
        drafting = greedy(kernels=True, draft="prompt-lookup", draft_tokens=k)
        threads = torch.get_num_threads()
        assert all((threads, n, 256) in products.KERNELS.rows_kernels for n in range(2, k + 2))  # the hidden width's
    finally:
        products.remove(trained)
        if was:
            products.apply(trained)
    spec = drafting.speculation
    assert spec.accepted > 0 and max(len(v.drafted) for v in spec.verifications) > 1
    assert max(rows) == k + 1 and all(1 <= n <= k + 1 for n in rows)  # verifications' rows, on their kernels
    assert drafting.generated_tokens == on.generated_tokens == off.generated_tokens


def test_a_transformers_model_or_a_bfloat16_one_is_left_as_it_is(tiny):
    half = kvexplore.load("tiny", dtype=torch.bfloat16)
    assert not products.apply(half) and not products.applied(half)
    assert not any(isinstance(m, KernelLinear) for m in half.modules())
    assert not products.apply(object())
    with pytest.raises(kvexplore.SettingsError, match="kernels must be True or False"):
        kvexplore.Generator(tiny, kvexplore.PreallocatedCache(tiny.config, 8), kernels="yes")


def test_the_models_files_name_no_kernel():
    """The models are plain torch: no file of theirs imports the speed stack or swaps in a kernel (issue 59; the plain
    decode's imports are checked in tests/project/test_layout.py)."""
    from pathlib import Path

    models = Path(kvexplore.__file__).parent / "models"
    switch = re.compile(r"^\s*(from|import)\s+\S*(fast|products|linear)\b|KernelLinear|\binstall\(", re.M)
    assert [p.name for p in models.rglob("*.py") if switch.search(p.read_text())] == []


def test_a_models_widest_weights_get_a_kernel_of_their_width(trained):
    """The packaged tiny model's 256-wide weights (q, k, v, gate, up and the head: 3.6M values) get a kernel of that
    width,
    its 512-wide ones (down: 0.8M) keep the kernel of any sizes; both give F.linear's products within rounding."""
    assert products.prepare_for(trained), products.status()
    threads = torch.get_num_threads()
    assert (threads, 256) in products.KERNELS.widths and (threads, 512) not in products.KERNELS.widths
    fixed, general = products.KERNELS.get(256), products.KERNELS.get()
    assert fixed is not general and products.KERNELS.get(512) is general
    assert "kernel of width 256" in products.status()
    calls, runs = [], {kernel: kernel.run for kernel in (fixed, general)}
    for kernel, run in runs.items():
        kernel.run = lambda args, _run=run, _kernel=kernel: calls.append(_kernel) or _run(args)
    try:
        g = torch.Generator().manual_seed(5)
        for width in (256, 512):
            x, w = torch.randn(1, width, generator=g), torch.randn(700, width, generator=g)
            got, want = products.linear(x, w), F.linear(x, w)
            assert (got - want).abs().max().item() <= 1e-5 * width ** 0.5
    finally:
        for kernel, run in runs.items():
            kernel.run = run
    assert calls == [fixed, general]


@pytest.mark.compile  # compiles the kernels afresh in an empty folder (seconds of C++)
def test_a_later_process_loads_the_saved_kernels(tmp_path, monkeypatch):
    monkeypatch.setenv("KVEXPLORE_COMPILED", str(tmp_path))
    first, later = products.Kernels(), products.Kernels()
    assert first.get() is not None and first.built == 1
    assert "compiled the one-row product kernel and saved it in" in first.note and str(tmp_path) in first.note
    assert first.prepare_widths([48]) == [48] and first.built == 2
    assert "compiled the one-row product kernel of width 48 and saved it in" in first.width_notes[48]
    assert later.get() is not None and later.prepare_widths([48]) == [48] and later.built == 0
    assert later.note.startswith("loaded the one-row product kernel an earlier process saved")
    assert later.width_notes[48].startswith("loaded the one-row product kernel of width 48 an earlier process")
    x, w = torch.randn(1, 50), torch.randn(30, 50)
    assert torch.equal(first.get()(x, w), later.get()(x, w))
    x, w = torch.randn(1, 48), torch.randn(30, 48)
    assert torch.equal(first.get(48)(x, w), later.get(48)(x, w))
    assert (first.get(48)(x, w) - F.linear(x, w)[0]).abs().max().item() <= 1e-5 * 48 ** 0.5
    first.prepare_rows([48, None], range(2, 4))  # a verification's rows: of that width, and of any sizes
    assert first.built == 6
    assert "compiled the 3-row product kernel of width 48 and saved it in" in first.rows_notes[3, 48]
    later.prepare_rows([48, None], range(2, 4))
    assert later.built == 0 and later.rows_notes[3, None].startswith("loaded the 3-row product kernel an earlier")
    for width in (48, 50):
        x, w = torch.randn(3, width), torch.randn(30, width)
        # the loaded kernel may split its sums as the first one did not: the same products within float32 rounding
        assert torch.allclose(first.get(width, 3)(x, w), later.get(width, 3)(x, w), rtol=0, atol=1e-5 * width ** 0.5)
        assert (later.get(width, 3)(x, w) - F.linear(x, w)).abs().max().item() <= 1e-5 * width ** 0.5


def test_switched_off_by_the_environment(monkeypatch):
    monkeypatch.setenv("KVEXPLORE_PRODUCTS", "torch")
    off = products.Kernels()
    assert not off.enabled() and off.get() is None
    assert off.why == "KVEXPLORE_PRODUCTS=torch: every product is F.linear"


# Where the kernels run: each width's kernel timed against F.linear (here: fixed figures), the verdict saved


def _chooser(monkeypatch, tmp_path, kernel, speeds, steady=True):
    """A fresh Kernels saving its verdicts in tmp_path, whose every kernel is the loaded one of any sizes (nothing
    compiled), and a timing that gives ``speeds[(width, rows)]`` (the kernel's speed against F.linear's); the
    timings asked for, in order."""
    kernels = {n: kernel if n == 1 else products.KERNELS.get(None, n) for n in range(1, 4)}  # loaded as saved
    monkeypatch.delenv("KVEXPLORE_PRODUCTS", raising=False)
    monkeypatch.setenv("KVEXPLORE_COMPILED", str(tmp_path))
    chooser = products.Kernels()
    monkeypatch.setattr(chooser, "get", lambda width=None, rows=1: kernels[rows])
    monkeypatch.setattr(chooser, "_kernel", lambda width, rows, own: kernels[rows])
    asked = []
    monkeypatch.setattr(product_kernels, "passes", lambda kernel, width, rows, weights: (width, rows))
    monkeypatch.setattr(product_timing, "timed", lambda width, rows, budget: asked.append((width, rows)) or
                        product_timing.Timing(1.0, speeds[width, rows], speeds[width, rows], steady))
    return chooser, asked


def _weights(*shapes):
    g = torch.Generator().manual_seed(11)
    return [torch.randn(out, width, generator=g) for out, width in shapes]


def test_a_kernel_slower_than_f_linear_is_not_used(kernel, monkeypatch, tmp_path):
    """Width 40's kernel ran 0.95x F.linear's speed: its products stay F.linear's (and its counts of rows are not
    timed at all); width 48's ran 1.02x, under the 3% it must beat; width 56's 1.2x: the kernel, at each count of
    rows that beat F.linear too (2 rows did, 3 rows did not)."""
    speeds = {(40, 1): 0.95, (48, 1): 1.02, (56, 1): 1.2, (56, 2): 1.1, (56, 3): 0.9}
    chooser, asked = _chooser(monkeypatch, tmp_path, kernel, speeds)
    widths = {40: _weights((30, 40)), 48: _weights((30, 48), (20, 48)), 56: _weights((30, 56))}
    assert chooser.choose(widths, [], range(2, 4))
    assert asked == [(40, 1), (48, 1), (56, 1), (56, 2), (56, 3)] and chooser.timed == 5
    assert [chooser.uses(w, n) for w, n in speeds] == [False, False, True, True, False]
    assert not chooser.uses(40, 2) and not chooser.uses(70)  # never timed: F.linear
    assert chooser.choice_notes[1, 40].startswith("kept F.linear for the one-row products of width 40 (the kernel "
                                                  "of any sizes): the kernel ran 0.95x its speed, under the 1.03x")
    assert "the kernel ran 1.02x" in chooser.choice_notes[1, 48]
    assert chooser.choice_notes[1, 56].startswith("the kernel runs the one-row products of width 56")
    assert "it ran 1.20x F.linear's speed (timed now, saved in" in chooser.choice_notes[1, 56]
    # the module's products go by the verdicts: F.linear itself where the kernel lost, the kernel where it won
    calls = []
    run = products.Kernel.__call__
    monkeypatch.setattr(products.Kernel, "__call__", lambda self, x, w: calls.append(x.shape) or run(self, x, w))
    monkeypatch.setattr(products, "KERNELS", chooser)
    for width, rows, used in [(40, 1, False), (48, 1, False), (56, 1, True), (56, 2, True), (56, 3, False)]:
        x, w = torch.randn(rows, width), torch.randn(30, width)
        got = products.linear(x, w)
        assert (calls == [(rows, width)]) == used and (torch.equal(got, F.linear(x, w)) or used)
        assert (got - F.linear(x, w)).abs().max().item() <= 1e-5 * width ** 0.5
        calls.clear()
    assert "kept F.linear for the one-row products of width 40" in products.status()


def test_the_verdict_is_saved_and_a_later_process_reads_it(kernel, monkeypatch, tmp_path):
    speeds = {(40, 1): 0.9, (56, 1): 1.3, (56, 2): 1.2}
    first, asked = _chooser(monkeypatch, tmp_path, kernel, speeds)
    widths = {40: _weights((30, 40)), 56: _weights((30, 56), (30, 56), (12, 56))}
    assert first.choose(widths, [56], range(2, 3)) and asked == [(40, 1), (56, 1), (56, 2)]
    saved = product_kernels.artifacts.Saved(tmp_path, "products.json")
    keys = sorted(saved._read())
    assert len(keys) == 3 and all(product_timing.cpu() in k and product_kernels.artifacts.machine() in k for k in keys)
    assert [k.split(" | ")[:3] for k in keys] == [
        ["2-row products of width 56 (its own kernel)", "float32", "30 rows x2, 12 rows x1"],
        ["one-row products of width 40 (the kernel of any sizes)", "float32", "30 rows x1"],
        ["one-row products of width 56 (its own kernel)", "float32", "30 rows x2, 12 rows x1"]]
    assert saved.get(keys[1])["kernel"] is False and saved.get(keys[2])["speed"] == 1.3
    later, asked_later = _chooser(monkeypatch, tmp_path, kernel, {})  # a timing now would fail: none is asked for
    assert later.choose(widths, [56], range(2, 3)) and asked_later == [] and later.timed == 0
    assert [later.uses(40), later.uses(56), later.uses(56, 2)] == [False, True, True]
    assert later.choice_notes[1, 56] == ("the kernel runs the one-row products of width 56 (its own kernel): it ran "
                                         f"1.30x F.linear's speed (timed by an earlier process: {saved.path})")
    assert later.choose(widths, [56], range(2, 3)) and asked_later == []  # known in this process: nothing read
    # other shapes of that width (another model), another torch: timed again
    other, asked_other = _chooser(monkeypatch, tmp_path, kernel, {(40, 1): 1.1})
    assert other.choose({40: _weights((31, 40))}, [], range(2, 2)) and asked_other == [(40, 1)]
    monkeypatch.setattr(torch, "__version__", "0.0-other")
    newer, asked_newer = _chooser(monkeypatch, tmp_path, kernel, speeds)
    assert newer.choose(widths, [56], range(2, 3)) and asked_newer == [(40, 1), (56, 1), (56, 2)]


def test_a_busy_machines_timing_keeps_f_linear_and_is_not_saved(kernel, monkeypatch, tmp_path):
    """Too few steady rounds (the process waited for a CPU): F.linear for this process, and a later one times
    again."""
    chooser, asked = _chooser(monkeypatch, tmp_path, kernel, {(40, 1): 1.5}, steady=False)
    assert chooser.choose({40: _weights((30, 40))}, [], range(2, 2)) and asked == [(40, 1)]
    assert not chooser.uses(40) and "too busy to time the kernel" in chooser.choice_notes[1, 40]
    assert not (tmp_path / "products.json").exists()
    later, asked_later = _chooser(monkeypatch, tmp_path, kernel, {(40, 1): 1.5})
    assert later.choose({40: _weights((30, 40))}, [], range(2, 2)) and asked_later == [(40, 1)] and later.uses(40)


def test_the_timing_leaves_out_the_rounds_a_busy_machine_spoiled(monkeypatch):
    """The real timed on two stand-in passes, the clock of waits faked: the rounds in which the process waited
    for a CPU are left out; with fewer than three steady rounds it says it was not steady; a first pass slower than
    the whole budget ends it at once."""
    waits = iter([0.0, 0.0] * 6 + [0.0, 1.0] * 1000)  # the first rounds steady, then every pass waited a second
    monkeypatch.setattr(product_timing, "waited", lambda: next(waits))
    timing = product_timing.timed(lambda: None, lambda: None, budget_s=0.05)
    assert timing.steady and timing.kernel_s >= 0 and timing.speed > 0
    waits = iter([0.0, 1.0] * 1000)
    assert not product_timing.timed(lambda: None, lambda: None, budget_s=0.05).steady
    monkeypatch.setattr(product_timing, "waited", lambda: pytest.fail("timed rounds"))
    slow = product_timing.timed(lambda: time.sleep(0.01), lambda: None, budget_s=0.005)
    assert not slow.steady and slow.kernel_s >= 0.01


def test_applied_only_where_a_widths_kernel_won(tiny, kernel, monkeypatch, tmp_path):
    """apply() on a model whose hidden width's kernel won and the others' lost: those layers' nn.Linear become
    KernelLinear on row-major weights, the others keep nn.Linear and the layout they were loaded with (F.linear's,
    plain decoding's products); the tokens are plain greedy's."""
    hidden = tiny.config.hidden_size
    others = sorted({m.weight.shape[1] for m in tiny.modules() if isinstance(m, nn.Linear)} - {hidden})
    speeds = {(hidden, 1): 1.5, **{(w, 1): 0.8 for w in others}}
    chooser, asked = _chooser(monkeypatch, tmp_path, kernel, speeds)
    monkeypatch.setattr(products, "KERNELS", chooser)
    was = products.applied(tiny)
    products.remove(tiny)
    plain = kvexplore.Generator(tiny, kvexplore.PreallocatedCache(tiny.config, 40))
    plain.prefill([1, 5, 9, 2])
    plain.run(6, stop_at_eos=False)
    try:
        gen = kvexplore.Generator(tiny, kvexplore.PreallocatedCache(tiny.config, 40), kernels=True)
        assert gen.kernels and products.applied(tiny) and sorted(asked) == sorted(speeds)
        for m in tiny.modules():
            if isinstance(m, nn.Linear):
                won = m.weight.shape[1] == hidden
                assert (type(m) is KernelLinear) == won and m.weight.is_contiguous() == won
        gen.prefill([1, 5, 9, 2])
        gen.run(6, stop_at_eos=False)
        assert gen.generated_tokens == plain.generated_tokens
        assert f"the kernel runs the one-row products of width {hidden}" in products.status()
        # forced on: every width's layers on the kernels, untimed
        monkeypatch.setenv("KVEXPLORE_PRODUCTS", "kernels")
        assert products.apply(tiny) and len(asked) == len(speeds)
        assert all(type(m) is KernelLinear and m.weight.is_contiguous() for m in tiny.modules()
                   if isinstance(m, nn.Linear))
        assert products.status().startswith("KVEXPLORE_PRODUCTS=kernels: every product the kernels take runs")
    finally:
        products.remove(tiny)
    assert not any(isinstance(m, KernelLinear) for m in tiny.modules())
    assert not tiny.model.layers[0].self_attn.q_proj.weight.is_contiguous()  # the loader's layout again
    if was:
        monkeypatch.undo()
        products.apply(tiny)


def test_forced_on_by_the_environment_untimed(kernel, monkeypatch, tmp_path):
    """KVEXPLORE_PRODUCTS=kernels: a width whose kernel lost runs on it all the same, and preparing a model times
    nothing."""
    chooser, asked = _chooser(monkeypatch, tmp_path, kernel, {(40, 1): 0.5})
    assert chooser.choose({40: _weights((30, 40))}, [], range(2, 2)) and not chooser.uses(40)
    monkeypatch.setenv("KVEXPLORE_PRODUCTS", "kernels")
    assert chooser.uses(40) and chooser.uses(40, 5) and chooser.uses(123)
    monkeypatch.setattr(products, "KERNELS", chooser)
    monkeypatch.setattr(product_timing, "timed", lambda *args: pytest.fail("timed although forced"))
    x, w = torch.randn(1, 40), torch.randn(30, 40)
    assert not torch.equal(products.linear(x, w), F.linear(x, w))  # the kernel's order of sums
    chooser.verdicts[torch.get_num_threads(), 1, 41] = True  # a width whose kernel won
    monkeypatch.setenv("KVEXPLORE_PRODUCTS", "torch")  # off: F.linear whatever the verdicts
    assert not chooser.uses(40) and not chooser.uses(41)
    x, w = torch.randn(1, 41), torch.randn(30, 41)
    assert torch.equal(products.linear(x, w), F.linear(x, w))
