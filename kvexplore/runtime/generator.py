"""A step-wise generator: prefill, step, run, rewind, fork, reset — one :class:`StepRecord` per new token.

The generator alone owns the sequence and decides every position. The newest token is not yet in the cache:
the next step feeds ``tokens[cache.length:]`` at position ``cache.length`` (one token with a cache, the whole
sequence with :class:`~kvexplore.NoCache`, whose length stays 0), writes it, and picks the following token.
A step that fails (cache full, bad input) raises before anything changes: tokens, history, RNG and cache
stay as they were.
"""

from __future__ import annotations

import time
import warnings
from collections.abc import Sequence
from dataclasses import replace

import torch

from ..caches.base import KVCache
from ..caches.factory import make_cache
from ..models.model import Model
from ..hf.cache import HFCache
from ..hf.model import HFModel, is_hf_model
from ..trace.records import Candidate, StepRecord
from .sampling import SamplingSettings, choose
from ..trace.tracer import Tracer
from ..trace.files import History
from ..errors import SettingsError, StateError
from ..core import host
from ..core.settings import integer


def _sampling_setting(name: str) -> property:
    """A generator attribute that reads ``sampling.<name>`` and sets it through a new, checked SamplingSettings."""
    def get(self: "Generator"):
        return getattr(self._sampling, name)

    def set_(self: "Generator", value) -> None:
        self._sampling = replace(self._sampling, **{name: value})  # __post_init__ checks the new value

    return property(get, set_, doc=f"``sampling.{name}``; setting it checks the value first (SettingsError)")


