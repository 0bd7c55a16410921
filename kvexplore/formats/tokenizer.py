"""One tokenizer interface over sentencepiece (``tokenizer.model``) and tokenizers (``tokenizer.json``): ``encode``
never adds special tokens (the generator prepends ``bos_id`` when ``add_bos`` says so)."""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

from ..config.model_config import ModelConfig
from ..config.config_fields import MAX_VOCAB
from ..errors import ConfigError, CorruptFileError, LoadError, SettingsError
from ..config.fields import BOOL, IDS, INT, STR, Field, read, read_json_object

# tokenizer_config.json and generation_config.json: the fields read, with their types
TOKENIZER_CONFIG_FIELDS = (Field("add_bos_token", BOOL), Field("bos_token", STR), Field("eos_token", STR))
GENERATION_CONFIG_FIELDS = (Field("bos_token_id", INT, 0, MAX_VOCAB - 1), Field("eos_token_id", IDS, 0, MAX_VOCAB - 1))


class _SentencePiece:
    """A ``tokenizer.model`` (sentencepiece) behind the calls :class:`Tokenizer` makes.

    Control pieces (``<bos>``, ``<start_of_turn>``) written in the text are read as those tokens, and decode to
    their text, as transformers' tokenizers do (sentencepiece itself spells them out and decodes them to nothing).
    """

    name = "sentencepiece"

    def __init__(self, raw: Any) -> None:
        self.raw = raw
        self.controls = {raw.id_to_piece(i): i for i in range(raw.get_piece_size()) if raw.is_control(i)}
        longest_first = sorted(self.controls, key=len, reverse=True)
        self._split = re.compile("(" + "|".join(map(re.escape, longest_first)) + ")") if self.controls else None

    def vocab_size(self) -> int:
        return self.raw.get_piece_size()

    def encode(self, text: str) -> list[int]:
        if self._split is None:
            return list(self.raw.encode(text, out_type=int))
        ids: list[int] = []
        for i, part in enumerate(self._split.split(text)):  # odd parts are the control pieces
            ids.extend([self.controls[part]] if i % 2 else self.raw.encode(part, out_type=int) if part else [])
        return ids

    def decode(self, ids: list[int]) -> str:
        text, run = [], []
        for i in ids:
            if self.raw.is_control(i):
                text += [self.raw.decode(run), self.raw.id_to_piece(i)]
                run = []
            else:
                run.append(i)
        return "".join(text) + self.raw.decode(run)

    def id_of(self, token: str) -> int | None:
        i = self.raw.piece_to_id(token)
        return None if i == self.raw.unk_id() and token != self.raw.id_to_piece(i) else i

    def save(self, folder: Path) -> None:
        (folder / "tokenizer.model").write_bytes(self.raw.serialized_model_proto())

    def native_ids(self) -> tuple[int | None, int | None]:
        """The bos and eos ids the model file itself names (None where it names none)."""
        bos, eos = self.raw.bos_id(), self.raw.eos_id()
        return (bos if bos >= 0 else None), (eos if eos >= 0 else None)

    def adds_bos(self, bos_id: int | None) -> bool:
        """Whether the model expects bos first when tokenizer_config.json does not say: yes, if it has one."""
        return bos_id is not None


class _Tokenizers:
    """A ``tokenizer.json`` (the tokenizers library) behind the calls :class:`Tokenizer` makes."""

    name = "tokenizers"

    def __init__(self, raw: Any) -> None:
        self.raw = raw

    def vocab_size(self) -> int:
        return self.raw.get_vocab_size(with_added_tokens=True)

    def encode(self, text: str) -> list[int]:
        return list(self.raw.encode(text, add_special_tokens=False).ids)

    def decode(self, ids: list[int]) -> str:
        return self.raw.decode(list(ids), skip_special_tokens=False)

    def id_of(self, token: str) -> int | None:
        return self.raw.token_to_id(token)

    def save(self, folder: Path) -> None:
        self.raw.save(str(folder / "tokenizer.json"))

    def native_ids(self) -> tuple[int | None, int | None]:
        return None, None

    def adds_bos(self, bos_id: int | None) -> bool:
        """A tokenizer.json adds bos through its post-processor if the model wants one."""
        with_special = self.raw.encode("a", add_special_tokens=True).ids
        return bool(with_special) and with_special[0] == bos_id


#: the tokenizer libraries kvexplore reads, by the name a Tokenizer is built with
BACKENDS = {b.name: b for b in (_SentencePiece, _Tokenizers)}


