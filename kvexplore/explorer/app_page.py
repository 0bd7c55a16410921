"""What ``kvexplore app``'s page shows: the explorer built from what the command line passed (in the environment,
:data:`ENV`), with every error on the page: a prompt that cannot be prefilled in the explorer's error line, a model
or strategies that cannot be opened in an error box (not Voila's "There was an error when executing cell [1]"). The
app notebook (``kvexplore/explorer/app.ipynb``) is two cells: :func:`app_explorer` builds the explorer with the
prompt in its box (:func:`app_view` shows it), then :func:`app_start` prefills it; Voila renders the page cell by
cell (``kvexplore app`` turns its progressive rendering on), so a chapter's prefill shows its progress in the page
instead of Voila's spinner.
"""

from __future__ import annotations

import difflib
import json
import os
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from ..errors import KVExploreError, SettingsError

MODEL_ENV = "KVEXPLORE_APP_MODEL"
STRATEGIES_ENV = "KVEXPLORE_APP_STRATEGIES"
PROMPT_ENV = "KVEXPLORE_APP_PROMPT"
MAX_SEQ_LEN_ENV = "KVEXPLORE_APP_MAX_SEQ_LEN"
OPTIONS_ENV = "KVEXPLORE_APP_OPTIONS"  # JSON: {lane: {option: value}} (kvexplore app --strategy-option LANE.KEY=VALUE)
ENV = (MODEL_ENV, STRATEGIES_ENV, PROMPT_ENV, MAX_SEQ_LEN_ENV, OPTIONS_ENV)
PROMPT = "Call me Ishmael."
STRATEGIES = ("preallocated", "concat", "paged")
MAX_SEQ_LEN = 128  # the caches' size for a short prompt; a longer one grows them (see .fit)
# a lane starts with its strategy's ``Options.app`` (kvexplore.caches.options: the sizes a class uses, a pasted chapter
# of thousands of tokens); ``--strategy-option`` replaces any of them


def strategy_option(text: str) -> tuple[str, str, Any]:
    """``"sink.window=256"`` as ``("sink", "window", 256)``: the lane, the option, its value (a number, true, false or
    null as JSON reads them, else the text as it is)."""
    left, eq, value = text.partition("=")
    lane, dot, key = left.rpartition(".")
    if not (eq and dot and lane and key):
        raise SettingsError(f"--strategy-option {text!r}: give LANE.OPTION=VALUE, e.g. sink.window=256, "
                            f"quantized.bits=2 or evict.press=snapkv")
    try:
        parsed = json.loads(value)
    except ValueError:
        parsed = value
    return lane, key, parsed


def lane_options(strategies: Sequence[str], given: Mapping[str, Mapping[str, Any]] | None = None,
                 max_seq_len: int | None = None) -> dict[str, dict[str, Any]]:
    """Each lane's options: its strategy's for the app (``Options.app``, fitted to caches of ``max_seq_len`` slots by
    ``Options.fitted``: the app's sink ring shrinks to them) under ``given``'s. An option for a lane not among
    ``strategies``, or one its cache does not take, is refused naming what it takes."""
    from ..caches.factory import STRATEGIES as CACHES
    from .lanes import GENERATOR_OPTIONS, base_strategy

    given = {lane: dict(options) for lane, options in (given or {}).items()}
    stray = [lane for lane in given if lane not in strategies]
    if stray:
        raise SettingsError(f"--strategy-option for {stray[0]!r}, which is not a lane: the lanes are "
                            f"{', '.join(strategies)} (--strategies A,B)")
    out: dict[str, dict[str, Any]] = {}
    for lane in strategies:
        declared = getattr(CACHES.get(base_strategy(lane)), "Options", None)
        mine = given.get(lane, {})
        options = {**(declared.app if declared is not None else {}), **mine}
        if declared is not None:
            options = declared.fitted(options, mine, max_seq_len)
            refused = sorted(set(mine) - set(declared.names()) - set(GENERATOR_OPTIONS))
            if refused:
                raise SettingsError(f"--strategy-option {lane}.{refused[0]}: a {base_strategy(lane)} cache does not "
                                    f"take {refused[0]!r}; it takes {', '.join(declared.names())}")
        if options:
            out[lane] = options
    return out


def app_options(model: str, strategies: Sequence[str] | None, option_texts: Sequence[str]) -> dict[str, dict[str, Any]]:
    """What ``kvexplore app`` checks before the server starts: ``model`` (a named model, or a folder or file that
    exists) and each ``--strategy-option`` text against the lanes (``strategies``, default :data:`STRATEGIES`);
    returns the options given, by lane."""
    from ..formats.store import MODELS

    if model not in MODELS and not Path(model).expanduser().exists():
        close = difflib.get_close_matches(model, list(MODELS), n=1)
        hint = f"did you mean {close[0]!r}? " if close else ""
        raise SettingsError(f"--model {model!r} is neither a named model nor a folder or file here; {hint}named "
                            f"models: {', '.join(MODELS)} (kvexplore models list)")
    given: dict[str, dict[str, Any]] = {}
    for text in option_texts:
        lane, key, value = strategy_option(text)
        given.setdefault(lane, {})[key] = value
    lane_options(strategies or STRATEGIES, given)  # refused here, before the page opens
    return given


