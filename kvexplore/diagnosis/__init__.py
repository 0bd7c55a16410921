"""The cache doctor: at every step, compare a cached forward pass with a full recomputation of the sequence, and
report the first step and layer where they part, with a hint at why (``kvexplore.doctor``)."""

from .report import DoctorReport
from .run import doctor

__all__ = ["DoctorReport", "doctor"]
