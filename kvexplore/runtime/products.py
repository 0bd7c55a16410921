"""The kernel behind a decoding step's one-row products on the CPU (:mod:`kvexplore.models.linear`): one compiled
loop that streams the model's own weights on every thread, instead of the BLAS library's matrix-vector product.

torch's ``F.linear`` hands a one-row product to MKL, which reads the weights on one core here: SmolLM2's 30 layers
and head take about 45 ms a token on the project's 2-core CPU, whatever ``torch.get_num_threads()`` says. The
product written as a multiply and a sum over each weight row, compiled by inductor once with every size symbolic,
is a loop over the rows split across the threads, reading each row front to back: 1.7x faster for the same
weights (``benchmarks/products.py``: 26 instead of 44 ms), with no copy of them.

The kernel is built once per process: when a Generator (or an explorer) is made for a float32 model on the CPU,
so that no timed step pays for it (:func:`prepare_for`), else at the first one-row product that wants it. It is
loaded from the graph an earlier process saved (:mod:`.artifacts`, ``$KVEXPLORE_HOME/compiled``; about 2 s, mostly
inductor's import and its check of the CPU's vector instructions), else compiled and saved (about 3 s more, once
per machine, torch version and thread count). From then on every one-row product of the process takes it, so
results never change path in the middle of a run. Where it cannot be built (no C++ compiler, a torch without
``standalone_compile``) or ``KVEXPLORE_PRODUCTS=torch`` is set, every product is ``F.linear``; :func:`status` says
which and why. Its sums run in another order than MKL's: logits agree within float32 rounding, not bit for bit.
"""

from __future__ import annotations

import hashlib
import inspect
import os
import threading
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

from ..models import linear as linear_module
from . import artifacts
from .capture import dynamo_graph

#: inductor options: no size checks of the inputs on every call (the caller passes the sizes it checked)
OPTIONS = {"size_asserts": False}


