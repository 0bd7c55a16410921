"""The product kernels (kvexplore.fast.kernels) of one row and of a verification's few, applied to a model from
outside: the same products as F.linear within float32 rounding, taken only where they apply, saved for a later
process, a step's products really run on them once applied and never before, a drafting generator's tokens plain
greedy's, and a plain decode that imports nothing of the compiler."""

from __future__ import annotations

import re

import pytest
import torch
import torch.nn.functional as F
from torch.overrides import TorchFunctionMode

import kvexplore
from kvexplore.fast import kernels as products
from kvexplore.fast.kernels import KernelLinear

pytestmark = pytest.mark.skipif(not products.KERNELS.enabled(), reason=products.status())


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
    run = products._Kernel.__call__
    monkeypatch.setattr(products._Kernel, "__call__", lambda self, x, w: calls.append((self, x.shape[0])) or
                        run(self, x, w))
    w = torch.randn(50, 40)
    kernels = {}
    for rows in [1, 2, 3, 6, 9, products.MAX_ROWS, products.MAX_ROWS + 1]:
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
    run = products._Kernel.__call__
    monkeypatch.setattr(products._Kernel, "__call__", lambda self, x, w: calls.append(w.shape) or run(self, x, w))

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
        run = products._Kernel.__call__
        monkeypatch.setattr(products._Kernel, "__call__", lambda self, x, w: rows.append(x.shape[0]) or run(self, x, w))
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


PLAIN_DECODE = """
import sys
import kvexplore as kx
g = kx.Generator(kx.load('tiny'), kx.make_cache('preallocated', kx.load('tiny'), max_seq_len=64))
g.prefill('a b c')
list(g.run(4))
loaded = [m for name, m in sys.modules.items() if name.startswith('kvexplore') and getattr(m, '__file__', None)]
print('torch._inductor' in sys.modules, 'torch._dynamo' in sys.modules,
      any(n.startswith('kvexplore.fast') for n in sys.modules),
      sum(sum(1 for _ in open(m.__file__)) for m in loaded))
"""


def test_a_plain_decode_imports_nothing_of_the_compiler_and_loads_a_small_core():
    """Issue 59's measure: a plain decode loads neither inductor nor dynamo nor kvexplore.fast, and at most 12,000
    lines of kvexplore's own modules (the labs and the screen load on first use); the models name no kernel."""
    import subprocess
    import sys
    from pathlib import Path

    out = subprocess.run([sys.executable, "-c", PLAIN_DECODE], capture_output=True, text=True, check=True).stdout
    inductor, dynamo, fast, lines = out.split()
    assert (inductor, dynamo, fast) == ("False", "False", "False")
    assert int(lines) <= 12_000, f"a plain decode loads {lines} lines of kvexplore"
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
    first, later = products._Kernels(), products._Kernels()
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
    off = products._Kernels()
    assert not off.enabled() and off.get() is None
    assert off.why == "KVEXPLORE_PRODUCTS=torch: every product is F.linear"
