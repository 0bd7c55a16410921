"""The names of a lane's tokens and the token strip's HTML, made once per prompt and once per generated token (only
the newest token's outline moves from one step to the next). The strip shows the newest :data:`SHOWN` tokens: what a
Step sends does not grow with the context (the cache map's token rows name every position)."""

from __future__ import annotations

from typing import Any

from ..runtime.generator import Generator
from ..views import tokens

SHOWN = 256  # tokens in the strip at most (the newest)


class TokenStrip:
    def __init__(self) -> None:
        self._tokenizer: Any = None
        self._ids: tuple[int, ...] | None = None
        self._texts: list[str] = []  # the prompt's token texts
        self._prompt_html: list[str] = []  # one span per prompt token
        self._spans: dict[int, tuple] = {}  # step -> (what its span shows of the record, its span)

    def _prompt(self, tokenizer: Any, ids: list[int]) -> None:
        if tokenizer is not self._tokenizer or tuple(ids) != self._ids:
            self._tokenizer, self._ids = tokenizer, tuple(ids)
            self._texts = [tokenizer.token_text(t, ids[:i]) if tokenizer is not None else str(t)
                           for i, t in enumerate(ids)]
            self._prompt_html = [tokens.prompt_span(pos, text) for pos, text in enumerate(self._texts)]

    def texts(self, tokenizer: Any, gen: Generator) -> list[str]:
        """The text of every position: the prompt's tokens, then the generated ones."""
        self._prompt(tokenizer, gen.prompt_tokens)
        return self._texts + [r.text for r in gen.history]

    def html(self, tokenizer: Any, gen: Generator, diverged: tuple[int, str] | None = None) -> str:
        """The strip of ``gen``'s sequence; ``diverged``: (step, words) of the token marked where it first parts."""
        self._prompt(tokenizer, gen.prompt_tokens)
        history = gen.history
        n = len(history)
        shown = history[max(0, n - SHOWN):]  # the newest records: the strip shows no more (older ones are kept compact)
        old, self._spans = self._spans, {}
        out = []
        mark = lambda r: diverged[1] if diverged is not None and r.step == diverged[0] else ""  # noqa: E731
        for r in shown[:-1]:  # a span made once per token (a rewound step made again is another token or mark)
            key = (r.token_id, r.text, r.prob, r.position, r.draft_token, r.verification, mark(r))
            entry = old.get(r.step)
            if entry is None or entry[0] != key:
                entry = (key, tokens.token_span(r, diverged=mark(r)))
            self._spans[r.step] = entry
            out.append(entry[1])
        if shown:
            out.append(tokens.token_span(shown[-1], last=True, diverged=mark(shown[-1])))
        skip = max(0, len(self._prompt_html) + n - SHOWN)
        prompt = "".join(self._prompt_html[skip:])
        return tokens.strip_html(prompt, out[max(0, skip - len(self._prompt_html)) - max(0, n - SHOWN):], earlier=skip)
