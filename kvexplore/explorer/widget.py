"""``kvexplore.Explorer``: step generation token by token in a notebook and watch the KV cache.

A thin controller: the state is a :class:`~kvexplore.explorer.session.Session` (several strategies in lockstep); every
refresh takes one :class:`~kvexplore.views.snapshot.Snapshot` of it and draws the registry's views
(:mod:`kvexplore.views.registry`) into :class:`~kvexplore.views.plot.PlotWidget`s. Controls are ipywidgets
(:mod:`.controls`, public as ``explorer.controls``), kept in step with the session by :class:`~.screen.Screen`.
Buttons are disabled while an operation runs; an error is shown in the widget and leaves every lane as it was. The
same operations are methods (:meth:`Explorer.step`, ...), which raise instead.
"""

from __future__ import annotations

import html
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from ..errors import SettingsError, StateError
from ..models.model import Model
from ..runtime.generator import Generator
from ..views import compare, divergence, snapshot
from ..views.frames import check_layer_head
from ..views.page import save_html
from ..views.plot import PlotWidget, loader
from ..views.registry import TABS, VIEWS
from ..views.spec import FigureSpec
from . import controls as layout
from . import inspect, models
from .screen import Screen
from .session import Lane, Session
from .static import StaticCopy
from .status import CONTINUE, SLOTS_TIP, STEP, at_end, fork_tip, full_note, status_line, stopped_note
from .strip import TokenStrip

DEFAULT_PROMPT = "Call me Ishmael. Some years ago"
# said above an explorer displayed a second time (n: which display): both places show one live explorer
SHOWN_AGAIN = ("The same live explorer as displayed above (display {n}): a click in either place changes both. "
               "For a second sequence use <code>fork()</code>; for a separate explorer make a new one.")


