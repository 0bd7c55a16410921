"""The cache doctor: at every step, compare a cached forward pass with a full recomputation of the sequence, and
report the first step and layer where they part, with a hint at why.

    report = kvexplore.doctor(model, tokenizer, prompt="The capital of France is", steps=64, cache="dynamic")
    report.diverged, report.step, report.layer, report.position, report.max_diff, report.hint
"""

from .report import DoctorReport
from .run import doctor

__all__ = ["DoctorReport", "doctor"]
