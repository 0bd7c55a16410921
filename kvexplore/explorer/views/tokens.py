"""The token strip: the prompt and the generated tokens, coloured by step; hovering a token shows its position and
the candidates the model weighed when it chose it. Plain HTML for an ``ipywidgets.HTML``."""

from __future__ import annotations

import html
from collections.abc import Sequence

from ...records import StepRecord
from .palette import step_colour

STYLE = """<style>
.kvx-strip {font-family: 'Liberation Mono', Menlo, Consolas, monospace; font-size: 13px; line-height: 1.9;
            white-space: pre-wrap; word-break: break-all; max-height: 11em; overflow-y: auto; padding: 4px;
            border: 1px solid #ddd; border-radius: 4px; background: #fff;}
.kvx-tok {padding: 1px 0; border-radius: 3px; margin-right: 1px; color: #111;}
.kvx-tok.kvx-prompt-tok {background: #eeeeee; color: #555;}
.kvx-tok.kvx-last {outline: 2px solid #f16913;}
</style>"""


def _show(text: str) -> str:
    """Whitespace made visible enough to count tokens; newlines kept as line breaks."""
    return html.escape(text.replace(" ", "·").replace("\t", "→")).replace("\n", "↵\n")


def strip_html(prompt_texts: Sequence[str], records: Sequence[StepRecord]) -> str:
    """One ``<span class="kvx-tok">`` per token: the prompt's, then one per record (the newest outlined)."""
    parts = [STYLE, '<div class="kvx-strip">']
    for pos, text in enumerate(prompt_texts):
        parts.append(f'<span class="kvx-tok kvx-prompt-tok" title="prompt · position {pos}">{_show(text)}</span>')
    n = len(records)
    for i, r in enumerate(records):
        top = "\n".join(f"  {c.text!r}  {c.prob:.3f}" for c in r.top)
        tip = html.escape(f"step {r.step} ({r.kind}) · position {r.position} · p = {r.prob:.3f}\ncandidates:\n{top}",
                          quote=True)
        last = " kvx-last" if i == n - 1 else ""
        parts.append(f'<span class="kvx-tok kvx-gen{last}" style="background:{step_colour(i, n)}" '
                     f'title="{tip}">{_show(r.text)}</span>')
    parts.append("</div>")
    return "".join(parts)