class Tokenizer:
    """``encode(str) -> list[int]``, ``decode(list[int]) -> str``, ``bos_id``, ``eos_ids``, ``chat_template``.

    ``backend`` is a sentencepiece processor or a tokenizers ``Tokenizer``, ``kind`` names which
    (``"sentencepiece"`` or ``"tokenizers"``, see :data:`BACKENDS`)."""

    def __init__(self, backend: Any, kind: str, bos_id: int | None, eos_ids: list[int], add_bos: bool,
                 chat_template: str | None = None, bos_token: str = "", eos_token: str = "") -> None:
        if kind not in BACKENDS:
            raise SettingsError(f"tokenizer backend {kind!r} is not supported; supported: {', '.join(BACKENDS)}")
        self._backend = BACKENDS[kind](backend)
        self.kind = kind
        self.bos_id = bos_id
        self.eos_ids = eos_ids
        self.add_bos = add_bos and bos_id is not None
        self.chat_template = chat_template
        self.bos_token, self.eos_token = bos_token, eos_token

    @property
    def vocab_size(self) -> int:
        return self._backend.vocab_size()

    def encode(self, text: str) -> list[int]:
        """Token ids of ``text``, with no special tokens added."""
        return self._backend.encode(text)

    def decode(self, ids: list[int]) -> str:
        return self._backend.decode(ids)

    def token_text(self, token: int, previous: list[int] = ()) -> str:
        """The text ``token`` adds after ``previous`` ids (a leading space stays visible, unlike ``decode``)."""
        tail = list(previous[-3:])
        before, after = self.decode(tail), self.decode(tail + [token])
        return after[len(before):] if after.startswith(before) else self.decode([token])

    def id_of(self, token: str) -> int | None:
        return self._backend.id_of(token)

    def apply_chat_template(self, messages: list[dict[str, str]], add_generation_prompt: bool = True) -> str:
        """Render ``messages`` (``[{"role": ..., "content": ...}]``) with the model's chat template."""
        if not self.chat_template:
            raise SettingsError("this model's tokenizer has no chat template; pass a plain prompt instead")
        from jinja2.exceptions import TemplateError
        from jinja2.sandbox import ImmutableSandboxedEnvironment

        def raise_exception(message: str) -> None:
            raise TemplateError(message)

        env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
        env.globals["raise_exception"] = raise_exception
        env.filters["tojson"] = lambda x, **kw: json.dumps(x, ensure_ascii=False, **kw)
        try:
            return env.from_string(self.chat_template).render(
                messages=messages, add_generation_prompt=add_generation_prompt,
                bos_token=self.bos_token, eos_token=self.eos_token)
        except Exception as e:  # TemplateError, or a Python error raised inside the template
            detail = "" if isinstance(e, TemplateError) else f" ({type(e).__name__} inside the template)"
            raise SettingsError(f"chat template rejected the messages{detail}: {e}") from e

    def encode_chat(self, messages: list[dict[str, str]]) -> list[int]:
        """Ids of a chat prompt: the rendered template, with bos prepended unless the template wrote it."""
        text = self.apply_chat_template(messages)
        ids = self.encode(text)
        if self.add_bos and not (self.bos_token and text.startswith(self.bos_token)):
            ids = [self.bos_id, *ids]
        return ids

    def save(self, folder: Path) -> None:
        """Write the tokenizer as a Hugging Face folder reads it: ``tokenizer.json`` or ``tokenizer.model``, plus
        ``tokenizer_config.json`` (special tokens, add_bos, chat template) and ``generation_config.json``."""
        self._backend.save(folder)
        config = {"bos_token": self.bos_token or None, "eos_token": self.eos_token or None,
                  "add_bos_token": self.add_bos}
        if self.chat_template:
            config["chat_template"] = self.chat_template
        (folder / "tokenizer_config.json").write_text(json.dumps(config, indent=2, ensure_ascii=False))
        generation = {"bos_token_id": self.bos_id, "eos_token_id": self.eos_ids}
        (folder / "generation_config.json").write_text(json.dumps(generation, indent=2))

    @classmethod
    def from_folder(cls, folder: Path, config: ModelConfig) -> "Tokenizer | None":
        """Load the tokenizer of a Hugging Face model folder, or ``None`` if it has none."""
        tok_path, gen_path = folder / "tokenizer_config.json", folder / "generation_config.json"
        tok_config = read_json_object(tok_path, required=False) or {}
        tok_config.update({k: _token_str(tok_config[k], tok_path, k) for k in ("bos_token", "eos_token")
                           if k in tok_config})
        tok_fields = read(tok_config, TOKENIZER_CONFIG_FIELDS, str(tok_path))
        gen_config = read(read_json_object(gen_path, required=False) or {}, GENERATION_CONFIG_FIELDS, str(gen_path))
        if (folder / "tokenizer.json").exists():
            from tokenizers import Tokenizer as HFTokenizer

            try:
                backend = HFTokenizer.from_file(str(folder / "tokenizer.json"))
            except Exception as e:  # tokenizers raises plain Exception subclasses
                raise CorruptFileError(f"{folder / 'tokenizer.json'} could not be read ({e}); it is damaged or from "
                                       f"a newer tokenizers: download it again") from e
            name = "tokenizers"
        elif (folder / "tokenizer.model").exists():
            import sentencepiece as spm

            backend = spm.SentencePieceProcessor()
            try:
                backend.load(str(folder / "tokenizer.model"))
            except Exception as e:  # OSError, RuntimeError, and a bare Exception for some damage
                raise CorruptFileError(f"{folder / 'tokenizer.model'} is not a sentencepiece model ({e}); download "
                                       f"it again") from e
            name = "sentencepiece"
        else:
            return None
        tok = cls(backend, name, None, [], False)
        bos_token, eos_token = tok_fields["bos_token"] or "", tok_fields["eos_token"] or ""
        native_bos, native_eos = tok._backend.native_ids()
        bos_id = next((i for i in (tok.id_of(bos_token) if bos_token else None, gen_config["bos_token_id"],
                                   config.bos_token_id, native_bos) if i is not None), None)
        eos_ids: list[int] = []
        for source in (gen_config["eos_token_id"], config.eos_token_id,
                       tok.id_of(eos_token) if eos_token else None,
                       native_eos):
            for i in source if isinstance(source, list) else [source]:
                if i is not None and i not in eos_ids:
                    eos_ids.append(int(i))
        add_bos = tok_fields["add_bos_token"]
        add_bos = tok._backend.adds_bos(bos_id) if add_bos is None else add_bos
        tok.bos_id, tok.eos_ids, tok.add_bos = bos_id, eos_ids, bool(add_bos and bos_id is not None)
        tok.bos_token = bos_token or (tok.decode([bos_id]) if bos_id is not None else "")
        tok.eos_token = eos_token or (tok.decode([eos_ids[0]]) if eos_ids else "")
        tok.chat_template = _chat_template(folder, tok_config, tok_path)
        if tok.vocab_size > config.vocab_size:
            raise LoadError(
                f"{folder}: the tokenizer has {tok.vocab_size} tokens but config.json says vocab_size "
                f"{config.vocab_size}; ids past {config.vocab_size - 1} have no embedding. Use the tokenizer "
                f"saved with these weights"
            )
        if bad := [i for i in [bos_id, *eos_ids] if i is not None and not 0 <= i < config.vocab_size]:
            raise ConfigError(str(folder), "bos/eos token id", bad[0], f"a token id in 0..{config.vocab_size - 1}",
                              fix="fix generation_config.json or config.json")
        return tok


