"""The kernels behind a decoding step's products on the CPU: compiled loops that stream the model's own row-major
weights, instead of MKL's matrix-vector product, for one row (a decoding step) and for a few (a verification's
k + 1 rows, a short prompt); more rows are ``F.linear``'s.

Two kinds: one of **any sizes** (built at the first one-row product; a serial vectorized loop) and one per
**width** that carries most of a model's weights (at least :data:`FIXED_WIDTH_FROM` values; the rows split across
the threads). Each is timed against ``F.linear`` on the model's own weights when applied and kept only where it
pays; the kernels and the verdicts are saved for later processes (:mod:`.artifacts`, ``products.json``). Their sums
run in another order than MKL's: logits agree within float32 rounding, not bit for bit. docs/python-api.md
("Eager decoding's products") says when each runs and how to turn them off; docs/benchmarks.md has the figures.
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
    """Which products this process runs, and why: per width, kernel or ``F.linear`` and how it was timed, which
    kernels were built or loaded; or why every product is ``F.linear``."""
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
    """Choose and build the kernels of ``model``'s products of 1 to ``rows`` rows (float32 on the CPU), each width
    timed here or read from an earlier verdict (:meth:`Kernels.choose`), so that no timed step waits for a build.
    False where the products will not take the kernels (refused, or none can be built here)."""
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
    """``F.linear(x, weight, bias)``, on the kernel of that many rows where :func:`takes_kernel` and
    :meth:`Kernels.uses` say so and it can be built."""
    if takes_kernel(x, weight):
        rows = x.reshape(-1, weight.shape[1]).contiguous()
        width, n = rows.shape[1], rows.shape[0]
        kernel = KERNELS.get(width, n) if KERNELS.uses(width, n) else None
        if kernel is not None:
            y = kernel(rows, weight).view(*x.shape[:-1], weight.shape[0])
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


def apply(model: Any, rows: int = 1) -> bool:
    """Route ``model``'s float32 products of up to :data:`MAX_ROWS` rows through the kernels where they pay
    (:func:`prepare_for`): each ``nn.Linear`` of such a width becomes a :class:`KernelLinear` with its weight laid
    out row-major (values unchanged), the output head's product :func:`linear`. False, with the model unchanged,
    where the kernels do not apply (:func:`status` says why)."""
    from ..models.model import Model
    if not isinstance(model, Model) or not prepare_for(model, rows):
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
