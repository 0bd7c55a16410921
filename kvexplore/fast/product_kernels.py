"""The product kernels themselves (:mod:`.kernels` applies them to a model): what each computes, how it is traced,
compiled, saved and loaded, and which of them run this machine's products (:meth:`Kernels.choose`)."""

from __future__ import annotations

import hashlib
import inspect
import os
import threading
import time
from pathlib import Path
from typing import Any, Callable

import torch
import torch.nn.functional as F
from torch import nn

from . import artifacts, product_timing
from .capture import dynamo_graph
from .product_timing import TIMING_S, Timing, cpu, sample, shapes


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

#: a kernel runs a width's products (of a count of rows) only where it was timed at least this much faster than
#: ``F.linear`` on this machine (:meth:`Kernels.choose`): 3% faster, past the timing's noise
MARGIN = 1.03
#: seconds one verdict's rounds take at most beyond its first five, and all the verdicts of one model
MODEL_TIMING_S = 0.5


class Kernel:
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


class Kernels:
    """The compiled kernels per thread count (inductor generates its C++ for the threads it is compiled under), or
    why there are none: one of any sizes, one per prepared width (:meth:`prepare_widths`: the inner loop's length
    known, whole vectors and no tail) and one per count of rows (:meth:`prepare_rows`)."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.runs: dict[int, Kernel | None] = {}
        self.widths: dict[tuple[int, int], Kernel] = {}  # (threads, width): a kernel of that width only
        self.width_notes: dict[int, str] = {}
        # (threads, rows, width or None for any): the kernel of that many rows (2 to MAX_ROWS), or None
        self.rows_kernels: dict[tuple[int, int, int | None], Kernel | None] = {}
        self.rows_notes: dict[tuple[int, int | None], str] = {}
        self.why = ""
        self.note = ""
        self.built = 0
        # (threads, rows, width): whether the kernel runs that width's products of that many rows (timed against
        # F.linear, or read from the verdict an earlier process saved); what each says, by (rows, width)
        self.verdicts: dict[tuple[int, int, int], bool] = {}
        self.choice_notes: dict[tuple[int, int], str] = {}
        self.timed = 0  # verdicts timed in this process
        self.choosing = threading.Lock()

    def enabled(self) -> bool:
        return not refusal()

    def uses(self, width: int, rows: int = 1) -> bool:
        """Whether products of ``rows`` rows of ``width`` input features run on the kernel under this thread count:
        where ``KVEXPLORE_PRODUCTS=kernels`` says so, else where the kernel was timed faster (:meth:`choose`); never
        with ``KVEXPLORE_PRODUCTS=torch``."""
        env = products_env()
        return env != "torch" and (env == "kernels" or self.verdicts.get((torch.get_num_threads(), rows, width), False))

    def choose(self, widths: dict[int, list[torch.Tensor]], fixed: list[int], rows: range) -> bool:
        """Time each width's kernel against ``F.linear`` on a sample of ``widths[width]``, for one row and then, where
        that won, for each count in ``rows`` (or read an earlier process's verdict), and build the kernels that won.
        ``fixed``: the widths that get a kernel of their own. False where no kernel can be built here."""
        threads = torch.get_num_threads()
        saved = artifacts.Saved(name="products.json")
        with self.choosing:
            wanted = [(n, w) for n in (1, *rows) for w in sorted(widths)]
            spent, busy = 0.0, False
            for i, (n, width) in enumerate(wanted):
                if (threads, n, width) in self.verdicts or (n > 1 and not self.verdicts.get((threads, 1, width))):
                    continue  # known; or the width keeps F.linear (and its layout) at every count of rows
                what = (f"{rows_name(n)} products of width {width} "
                        f"({'its own kernel' if width in fixed else 'the kernel of any sizes'})")
                key = f"{what} | float32 | {shapes(widths[width])} | {cpu()} | {artifacts.machine()}"
                source = _SOURCE if n == 1 else _ROWS_SOURCE
                entry = saved.get(key) or {}
                timed = not (entry.get("torch") == torch.__version__ and entry.get("source") == source)
                use, speed = (False, 0.0) if timed else (bool(entry.get("kernel")), float(entry.get("speed", 0)))
                how = f"timed by an earlier process: {saved.path}"
                timing, kernel = None, None
                if timed and busy:  # the machine was too busy a moment ago: not timed (nor built) either
                    timing = Timing(0.0, 0.0, 0.0, False)
                elif timed or use:
                    kernel = self._kernel(width, n, width in fixed)
                    if timed and kernel is None and self.get() is None:  # no kernel at all here: why says why
                        return False
                if timed and kernel is not None:
                    # what is left of the model's time, shared with the verdicts that may still be timed
                    pending = sum((threads, m, w) not in self.verdicts and (m == 1 or self.verdicts.get(
                        (threads, 1, w), True)) for m, w in wanted[i:])
                    budget = max(0.03, min(TIMING_S, (MODEL_TIMING_S - spent) / pending))
                    t0 = time.perf_counter()
                    timing = product_timing.timed(*passes(kernel, width, n, widths[width]), budget)
                    spent += time.perf_counter() - t0
                    self.timed += 1
                    speed, busy = timing.speed, not timing.steady
                    use = timing.steady and speed >= MARGIN
                    stored = timing.steady and saved.put(key, {
                        "torch": torch.__version__, "source": source, "kernel": use, "speed": round(speed, 4),
                        "kernel_ms": round(timing.kernel_s * 1e3, 4), "linear_ms": round(timing.linear_s * 1e3, 4),
                        "saved": time.strftime("%Y-%m-%d %H:%M:%S")})
                    how = f"timed now, saved in {saved.path}" if stored else (
                        f"timed now; {saved.path} cannot be written")
                if timing is not None and not timing.steady:
                    note = (f"kept F.linear for the {what} in this process: the machine was too busy to time the "
                            f"kernel (other programs held the CPUs), so a later process times it again")
                elif kernel is None and (timed or use):
                    use, note = False, f"kept F.linear for the {what}: its kernel cannot be built here"
                elif use:
                    note = f"the kernel runs the {what}: it ran {speed:.2f}x F.linear's speed ({how})"
                else:
                    note = (f"kept F.linear for the {what}: the kernel ran {speed:.2f}x its speed, under the "
                            f"{MARGIN:.2f}x it must beat ({how})")
                self.verdicts[(threads, n, width)] = use
                self.choice_notes[(n, width)] = note
        return True

    def _kernel(self, width: int, rows: int, own: bool) -> Kernel | None:
        """The kernel that would run ``rows`` rows of ``width``, built or loaded now (of its own width where
        ``own``)."""
        if rows == 1 and own:
            self.prepare_widths([width])
        return self.get(width, rows)

    def get(self, width: int | None = None, rows: int = 1) -> Kernel | None:
        """The kernel for products of ``rows`` rows of ``width`` input features under this thread count: the one of
        that width where the width was prepared, else the one of any sizes (built now if it has not been)."""
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

    def _rows_kernel(self, width: int | None, rows: int) -> Kernel | None:
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

    def _make(self, width: int | None, rows: int = 1) -> Kernel | None:
        from .regional import available
        self.why = refusal() or ("" if available() else
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
            what = f"the {rows_name(rows)} product kernel{f' of width {width}' if width else ''}"
            self.why = f"{what} could not be built ({type(e).__name__}: {e}): " + (
                "F.linear instead" if width is None else "the kernel of any sizes instead")
        return None

    def _built(self, width: int | None, rows: int = 1) -> Kernel:
        saved = artifacts.Saved()
        what = f"the {rows_name(rows)} product kernel" + (f" of width {width}" if width else "")
        step = f"{rows_name(rows)} products | float32 | {f'width {width} | ' if width else ''}{artifacts.machine()}"
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
                return Kernel(compiled, entry["roles"])
        x, weight = torch.zeros(rows, width or 24), torch.zeros(40, width or 24)
        for t, dims in ((x, () if width else (1,)), (weight, (0,) if width else (0, 1))):
            for d in dims:
                torch._dynamo.mark_dynamic(t, d)
        # a fixed width: only the weight's count of rows is symbolic (dynamic=False: dynamo must not make the width
        # symbolic because the kernel of any sizes traced this function with others); the rows of x are always fixed
        gm, inputs = dynamo_graph(_row_products if rows == 1 else _rows_products, (x, weight),
                                  dynamic=False if width else None)
        key, roles = artifacts.graph_key(gm, inputs, options), Kernel.roles_of(gm)
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
        return Kernel(compiled, roles)

    def _noted(self, note: str, width: int | None, rows: int = 1) -> None:
        if rows != 1:
            self.rows_notes[(rows, width)] = note
        elif width is None:
            self.note = note
        else:
            self.width_notes[width] = note


def rows_name(rows: int) -> str:
    return "one-row" if rows == 1 else f"{rows}-row"


def passes(kernel: Kernel, width: int, rows: int, weights: list[torch.Tensor]) -> tuple[Callable, Callable]:
    """One pass of ``rows`` rows over a sample of ``weights`` on the kernel (row-major copies, as :func:`apply` lays
    them out), and one on ``F.linear``: on the weights as loaded for one row, on the row-major ones for more (a
    width whose one-row kernel won is laid out so)."""
    g = torch.Generator().manual_seed(width * 31 + rows)
    x = torch.randn(rows, width, generator=g)
    loaded = [w.detach() for w in sample(weights)]
    row_major = [w.contiguous() for w in loaded]
    plain = loaded if rows == 1 else row_major

    def on_kernel() -> None:
        for w in row_major:
            if takes_kernel(x, w):  # what linear() checks before each product
                kernel(x, w)

    def on_f_linear() -> None:
        for w in plain:
            F.linear(x, w)

    return on_kernel, on_f_linear


def products_env() -> str:
    return os.environ.get("KVEXPLORE_PRODUCTS", "").strip().lower()


def forced() -> bool:
    """``KVEXPLORE_PRODUCTS=kernels``: every product the kernels take runs on them, untimed."""
    return products_env() == "kernels"


def refusal() -> str:
    if products_env() == "torch":
        return "KVEXPLORE_PRODUCTS=torch: every product is F.linear"
    if not (Path(torch.__file__).parent / "_inductor" / "standalone_compile.py").exists():  # without importing it
        return f"torch {torch.__version__} has no standalone_compile: every product is F.linear"
    return ""


def takes_kernel(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """Whether ``F.linear(x, weight)`` is 1 to :data:`MAX_ROWS` float32 rows of plain CPU tensors (no subclass, no
    torch function or dispatch mode watching), on a row-major weight, outside a trace and without gradients."""
    return (not torch.compiler.is_compiling()  # first: a trace reads nothing below (dynamo cannot trace the stacks)
            and type(x) is torch.Tensor and type(weight) in (torch.Tensor, nn.Parameter) and x.device.type == "cpu"
            and x.dtype == torch.float32 and weight.dtype == torch.float32 and weight.dim() == 2
            and x.dim() >= 1 and x.shape[-1] == weight.shape[1] and 0 < x.numel() <= MAX_ROWS * weight.shape[1]
            and weight.is_contiguous()
            and not (torch.is_grad_enabled() and (x.requires_grad or weight.requires_grad))
            and not torch._C._len_torch_function_stack() and not torch._C._len_torch_dispatch_stack())
