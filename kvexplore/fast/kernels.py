"""The kernels behind a decoding step's products on the CPU: compiled loops that stream the model's own weights,
instead of the BLAS library's matrix-vector product, for one row (a decoding step) and for a few (a
verification's k + 1 rows, a short prompt).

torch's ``F.linear`` hands a one-row product to MKL, whose speed on the project's 2-core CPUs depends on the
weight's layout and the machine (on some it reads the weights on one core whatever the thread count). The product
written as a multiply and a sum over each weight row, compiled by inductor, reads the model's own row-major weights
with no copy. Two kinds:

- **any sizes**: every size symbolic, built at the first one-row product; inductor emits a vectorized loop over the
  rows on one thread (it cannot tell how big the loop is, and leaves it serial);
- **one width**: the input features fixed, the rows symbolic, for the widths that carry most of a model's weights
  (:func:`prepare_for`: at least :data:`FIXED_WIDTH_FROM` values: a real model's hidden and feed-forward widths,
  the packaged tiny model's hidden one, none of the tests' small random models); inductor splits the rows across
  the threads and the inner loop has whole vectors only.

A product of 2 to :data:`MAX_ROWS` rows runs on a kernel of that count of rows (of one width, or of any sizes, as
above): one sum per row of ``x`` over the same weight row, which inductor fuses into one loop with an accumulator
per row, so each weight row is read once for all the rows (``F.linear`` hands them to MKL's small matrix product,
slower on the row-major weights than on the column-major ones the loader gives). More rows (a prompt's prefill)
are ``F.linear``'s. ``benchmarks/products.py`` and ``benchmarks/decode_speed.py`` print the one-row kernels against
``F.linear``, ``benchmarks/speculative_speed.py`` verifications on the kernels of k + 1 rows; docs/benchmarks.md
has the figures, which depend on the machine.

The kernels are built once per process: when they are applied to a float32 model on the CPU, so that no timed step
pays for them (:func:`prepare_for`; a drafting generator's k + 1 rows too), else at the first product that wants
one. Each is loaded from the graph an earlier process saved (:mod:`.artifacts`, ``$KVEXPLORE_HOME/compiled``; the
first load in a process pays for inductor's import and its check of the CPU's vector instructions), else compiled
and saved (seconds, once per machine, torch version, thread count, width and count of rows). Where it cannot be
built (no C++ compiler, a torch without ``standalone_compile``) or ``KVEXPLORE_PRODUCTS=torch`` is set, every
product is ``F.linear``; :func:`status` says which and why. Their sums run in another order than MKL's: logits
agree within float32 rounding, not bit for bit. A width's kernel is used from the moment a model that needs it is
prepared: a run whose products already took the kernel of any sizes at that width (another model of the same width
made later, mid-run) moves within that rounding.
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
#: the kernels of a few rows also let the C++ compiler fuse each multiply and add (one rounding instead of two): with
#: an accumulator per row, their loop does more arithmetic per weight read than one row's
ROWS_OPTIONS = {**OPTIONS, "cpp.enable_floating_point_contract_flag": "fast"}


def _row_products(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    return (x * weight).sum(-1)  # x (1, in), weight (out, in) -> (out,)


def _rows_products(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    # x (rows, in), weight (out, in) -> (rows, out). One sum per row over the same weight: inductor fuses them into one
    # loop over the weight's rows with an accumulator per row of x, so each weight row is read once for all of them
    return torch.stack([(x[r] * weight).sum(-1) for r in range(x.shape[0])])


def _source(fn: Any, options: dict) -> str:
    """What a saved kernel was built from: a change to ``fn`` (or to the options) makes the saved one stale."""
    return hashlib.blake2b((inspect.getsource(fn) + repr(sorted(options.items()))).encode(), digest_size=8).hexdigest()


_SOURCE = _source(_row_products, OPTIONS)
_ROWS_SOURCE = _source(_rows_products, ROWS_OPTIONS)

#: products of up to this many rows (a verification's k + 1) run on a kernel of their count of rows; more (a prompt's
#: prefill) are ``F.linear``'s: a matrix product that MKL does well
MAX_ROWS = 16


class _Kernel:
    """The compiled graph and what goes in each of its inputs (``roles``): the rows, the weight, or one of their
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
    the compiler then knows the inner loop's length, whole vectors and no tail, and reads a large matrix faster
    (docs/benchmarks.md, "One-row products of a fixed width"). Products of a few rows have a kernel per count of
    rows (:meth:`prepare_rows`), of one width or of any sizes alike."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.runs: dict[int, _Kernel | None] = {}
        self.widths: dict[tuple[int, int], _Kernel] = {}  # (threads, width): a kernel of that width only
        self.width_notes: dict[int, str] = {}
        # (threads, rows, width or None for any): the kernel of that many rows (2 to MAX_ROWS), or None
        self.rows_kernels: dict[tuple[int, int, int | None], _Kernel | None] = {}
        self.rows_notes: dict[tuple[int, int | None], str] = {}
        self.why = ""
        self.note = ""
        self.built = 0

    def enabled(self) -> bool:
        return not _refusal()

    def get(self, width: int | None = None, rows: int = 1) -> _Kernel | None:
        """The kernel for products of ``rows`` rows (1 to :data:`MAX_ROWS`) of ``width`` input features under this
        thread count: the one of that width where the width was prepared, else the one of any sizes (built now if it
        has not been)."""
        if rows != 1:
            return self._rows_kernel(width, rows)
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

    def _rows_kernel(self, width: int | None, rows: int) -> _Kernel | None:
        threads = torch.get_num_threads()
        key = (threads, rows, width if (threads, width) in self.widths else None)
        kernel = self.rows_kernels.get(key, False)
        if kernel is not False:
            return kernel
        if self.get() is None:  # no kernel at all here (refused, or no compiler)
            return None
        with self.lock:
            if key not in self.rows_kernels:
                self.rows_kernels[key] = self._make(key[2], rows)
            kernel = self.rows_kernels[key]
        if kernel is None and key[2] is not None:  # that width's failed: the rows' kernel of any sizes
            return self._rows_kernel(None, rows)
        return kernel

    def prepare_rows(self, widths: list[int | None], rows: range) -> None:
        """Build (or load) the kernels of these counts of rows for these widths (None: any sizes; a width gets its
        own only where :meth:`prepare_widths` gave it one)."""
        for width in widths:
            for n in rows:
                self.get(width, n)

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

    def _make(self, width: int | None, rows: int = 1) -> _Kernel | None:
        from .regional import available
        self.why = _refusal() or ("" if available() else
                                  f"torch {torch.__version__}'s standalone_compile cannot save: every product is "
                                  f"F.linear")
        if self.why:
            return None
        try:
            with torch.inference_mode(False), torch.no_grad():
                kernel = self._built(width, rows)
                g = torch.Generator().manual_seed(0)  # not the global generator: a user's random draws stay theirs
                x, weight = torch.randn(rows, width or 37, generator=g), torch.randn(21, width or 37, generator=g)
                tolerance = 1e-5 * max(1, width or 1) ** 0.5
                if not torch.allclose(kernel(x, weight).view(rows, -1), F.linear(x, weight), atol=tolerance):
                    raise RuntimeError("its products differ from F.linear's")
                return kernel
        except Exception as e:  # no C++ compiler, a torch that traces it otherwise: products stay F.linear
            what = f"the {_rows_name(rows)} product kernel{f' of width {width}' if width else ''}"
            self.why = f"{what} could not be built ({type(e).__name__}: {e}): " + (
                "F.linear instead" if width is None else "the kernel of any sizes instead")
        return None

    def _built(self, width: int | None, rows: int = 1) -> _Kernel:
        saved = artifacts.Saved()
        what = f"the {_rows_name(rows)} product kernel" + (f" of width {width}" if width else "")
        step = f"{_rows_name(rows)} products | float32 | {f'width {width} | ' if width else ''}{artifacts.machine()}"
        source, options = (_SOURCE, OPTIONS) if rows == 1 else (_ROWS_SOURCE, ROWS_OPTIONS)
        entry = saved.get(step) or {}
        if entry.get("torch") == torch.__version__ and entry.get("source") == source and entry.get("roles"):
            # this machine compiled and saved it: loaded without a trace, and without inductor's check of the CPU's
            # vector instructions (it builds and loads a probe per instruction set, in a child process each: a
            # second of every process; the kernel was compiled here, so the check would pass)
            from torch._inductor import config
            with config.patch({"cpp.vec_isa_ok": True}):
                compiled = artifacts.load(saved, entry["file"])
            if compiled is not None:
                self._noted(f"loaded {what} an earlier process saved ({saved.folder})", width, rows)
                return _Kernel(compiled, entry["roles"])
        x, weight = torch.zeros(rows, width or 24), torch.zeros(40, width or 24)
        for t, dims in ((x, () if width else (1,)), (weight, (0,) if width else (0, 1))):
            for d in dims:
                torch._dynamo.mark_dynamic(t, d)
        # a fixed width: only the weight's count of rows is symbolic (dynamic=False: dynamo must not make the width
        # symbolic because the kernel of any sizes traced this function with others); the rows of x are always fixed
        gm, inputs = dynamo_graph(_row_products if rows == 1 else _rows_products, (x, weight),
                                  dynamic=False if width else None)
        key, roles = artifacts.graph_key(gm, inputs, options), _Kernel.roles_of(gm)
        compiled = loaded = artifacts.load(saved, key)
        stored = True
        if loaded is None:
            compiled = torch._inductor.standalone_compile(gm, inputs, dynamic_shapes="from_graph", aot=True,
                                                          options={"config_patches": options})
            self.built += 1
            stored = artifacts.store(saved, key, compiled)
        remembered = stored and saved.put(step, {"torch": torch.__version__, "source": source, "roles": roles,
                                                 "file": key})
        self._noted(f"loaded {what} an earlier process saved ({saved.folder})" if loaded is not None
                    else f"compiled {what} and saved it in {saved.folder}" if remembered
                    else f"compiled {what}; not saved ({saved.folder} cannot be written)", width, rows)
        return _Kernel(compiled, roles)

    def _noted(self, note: str, width: int | None, rows: int = 1) -> None:
        if rows != 1:
            self.rows_notes[(rows, width)] = note
        elif width is None:
            self.note = note
        else:
            self.width_notes[width] = note


