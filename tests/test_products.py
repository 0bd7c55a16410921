"""The one-row product kernel (kvexplore.runtime.products behind kvexplore.models.linear): the same products as
F.linear within float32 rounding, taken only where it applies, saved for a later process, and a step's products
really run on it."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch.overrides import TorchFunctionMode

import kvexplore
from kvexplore.models import linear
from kvexplore.runtime import products

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
    got = linear.linear(x, w, b)
    assert got.shape == want.shape == (1, 1, out)
    assert (got - want).abs().max().item() <= 1e-5 * max(1.0, width ** 0.5)
    assert not torch.equal(got, want) or out * width < 100  # another order of sums: it did not fall back


class _Watching(TorchFunctionMode):
    def __torch_function__(self, func, types, args=(), kwargs=None):
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize("case", ["two rows", "bfloat16", "gradients", "column-major weight", "a function mode"])
def test_everything_else_is_f_linear_itself(kernel, case):
    g = torch.Generator().manual_seed(3)
    x, w = torch.randn(2 if case == "two rows" else 1, 300, generator=g), torch.randn(200, 300, generator=g)
    if case == "bfloat16":
        x, w = x.bfloat16(), w.bfloat16()
    if case == "gradients":
        w.requires_grad_(True)
    if case == "column-major weight":
        w = w.t().contiguous().t()
    assert not linear.takes_kernel(x, w) or case == "a function mode"
    if case == "a function mode":
        with _Watching():
            assert not linear.takes_kernel(x, w)
            got = linear.linear(x, w)
    else:
        got = linear.linear(x, w)
    assert torch.equal(got, F.linear(x, w))


def test_a_step_runs_its_products_on_the_kernel_and_keeps_its_tokens(tiny, monkeypatch):
    calls = []
    run = products._Kernel.__call__
    monkeypatch.setattr(products._Kernel, "__call__", lambda self, x, w: calls.append(w.shape) or run(self, x, w))
    gen = kvexplore.Generator(tiny, kvexplore.PreallocatedCache(tiny.config, 40))
    gen.prefill([1, 5, 9, 2])
    gen.run(11, stop_at_eos=False)
    with_kernel = gen.generated_tokens
    layers = tiny.config.num_layers
    # q, k, v, o, gate, up, down per layer and the head, per decode step; the prefill's head reads its last row only
    assert len(calls) == 11 * (7 * layers + 1) + 1
    monkeypatch.setattr(linear, "_SOURCE", None)
    gen = kvexplore.Generator(tiny, kvexplore.PreallocatedCache(tiny.config, 40))
    gen.prefill([1, 5, 9, 2])
    gen.run(11, stop_at_eos=False)
    assert gen.generated_tokens == with_kernel and len(with_kernel) == 12
    assert len(calls) == 11 * (7 * layers + 1) + 1


def test_a_models_widest_weights_get_a_kernel_of_their_width(trained):
    """The packaged tiny model's 256-wide weights (q, k, v, gate, up and the head: 3.6M values) get a kernel of that width,
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
            got, want = linear.linear(x, w), F.linear(x, w)
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


def test_switched_off_by_the_environment(monkeypatch):
    monkeypatch.setenv("KVEXPLORE_PRODUCTS", "torch")
    off = products._Kernels()
    assert not off.enabled() and off.get() is None
    assert off.why == "KVEXPLORE_PRODUCTS=torch: every product is F.linear"
