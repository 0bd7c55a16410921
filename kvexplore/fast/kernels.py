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
pays for them (:func:`prepare_for`; a drafting generator's k + 1 rows too; with ``KVEXPLORE_PRODUCTS=kernels``, a
product no model prepared builds its kernel when it runs). Each is loaded from the graph an earlier process saved
(:mod:`.artifacts`, ``$KVEXPLORE_HOME/compiled``; the first load in a process pays for inductor's import and its
check of the CPU's vector instructions), else compiled and saved (seconds, once per machine, torch version, thread
count, width and count of rows). Where it cannot be built (no C++ compiler, a torch without ``standalone_compile``)
or ``KVEXPLORE_PRODUCTS=torch`` is set, every product is ``F.linear``; :func:`status` says which and why. Their sums
run in another order than MKL's: logits agree within float32 rounding, not bit for bit. A width's kernel is used
from the moment a model that needs it is prepared: a run whose products already took the kernel of any sizes at that
width (another model of the same width made later, mid-run) moves within that rounding.

Whether they pay depends on the machine: where MKL runs a one-row product on every core, ``F.linear`` beats them
(docs/benchmarks.md: 0.88-0.96x on the project's 2-core machine). So when they are applied to a model
(:func:`prepare_for`), each width's kernel is timed against ``F.linear`` on a sample of the model's own weights of that
width (:func:`.product_timing.timed`: interleaved rounds, a tenth of a second or so a verdict, about half a second a
model; rounds in which the process waited for a CPU are left out, and with too few left the width keeps ``F.linear`` in
that process and nothing is saved), and runs that width's products only where it is at least
:data:`~.product_kernels.MARGIN` faster; elsewhere the width keeps ``nn.Linear``, ``F.linear`` and the layout its
weights were loaded with. A count of rows of a verification (2 to k + 1) is timed the same way, for the widths whose
one-row kernel won. The verdict is saved beside the kernels (``products.json``), per count of rows, width, shapes of the
model's weights of that width, CPU, thread count and torch version, so a later process reads it instead of timing (and,
where every width keeps ``F.linear``, builds no kernel at all); delete the file to time again.
``KVEXPLORE_PRODUCTS=kernels`` skips the timing and runs every product the kernels take on them (what they did before
the choice; the tests of their numerics set it); :func:`status` says what was chosen and why.
"""

from __future__ import annotations

import weakref
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from .product_kernels import MAX_ROWS, Kernel, Kernels, forced, refusal, takes_kernel  # noqa: F401 (the API)


KERNELS = Kernels()


def status() -> str:
    """Which products this process runs, and why: the kernels' notes (for each width of a model they were applied
    to, whether its kernel or ``F.linear`` runs its products and how they were timed; which kernels were built or
    loaded), or why every product is ``F.linear``."""
    if KERNELS.why or refusal():
        return refusal() or KERNELS.why
    untimed = ["KVEXPLORE_PRODUCTS=kernels: every product the kernels take runs on them, untimed"] if forced() else []
    built = [n for n in (KERNELS.note, *KERNELS.width_notes.values(), *KERNELS.rows_notes.values()) if n]
    notes = untimed + list(KERNELS.choice_notes.values()) + built
    return "; ".join(notes) or "not used yet in this process (built at the first one-row product)"


def prepare() -> bool:
    """Build the kernel of any sizes now (what the first one-row product would do), e.g. before timing steps or
    opening a view; True where products will take it."""
    return KERNELS.get() is not None


#: a width gets a kernel of its own where a model's weights of that width hold at least this many values
FIXED_WIDTH_FROM = 1 << 20


def prepare_for(model: Any, rows: int = 1) -> bool:
    """Choose and build the kernels of ``model``'s decoding products (kvexplore's own model, float32 weights on the
    CPU; e.g. when an explorer opens, so that its first Step does not wait for the build): for each width, whether
    its kernel or ``F.linear`` runs its one-row products, and for the widths whose kernel does, its products of 2 to
    ``rows`` rows (a verification's k + 1), each timed here or read from an earlier process's verdict
    (:meth:`Kernels.choose`; with ``KVEXPLORE_PRODUCTS=kernels`` the kernels untimed, for every width). The widths
    that carry most of its weights (at least :data:`FIXED_WIDTH_FROM` values: a small test model's do not, a real
    model's output head does) get a kernel of their own width. False where the products will not take the kernels
    (refused, or none can be built here)."""
    head = getattr(model, "head_weight", None)
    if not isinstance(head, torch.Tensor) or head.device.type != "cpu" or head.dtype != torch.float32:
        return False
    if not KERNELS.enabled():
        return False
    widths: dict[int, list[torch.Tensor]] = {}
    for w in {id(w): w for w in row_weights(model)}.values():  # tied: once
        if w.dim() == 2 and w.dtype == torch.float32:
            widths.setdefault(w.shape[1], []).append(w)
    fixed = sorted(w for w, ws in widths.items() if sum(t.numel() for t in ws) >= FIXED_WIDTH_FROM)
    counts = range(2, min(rows, MAX_ROWS) + 1)
    if not forced():
        return KERNELS.choose(widths, fixed, counts)
    if not prepare():
        return False
    KERNELS.prepare_widths(fixed)
    KERNELS.prepare_rows(sorted(widths), counts)
    return True


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """``F.linear(x, weight, bias)``, on the kernels where :func:`takes_kernel` says so and they can be built."""
    if takes_kernel(x, weight):
        y = _products(x.reshape(-1, weight.shape[1]).contiguous(), weight)
        if y is not None:
            y = y.view(*x.shape[:-1], weight.shape[0])
            return y if bias is None else y + bias
    return F.linear(x, weight, bias)


def _products(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor | None:
    """``x @ weight.T`` for ``x`` (rows, in) on the kernel of that many rows; None where ``F.linear`` runs them (it
    was timed faster here, or they were never timed: :meth:`Kernels.uses`) or the kernel cannot be built."""
    if not KERNELS.uses(x.shape[1], x.shape[0]):
        return None
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
    """Route ``model``'s float32 products of up to :data:`MAX_ROWS` rows through the kernels where they pay on this
    machine (:func:`prepare_for`: each width's kernel timed against ``F.linear``, or every width's with
    ``KVEXPLORE_PRODUCTS=kernels``): each ``nn.Linear`` of such a width becomes a :class:`KernelLinear` and its
    weight row-major (values unchanged), the output head's product :func:`linear`; the kernels of those widths are
    built or loaded now, those of 2 to ``rows`` rows too (a verification's k + 1, timed likewise; other counts of
    rows are ``F.linear``'s unless forced), so that no timed step waits for them. A width whose kernel lost keeps
    ``nn.Linear`` and the layout its weights were loaded with: its products are plain ``F.linear``. False, with the
    model unchanged, where the kernels do not apply (not kvexplore's own model, not float32 on the CPU, kernels
    refused or not buildable here: :func:`status` says why, and which widths run on them). Logits then agree with
    ``F.linear``'s within float32 rounding."""
    from ..models.model import Model
    if not isinstance(model, Model):
        return False
    if not prepare_for(model, rows):
        return False
    for module in model.modules():
        if type(module) is nn.Linear and KERNELS.uses(module.weight.shape[1]):
            module.__class__ = KernelLinear
    relaid = {id(w): w for w in row_weights(model) if not w.is_contiguous() and KERNELS.uses(w.shape[1])}  # tied: once
    for weight in relaid.values():
        _relay(weight, row_major=True)
    _RELAID.setdefault(model, []).extend(relaid.values())
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