def _token_str(value: Any, path: Path, key: str) -> str | None:
    """A special token as a string: ``"<s>"``, or ``{"content": "<s>", ...}`` in older tokenizer configs."""
    if isinstance(value, dict):
        value = value.get("content")
    if value is not None and not isinstance(value, str):
        raise ConfigError(str(path), key, value, 'a string such as "<s>", or {"content": "<s>"}')
    return value


def _chat_template(folder: Path, tok_config: dict[str, Any], where: Path) -> str | None:
    path = folder / "chat_template.jinja"
    if path.exists():
        try:
            return path.read_bytes().decode("utf-8")
        except UnicodeDecodeError as e:
            raise CorruptFileError(f"{path} is not UTF-8 text; download it again") from e
    template = tok_config.get("chat_template")
    expected = 'a string, or a list of {"name": ..., "template": ...} objects'
    if isinstance(template, list):  # named templates: take the default one
        if not all(isinstance(t, dict) and isinstance(t.get("template"), str) for t in template):
            raise ConfigError(str(where), "chat_template", template, expected)
        named = {t.get("name"): t["template"] for t in template}
        template = named.get("default") or next(iter(named.values()), None)
    if template is not None and not isinstance(template, str):
        raise ConfigError(str(where), "chat_template", template, expected)
    return template
