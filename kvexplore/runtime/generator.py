"""A step-wise generator: prefill, step, run, rewind, fork, reset — one :class:`StepRecord` per new token. The generator
alone owns the sequence and decides every position. The newest token is not yet in the cache: the next step feeds
``tokens[cache.length:]`` at position ``cache.length`` (one token with a cache, the whole sequence with
:class:`~kvexplore.NoCache`, whose length stays 0), writes it, and picks the following token. A step that fails (cache
full, bad input) raises before anything changes: tokens, history, RNG and cache stay as they were. Every forward pass
goes through one :class:`~kvexplore.models.executor.Executor` (kvexplore's eager model, its compiled one-token step, a
transformers model): the generator never asks which one it has."""

from __future__ import annotations

import time
from collections.abc import Sequence
from importlib import import_module
from typing import Any

import torch

from ..core import host
from ..core.settings import integer
from ..errors import SettingsError, StateError
from ..trace.files import History
from ..trace.records import StepRecord
from ..trace.tracer import Tracer, checked_tracer
from . import clock, eager  # noqa: F401  (eager registers the adapter that runs a kvexplore Model)
from ..models.executor import Executor, as_executor
from .compiled_use import CompiledUse
from .prompt import prompt_ids
from .recording import run_meta, step_record
from .sampling import SamplingSettings, choose, sampling_setting
from .target import Target


