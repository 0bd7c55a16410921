"""``kvexplore.Explorer``: step generation token by token in a notebook and watch the KV cache.

A thin controller over :class:`~kvexplore.explorer.session.Session` (the state: several strategies in
lockstep) and the views (pure ``records -> FigureSpec`` builders in :mod:`kvexplore.explorer.views`). Controls are
ipywidgets (:mod:`.controls`); plots are plotly ``FigureWidget``s built once and updated in place after every
operation (:mod:`.figures`); the token strip is made once per token (:mod:`.strip`). Buttons are disabled while an operation runs, so clicks cannot interleave; an error (cache full, bad
prompt, an impossible rewind) is shown in the widget and leaves every lane as it was. The same operations are
methods (:meth:`Explorer.step`, ...), which raise instead.
"""

from __future__ import annotations

import html
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from ..generate import Generator
from ..loading import load
from ..model import Model
from . import controls
from .figures import LiveFigures
from .session import Lane, Session
from .strip import TokenStrip
from .views import attention, cache_map, compare, memory, tensors
from .views.spec import FigureSpec

FIGURE_WIDTH = 960  # pixels: fits a notebook column in JupyterLab and the Voila page
VIEWS = ("cache_map", "memory", "attention", "tensors", "compare")
HEADINGS = {"cache_map": "Cache map — layers × physical slots", "memory": "Memory per step",
            "attention": "Attention", "tensors": "Stored keys and values", "compare": "Strategies compared"}


