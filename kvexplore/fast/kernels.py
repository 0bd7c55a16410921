"""The kernels behind a decoding step's one-row products on the CPU (:mod:`kvexplore.models.linear`): compiled loops
that stream the model's own weights, instead of the BLAS library's matrix-vector product.

torch's ``F.linear`` hands a one-row product to MKL, whose speed on the project's 2-core CPUs depends on the weight's
layout and the machine (SmolLM2's 30 layers and head: 30-45 ms a token). The product written as a multiply and a sum
over each weight row, compiled by inductor, reads the model's own row-major weights with no copy. Two kinds:

- **any sizes**: every size symbolic, built at the first one-row product; inductor emits a vectorized loop over the
  rows on one thread (it cannot tell how big the loop is, and leaves it serial);
- **one width**: the input features fixed, the rows symbolic, for the widths that carry most of a model's weights
  (:func:`prepare_for`: at least :data:`FIXED_WIDTH_FROM` values: a real model's hidden and feed-forward widths,
  the packaged tiny model's hidden one, none of the tests' small random models); inductor splits the rows across
  the threads and the inner loop has whole vectors only.
  ``benchmarks/products.py`` and ``benchmarks/decode_speed.py`` print both against ``F.linear`` (docs/benchmarks.md).

The kernels are built once per process: when they are applied to a float32 model on the CPU, so that no timed step
pays for them (:func:`prepare_for`), else the kernel of any sizes at the first one-row product
that wants it. Each is loaded from the graph an earlier process saved (:mod:`.artifacts`,
``$KVEXPLORE_HOME/compiled``; about 2 s for the first, mostly inductor's import and its check of the CPU's vector
instructions), else compiled and saved (a second or three more, once per machine, torch version, thread count and
width). Where it cannot be built (no C++ compiler, a torch without ``standalone_compile``) or
``KVEXPLORE_PRODUCTS=torch`` is set, every product is ``F.linear``; :func:`status` says which and why. Their sums
run in another order than MKL's: logits agree within float32 rounding, not bit for bit. A width's kernel is used
from the moment a model that needs it is prepared: a run whose products already took the kernel of any sizes at
that width (another model of the same width made later, mid-run) moves within that rounding.
"""

from __future__ import annotations

