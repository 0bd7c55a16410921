"""What :func:`kvexplore.course.check` answers: right or wrong, and why, in words a student reads."""

from __future__ import annotations

import html
from dataclasses import dataclass


@dataclass(frozen=True)
class Verdict:
    exercise: str
    ok: bool
    message: str
    answered: bool = True   # False: nothing was given yet (the notebook's cell as it ships)

    def __bool__(self) -> bool:
        return self.ok

    def __str__(self) -> str:
        mark = "right" if self.ok else ("not answered yet" if not self.answered else "not yet")
        return f"{self.exercise}: {mark}: {self.message}"

    def _repr_html_(self) -> str:
        colour = "#2e7d32" if self.ok else ("#666" if not self.answered else "#c62828")
        mark = "✓ right" if self.ok else ("… not answered yet" if not self.answered else "✗ not yet")
        return (f'<div style="border-left: 4px solid {colour}; padding: 4px 10px; font-size: 15px">'
                f'<b style="color: {colour}">{self.exercise} · {mark}</b><br>{html.escape(self.message)}</div>')