class Explorer:
    """An explorer widget; display it by making it a cell's last expression.

    ``source``: a named model (``"tiny"``, ``"smollm2-135m"``), a folder or ``.gguf`` file, a loaded
    :class:`~kvexplore.Model`, or a :class:`~kvexplore.Generator` (it becomes the first lane as it is).
    ``strategies``: cache kinds run in lockstep on the same prompt and seed; the first is the reference the others
    are compared with (and, with ``follow_reference``, fed the tokens of). ``strategy_options``: per kind, options
    for :func:`~kvexplore.make_cache` (e.g. ``{"paged": {"block_size": 8}}``). ``views``: which plots to show.
    """

    def __init__(self, source: str | Path | Model | Generator = "tiny", strategies: Sequence[str] | None = None,
                 max_seq_len: int = 256, prompt: str | None = None, chat: bool = False, temperature: float = 0.0,
                 top_k: int | None = None, top_p: float | None = None, seed: int = 0, top_candidates: int = 5,
                 layer: int = 0, head: int = 0, strategy_options: dict[str, dict[str, Any]] | None = None,
                 follow_reference: bool = True, device: str | None = None, dtype: str | None = None,
                 views: Sequence[str] = VIEWS) -> None:
        unknown = [v for v in views if v not in VIEWS]
        if unknown:
            raise ValueError(f"unknown view {unknown[0]!r}; choose from {', '.join(VIEWS)}")
        generator = source if isinstance(source, Generator) else None
        if strategies is None:
            strategies = (generator.cache.kind,) if generator is not None else ("preallocated",)
        if generator is not None:  # its sampling is what every lane and the controls use
            g = generator.sampling
            temperature, top_k, top_p, seed = g.temperature, g.top_k, g.top_p, generator.seed
            top_candidates = generator.top_candidates
        self._settings = dict(strategies=tuple(strategies), max_seq_len=max_seq_len, temperature=temperature,
                              top_k=top_k, top_p=top_p, seed=seed, top_candidates=top_candidates,
                              strategy_options=strategy_options, follow_reference=follow_reference)
        self._device, self._dtype = device, dtype
        self.views = tuple(views)
        self.error = ""  # the last error shown in the widget ("" when the last operation succeeded)
        self._busy = False
        self._syncing = False  # True while the pickers are given new options (their observers stand still)
        self._strip = TokenStrip()
        self.model = self._load(source)
        self._check_picks(layer, head)
        self.session = Session(self.model, generator=generator, **self._settings)
        self.layer, self.head = layer, head
        self._build_widgets(prompt or "", chat, source)
        self._make_figures()
        if prompt:
            self.prefill(prompt, chat=chat)
        else:
            self.refresh()

    # -- the operations (also what the buttons do) ---------------------------------------------------------
    @property
    def lanes(self) -> dict[str, Lane]:
        return self.session.lanes

    @property
    def lane(self) -> Lane:
        """The lane the cache map, attention and tensor views show (the strategy picker)."""
        return self.session.lanes.get(self._w["lane"].value) or self.session.reference

    def prefill(self, prompt: str | Sequence[int] | None = None, chat: bool | None = None) -> None:
        """Start every strategy on ``prompt`` (default: the prompt box)."""
        if prompt is None:
            prompt = self._w["prompt"].value
        if chat is None:
            chat = self._w["chat"].value

        def go():
            if isinstance(prompt, str):
                if not prompt.strip():
                    raise ValueError("the prompt is empty: type some text in the prompt box, then press Prefill")
                self._w["prompt"].value = prompt
            self.session.prefill(prompt, chat=chat)

        self._operate(go)

    def step(self) -> None:
        """One token on every strategy."""
        self._operate(self.session.step)

    def run(self, n: int | None = None) -> None:
        """Up to ``n`` steps (default: the Run box), stopping after an end-of-sequence token; the figures follow
        every step and a progress bar shows how far the run is."""
        n = self._w["run_n"].value if n is None else n
        if n < 1:
            raise ValueError(f"run needs a positive number of steps, got {n}")

        def go():
            bar = self._w["progress"]
            bar.max, bar.value, bar.description = n, 0, "running"
            bar.layout.visibility = "visible"
            try:
                for i in range(n):
                    last = self.session.reference.last
                    if last is not None and last.is_eos:
                        break
                    self.session.step()
                    bar.value = i + 1
                    self.refresh()
            finally:
                bar.layout.visibility = "hidden"

        self._operate(go)

    def rewind(self, n: int | None = None) -> None:
        """Forget the last ``n`` tokens on every strategy (the pre-allocated cache's slots turn stale)."""
        n = self._w["rewind_n"].value if n is None else n
        self._operate(lambda: self.session.rewind(n))

    def reset(self) -> None:
        """Empty every strategy's cache and forget the sequence."""
        self._operate(self.session.reset)

    def fork(self, lane: str | None = None) -> Lane:
        """A second sequence continuing from the shown lane (paged caches share their pages until they diverge);
        it appears in the strategy picker."""
        out: list[Lane] = []
        self._operate(lambda: out.append(self.session.fork(lane or self.lane.name)))
        self._w["lane"].value = out[0].name
        return out[0]

    def load_model(self, source: str | Path | Model) -> None:
        """Load another model and start over with the same strategies (the progress bar shows the load)."""
        def go():
            bar = self._w["progress"]
            bar.max, bar.value, bar.description = 1, 0, "loading"
            bar.layout.visibility = "visible"
            try:
                model = self._load(source)
                session = Session(model, **self._settings)
            finally:
                bar.layout.visibility = "hidden"
            self.model, self.session = model, session
            self.layer = min(self.layer, model.config.num_layers - 1)
            self.head = min(self.head, model.config.num_heads - 1)
            self._sync_pickers()

        self._operate(go)

    # -- state shown -------------------------------------------------------------------------------------
    def specs(self) -> dict[str, FigureSpec]:
        """What every view draws now (the same data the figures hold)."""
        lane = self.lane
        texts = self._strip.texts(self.model.tokenizer, lane.generator)
        c = self.model.config
        # the slots as they are now (a fork stepping after this lane changes a shared pool); the step's write and
        # read windows only while the cache is as the last step left it (not after a rewind or a fork)
        fresh = self.session.last_op in ("prefill", "step")
        slots = None if lane.last is None else lane.cache.slot_view()
        out = {}
        for name in self.views:
            if name == "cache_map":
                out[name] = cache_map.spec(lane.last, lane.kind, c.num_layers, texts, slots=slots, fresh=fresh,
                                           after=self.session.last_op)
            elif name == "memory":
                out[name] = memory.spec({n: l.history for n, l in self.lanes.items()},
                                        cuda=self.model.device.type == "cuda")
            elif name == "attention":
                out[name] = attention.spec(lane.history, self.layer, self.head, texts, c.gqa_groups, c.num_heads)
            elif name == "tensors":
                norms = lane.tracer.norms[self.layer] if lane.history else None
                err = lane.cache.quantization_error(self.layer)[0] if lane.kind == "quantized" and lane.history else None
                out[name] = tensors.spec(lane.last, norms, self.layer, err, slots)
            elif name == "compare":
                out[name] = compare.spec({n: l.history for n, l in self.lanes.items()},
                                         {n: l.kl for n, l in self.lanes.items()}, self.session.reference.name)
        return out

    def compare_rows(self) -> list[list[str]]:
        """The comparison table: one row per strategy (see :data:`~kvexplore.explorer.views.compare.COLUMNS`)."""
        lanes = self.lanes
        return compare.rows({n: l.history for n, l in lanes.items()}, {n: l.kl for n, l in lanes.items()},
                            {n: l.top1 for n, l in lanes.items()}, self.session.reference.name,
                            forced={n: l.forced_at for n, l in lanes.items()})

    def refresh(self) -> None:
        """Redraw the token strip, status and every figure from the session (in place)."""
        lane = self.lane
        self._sync_lanes()
        w = self._w
        w["tokens"].value = self._strip.html(self.model.tokenizer, lane.generator)
        w["status"].value = html.escape(self._status(lane))
        if "compare" in self.views:
            w["compare"].value = compare.table_html(self.compare_rows())
        for name, spec in self.specs().items():
            self._live.update(name, spec)

    # -- internals ---------------------------------------------------------------------------------------
    def _load(self, source):
        if isinstance(source, Generator):
            return source.model
        if isinstance(source, Model):
            return source
        return load(source, dtype=self._dtype, device=self._device)

    def _check_picks(self, layer: int, head: int) -> None:
        c = self.model.config
        if not 0 <= layer < c.num_layers:
            raise ValueError(f"layer {layer} does not exist: the model has layers 0..{c.num_layers - 1}")
        if not 0 <= head < c.num_heads:
            raise ValueError(f"head {head} does not exist: the model has query heads 0..{c.num_heads - 1}")

    def _operate(self, fn) -> None:
        """Run one operation with the buttons disabled; show its error in the widget and raise it."""
        if self._busy:
            raise RuntimeError("another operation is still running; wait for it to finish")
        self._busy = True
        self._set_enabled(False)
        self.error = ""
        self._w["error"].value = ""
        try:
            fn()
        except Exception as e:
            self._show_error(e)
            raise
        finally:
            self._busy = False
            self._set_enabled(True)
            self.refresh()

    def _show_error(self, e: Exception) -> None:
        self.error = str(e)
        self._w["error"].value = (f'<div style="color:#b30000;border:1px solid #e0b4b4;background:#fff6f6;'
                                  f'padding:4px 8px;border-radius:4px"><b>{type(e).__name__}</b>: '
                                  f'{html.escape(str(e))}</div>')

    def _status(self, lane: Lane) -> str:
        last = lane.last
        if last is None:
            n = len(lane.generator.tokens)
            return (f"{lane.name} · no sequence yet" if not n else
                    f"{lane.name} · {n} prompt tokens, nothing generated yet (Step continues)")
        cache = lane.cache
        cap = "unbounded" if cache.capacity is None else cache.capacity
        eos = " · end of sequence" if last.is_eos else ""
        return (f"{lane.name} · step {last.step} · {len(lane.generator.tokens)} tokens "
                f"({len(lane.generator.prompt_tokens)} prompt) · cache holds {cache.held} of {cap} slots{eos}")

    # -- widgets ---------------------------------------------------------------------------------------
    def _build_widgets(self, prompt: str, chat: bool, source) -> None:
        w = controls.make(self.model.config, list(self.session.lanes), self.layer, self.head, self._settings,
                          prompt, chat, self._has_chat(), source if isinstance(source, str) else None)
        self._w = w

        def safely(fn):  # a button reports its error in the widget; the traceback stays out of the page
            def handler(*_):
                try:
                    fn()
                except Exception:
                    pass
            return handler

        w["prefill"].on_click(safely(lambda: self.prefill()))
        w["step"].on_click(safely(self.step))
        w["run"].on_click(safely(lambda: self.run()))
        w["rewind"].on_click(safely(lambda: self.rewind()))
        w["reset"].on_click(safely(self.reset))
        w["fork"].on_click(safely(lambda: self.fork()))
        w["load"].on_click(safely(lambda: self.load_model(w["model"].value)))
        w["lane"].observe(lambda ch: self._redraw(), names="value")
        w["layer"].observe(lambda ch: self._pick(layer=ch["new"]), names="value")
        w["head"].observe(lambda ch: self._pick(head=ch["new"]), names="value")
        for name in ("temperature", "top_k", "top_p"):
            w[name].observe(lambda ch: self._sampling_changed(), names="value")
        w["seed"].observe(lambda ch: self._seed_changed(ch["new"]), names="value")
        self._figure_box, self.widget = controls.arrange(w)
        self._buttons = [w[n] for n in controls.BUTTONS]

    def _make_figures(self) -> None:
        import ipywidgets as W

        self._live = LiveFigures(self.specs(), FIGURE_WIDTH)
        self.figures: dict[str, Any] = self._live.widgets  # name -> plotly FigureWidget
        boxes = []
        for name, fig in self.figures.items():
            boxes.append(W.HTML(f"<b>{HEADINGS[name]}</b>"))
            if name == "compare":
                boxes.append(self._w["compare"])
            boxes.append(fig)
        self._figure_box.children = boxes

    def _has_chat(self) -> bool:
        tok = self.model.tokenizer
        return tok is not None and bool(tok.chat_template)

    def _set_enabled(self, enabled: bool) -> None:
        for b in self._buttons:
            b.disabled = not enabled

    def _sync_lanes(self) -> None:
        dd = self._w["lane"]
        names = list(self.session.lanes)
        if list(dd.options) != names:
            current = dd.value
            dd.options = names
            dd.value = current if current in names else names[0]

    def _sync_pickers(self) -> None:
        c = self.model.config
        self._syncing = True  # setting options selects the first one: the observers must not take it
        try:
            self._w["layer"].options = list(range(c.num_layers))
            self._w["layer"].value = self.layer
            self._w["head"].options = list(range(c.num_heads))
            self._w["head"].value = self.head
        finally:
            self._syncing = False
        self._w["chat"].layout.display = "" if self._has_chat() else "none"

    def _seed_changed(self, seed: int) -> None:
        self.session.seed = seed
        self._settings["seed"] = seed

    def _pick(self, layer: int | None = None, head: int | None = None) -> None:
        if self._syncing:
            return
        if layer is not None:
            self.layer = layer
        if head is not None:
            self.head = head
        self._redraw()

    def _redraw(self) -> None:
        if self._busy or self._syncing:
            return
        try:
            self.refresh()
        except Exception as e:  # a picker's change has no caller to raise to: show it
            self._show_error(e)

    def _sampling_changed(self) -> None:
        w = self._w
        chosen = dict(temperature=w["temperature"].value, top_k=w["top_k"].value or None,
                      top_p=None if w["top_p"].value >= 1 else w["top_p"].value)
        try:
            self.session.set_sampling(**chosen)
            self._settings.update(chosen)
            w["error"].value = ""
        except ValueError as e:
            self._show_error(e)

    def _repr_mimebundle_(self, **kwargs):
        self._live.sync()
        return self.widget._repr_mimebundle_(**kwargs)

    def _ipython_display_(self) -> None:
        from IPython.display import display

        self._live.sync()
        display(self.widget)

    def __repr__(self) -> str:
        return f"Explorer({self.session!r}, layer={self.layer}, head={self.head})"