import hashlib
import inspect
import os
import threading
import weakref
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

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
    """The compiled graph and what goes in each of its inputs (``roles``): the row, the weight, or one of their
    sizes."""

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
    """The compiled kernels per thread count (inductor generates its C++ for the threads it is compiled under), or
    why there are none.

    One kernel takes any sizes (built at the first product that wants it); for the widths (input features) that
    carry most of a model's weights, :meth:`prepare_widths` adds one whose width is fixed (the rows, any number):
    the compiler then knows the inner loop's length, whole vectors and no tail, and reads the weights 1.3-1.7x
    faster on a large matrix (an output head: 32,000 x 288 in 0.73 instead of 0.99-1.30 ms here)."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.runs: dict[int, _Kernel | None] = {}
        self.widths: dict[tuple[int, int], _Kernel] = {}  # (threads, width): a kernel of that width only
        self.width_notes: dict[int, str] = {}
        self.why = ""
        self.note = ""
        self.built = 0

    def enabled(self) -> bool:
        return not _refusal()

    def get(self, width: int | None = None) -> _Kernel | None:
        """The kernel for products of ``width`` input features under this thread count: the one of that width
        where it was prepared, else the one of any sizes (built now if it has not been)."""
        threads = torch.get_num_threads()
        fixed = self.widths.get((threads, width)) if width is not None else None
        if fixed is not None:
            return fixed
        run = self.runs.get(threads, False)
        if run is not False:
            return run
        with self.lock:
            if threads not in self.runs:
                self.runs[threads] = self._make(None)
            return self.runs[threads]

    def prepare_widths(self, widths: list[int]) -> list[int]:
        """Build (or load) the kernels of these widths, beside the kernel of any sizes; the widths that have one."""
        threads = torch.get_num_threads()
        if self.get() is None:  # no kernel at all here (refused, or no compiler): nothing of a fixed width either
            return []
        with self.lock:
            for width in widths:
                if (threads, width) not in self.widths and (kernel := self._make(width)) is not None:
                    self.widths[(threads, width)] = kernel
        return [w for w in widths if (threads, w) in self.widths]

    def _make(self, width: int | None) -> _Kernel | None:
        from .regional import available
        self.why = _refusal() or ("" if available() else
                                  f"torch {torch.__version__}'s standalone_compile cannot save: every product is "
                                  f"F.linear")
        if self.why:
            return None
        try:
            with torch.inference_mode(False), torch.no_grad():
                kernel = self._built(width)
                g = torch.Generator().manual_seed(0)  # not the global generator: a user's random draws stay theirs
                x, weight = torch.randn(1, width or 37, generator=g), torch.randn(21, width or 37, generator=g)
                tolerance = 1e-5 * max(1, width or 1) ** 0.5
                if not torch.allclose(kernel(x, weight), F.linear(x, weight)[0], atol=tolerance):
                    raise RuntimeError("its products differ from F.linear's")
                return kernel
        except Exception as e:  # no C++ compiler, a torch that traces it otherwise: products stay F.linear
            what = f"the one-row product kernel{f' of width {width}' if width else ''}"
            self.why = f"{what} could not be built ({type(e).__name__}: {e}): " + (
                "F.linear instead" if width is None else "the kernel of any sizes instead")
        return None

    def _built(self, width: int | None) -> _Kernel:
        saved = artifacts.Saved()
        what = "the one-row product kernel" + (f" of width {width}" if width else "")
        step = f"one-row products | float32 | {f'width {width} | ' if width else ''}{artifacts.machine()}"
        entry = saved.get(step) or {}
        if entry.get("torch") == torch.__version__ and entry.get("source") == _SOURCE and entry.get("roles"):
            # this machine compiled and saved it: loaded without a trace, and without inductor's check of the CPU's
            # vector instructions (it builds and loads a probe per instruction set, in a child process each: a
            # second of every process; the kernel was compiled here, so the check would pass)
            from torch._inductor import config
            with config.patch({"cpp.vec_isa_ok": True}):
                compiled = artifacts.load(saved, entry["file"])
            if compiled is not None:
                self._noted(f"loaded {what} an earlier process saved ({saved.folder})", width)
                return _Kernel(compiled, entry["roles"])
        x, weight = torch.zeros(1, width or 24), torch.zeros(40, width or 24)
        for t, dims in ((x, () if width else (1,)), (weight, (0,) if width else (0, 1))):
            for d in dims:
                torch._dynamo.mark_dynamic(t, d)
        # a fixed width: only the rows' count is symbolic (dynamic=False: dynamo must not make the width symbolic
        # because the kernel of any sizes traced this function with others)
        gm, inputs = dynamo_graph(_row_products, (x, weight), dynamic=False if width else None)
        key, roles = artifacts.graph_key(gm, inputs, OPTIONS), _Kernel.roles_of(gm)
        compiled = loaded = artifacts.load(saved, key)
        stored = True
        if loaded is None:
            compiled = torch._inductor.standalone_compile(gm, inputs, dynamic_shapes="from_graph", aot=True,
                                                          options={"config_patches": OPTIONS})
            self.built += 1
            stored = artifacts.store(saved, key, compiled)
        remembered = stored and saved.put(step, {"torch": torch.__version__, "source": _SOURCE, "roles": roles,
                                                 "file": key})
        self._noted(f"loaded {what} an earlier process saved ({saved.folder})" if loaded is not None
                    else f"compiled {what} and saved it in {saved.folder}" if remembered
                    else f"compiled {what}; not saved ({saved.folder} cannot be written)", width)
        return _Kernel(compiled, roles)

    def _noted(self, note: str, width: int | None) -> None:
        if width is None:
            self.note = note
        else:
            self.width_notes[width] = note


KERNELS = _Kernels()


def _refusal() -> str:
    if os.environ.get("KVEXPLORE_PRODUCTS", "").strip().lower() == "torch":
        return "KVEXPLORE_PRODUCTS=torch: every product is F.linear"
    if not (Path(torch.__file__).parent / "_inductor" / "standalone_compile.py").exists():  # without importing it
        return f"torch {torch.__version__} has no standalone_compile: every product is F.linear"
    return ""


def status() -> str:
    """Which products this process runs, and why: the kernel's note, or why it is ``F.linear``."""
    if KERNELS.why or not KERNELS.note:
        return KERNELS.why or "not used yet in this process (built at the first one-row product)"
    return "; ".join([KERNELS.note, *KERNELS.width_notes.values()])


def prepare() -> bool:
    """Build the kernel of any sizes now (what the first one-row product would do), e.g. before timing steps or
    opening a view; True where products will take it."""
    return KERNELS.get() is not None


#: a width gets a kernel of its own where a model's weights of that width hold at least this many values
FIXED_WIDTH_FROM = 1 << 20