def _row_products(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    return (x * weight).sum(-1)  # x (1, in), weight (out, in) -> (out,)


#: what the saved kernel was built from: a change to it (or to the options) makes the saved one stale
_SOURCE = hashlib.blake2b((inspect.getsource(_row_products) + repr(sorted(OPTIONS.items()))).encode(),
                          digest_size=8).hexdigest()


class _Kernel:
    """The compiled graph and what goes in each of its inputs (``roles``): the row, the weight, or one of their sizes."""

    def __init__(self, compiled: Any, roles: list[str]) -> None:
        from .regional import _innermost
        self.roles = roles
        self.run = _innermost(compiled)

    @staticmethod
    def roles_of(gm: torch.fx.GraphModule) -> list[str]:
        fakes = [n.meta["example_value"] for n in gm.graph.nodes if n.op == "placeholder"]
        x, weight = (f for f in fakes if isinstance(f, torch.Tensor))
        sizes = {str(x.shape[1]): "in", str(weight.shape[0]): "out"}
        return ["x" if f is x else "weight" if f is weight else sizes[str(f)] for f in fakes]

    def __call__(self, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        given = {"x": x, "weight": weight, "in": weight.shape[1], "out": weight.shape[0]}
        return self.run([given[r] for r in self.roles])[0]


class _Kernels:
    """The compiled kernel per thread count (inductor generates its C++ for the threads it is compiled under), or why
    there is none: the :class:`~kvexplore.models.linear.KernelSource` the package installs."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.runs: dict[int, _Kernel | None] = {}
        self.why = ""
        self.note = ""
        self.built = 0

    def enabled(self) -> bool:
        return not _refusal()

    def get(self) -> _Kernel | None:
        threads = torch.get_num_threads()
        run = self.runs.get(threads, False)
        if run is not False:
            return run
        with self.lock:
            if threads not in self.runs:
                self.runs[threads] = self._make()
            return self.runs[threads]

    def _make(self) -> _Kernel | None:
        from .regional import available
        self.why = _refusal() or ("" if available() else
                                  f"torch {torch.__version__}'s standalone_compile cannot save: every product is F.linear")
        if self.why:
            return None
        try:
            with torch.inference_mode(False), torch.no_grad():
                kernel = self._built()
                g = torch.Generator().manual_seed(0)  # not the global generator: a user's random draws stay theirs
                x, weight = torch.randn(1, 37, generator=g), torch.randn(21, 37, generator=g)
                if not torch.allclose(kernel(x, weight), F.linear(x, weight)[0], atol=1e-5):
                    raise RuntimeError("its products differ from F.linear's")
                return kernel
        except Exception as e:  # no C++ compiler, a torch that traces it otherwise: products stay F.linear
            self.why = f"the one-row product kernel could not be built ({type(e).__name__}: {e}): F.linear instead"
            return None

    def _built(self) -> _Kernel:
        saved = artifacts.Saved()
        step = f"one-row products | float32 | {artifacts.machine()}"
        entry = saved.get(step) or {}
        if entry.get("torch") == torch.__version__ and entry.get("source") == _SOURCE and entry.get("roles"):
            # this machine compiled and saved it: loaded without a trace, and without inductor's check of the CPU's
            # vector instructions (it builds and loads a probe per instruction set, in a child process each: a
            # second of every process; the kernel was compiled here, so the check would pass)
            from torch._inductor import config
            with config.patch({"cpp.vec_isa_ok": True}):
                compiled = artifacts.load(saved, entry["file"])
            if compiled is not None:
                self.note = f"loaded the one-row product kernel an earlier process saved ({saved.folder})"
                return _Kernel(compiled, entry["roles"])
        x, weight = torch.zeros(1, 24), torch.zeros(40, 24)
        for t, dims in ((x, (1,)), (weight, (0, 1))):
            for d in dims:
                torch._dynamo.mark_dynamic(t, d)
        gm, inputs = dynamo_graph(_row_products, (x, weight), dynamic=None)
        key, roles = artifacts.graph_key(gm, inputs, OPTIONS), _Kernel.roles_of(gm)
        compiled, stored = artifacts.load(saved, key), True
        if compiled is None:
            compiled = torch._inductor.standalone_compile(gm, inputs, dynamic_shapes="from_graph", aot=True,
                                                          options={"config_patches": OPTIONS})
            self.built += 1
            stored = artifacts.store(saved, key, compiled)
        remembered = stored and saved.put(step, {"torch": torch.__version__, "source": _SOURCE, "roles": roles,
                                                 "file": key})
        self.note = (f"loaded the one-row product kernel an earlier process saved ({saved.folder})" if not self.built
                     else f"compiled the one-row product kernel and saved it in {saved.folder}" if remembered
                     else f"compiled the one-row product kernel; not saved ({saved.folder} cannot be written)")
        return _Kernel(compiled, roles)


KERNELS = _Kernels()


def _refusal() -> str:
    if os.environ.get("KVEXPLORE_PRODUCTS", "").strip().lower() == "torch":
        return "KVEXPLORE_PRODUCTS=torch: every product is F.linear"
    if not (Path(torch.__file__).parent / "_inductor" / "standalone_compile.py").exists():  # without importing it
        return f"torch {torch.__version__} has no standalone_compile: every product is F.linear"
    return ""


def status() -> str:
    """Which products this process runs, and why: the kernel's note, or why it is ``F.linear``."""
    return KERNELS.why or KERNELS.note or "not used yet in this process (built at the first one-row product)"


def prepare() -> bool:
    """Build the kernel now (what the first one-row product would do), e.g. before timing steps or opening a view;
    True where products will take it."""
    return KERNELS.get() is not None


def prepare_for(model: Any) -> bool:
    """:func:`prepare` where ``model``'s decoding products would take the kernel (kvexplore's own model, float32 weights
    on the CPU; e.g. when an explorer opens, so that its first Step does not wait for the build); False otherwise."""
    weight = getattr(model, "head_weight", None)
    if not isinstance(weight, torch.Tensor) or weight.device.type != "cpu" or weight.dtype != torch.float32:
        return False
    return prepare()


linear_module.install(KERNELS)