def linked(environ: Mapping[str, str]) -> tuple[dict[str, str], dict[str, str]]:
    """``environ`` with what the page's link carries (Voila's ``QUERY_STRING``: :mod:`.app_link`) in place of what
    the command line passed, and the link's settings."""
    from . import app_link

    link = app_link.parse(environ.get("QUERY_STRING", ""))
    names = {"model": MODEL_ENV, "strategies": STRATEGIES_ENV, "max_seq_len": MAX_SEQ_LEN_ENV, "prompt": PROMPT_ENV}
    return {**environ, **{names[k]: v for k, v in link.items() if k in names}}, link


def settings(environ: Mapping[str, str]) -> dict[str, Any]:
    """The explorer's arguments from ``environ`` (unset: the bundled tiny model and the defaults above)."""
    strategies = tuple(s for s in environ.get(STRATEGIES_ENV, "").split(",") if s) or STRATEGIES
    text = environ.get(MAX_SEQ_LEN_ENV, "") or str(MAX_SEQ_LEN)
    if not text.isdigit() or int(text) < 1:
        raise SettingsError(f"{MAX_SEQ_LEN_ENV}={text!r}: the caches' size must be a positive whole number of "
                            f"slots (kvexplore app --max-seq-len N)")
    try:
        given = json.loads(environ.get(OPTIONS_ENV, "") or "{}")
    except ValueError as e:
        raise SettingsError(f"{OPTIONS_ENV} is not JSON ({e}): pass options as kvexplore app --strategy-option "
                            f"LANE.OPTION=VALUE") from e
    return {"source": environ.get(MODEL_ENV, "tiny"), "strategies": strategies, "max_seq_len": int(text),
            "strategy_options": lane_options(strategies, given, int(text)) or None}


def app_explorer(environ: Mapping[str, str] | None = None, start: bool = True) -> Any:
    """The app's explorer, its first prompt prefilled (an error doing it shown in the explorer), or, when the
    explorer cannot be built, an HTML box on the page naming the problem and the fix. ``start=False``: the prompt
    only in its box, for :func:`app_start` (the app notebook's next cell) to prefill."""
    import ipywidgets as W

    from . import app_link
    from .controls import error_html
    from .widget import Explorer

    asked = os.environ if environ is None else environ
    try:
        environ, link = linked(asked)
        given = settings(environ)
        explorer = Explorer(**given)
    except (KVExploreError, ValueError, OSError) as e:
        return W.HTML(f'<div class="kvx-app-error">{error_html(e)}<p>Start the page again with other arguments: '
                      f'<code>kvexplore app --model M --strategies A,B --max-seq-len N --prompt TEXT</code> '
                      f'(<code>kvexplore app --help</code>).</p></div>')
    explorer.controls["prompt"].value = environ.get(PROMPT_ENV, PROMPT)
    if app_link.on(link, "chat"):
        explorer.controls["chat"].value = True
    explorer.widget.children = (*explorer.widget.children,
                                app_link.button(explorer, given, environ.get("SCRIPT_NAME", "") or "/"))
    if start:
        app_start(explorer, asked)
    return explorer


def app_view(explorer: Any) -> Any:
    """What the app's page shows of :func:`app_explorer`'s result: the live explorer alone (the page always has a
    kernel: the static copy an explorer shows for kernel-less pages would stand below it until its figures draw, a
    chapter's prefill later), or the error box."""
    from .widget import Explorer

    return explorer.widget if isinstance(explorer, Explorer) else explorer


def app_start(explorer: Any, environ: Mapping[str, str] | None = None) -> None:
    """Prefill the prompt :func:`app_explorer` put in the box (none: nothing), then go where the page's link stands
    (its steps, lane, layer, head and tab); a failure is shown in the explorer's error line. Nothing for the error box
    of an explorer that could not be built."""
    from . import app_link
    from .controls import error_html
    from .widget import Explorer

    if not isinstance(explorer, Explorer) or not explorer.controls["prompt"].value:
        return
    try:
        _, link = linked(os.environ if environ is None else environ)
        explorer.prefill()  # the prompt box
        app_link.apply(explorer, link)
    except KVExploreError as e:
        if not explorer.controls["error"].value:  # the prefill's own error is shown already
            explorer.controls["error"].value = error_html(e)