class Generator:
    """Generate from ``model`` (a kvexplore :class:`~kvexplore.Model`, a transformers model or any
    :class:`~kvexplore.models.executor.Executor`, :attr:`executor`) through ``cache`` one token at a time. The
    arguments (sampling and its ``seed``, ``top_candidates``, ``tracer``, ``compile``, ``kernels``, ``draft``):
    docs/python-api.md, "The generator's arguments"."""

    def __init__(self, model: Any, cache: Any = None, temperature: float = 0.0,
                 top_k: int | None = None, top_p: float | None = None, seed: int | None = None,
                 top_candidates: int = 5, tracer: Tracer | None = None, compile: bool | str = False,
                 draft: Any = None, draft_tokens: int = 4, *, kernels: bool = False) -> None:
        executor = as_executor(model)
        if cache is None:
            cache = executor.default_cache()
        executor.check_cache(cache)
        if cache.batch_size != 1:
            raise SettingsError(f"the generator drives one sequence but the cache has batch_size={cache.batch_size}; "
                                f"make the cache with batch_size=1")
        self.executor: Executor = executor
        self.cache = cache
        self.tracer = checked_tracer(tracer)
        self.sampling = SamplingSettings(temperature, top_k, top_p)
        self.top_candidates = top_candidates
        self.seed = int(torch.seed()) if seed is None else integer(seed, "seed", 0, 2 ** 64 - 1)
        self._rng = torch.Generator().manual_seed(self.seed)
        self._tokens: list[int] = []
        self._prompt_len = 0
        self.history = History()  # one record per generated token; history.save(path) writes a trace
        self._rng_states: list[torch.Tensor] = []  # RNG state before each generated token was drawn
        self._undoable = False  # the cache's undo record is the last step's (see undo_step)
        self.speculation = None if draft is None else import_module("kvexplore.speculation").Speculation(
            draft, draft_tokens, executor, cache)  # the speculation lab, loaded when a generator drafts
        rows = 1 if self.speculation is None else self.speculation.k + 1  # a verification's kernels built now too
        self._compiled = CompiledUse(executor, cache, compile, kernels, rows=rows)
        self.kernels = self._compiled.kernels  # whether the model's products run on the kernels
        self.compile = compile  # True: the best mode for the device (CPU: regional, CUDA: reduce-overhead)
        self._spec_undo: Any = None  # what undo_step needs to take back a verification (the lab's Undo)

    @property
    def model(self) -> Any:
        """The model as it was given (a transformers module: its :class:`kvexplore.hf.HFModel`)."""
        return self.executor.model

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

    temperature = sampling_setting("temperature")
    top_k = sampling_setting("top_k")
    top_p = sampling_setting("top_p")

    @property
    def top_candidates(self) -> int:
        """How many likely tokens each record lists (at least 1, at most the vocabulary)."""
        return self._top_candidates

    @top_candidates.setter
    def top_candidates(self, value: int) -> None:
        self._top_candidates = integer(value, "top_candidates", 1, self.executor.config.vocab_size)

    # -- the sequence -----------------------------------------------------------------------------------
    def target(self) -> Target:
        """What a verification reads from this generator: executor, cache, tracer, sampling, RNG, top candidates."""
        return Target(self.executor, self.cache, self.tracer, self.sampling, self._rng, self.top_candidates)

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
        """Start a new sequence from ``prompt`` (text, encoded with a bos token when the model expects one, or token
        ids used as they are) and pick its first token (or take ``force``, as :meth:`step` does)."""
        ids = self.prompt_ids(prompt)
        self._check_force(force)
        saved = self._rng.get_state()
        self._rng.manual_seed(self.seed)
        try:
            record = self._forward(ids, pos=0, first=True, context=ids, force=force)
        except BaseException:
            self._rng.set_state(saved)  # _forward put the cache back
            raise
        self.cache.settle()
        self._tokens = [*ids, record.token_id]
        self._undoable = False
        if self.speculation is not None:
            self.speculation.forget()
        self._prompt_len = len(ids)
        self.history = History([record], run_meta(self.executor, self.cache, ids))
        return record

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
        """Feed what the cache does not hold yet, write it, and pick the next token. ``force`` (a token id) is
        appended instead of the chosen token (teacher forcing: the record still lists the model's own candidates and
        the forced token's probability), e.g. to keep two caches on one sequence. ``keep_undo``: keep what
        :meth:`undo_step` needs (the slots the step overwrote and, for the concatenating cache, the storage it
        replaced) until :meth:`settle`; by default it is dropped when the step succeeds. With a drafter (and no
        ``force``) the step is one verification pass: its records are added and the last is returned."""
        if self.speculation is not None and force is None:
            return self._speculate(1 << 62, False, keep_undo)[-1]
        return self._plain_step(force, keep_undo)

    def _plain_step(self, force: int | None, keep_undo: bool) -> StepRecord:
        if not self._tokens:
            raise StateError("nothing to continue: call prefill(prompt) first")
        self._check_force(force)
        start = self.cache.length
        if start >= len(self._tokens):
            raise StateError(f"the cache holds {start} positions but the sequence has only {len(self._tokens)} "
                             f"tokens: the cache was written by something else. Call reset() and prefill again, or "
                             f"give each generator its own cache")
        record = self._forward(self._tokens[start:], pos=start, first=False, context=self._tokens, force=force)
        self._tokens.append(record.token_id)
        self.history.append(record)
        self._spec_undo, self._undoable = None, keep_undo
        if not keep_undo:
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
        if self._spec_undo is not None:  # a verification: its records, and the cache back before it
            n = self.speculation.undo(self._spec_undo, self.target(), self._tokens)
        else:
            n = 1
            self.cache.rollback()
        self._rng.set_state(self._rng_states[-n])
        del self._tokens[-n:], self.history[-n:], self._rng_states[-n:]
        self._undoable, self._spec_undo = False, None

    def run(self, n: int, stop_at_eos: bool = True) -> list[StepRecord]:
        """Up to ``n`` steps; stops after an end-of-sequence token when ``stop_at_eos`` (and does not start
        past one). If a step fails, the steps before it are kept and the error is raised."""
        n = integer(n, "n", minimum=0, hint=" (the number of steps)")
        records: list[StepRecord] = []
        while len(records) < n:
            if stop_at_eos and self.history and self.history[-1].is_eos:
                break
            if self.speculation is None:
                records.append(self.step())
            else:
                records.extend(self._speculate(n - len(records), stop_at_eos, False))
        return records

    def _speculate(self, limit: int, stop_at_eos: bool, keep_undo: bool) -> list[StepRecord]:
        """One verification of at most ``limit`` tokens (a plain step when the drafter has nothing to offer)."""
        self.check_step()
        state = self._rng.get_state()  # before the drafter samples: a rewind or undo draws the draft again
        target = self.target()
        draft = self.speculation.draft(self._tokens, limit - 1, target)
        if not draft.tokens:
            return [self._plain_step(None, keep_undo)]
        self._undoable = False
        records, self._spec_undo = self.speculation.verify(draft, self._tokens, len(self.history), target,
                                                           stop_at_eos, keep_undo)
        self._tokens.extend(r.token_id for r in records)
        self._rng_states.extend([state] * len(records))
        self.history.extend(records)
        self._undoable = keep_undo
        if not keep_undo:
            self.settle()
        return records

    def check_rewind(self, n: int) -> None:
        """Raise, changing nothing, if :meth:`rewind` ``(n)`` would be refused."""
        integer(n, "n", hint=" (the number of tokens to rewind)")
        if not 0 <= n <= len(self.history):
            raise SettingsError(f"cannot rewind {n} tokens: {len(self.history)} have been generated "
                             f"(0 <= n <= {len(self.history)})")
        if n:
            target = min(self.cache.length, len(self._tokens) - n - 1)
            if not self.cache.inspect.needs_replay(target):
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
        self.executor.cut_back(self._tokens[:target], self.cache)  # a replay: what a fresh prefill of them gives
        self._rng.set_state(self._rng_states[len(self.history) - n])  # the last kept token is fed again next step
        del self._tokens[keep:], self.history[len(self.history) - n:], self._rng_states[len(self._rng_states) - n:]
        if self.speculation is not None:
            self.speculation.forget_after(len(self.history))

    def reset(self) -> None:
        """Forget the sequence and empty the cache (its storage is kept)."""
        self._undoable = False
        self.cache.truncate(0)
        self._tokens, self._prompt_len, self.history, self._rng_states = [], 0, History(), []
        self._rng.manual_seed(self.seed)
        if self.speculation is not None:
            self.speculation.forget()

    def fork(self) -> "Generator":
        """A second generator that continues from the same sequence, with the cache's ``fork()`` (a copy, or
        storage shared until the two diverge where the strategy allows)."""
        if not self._tokens:
            raise StateError("nothing to fork: call prefill(prompt) first")
        self._undoable = False  # the fork shares what the last step wrote (paged pages): it stays
        self.cache.settle()
        twin = Generator(self.executor, self.cache.fork(), self.sampling.temperature, self.sampling.top_k,
                         self.sampling.top_p, self.seed, self.top_candidates, self.tracer, self.compile,
                         *((spec.drafter, spec.k) if (spec := self.speculation) is not None else ()),
                         kernels=self.kernels)
        twin._rng.set_state(self._rng.get_state())
        twin._tokens, twin._prompt_len = list(self._tokens), self._prompt_len
        twin.history, twin._rng_states = History(self.history), list(self._rng_states)
        return twin

    # -- internals --------------------------------------------------------------------------------------
    def _forward(self, feed: list[int], pos: int, first: bool, context: list[int],
                 force: int | None = None) -> StepRecord:
        """One forward pass and its record (``first``: the prefill's). Anything that fails, in the model or after
        it (sampling, the record), rolls the cache back, so the step leaves no trace: the caller changes tokens and
        history only after."""
        tracer = self.tracer
        if tracer is not None:
            tracer.begin_step(self.cache, pos, len(feed))
        state = self._rng.get_state()
        self.cache.settle()  # a failure before the cache's begin_step must not undo the previous step
        self._undoable = False
        try:
            record = self._compute(feed, pos, first, context, force)
        except BaseException:
            self.cache.rollback()
            self._rng.set_state(state)
            raise
        if first:
            self._rng_states = [state]
        else:
            self._rng_states.append(state)
        return record

    def _compute(self, feed: list[int], pos: int, first: bool, context: list[int], force: int | None) -> StepRecord:
        executor = self._compiled.fast if self.compiled_step(len(feed)) else self.executor
        ids = torch.tensor([feed], dtype=torch.long)  # checked on the CPU, moved by the executor
        mark = clock.now()  # wall time less the time other programs held the CPU (clock.py)
        logits = executor(ids, self.cache, pos, tracer=self.tracer, last_only=True, keep_undo=True)[0, -1]
        (logits,) = host.fetch([logits])  # the step's one sync on CUDA: it also ends the forward pass's timing
        forward_s, t1 = clock.since(mark), time.perf_counter()
        token = choose(logits, self.sampling, self._rng)  # on the host, with the host RNG: the same on any device
        if force is not None:
            token = force
        return step_record(logits, token, step=len(self.history), first=first, pos=pos, feed=len(feed),
                           context=context, executor=self.executor, cache=self.cache,
                           top_candidates=self.top_candidates, forward_s=forward_s, sampled_at=t1, tracer=self.tracer)

    def compiled_step(self, q_len: int = 1) -> bool:
        """Whether a step feeding ``q_len`` tokens runs the compiled decode step (``compile=True``, one token, a
        pre-allocated cache, no tracer: tracing and hooks run eager, with a message once)."""
        return self._compiled.runs(q_len, self.tracer)

    @property
    def compile_note(self) -> str:
        """Why decode steps run eager although ``compile`` asked for a compiled step ("" when they compile)."""
        return self._compiled.note

    @property
    def compile_s(self) -> float | None:
        """Seconds the compiled step took to compile (None before the first compiled step)."""
        return self._compiled.compile_s(self.cache)

    @property
    def compile_reuse(self) -> str:
        """After the first compiled step: whether its graphs were loaded from an earlier process, compiled and saved
        for a later one, rebuilt (the saved ones stale or missing), or not saved and why ("" before it;
        :mod:`~kvexplore.fast.artifacts`, :mod:`~kvexplore.fast.compile_cache`)."""
        return self._compiled.reuse_note(self.cache)

    def _check_force(self, force: int | None) -> None:
        if (force is not None
                and not 0 <= integer(force, "force", hint=" (a token id)") < self.executor.config.vocab_size):
            raise SettingsError(f"forced token id {force} is outside the vocabulary "
                                f"(0..{self.executor.config.vocab_size - 1})")

    def prompt_ids(self, prompt: str | Sequence[int] | torch.Tensor) -> list[int]:
        """The token ids ``prompt`` prefills as (text through the tokenizer, with its bos token), checked against
        the vocabulary; nothing runs."""
        return prompt_ids(prompt, self._tokenizer, self.executor.config.vocab_size)

    def _tokenizer(self):
        if self.executor.tokenizer is None:
            raise SettingsError("this model was loaded without a tokenizer: pass token ids instead of text")
        return self.executor.tokenizer

    def __repr__(self) -> str:
        return (f"Generator(tokens={len(self._tokens)}, generated={len(self.history)}, cache={self.cache!r}, "
                f"sampling={self.sampling})")
