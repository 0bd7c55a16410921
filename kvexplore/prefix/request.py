"""What a request asks for, checked before anything is touched: its prompt as token ids (from text, ids, or chat
messages rendered by a chat template), and how many tokens to generate or the answer to replay."""

from __future__ import annotations

import copy
from dataclasses import dataclass

from ..core.settings import integer
from ..errors import SettingsError

DEFAULT_NEW_TOKENS = 16


@dataclass(frozen=True)
class RequestInput:
    ids: list[int]
    chat: bool
    text: str
    new_tokens: int
    forced: list[int] | None  # the answer to replay instead of generating (None: generate)
    answers: tuple[str, ...] = ()  # the contents of a chat's assistant messages

    @classmethod
    def parse(cls, pool, request, chat_template: str | None, response, max_new_tokens: int | None) -> "RequestInput":
        tok, vocab = pool.tokenizer, pool.config.vocab_size
        chat = isinstance(request, (list, tuple)) and bool(request) and all(isinstance(m, dict) for m in request)
        if chat:
            ids = cls._chat(tok, list(request), chat_template)
        elif isinstance(request, str):
            ids = cls._text(tok, request, "the prompt")
        elif isinstance(request, (list, tuple)) or hasattr(request, "tolist"):
            ids = [int(i) for i in (request.tolist() if hasattr(request, "tolist") else request)]
        else:
            raise SettingsError(f"a request is text, a list of token ids or a list of chat messages "
                                f"([{{'role': 'user', 'content': ...}}]), got {type(request).__name__}")
        if not ids:
            raise SettingsError("the request is empty: give at least one token")
        if bad := [i for i in ids if not 0 <= i < vocab]:
            raise SettingsError(f"token id {bad[0]} is outside this model's vocabulary (0..{vocab - 1})")
        forced = None
        if response is not None:
            forced = (cls._text(tok, response, "the response") if isinstance(response, str) else
                      [int(i) for i in response])
            if not forced or any(not 0 <= i < vocab for i in forced):
                raise SettingsError("response must be non-empty text or token ids inside the vocabulary")
        if max_new_tokens is None:
            new = len(forced) if forced is not None else DEFAULT_NEW_TOKENS
        else:
            new = integer(max_new_tokens, "max_new_tokens", minimum=0)
            if forced is not None and new > len(forced):
                raise SettingsError(f"max_new_tokens={new} is more than the response's {len(forced)} tokens; leave "
                                    f"it out to replay the whole response")
        text = tok.decode(ids) if tok is not None else ""
        answers = tuple(m["content"] for m in request if m.get("role") == "assistant") if chat else ()
        return cls(ids, chat, text, new, forced, answers)

    @staticmethod
    def _text(tok, text: str, what: str) -> list[int]:
        if tok is None:
            raise SettingsError(f"this model has no tokenizer: give {what} as token ids")
        return tok.encode(text)

    @staticmethod
    def _chat(tok, messages: list[dict], template: str | None) -> list[int]:
        if tok is None:
            raise SettingsError("this model has no tokenizer to render chat messages: give token ids")
        for m in messages:
            if not isinstance(m.get("role"), str) or not isinstance(m.get("content"), str):
                raise SettingsError(f"each chat message needs a 'role' and a 'content' string, got {m!r}")
        if template is not None:
            tok = copy.copy(tok)
            tok.chat_template = template
        if not tok.chat_template:
            raise SettingsError("this model's tokenizer has no chat template: pass chat_template=... or plain text")
        return tok.encode_chat(messages)