class Generator:
    """Generate from ``model`` through ``cache`` one token at a time.

    ``temperature=0`` (the default) is greedy; otherwise temperature / ``top_k`` / ``top_p`` sampling with
    a ``seed`` (the RNG restarts from it at every :meth:`prefill`, and :meth:`rewind` restores it, so a rewound
    and regenerated run draws the same tokens). ``top_candidates`` is how many likely tokens each record lists;
    ``tracer`` a :class:`~kvexplore.Tracer` whose step traces the records carry.
    """

    def __init__(self, model: Model, cache: KVCache | None = None, temperature: float = 0.0,
                 top_k: int | None = None, top_p: float | None = None, seed: int | None = None,
                 top_candidates: int = 5, tracer: Tracer | None = None, compile: bool = False) -> None:
        if is_hf_model(model):
            model = HFModel(model)
        if not isinstance(model, (Model, HFModel)):
            raise SettingsError(f"model must be a kvexplore Model (from kvexplore.load) or a transformers model, got "
                                f"{type(model).__name__}")
        if cache is None:
            cache = make_cache("hf:dynamic" if isinstance(model, HFModel) else "preallocated", model)
        if not isinstance(cache, (HFCache if isinstance(model, HFModel) else KVCache)):
            raise SettingsError(f"cache must be a {'transformers cache (kvexplore.hf.make_cache)' if isinstance(model, HFModel) else 'KVCache (from kvexplore.make_cache)'}"
                                f", got {type(cache).__name__}")
        if cache.batch_size != 1:
            raise SettingsError(f"the generator drives one sequence but the cache has batch_size={cache.batch_size}; "
                             f"make the cache with batch_size=1")
        self.model = model
        self.cache = cache
        self.tracer = tracer
        if tracer is not None and not all(callable(getattr(tracer, m, None)) for m in
                                          ("begin_step", "end_step", "hook", "wants_attention")):
            raise SettingsError(f"tracer must be a kvexplore Tracer (or have its begin_step, end_step, hook and "
                                f"wants_attention methods), got {type(tracer).__name__}")
        self.sampling = SamplingSettings(temperature, top_k, top_p)
        self.top_candidates = top_candidates
        self.seed = int(torch.seed()) if seed is None else integer(seed, "seed", 0, 2 ** 64 - 1)
        self._rng = torch.Generator().manual_seed(self.seed)
        self._tokens: list[int] = []
        self._prompt_len = 0
        self.history = History()  # one record per generated token; history.save(path) writes a trace
        self._rng_states: list[torch.Tensor] = []  # RNG state before each generated token was drawn
        self._undoable = False  # the cache's undo record is the last step's (see undo_step)
        from .compiled import MODES, refusal

        if not isinstance(compile, bool) and compile not in MODES:
            raise SettingsError(f"compile must be True, False or a torch.compile mode ({', '.join(MODES)}), got "
                                f"{compile!r}")
        self.compile = compile  # True: the best mode for the device (CPU: max-autotune, CUDA: reduce-overhead)
        self.compile_note = ""  # why decode steps run eager although compile=True ("" when they compile)
        if self.compile:

            self.compile_note = refusal(model, cache) or ""
            if self.compile_note:
                warnings.warn(f"compile=True: {self.compile_note}; decoding runs eager", stacklevel=2)

    # -- settings (checked when set, so a step never fails on them) -------------------------------------
    @property
    def sampling(self) -> SamplingSettings:
        return self._sampling

    @sampling.setter
    def sampling(self, settings: SamplingSettings) -> None:
        if not isinstance(settings, SamplingSettings):
            raise SettingsError(f"sampling must be a SamplingSettings(temperature, top_k, top_p), got "
                                f"{type(settings).__name__}")
        self._sampling = settings

    temperature = _sampling_setting("temperature")
    top_k = _sampling_setting("top_k")
    top_p = _sampling_setting("top_p")

    @property
    def top_candidates(self) -> int:
        """How many likely tokens each record lists (at least 1, at most the vocabulary)."""
        return self._top_candidates

    @top_candidates.setter
    def top_candidates(self, value: int) -> None:
        self._top_candidates = integer(value, "top_candidates", 1, self.model.config.vocab_size)

    # -- the sequence -----------------------------------------------------------------------------------
    @property
    def tokens(self) -> list[int]:
        """Every token id so far: the prompt, then the generated tokens."""
        return list(self._tokens)

    @property
    def prompt_tokens(self) -> list[int]:
        return self._tokens[: self._prompt_len]

    @property
    def generated_tokens(self) -> list[int]:
        return self._tokens[self._prompt_len:]

    @property
    def text(self) -> str:
        """The generated text (the prompt excluded)."""
        return self._tokenizer().decode(self.generated_tokens)

    @property
    def position(self) -> int:
        """Position the next token will take (the length of the sequence so far)."""
        return len(self._tokens)

    # -- stepping ---------------------------------------------------------------------------------------
    def prefill(self, prompt: str | Sequence[int] | torch.Tensor, force: int | None = None) -> StepRecord:
        """Start a new sequence from ``prompt`` (text, or token ids used as they are) and pick its first token
        (or take ``force``, as :meth:`step` does).

        Text is encoded with the model's tokenizer and gets a bos token when the model expects one.
        """
        ids = self._prompt_ids(prompt)
        self._check_force(force)
        saved = self._rng.get_state()
        self._rng.manual_seed(self.seed)
        try:
            record = self._forward(ids, pos=0, kind="prefill", context=ids, force=force)
        except BaseException:
            self._rng.set_state(saved)  # _forward put the cache back
            raise
        self.cache.settle()
        self._tokens = [*ids, record.token_id]
        self._undoable = False
        self._prompt_len = len(ids)
        self.history = History([record], self._run_meta(ids))
        return record

    def _run_meta(self, ids: list[int]) -> dict:
        """What a saved trace carries besides its records: the prompt, the strategy, the model's shape."""
        c, tok = self.model.config, self.model.tokenizer
        return {"prompt_ids": list(ids),
                "prompt_texts": [tok.token_text(t, ids[:i]) if tok is not None else str(t) for i, t in enumerate(ids)],
                "kind": self.cache.kind, "dtype": str(self.model.dtype).removeprefix("torch."),
                "device": str(self.model.device),
                "model": {"name": self.model.source or "", "num_layers": c.num_layers, "num_heads": c.num_heads,
                          "num_kv_heads": c.num_kv_heads, "gqa_groups": c.gqa_groups,
                          "attention_sinks": bool(c.attention_sinks)}}

    def prefill_chat(self, messages: list[dict[str, str]]) -> StepRecord:
        """Prefill with ``messages`` rendered by the tokenizer's chat template (ready for the reply)."""
        return self.prefill(self._tokenizer().encode_chat(messages))

    def check_step(self) -> None:
        """Raise, changing nothing, if :meth:`step` would be refused before computing (no sequence, cache full)."""
        if not self._tokens:
            raise StateError("nothing to continue: call prefill(prompt) first")
        start = self.cache.length
        if start < len(self._tokens):
            self.cache.check_write(start, len(self._tokens) - start, 1)

    def step(self, force: int | None = None, keep_undo: bool = False) -> StepRecord:
        """Feed what the cache does not hold yet, write it, and pick the next token.

        ``force`` (a token id) is appended instead of the chosen token (teacher forcing: the record still lists
        the model's own candidates and the forced token's probability), e.g. to keep two caches on one sequence.
        ``keep_undo``: keep what :meth:`undo_step` needs (the slots the step overwrote and, for the concatenating
        cache, the storage it replaced) until :meth:`settle`; by default it is dropped when the step succeeds.
        """
        if not self._tokens:
            raise StateError("nothing to continue: call prefill(prompt) first")
        self._check_force(force)
        start = self.cache.length
        if start >= len(self._tokens):
            raise StateError(
                f"the cache holds {start} positions but the sequence has only {len(self._tokens)} tokens: the cache "
                f"was written by something else. Call reset() and prefill again, or give each generator its own cache"
            )
        record = self._forward(self._tokens[start:], pos=start, kind="decode", context=self._tokens, force=force)
        self._tokens.append(record.token_id)
        self.history.append(record)
        if keep_undo:
            self._undoable = True
        else:
            self.settle()
        return record

    def settle(self) -> None:
        """Drop what :meth:`undo_step` would need (after a ``step(keep_undo=True)``)."""
        self._undoable = False
        self.cache.settle()

    def undo_step(self) -> None:
        """Take back the last :meth:`step` exactly: its token, record and RNG draw, and the cache rolled back bit
        for bit (a sink cache gets back the position the step evicted). Only right after a
        ``step(keep_undo=True)`` (no rewind, reset, prefill or settle since); otherwise raises StateError. The
        explorer uses it when one lane of a step fails."""
        if not self._undoable:
            raise StateError("undo_step() takes back only the last step(keep_undo=True), right after it; use "
                             "rewind(1) instead")
        self.cache.rollback()
        self._rng.set_state(self._rng_states.pop())
        self._tokens.pop()
        self.history.pop()
        self._undoable = False

    def run(self, n: int, stop_at_eos: bool = True) -> list[StepRecord]:
        """Up to ``n`` steps; stops after an end-of-sequence token when ``stop_at_eos`` (and does not start
        past one). If a step fails, the steps before it are kept and the error is raised."""
        n = integer(n, "n", minimum=0, hint=" (the number of steps)")
        records: list[StepRecord] = []
        for _ in range(n):
            if stop_at_eos and self.history and self.history[-1].is_eos:
                break
            records.append(self.step())
        return records

    def check_rewind(self, n: int) -> None:
        """Raise, changing nothing, if :meth:`rewind` ``(n)`` would be refused."""
        integer(n, "n", hint=" (the number of tokens to rewind)")
        if not 0 <= n <= len(self.history):
            raise SettingsError(f"cannot rewind {n} tokens: {len(self.history)} have been generated "
                             f"(0 <= n <= {len(self.history)})")
        if n:
            target = min(self.cache.length, len(self._tokens) - n - 1)
            if not self.cache.needs_replay(target):
                self.cache.check_truncate(target)  # evicted positions

    def rewind(self, n: int = 1) -> None:
        """Forget the last ``n`` generated tokens (and their records); the cache is truncated to match. When a
        sliding layer's ring has overwritten what the kept sequence needs, the cache is rebuilt by one forward
        pass over the kept tokens (the same cache a fresh prefill of them gives; no record is added)."""
        self.check_rewind(n)
        self._undoable = False
        n = int(n)
        if n == 0:
            return
        keep = len(self._tokens) - n
        target = min(self.cache.length, keep - 1)
        if self.cache.needs_replay(target):
            self._replay(target)
        else:
            self.cache.truncate(target)
        self._rng.set_state(self._rng_states[len(self.history) - n])  # the last kept token is fed again next step
        del self._tokens[keep:], self.history[len(self.history) - n:], self._rng_states[len(self._rng_states) - n:]

    def _replay(self, n: int) -> None:
        """Rebuild the cache as the first ``n`` tokens' prefill leaves it; on failure the cache is as before."""
        backup = self.cache.clone()
        try:
            self.cache.truncate(0)
            if n:
                self.model(torch.tensor([self._tokens[:n]]), self.cache, 0, last_only=True)
        except BaseException:
            self.cache.__dict__.update(backup.__dict__)  # every strategy keeps its state in its attributes
            backup.__dict__ = {}  # its storage is the cache's again: dropping the backup must not release it
            raise

    def reset(self) -> None:
        """Forget the sequence and empty the cache (its storage is kept)."""
        self._undoable = False
        self.cache.truncate(0)
        self._tokens, self._prompt_len, self.history, self._rng_states = [], 0, History(), []
        self._rng.manual_seed(self.seed)

    def fork(self) -> "Generator":
        """A second generator that continues from the same sequence, with the cache's ``fork()`` (a copy, or
        storage shared until the two diverge where the strategy allows)."""
        if not self._tokens:
            raise StateError("nothing to fork: call prefill(prompt) first")
        self._undoable = False  # the fork shares what the last step wrote (paged pages): it stays
        self.cache.settle()
        twin = Generator(self.model, self.cache.fork(), self.sampling.temperature, self.sampling.top_k,
                         self.sampling.top_p, self.seed, self.top_candidates, self.tracer, self.compile)
        twin._rng.set_state(self._rng.get_state())
        twin._tokens, twin._prompt_len = list(self._tokens), self._prompt_len
        twin.history, twin._rng_states = History(self.history), list(self._rng_states)
        return twin

    # -- internals --------------------------------------------------------------------------------------
    def _forward(self, feed: list[int], pos: int, kind: str, context: list[int], force: int | None = None) -> StepRecord:
        """One forward pass and its record. Anything that fails, in the model or after it (sampling, the record),
        rolls the cache back, so the step leaves no trace: the caller changes tokens and history only after."""
        tracer = self.tracer
        if tracer is not None:
            tracer.begin_step(self.cache, pos, len(feed))
        state = self._rng.get_state()
        self.cache.settle()  # a failure before the cache's begin_step must not undo the previous step
        self._undoable = False
        try:
            return self._compute(feed, pos, kind, context, force, state)
        except BaseException:
            self.cache.rollback()
            self._rng.set_state(state)
            raise

    def _compute(self, feed: list[int], pos: int, kind: str, context: list[int], force: int | None,
                 state: torch.Tensor) -> StepRecord:
        model, tracer = self.model, self.tracer
        ids = torch.tensor([feed], dtype=torch.long)  # checked on the CPU, moved by the model
        t0 = time.perf_counter()
        if self.compiled_step(len(feed)):
            logits = self._compiled(feed[0], pos)
        else:
            logits = model(ids, self.cache, pos, tracer=tracer, last_only=True, keep_undo=True)[0, -1]  # (vocab,) for the last position
        (logits,) = host.fetch([logits])  # the step's one sync on CUDA: it also ends the forward pass's timing
        t1 = time.perf_counter()
        token = choose(logits, self.sampling, self._rng)  # on the host, with the host RNG: the same on any device
        if force is not None:
            token = force
        probs = logits.softmax(-1)
        top_p, top_i = probs.topk(min(self.top_candidates, probs.shape[-1]))
        tok = model.tokenizer
        text = (lambda i: tok.token_text(i, context)) if tok is not None else str
        top = [Candidate(int(i), text(int(i)), float(p)) for p, i in zip(top_p.tolist(), top_i.tolist())]
        eos = tok.eos_ids if tok is not None else model.config.eos_token_id
        record = StepRecord(step=len(self.history) if kind == "decode" else 0, kind=kind, token_id=token,
                            text=text(token), position=pos + len(feed), input_len=len(feed),
                            cache_length=self.cache.length, prob=float(probs[token]), top=top,
                            forward_s=t1 - t0, sample_s=time.perf_counter() - t1, is_eos=token in eos,
                            memory=self.cache.memory_report(),
                            trace=None if tracer is None else tracer.end_step(self.cache))
        if kind == "prefill":
            self._rng_states = [state]
        else:
            self._rng_states.append(state)
        return record

    def compiled_step(self, q_len: int = 1) -> bool:
        """Whether a step feeding ``q_len`` tokens runs the compiled decode step (``compile=True``, one token, a
        pre-allocated cache, no tracer: tracing and hooks run eager, with a message once)."""
        if not self.compile or self.compile_note or q_len != 1:
            return False
        t = self.tracer
        if t is not None and ("qkv" in getattr(t, "capture", ()) or any(
                t.wants_attention(i) for i in range(self.model.config.num_layers))):
            if not getattr(self, "_traced_note", False):
                warnings.warn("compile=True: a step that records attention or q/k/v runs eager (its hooks see inside "
                              "every layer); other steps run compiled", stacklevel=3)
                self._traced_note = True
            return False
        return True

    def _compiled(self, token: int, pos: int) -> torch.Tensor:
        from .compiled import decoder_for

        cache = self.cache
        cache.check_write(pos, 1, 1)
        cache.begin_step(pos, 1)
        cache.note_inplace_write(pos, 1)
        logits = decoder_for(self.model, cache.capacity, self._mode)(token, cache, pos)[0]
        cache.commit(pos + 1)
        if self.tracer is not None:  # what a trace without attention holds, read from the cache after the step
            for layer in cache.full_layers:
                name = f"layers.{layer}.attn"
                keys, values = cache.key(layer), cache.value(layer)
                self.tracer.hook(f"{name}.k_new", keys.narrow(2, pos, 1).clone())
                self.tracer.hook(f"{name}.v_new", values.narrow(2, pos, 1).clone())
                self.tracer.hook(f"{name}.cache_read", keys.narrow(2, 0, pos + 1))  # the slots the mask let through
            self.tracer.hook("logits", logits.view(1, 1, -1))
        return logits

    @property
    def _mode(self) -> str | None:
        return None if self.compile is True else self.compile

    @property
    def compile_s(self) -> float | None:
        """Seconds the compiled step took to compile (None before the first compiled step)."""
        if not self.compile or self.compile_note:
            return None
        from .compiled import decoder_for

        decoder = decoder_for(self.model, self.cache.capacity, self._mode, build=False)
        return None if decoder is None else decoder.compile_s

    def _check_force(self, force: int | None) -> None:
        if force is not None:
            integer(force, "force", hint=" (a token id)")
        if force is not None and not 0 <= force < self.model.config.vocab_size:
            raise SettingsError(f"forced token id {force} is outside the vocabulary (0..{self.model.config.vocab_size - 1})")

    def _prompt_ids(self, prompt: str | Sequence[int] | torch.Tensor) -> list[int]:
        if isinstance(prompt, str):
            tok = self._tokenizer()
            ids = tok.encode(prompt)
            if tok.add_bos:
                ids = [tok.bos_id, *ids]
        elif isinstance(prompt, torch.Tensor):
            if prompt.dim() != 1:
                raise SettingsError(f"prompt ids must be one sequence (1-D), got shape {tuple(prompt.shape)}")
            if prompt.is_floating_point() or prompt.is_complex() or prompt.dtype == torch.bool:
                raise SettingsError(f"prompt ids must be an integer tensor, got {prompt.dtype}")
            ids = [int(i) for i in prompt.tolist()]
        elif isinstance(prompt, (list, tuple, range)):
            ids = [integer(i, f"prompt token {n}") for n, i in enumerate(prompt)]
        else:
            raise SettingsError(f"prompt must be text (str) or token ids (a list of ints or a 1-D tensor), got "
                                f"{type(prompt).__name__}")
        if not ids:
            raise SettingsError("the prompt is empty: give at least one token (empty text encodes to nothing "
                             "for a model without a bos token)")
        vocab = self.model.config.vocab_size
        bad = [i for i in ids if not 0 <= i < vocab]
        if bad:
            raise SettingsError(f"prompt token id {bad[0]} is outside the vocabulary (0..{vocab - 1})")
        return ids

    def _tokenizer(self):
        if self.model.tokenizer is None:
            raise SettingsError("this model was loaded without a tokenizer: pass token ids instead of text")
        return self.model.tokenizer

    def __repr__(self) -> str:
        return (f"Generator(tokens={len(self._tokens)}, generated={len(self.history)}, cache={self.cache!r}, "
                f"sampling={self.sampling})")
