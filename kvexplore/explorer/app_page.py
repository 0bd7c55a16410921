"""What ``kvexplore app``'s page shows: the explorer built from what the command line passed (in the environment,
:data:`ENV`), with every error on the page.

The app notebook (``kvexplore/explorer/app.ipynb``, served by Voila with its code hidden) is one call,
:func:`app_explorer`. A prompt that cannot be prefilled (too long for the model's context, no tokenizer) leaves the
explorer on the page with the prompt in its box and the error, naming the fix, in its error line; a model or
strategies that cannot be opened give an error box on the page instead of Voila's "There was an error when executing
cell [1]" (whose reason only the server log had).
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import Any

from ..errors import KVExploreError, SettingsError

MODEL_ENV = "KVEXPLORE_APP_MODEL"
STRATEGIES_ENV = "KVEXPLORE_APP_STRATEGIES"
PROMPT_ENV = "KVEXPLORE_APP_PROMPT"
MAX_SEQ_LEN_ENV = "KVEXPLORE_APP_MAX_SEQ_LEN"
ENV = (MODEL_ENV, STRATEGIES_ENV, PROMPT_ENV, MAX_SEQ_LEN_ENV)
PROMPT = "Call me Ishmael."
STRATEGIES = ("preallocated", "concat", "paged")
MAX_SEQ_LEN = 128  # the caches' size for a short prompt; a longer one grows them (see .fit)


def settings(environ: Mapping[str, str]) -> dict[str, Any]:
    """The explorer's arguments from ``environ`` (unset: the bundled tiny model and the defaults above)."""
    strategies = tuple(s for s in environ.get(STRATEGIES_ENV, "").split(",") if s) or STRATEGIES
    text = environ.get(MAX_SEQ_LEN_ENV, "") or str(MAX_SEQ_LEN)
    if not text.isdigit() or int(text) < 1:
        raise SettingsError(f"{MAX_SEQ_LEN_ENV}={text!r}: the caches' size must be a positive whole number of "
                            f"slots (kvexplore app --max-seq-len N)")
    return {"source": environ.get(MODEL_ENV, "tiny"), "strategies": strategies, "max_seq_len": int(text),
            "strategy_options": {"paged": {"block_size": 8}} if "paged" in strategies else None}


def app_explorer(environ: Mapping[str, str] | None = None) -> Any:
    """The app's explorer, its first prompt prefilled (an error doing it shown in the explorer), or, when the
    explorer cannot be built, an HTML box on the page naming the problem and the fix."""
    import ipywidgets as W

    from .controls import error_html
    from .widget import Explorer

    environ = os.environ if environ is None else environ
    try:
        explorer = Explorer(**settings(environ))
    except (KVExploreError, ValueError, OSError) as e:
        return W.HTML(f'<div class="kvx-app-error">{error_html(e)}<p>Start the page again with other arguments: '
                      f'<code>kvexplore app --model M --strategies A,B --max-seq-len N --prompt TEXT</code> '
                      f'(<code>kvexplore app --help</code>).</p></div>')
    prompt = environ.get(PROMPT_ENV, PROMPT)
    if prompt:
        explorer.controls["prompt"].value = prompt
        try:
            explorer.prefill()  # the prompt box; a failure is shown in the explorer's error line
        except KVExploreError:
            pass
    return explorer
