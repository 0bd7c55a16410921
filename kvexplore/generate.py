"""A step-wise generator: prefill, step, run, rewind, fork, reset — one :class:`StepRecord` per new token.

The generator alone owns the sequence and decides every position. The newest token is not yet in the cache:
the next step feeds ``tokens[cache.length:]`` at position ``cache.length`` (one token with a cache, the whole
sequence with :class:`~kvexplore.NoCache`, whose length stays 0), writes it, and picks the following token.
A step that fails (cache full, bad input) raises before anything changes: tokens, history, RNG and cache
stay as they were.
"""

from __future__ import annotations

import time
from collections.abc import Sequence

import torch

from .caches.base import KVCache
from .caches.factory import make_cache
from .model import Model
from .records import Candidate, StepRecord
from .sampling import SamplingSettings, choose
from .trace import Tracer
from .trace_io import History


class Generator:
    """Generate from ``model`` through ``cache`` one token at a time.

    ``temperature=0`` (the default) is greedy; otherwise temperature / ``top_k`` / ``top_p`` sampling with
    a ``seed`` (the RNG restarts from it at every :meth:`prefill`, and :meth:`rewind` restores it, so a rewound
    and regenerated run draws the same tokens). ``top_candidates`` is how many likely tokens each record lists;
    ``tracer`` a :class:`~kvexplore.Tracer` whose step traces the records carry.
    """

    def __init__(self, model: Model, cache: KVCache | None = None, temperature: float = 0.0,
                 top_k: int | None = None, top_p: float | None = None, seed: int | None = None,
                 top_candidates: int = 5, tracer: Tracer | None = None) -> None:
        if cache is None:
            cache = make_cache("preallocated", model)
        if cache.batch_size != 1:
            raise ValueError(f"the generator drives one sequence but the cache has batch_size={cache.batch_size}; "
                             f"make the cache with batch_size=1")
        self.model = model
        self.cache = cache
        self.tracer = tracer
        self.sampling = SamplingSettings(temperature, top_k, top_p)
        self.seed = int(torch.seed()) if seed is None else seed
        self.top_candidates = top_candidates
        self._rng = torch.Generator().manual_seed(self.seed)
        self._tokens: list[int] = []
        self._prompt_len = 0
        self.history = History()  # one record per generated token; history.save(path) writes a trace
        self._rng_states: list[torch.Tensor] = []  # RNG state before each generated token was drawn

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
            self._rng.set_state(saved)
            raise
        self._tokens = [*ids, record.token_id]
        self._prompt_len = len(ids)
        self.history = History([record])
        return record

    def prefill_chat(self, messages: list[dict[str, str]]) -> StepRecord:
        """Prefill with ``messages`` rendered by the tokenizer's chat template (ready for the reply)."""
        return self.prefill(self._tokenizer().encode_chat(messages))

    def check_step(self) -> None:
        """Raise, changing nothing, if :meth:`step` would be refused before computing (no sequence, cache full)."""
        if not self._tokens:
            raise RuntimeError("nothing to continue: call prefill(prompt) first")
        start = self.cache.length
        if start < len(self._tokens):
            self.cache.check_write(start, len(self._tokens) - start, 1)

    def step(self, force: int | None = None) -> StepRecord:
        """Feed what the cache does not hold yet, write it, and pick the next token.

        ``force`` (a token id) is appended instead of the chosen token (teacher forcing: the record still lists
        the model's own candidates and the forced token's probability), e.g. to keep two caches on one sequence.
        """
        if not self._tokens:
            raise RuntimeError("nothing to continue: call prefill(prompt) first")
        self._check_force(force)
        start = self.cache.length
        if start >= len(self._tokens):
            raise RuntimeError(
                f"the cache holds {start} positions but the sequence has only {len(self._tokens)} tokens: the cache "
                f"was written by something else. Call reset() and prefill again, or give each generator its own cache"
            )
        record = self._forward(self._tokens[start:], pos=start, kind="decode", context=self._tokens, force=force)
        self._tokens.append(record.token_id)
        self.history.append(record)
        return record

    def run(self, n: int, stop_at_eos: bool = True) -> list[StepRecord]:
        """Up to ``n`` steps; stops after an end-of-sequence token when ``stop_at_eos`` (and does not start
        past one). If a step fails, the steps before it are kept and the error is raised."""
        if n < 0:
            raise ValueError(f"n must be >= 0, got {n}")
        records: list[StepRecord] = []
        for _ in range(n):
            if stop_at_eos and self.history and self.history[-1].is_eos:
                break
            records.append(self.step())
        return records

    def check_rewind(self, n: int) -> None:
        """Raise, changing nothing, if :meth:`rewind` ``(n)`` would be refused."""
        if not 0 <= n <= len(self.history):
            raise ValueError(f"cannot rewind {n} tokens: {len(self.history)} have been generated "
                             f"(0 <= n <= {len(self.history)})")
        if n:
            self.cache.check_truncate(min(self.cache.length, len(self._tokens) - n - 1))  # evicted positions

    def rewind(self, n: int = 1) -> None:
        """Forget the last ``n`` generated tokens (and their records); the cache is truncated to match."""
        self.check_rewind(n)
        if n == 0:
            return
        keep = len(self._tokens) - n
        self.cache.truncate(min(self.cache.length, keep - 1))
        self._rng.set_state(self._rng_states[len(self.history) - n])  # the last kept token is fed again next step
        del self._tokens[keep:], self.history[len(self.history) - n:], self._rng_states[len(self._rng_states) - n:]

    def reset(self) -> None:
        """Forget the sequence and empty the cache (its storage is kept)."""
        self.cache.truncate(0)
        self._tokens, self._prompt_len, self.history, self._rng_states = [], 0, History(), []
        self._rng.manual_seed(self.seed)

    def fork(self) -> "Generator":
        """A second generator that continues from the same sequence, with the cache's ``fork()`` (a copy, or
        storage shared until the two diverge where the strategy allows)."""
        if not self._tokens:
            raise RuntimeError("nothing to fork: call prefill(prompt) first")
        twin = Generator(self.model, self.cache.fork(), self.sampling.temperature, self.sampling.top_k,
                         self.sampling.top_p, self.seed, self.top_candidates, self.tracer)
        twin._rng.set_state(self._rng.get_state())
        twin._tokens, twin._prompt_len = list(self._tokens), self._prompt_len
        twin.history, twin._rng_states = History(self.history), list(self._rng_states)
        return twin

    # -- internals --------------------------------------------------------------------------------------
    def _forward(self, feed: list[int], pos: int, kind: str, context: list[int], force: int | None = None) -> StepRecord:
        model = self.model
        ids = torch.tensor([feed], dtype=torch.long)  # checked on the CPU, moved by the model
        tracer = self.tracer
        if tracer is not None:
            tracer.begin_step(self.cache, pos, len(feed))
        t0 = time.perf_counter()
        logits = model(ids, self.cache, pos, tracer=tracer, last_only=True)[0, -1]  # (vocab,) for the last position
        if logits.is_cuda:
            torch.cuda.synchronize(logits.device)
        t1 = time.perf_counter()
        state = self._rng.get_state()
        token = choose(logits, self.sampling, self._rng)
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

    def _check_force(self, force: int | None) -> None:
        if force is not None and not 0 <= force < self.model.config.vocab_size:
            raise ValueError(f"forced token id {force} is outside the vocabulary (0..{self.model.config.vocab_size - 1})")

    def _prompt_ids(self, prompt: str | Sequence[int] | torch.Tensor) -> list[int]:
        if isinstance(prompt, str):
            tok = self._tokenizer()
            ids = tok.encode(prompt)
            if tok.add_bos:
                ids = [tok.bos_id, *ids]
        elif isinstance(prompt, torch.Tensor):
            if prompt.dim() != 1:
                raise ValueError(f"prompt ids must be one sequence (1-D), got shape {tuple(prompt.shape)}")
            ids = [int(i) for i in prompt.tolist()]
        else:
            ids = [int(i) for i in prompt]
        if not ids:
            raise ValueError("the prompt is empty: give at least one token (empty text encodes to nothing "
                             "for a model without a bos token)")
        vocab = self.model.config.vocab_size
        bad = [i for i in ids if not 0 <= i < vocab]
        if bad:
            raise ValueError(f"prompt token id {bad[0]} is outside the vocabulary (0..{vocab - 1})")
        return ids

    def _tokenizer(self):
        if self.model.tokenizer is None:
            raise ValueError("this model was loaded without a tokenizer: pass token ids instead of text")
        return self.model.tokenizer

    def __repr__(self) -> str:
        return (f"Generator(tokens={len(self._tokens)}, generated={len(self.history)}, cache={self.cache!r}, "
                f"sampling={self.sampling})")
