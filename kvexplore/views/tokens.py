"""The token strip: the prompt and the generated tokens, coloured by step; hovering a token shows its position and
the candidates the model weighed when it chose it. Plain HTML for an ``ipywidgets.HTML``."""

from __future__ import annotations

import html
from collections.abc import Sequence

from ..trace.records import StepRecord
from . import assets
from .divergence import DRIFT
from .palette import step_colour

STYLE = f"<style>\n{assets.text(__file__, 'tokens.css')}</style>"  # the strip's look, before every strip


def _show(text: str) -> str:
    """Whitespace made visible enough to count tokens, newlines as breaks; a token with no text (bos) shows as ∅."""
    if not text:
        return "∅"
    return html.escape(text.replace(" ", "·").replace("\t", "→")).replace("\n", "↵\n")


def prompt_span(pos: int, text: str) -> str:
    return f'<span class="kvx-tok kvx-prompt-tok" title="prompt · position {pos}">{_show(text)}</span>'


def prompt_spans(prompt_texts: Sequence[str]) -> str:
    return "".join(prompt_span(pos, text) for pos, text in enumerate(prompt_texts))


def _drafted(record: StepRecord) -> tuple[str, str]:
    """A speculative token's class (underlined: green an accepted draft, red the target's correction of one) and
    a line for its tooltip; nothing for a plain step."""
    if record.verification is None:
        return "", ""
    v = f"verification {record.verification}"
    if record.accepted:
        return " kvx-accepted", f"\ndrafted and accepted ({v})"
    if record.drafted:
        return " kvx-corrected", f"\nthe target's correction: the draft (id {record.draft_token}) was rejected ({v})"
    return "", f"\nthe bonus token after every draft was accepted ({v})"


def token_span(record: StepRecord, last: bool = False, diverged: str = "") -> str:
    """One generated token: its step's colour, the newest outlined, a speculative token underlined (green: an
    accepted draft, red: a correction); the tooltip lists the candidates. ``diverged``: this token is where the lane
    first parts from the reference (red, bold, the words in its tooltip)."""
    top = "\n".join(f"  {c.text!r}  {c.prob:.3f}" for c in record.top)
    cls, drafted = _drafted(record)
    tip = html.escape(f"{diverged + chr(10) if diverged else ''}step {record.step} ({record.kind}) · position "
                      f"{record.position} · p = {record.prob:.3f}{drafted}\ncandidates:\n{top}", quote=True)
    cls += (" kvx-drift" if diverged.startswith(DRIFT) else " kvx-diverge") if diverged else ""
    return (f'<span class="kvx-tok kvx-gen{" kvx-last" if last else ""}{cls}" '
            f'style="background:{step_colour(record.step)}" title="{tip}">{_show(record.text)}</span>')


def strip_html(prompt_texts: Sequence[str] | str, records: Sequence[StepRecord] | Sequence[str],
               earlier: int = 0) -> str:
    """The whole strip: the prompt (texts, or :func:`prompt_spans` already made), then one span per record (or the
    spans already made with :func:`token_span`); ``earlier``: how many tokens before these are left out (a long
    sequence shows its newest tokens only), said first. The box follows its end: the newest token is in view."""
    head = prompt_texts if isinstance(prompt_texts, str) else prompt_spans(prompt_texts)
    n = len(records)
    spans = [r if isinstance(r, str) else token_span(r, last=i == n - 1) for i, r in enumerate(records)]
    more = (f'<span class="kvx-more" style="color:#777">… {earlier:,} earlier tokens (the cache map\'s token rows '
            f'name them) · </span>') if earlier else ""
    # the box scrolls from its end (a column-reverse flex box starts scrolled to its last line): the newest token
    # shows, whatever the length, and a teacher can scroll back
    return f'{STYLE}<div class="kvx-strip kvx-follow"><div>{more}{head}{"".join(spans)}</div></div>'