class Explorer(Screen):
    """An explorer widget; display it by making it a cell's last expression.

    ``source``: a named model (``"tiny"``, ``"smollm2-135m"``), a folder or ``.gguf`` file, a loaded
    :class:`~kvexplore.Model`, a :class:`~kvexplore.Generator` (it becomes the first lane as it is), or a
    transformers causal LM with its ``tokenizer`` (a transformers tokenizer or the model folder): its own caches
    run as ``hf:dynamic``, ``hf:static``, ... lanes (default both), and kvexplore's strategies beside them on the
    same weights where kvexplore implements the architecture.
    ``strategies``: cache kinds run in lockstep on the same prompt and seed; the first is the reference the others
    are compared with (and, with ``follow_reference``, fed the tokens of). ``strategy_options``: per kind, options
    for :func:`~kvexplore.make_cache` (e.g. ``{"paged": {"block_size": 8}}``). ``prompt``: prefilled at once when
    given; otherwise the prompt box holds :data:`DEFAULT_PROMPT` and Step or Run prefill it first. ``view``: the view
    beside the cache map (one of :data:`~.registry.TABS`). ``presentation``: bigger fonts, fewer controls.
    ``max_seq_len``: the slots of each cache; a prompt that does not leave one free grows them to the prompt and 128
    more (up to the model's context, :mod:`.fit`), and the status line says so; ``grow=False`` keeps the size (a
    longer prompt is then refused with :class:`~kvexplore.CacheFullError`). A strategy's own ``max_seq_len`` in
    ``strategy_options`` is kept as it is.
    """

    def __init__(self, source: str | Path | Model | Generator = "tiny", tokenizer: Any = None,
                 strategies: Sequence[str] | None = None,
                 max_seq_len: int = 256, prompt: str | Sequence[int] | None = None, chat: bool = False,
                 temperature: float = 0.0,
                 top_k: int | None = None, top_p: float | None = None, seed: int = 0, top_candidates: int = 5,
                 layer: int = 0, head: int = 0, strategy_options: dict[str, dict[str, Any]] | None = None,
                 follow_reference: bool = True, device: str | None = None, dtype: str | None = None,
                 view: str = "attention", presentation: bool = False, grow: bool = True) -> None:
        if isinstance(tokenizer, (list, tuple)) and strategies is None:  # Explorer(source, strategies) still works
            tokenizer, strategies = None, tokenizer
        if view not in TABS:
            raise SettingsError(f"unknown view {view!r}; choose from {', '.join(TABS)}")
        opened = models.open_source(source, tokenizer, strategies, device, dtype)  # loads a model by name
        generator, self._hf = opened.generator, opened.hf
        if generator is not None:  # its sampling is what every lane and the controls use
            g = generator.sampling
            temperature, top_k, top_p, seed = g.temperature, g.top_k, g.top_p, generator.seed
            top_candidates = generator.top_candidates
        self._lanes_args = dict(strategies=opened.strategies, max_seq_len=max_seq_len, top_candidates=top_candidates,
                                strategy_options=strategy_options, follow_reference=follow_reference, grow=grow)
        self._device, self._dtype = device, dtype
        self.error = ""  # the last error shown in the widget ("" when the last operation succeeded)
        self._busy = False
        self.operations = 0  # operations finished (a click's effect is in once this count grows past its value)
        self._zoom, self._reversed = {}, {}  # per figure, the axis ranges on screen and its reversed axes (.zoom)
        self._syncing = False  # True while the pickers are given new options (their observers stand still)
        self._tab = view
        self.token_strip = TokenStrip()
        self.model = opened.model
        check_layer_head(self.model.config, layer, head)
        self.session = Session(self.model, generator=generator, temperature=temperature, top_k=top_k, top_p=top_p,
                               seed=seed, hf=self._hf, **self._lanes_args)
        self.layer, self.head = layer, head
        self.controls = layout.make(
            self.model.config, list(self.session.lanes), layer, head, self.session.sampling, self.session.seed,
            self._box_text(prompt) if prompt else DEFAULT_PROMPT, chat, self._has_chat(),
            models.picker_entry(source, self.model),
            [(VIEWS[n].title, n) for n in TABS], view, presentation)
        snap = self.snapshot()
        self.figures: dict[str, PlotWidget] = {name: PlotWidget(self._fit(name, v.build(snap)), name)
                                               for name, v in VIEWS.items()}
        self.widget, self._panel = layout.arrange(self.controls, self.figures, loader())
        self._truth = inspect.element()  # only when KVEXPLORE_INSPECT is set (browser tests)
        if self._truth is not None:
            self.widget.children = (*self.widget.children, self._truth)
        self._static = StaticCopy(self)
        self._displays = 0  # how many times IPython displayed this explorer
        self.figures["cache_map"].on_msg(self._static.on_message)
        self._wire()
        self._apply_presentation()  # and draws what there is
        if prompt:
            self.prefill(prompt, chat=chat)

    # -- the operations (also what the buttons do) ---------------------------------------------------------
    @property
    def lanes(self) -> dict[str, Lane]:
        return self.session.lanes

    @property
    def lane(self) -> Lane:
        """The lane the cache map, attention and tensor views show (the strategy picker)."""
        return self.session.lanes.get(self.controls["lane"].value) or self.session.reference

    @property
    def view(self) -> str:
        """The view beside the cache map (the tabs; presenting, the last one picked other than the cache map's)."""
        return self._tab

    @view.setter
    def view(self, name: str) -> None:
        if name not in TABS:
            raise SettingsError(f"unknown view {name!r}; choose from {', '.join(TABS)}")
        picker = self.controls["view"]
        self._tab = name
        if name not in [value for _, value in picker.options]:  # a tab hidden as applying to no lane: asked for
            with self._quiet():
                current = picker.value
                picker.options = [*picker.options, (VIEWS[name].title, name)]
                picker.value = current
        picker.value = name

    @property
    def presentation(self) -> bool:
        return self.controls["presentation"].value

    @presentation.setter
    def presentation(self, on: bool) -> None:
        self.controls["presentation"].value = bool(on)

    @property
    def side_by_side(self) -> str | None:
        """The second strategy whose cache map is drawn under the first (None when off). Set a lane name or None."""
        w = self.controls
        return w["lane_b"].value if w["side_by_side"].value else None

    @side_by_side.setter
    def side_by_side(self, lane: str | None) -> None:
        w = self.controls
        if lane is not None:
            if lane not in self.session.lanes:
                raise SettingsError(f"no strategy {lane!r}; lanes: {', '.join(self.session.lanes)}")
            w["lane_b"].value = lane
        w["side_by_side"].value = lane is not None

    def prefill(self, prompt: str | Sequence[int] | None = None, chat: bool | None = None) -> None:
        """Start every strategy on ``prompt`` (default: the prompt box)."""
        self._operate(lambda: self._prefill(prompt, chat))

    def step(self) -> None:
        """One token on every strategy; with nothing run yet, the prefill of the prompt box (its first token)."""
        self._operate(lambda: self._prefill(None, None) if not self.session.tokens else self.session.step())

    def run(self, n: int | None = None) -> None:
        """Up to ``n`` steps (default: the Run box; a prefill of the prompt box first when nothing has run),
        stopping after an end-of-sequence token; the figures follow every step and a progress bar shows how far
        the run is. With a lane that drafts, a step is one verification (one token or more on every lane)."""
        n = self.controls["run_n"].value if n is None else n
        if n < 1:
            raise SettingsError(f"run needs a positive number of steps, got {n}")

        def go():
            with layout.progress(self.controls["progress"], n, "running") as bar:
                for i in range(n):
                    last = self.session.reference.last
                    if last is not None and last.is_eos:
                        break
                    if not self.session.tokens:
                        self._prefill(None, None)
                    else:
                        self.session.step()
                    bar.value = i + 1
                    self.refresh()

        self._operate(go)

    def rewind(self, n: int | None = None) -> None:
        """Forget the last ``n`` tokens on every strategy (the pre-allocated cache's slots turn stale)."""
        n = self.controls["rewind_n"].value if n is None else n
        self._operate(lambda: self.session.rewind(n))

    def reset(self) -> None:
        """Empty every strategy's cache and forget the sequence (and every zoom)."""
        self._zoom.clear()
        self._operate(self.session.reset)

    def fork(self, lane: str | None = None) -> Lane:
        """A second sequence from the shown lane, in the strategy picker (paged caches share pages until they part)."""
        out: list[Lane] = []
        self._operate(lambda: out.append(self.session.fork(lane or self.lane.name)))
        self.controls["lane"].value = out[0].name
        return out[0]

    def load_model(self, source: str | Path | Model) -> None:
        """Load another model (the progress bar shows it) and start over with the same strategies and sampling."""
        def go():
            if source == "":
                raise SettingsError("this model came as an object, not a name or a path: it cannot be loaded again; "
                                    "choose a named model")
            old = self.session
            with layout.progress(self.controls["progress"], 1, "loading"):
                model, hf = models.reopen(source, self._lanes_args["strategies"], self._device, self._dtype)
                s = old.sampling
                session = Session(model, temperature=s.temperature, top_k=s.top_k, top_p=s.top_p, seed=old.seed,
                                  hf=hf, **self._lanes_args)
            old.close()  # (a lane over ranks: the old model's ranks stop now)
            self.model, self.session, self._hf = model, session, hf
            layout.name_model(self.controls["model"], models.picker_entry(source, model))
            self._zoom.clear()
            self.layer = min(self.layer, model.config.num_layers - 1)
            self.head = min(self.head, model.config.num_heads - 1)
            self._sync_pickers()

        self._operate(go)

    # -- state shown -------------------------------------------------------------------------------------
    def snapshot(self) -> snapshot.Snapshot:
        """What the views need of the session now (the lanes on screen in detail)."""
        return snapshot.take(self.session, self.token_strip, self.lane.name, self.side_by_side, self.layer, self.head,
                             zoom=self._zoom)

    def save_html(self, path, title: str | None = None, picks: Sequence[Sequence[int]] | None = None):
        """Write the session so far as one self-contained HTML replay (every lane, the layer and head chosen now;
        see :mod:`kvexplore.replay`: the same page, drawn by :mod:`kvexplore.views.page`). ``picks``: more (layer,
        head) pairs the page can switch to after the one chosen now (``picks=[(3, 1)]``). Returns the path."""
        runs = self.session.runs()
        if not runs:
            raise StateError("nothing to save yet: prefill first (the Prefill button, or ex.step())")
        return save_html(runs, path, layer=self.layer, head=self.head, title=title, picks=picks)

    def specs(self, names: Sequence[str] | None = None) -> dict[str, FigureSpec]:
        """What each view draws now (default: every view; :meth:`shown` are the ones on screen)."""
        return self._drawn(names or VIEWS, self.snapshot())

    def shown(self) -> list[str]:
        """The views on screen: the cache map(s) and the tab's view (presenting: the maps or the view)."""
        maps = ["cache_map", *(["cache_map_b"] if self.side_by_side else [])]
        if self.presentation:
            return maps if self.map_tab else [self.view]
        return [*maps, self.view]

    def divergence_mark(self, lane) -> tuple[int, str] | None:
        """(step, words) where ``lane`` first parts from the reference, for the strip (None: not yet, or is it)."""
        d = lane.divergence
        if d is None:
            return None
        return d[0], divergence.words(*d, self.session.reference.name, lane.top1_at.get(d[0]) is True)

    def compare_rows(self) -> list[list[str]]:
        return compare.rows_from_snapshot(self.snapshot())

    def refresh(self) -> None:
        """Redraw the token strip, status and the figures on screen from one snapshot of the session."""
        self._sync_lanes()
        lane = self.lane
        w = self.controls
        w["tokens"].value = self.token_strip.html(self.model.tokenizer, lane.generator, self.divergence_mark(lane))
        w["status"].value = (f'<span title="{html.escape(SLOTS_TIP)}">'
                             f'{html.escape(status_line(lane, self.session.grew))}</span>')
        w["fork"].tooltip = fork_tip(lane)
        if not self.error:  # a lane that sits out the steps, said until a rewind or reset (a stopped rank: red)
            lanes = list(self.session.lanes.values())
            stopped = stopped_note(lanes)
            w["error"].value = (layout.stopped_html(stopped) if stopped else "") + \
                layout.notice_html(full_note(lanes))
        ended = at_end(lane)  # Step offers to go on past the end of sequence
        w["step"].description = CONTINUE if ended else STEP
        w["step"].tooltip = layout.CONTINUE_TIP if ended else layout.STEP_TIP
        snap = self.snapshot()
        w["compare"].value = compare.table_html(compare.rows_from_snapshot(snap), compare.notes_from_snapshot(snap))
        for name, spec in self._drawn(self.shown(), snap).items():
            self.figures[name].show(spec)
        inspect.publish(self._truth, self)

    # -- internals ---------------------------------------------------------------------------------------
    def _prefill(self, prompt, chat) -> None:
        w = self.controls
        prompt = w["prompt"].value if prompt is None else prompt
        chat = w["chat"].value if chat is None else chat
        if isinstance(prompt, str) and not prompt.strip():
            raise SettingsError("the prompt is empty: type some text in the prompt box, then press Prefill")
        layers, tips = self.model.config.num_layers, {b: b.tooltip for b in self._buttons}
        with layout.progress(w["progress"], 1, "prefilling") as bar:
            def show(i: int, lanes: int, name: str, layer: int | None, tokens: int) -> None:
                # the new prompt in the status at once, then which lane and layer its pass has reached
                bar.max, bar.value = lanes * layers, i * layers + (0 if layer is None else layer + 1)
                text = (f"prefilling the new prompt ({tokens:,} tokens): {name}, lane {i + 1} of {lanes}"
                        + ("" if layer is None else f", layer {layer + 1} of {layers}"))
                w["status"].value = html.escape(text)
                for b in tips:
                    b.tooltip = f"wait: {text}"

            try:
                self.session.prefill(prompt, chat=chat, progress=show)
            finally:
                for b, tip in tips.items():
                    b.tooltip = tip
        w["prompt"].value = self._box_text(prompt)  # token ids: the text they decode to

    def _box_text(self, prompt: str | Sequence[int]) -> str:
        """What the prompt box shows for ``prompt``: the text, or the text token ids decode to."""
        if isinstance(prompt, str):
            return prompt
        tok = self.model.tokenizer
        return tok.decode(list(prompt)) if tok is not None else " ".join(str(i) for i in prompt)

    def _operate(self, fn) -> None:
        """Run one operation with the buttons disabled; show its error in the widget and raise it."""
        if self._busy:
            raise StateError("another operation is still running; wait for it to finish")
        self._busy = True
        self._set_enabled(False)
        self.error = ""
        self.controls["error"].value = ""
        try:
            fn()
        except Exception as e:
            self._show_error(e)
            raise
        finally:
            self._busy = False
            self.operations += 1
            self._set_enabled(True)
            self.refresh()

    def _ipython_display_(self) -> None:
        from IPython.display import HTML, display

        self._displays += 1
        if self._displays > 1:  # the same widget again: every copy on the page shows (and changes with) one state
            display(HTML(f'<div class="kvx-again">{SHOWN_AGAIN.format(n=self._displays)}</div>'))
        display(self.widget)
        self._static.show()  # for nbconvert and GitHub: emptied as soon as a frontend draws the widget

    def close(self) -> None:
        """Stop what the explorer runs outside this kernel (the ranks of a ``tp:N`` or ``cp:N`` lane) and close its
        widget; the kernel's exit or restart stops those ranks too."""
        self.session.close()
        self.widget.close()

    def _repr_mimebundle_(self, **kwargs):
        return self.widget._repr_mimebundle_(**kwargs)

    def __repr__(self) -> str:
        return f"Explorer({self.session!r}, layer={self.layer}, head={self.head})"