def _rows_name(rows: int) -> str:
    return "one-row" if rows == 1 else f"{rows}-row"


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
    return "; ".join([KERNELS.note, *KERNELS.width_notes.values(), *KERNELS.rows_notes.values()])


def prepare() -> bool:
    """Build the kernel of any sizes now (what the first one-row product would do), e.g. before timing steps or
    opening a view; True where products will take it."""
    return KERNELS.get() is not None


#: a width gets a kernel of its own where a model's weights of that width hold at least this many values
FIXED_WIDTH_FROM = 1 << 20


def prepare_for(model: Any, rows: int = 1) -> bool:
    """:func:`prepare` where ``model``'s decoding products would take the kernel (kvexplore's own model, float32 weights
    on the CPU; e.g. when an explorer opens, so that its first Step does not wait for the build), with kernels of
    fixed width for the widths that carry most of its weights (at least :data:`FIXED_WIDTH_FROM` values: a small
    test model's do not, a real model's output head does), and the kernels of 2 to ``rows`` rows (a verification's
    k + 1) for its widths; False where the products will not take it."""
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
    KERNELS.prepare_rows(sorted(held), range(2, min(rows, MAX_ROWS) + 1))
    return True


def takes_kernel(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """Whether ``F.linear(x, weight)`` is 1 to :data:`MAX_ROWS` float32 rows (a decoding step's one, a verification's
    k + 1) of plain CPU tensors (no subclass, no torch function or dispatch mode watching), on a row-major weight,
    outside a trace and without gradients."""
    return (not torch.compiler.is_compiling()  # first: a trace reads nothing below (dynamo cannot trace the stacks)
            and type(x) is torch.Tensor and type(weight) in (torch.Tensor, nn.Parameter) and x.device.type == "cpu"
            and x.dtype == torch.float32 and weight.dtype == torch.float32 and weight.dim() == 2
            and x.dim() >= 1 and x.shape[-1] == weight.shape[1] and 0 < x.numel() <= MAX_ROWS * weight.shape[1]
            and weight.is_contiguous()
            and not (torch.is_grad_enabled() and (x.requires_grad or weight.requires_grad))
            and not torch._C._len_torch_function_stack() and not torch._C._len_torch_dispatch_stack())


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """``F.linear(x, weight, bias)``, on the kernels where :func:`takes_kernel` says so and they can be built."""
    if takes_kernel(x, weight):
        y = _products(x.reshape(-1, weight.shape[1]).contiguous(), weight)
        if y is not None:
            y = y.view(*x.shape[:-1], weight.shape[0])
            return y if bias is None else y + bias
    return F.linear(x, weight, bias)


def _products(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor | None:
    """``x @ weight.T`` for ``x`` (rows, in) on the kernel of that many rows; None where it cannot be built."""
    kernel = KERNELS.get(x.shape[1], x.shape[0])
    return None if kernel is None else kernel(x, weight).view(x.shape[0], -1)


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


def apply(model: Any, rows: int = 1) -> bool:
    """Route ``model``'s float32 products of up to :data:`MAX_ROWS` rows through the kernels: each ``nn.Linear``
    becomes a :class:`KernelLinear`, the output head's product :func:`linear`, the weights row-major (their values
    unchanged), and the kernels for its widths built or loaded now, those of 2 to ``rows`` rows too (a
    verification's k + 1; other counts are built at their first product), so that no timed step waits for them.
    False, with the model unchanged, where they do not apply (not kvexplore's own model, not float32 on the CPU,
    kernels refused or not buildable here: :func:`status` says why). Logits then agree with ``F.linear``'s within
    float32 rounding."""
    from ..models.model import Model
    if not isinstance(model, Model):
        return False
    if applied(model):
        return prepare_for(model, rows)
    if not prepare_for(model, rows):
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