def prepare_for(model: Any) -> bool:
    """:func:`prepare` where ``model``'s decoding products would take the kernel (kvexplore's own model, float32 weights
    on the CPU; e.g. when an explorer opens, so that its first Step does not wait for the build), with kernels of
    fixed width for the widths that carry most of its weights (at least :data:`FIXED_WIDTH_FROM` values: a small
    test model's do not, a real model's output head does); False where the products will not take it."""
    head = getattr(model, "head_weight", None)
    if not isinstance(head, torch.Tensor) or head.device.type != "cpu" or head.dtype != torch.float32:
        return False
    if not prepare():
        return False
    held: dict[int, int] = {}
    for w in row_weights(model):
        if w.dim() == 2 and w.dtype == torch.float32:
            held[w.shape[1]] = held.get(w.shape[1], 0) + w.numel()
    KERNELS.prepare_widths(sorted(w for w, n in held.items() if n >= FIXED_WIDTH_FROM))
    return True


def takes_kernel(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """Whether ``F.linear(x, weight)`` is one float32 row of plain CPU tensors (no subclass, no torch function or
    dispatch mode watching), outside a trace and without gradients."""
    return (not torch.compiler.is_compiling()  # first: a trace reads nothing below (dynamo cannot trace the stacks)
            and type(x) is torch.Tensor and type(weight) in (torch.Tensor, nn.Parameter) and x.device.type == "cpu"
            and x.dtype == torch.float32 and weight.dtype == torch.float32 and weight.dim() == 2
            and x.numel() == weight.shape[1] and weight.is_contiguous()
            and not (torch.is_grad_enabled() and (x.requires_grad or weight.requires_grad))
            and not torch._C._len_torch_function_stack() and not torch._C._len_torch_dispatch_stack())


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """``F.linear(x, weight, bias)``, on a kernel where :func:`takes_kernel` says so and one can be built."""
    if takes_kernel(x, weight):
        kernel = KERNELS.get(weight.shape[1])
        if kernel is not None:
            y = kernel(x.reshape(1, weight.shape[1]).contiguous(), weight).view(*x.shape[:-1], weight.shape[0])
            return y if bias is None else y + bias
    return F.linear(x, weight, bias)


class KernelLinear(nn.Linear):
    """``nn.Linear`` whose one-row products go through :func:`linear` (what :func:`apply` makes of each)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return linear(x, self.weight, self.bias)


def row_weights(model: nn.Module) -> list[torch.Tensor]:
    """The weight matrices a decoding step multiplies one row by: every ``nn.Linear``'s in module order, then the
    output head (``model.head_weight``)."""
    return [m.weight for m in model.modules() if isinstance(m, nn.Linear)] + [model.head_weight]


#: the weights :func:`apply` laid out row-major, by model: :func:`remove` lays them out as they were
_RELAID: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def _relay(weight: torch.Tensor, row_major: bool) -> None:
    """The same Parameter (tied weights stay tied), its values laid out row-major (what the kernels read fastest) or
    column-major (what the loader gives float32 CPU weights: ``F.linear``'s fastest)."""
    with torch.no_grad():
        weight.data = weight.data.contiguous() if row_major else weight.data.t().contiguous().t()


def applied(model: Any) -> bool:
    """Whether :func:`apply` routed ``model``'s products through the kernels."""
    return vars(model).get("project") is linear


def apply(model: Any) -> bool:
    """Route ``model``'s one-row float32 products through the kernels: each ``nn.Linear`` becomes a
    :class:`KernelLinear`, the output head's product :func:`linear`, the weights row-major (their values unchanged),
    and the kernels for its widths built or loaded now, so that no timed step waits for them. False, with the model
    unchanged, where they do not apply (not kvexplore's own model, not float32 on the CPU, kernels refused or not
    buildable here: :func:`status` says why). Logits then agree with ``F.linear``'s within float32 rounding."""
    from ..models.model import Model
    if not isinstance(model, Model):
        return False
    if applied(model):
        return True
    if not prepare_for(model):
        return False
    for module in model.modules():
        if type(module) is nn.Linear:
            module.__class__ = KernelLinear
    relaid = {id(w): w for w in row_weights(model) if not w.is_contiguous()}  # tied: once
    for weight in relaid.values():
        _relay(weight, row_major=True)
    _RELAID[model] = list(relaid.values())
    model.project = linear
    return True


def remove(model: Any) -> None:
    """Undo :func:`apply`: ``model``'s products are ``F.linear``'s again, on its weights laid out as they were."""
    for module in model.modules():
        if type(module) is KernelLinear:
            module.__class__ = nn.Linear
    for weight in _RELAID.pop(model, []):
        _relay(weight, row_major=False)
    vars(model).pop("project", None)
