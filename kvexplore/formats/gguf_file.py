"""Reading a GGUF file (llama.cpp's format) into a :class:`ModelConfig`, Hugging Face named tensors (dequantized,
``reversed(shape)`` of ggml's order, q/k rows un-permuted from llama.cpp's rope order) and a tokenizer rebuilt from
``tokenizer.ggml.*`` (byte-level BPE or sentencepiece)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace
from functools import cached_property
from pathlib import Path
from typing import Any

import numpy as np
import torch

from ..config.config_json import fields_from_hf
from ..config.model_config import ModelConfig
from ..config.config_fields import MAX_FFN, MAX_HEAD_DIM, MAX_HEADS, MAX_HIDDEN, MAX_LAYERS, MAX_POSITIONS, MAX_VOCAB
from ..errors import ConfigError, CorruptFileError, LoadError, MissingFileError, UnsupportedModelError
from ..config.fields import BOOL, FLOAT, INT, STR, STR_LIST, Field, read
from ..config.families import Architecture, registered
from ..models import architectures as _registry  # noqa: F401  (importing it registers every architecture)
from .gguf_scan import scan
from .tokenizer import Tokenizer
from .weights import check_layer_count, check_tensors, expected_shapes

# {arch}.* metadata kvexplore reads, with types and ranges (keys without the architecture prefix)
MODEL_FIELDS = (
    Field("block_count", INT, 1, MAX_LAYERS, required=True),
    Field("embedding_length", INT, 1, MAX_HIDDEN, required=True),
    Field("feed_forward_length", INT, 1, MAX_FFN, required=True),
    Field("attention.head_count", INT, 1, MAX_HEADS, required=True),
    Field("attention.head_count_kv", INT, 1, MAX_HEADS),
    Field("attention.key_length", INT, 1, MAX_HEAD_DIM),
    Field("rope.dimension_count", INT, 1, MAX_HEAD_DIM),
    Field("attention.layer_norm_rms_epsilon", FLOAT, 0, 1, lo_open=True),
    Field("rope.freq_base", FLOAT, 0, 1e12, lo_open=True),
    Field("rope.scaling.type", STR),
    Field("rope.scaling.factor", FLOAT, 0, 1e6, lo_open=True),
    Field("context_length", INT, 1, MAX_POSITIONS),
    Field("attention.sliding_window", INT, 1, MAX_POSITIONS),
    Field("vocab_size", INT, 1, MAX_VOCAB),
)
# tokenizer.ggml.* metadata (token ids are checked against the token list separately)
TOKENIZER_FIELDS = (
    Field("tokenizer.ggml.model", STR), Field("tokenizer.ggml.pre", STR),
    Field("tokenizer.ggml.tokens", STR_LIST),
    Field("tokenizer.ggml.merges", STR_LIST),
    Field("tokenizer.ggml.bos_token_id", INT, 0, MAX_VOCAB - 1),
    Field("tokenizer.ggml.eos_token_id", INT, 0, MAX_VOCAB - 1),
    Field("tokenizer.ggml.eot_token_id", INT, 0, MAX_VOCAB - 1),
    Field("tokenizer.ggml.unknown_token_id", INT, 0, MAX_VOCAB - 1),
    Field("tokenizer.ggml.add_bos_token", BOOL), Field("tokenizer.ggml.add_space_prefix", BOOL),
    Field("tokenizer.chat_template", STR),
)
TOKEN_TYPES = range(1, 7)  # normal, unknown, control, user-defined, unused, byte
NORMAL, USER_DEFINED = 1, 4
SPECIAL_TOKEN_TYPES = (3, USER_DEFINED)  # control and user-defined tokens: never split, added as special tokens


def gguf_architectures() -> dict[str, Architecture]:
    """GGUF ``general.architecture`` -> the registered architecture that declares those GGUF names."""
    return {a.gguf.name: a for a in registered() if a.gguf is not None}


def _float32_value(x: float) -> float:
    """GGUF stores floats as float32: 1e-5 comes back as 9.99999974e-06. Keep the float32's shortest decimal."""
    return float(np.format_float_positional(np.float32(x), unique=True, trim="-"))


def hf_name(gguf_name: str, arch: Architecture) -> str | None:
    """``blk.3.attn_q.weight`` -> ``model.layers.3.self_attn.q_proj.weight`` by ``arch``'s GGUF names (None for a
    name it does not declare)."""
    names = arch.gguf
    if gguf_name in names.globals:
        return names.globals[gguf_name]
    parts = gguf_name.split(".")
    if len(parts) == 4 and parts[0] == "blk" and parts[2] in names.layer:
        return f"model.layers.{parts[1]}.{names.layer[parts[2]]}.{parts[3]}"
    return None


def unpermute_rope_rows(w: torch.Tensor, n_head: int) -> torch.Tensor:
    """Undo llama.cpp's q/k row order: per head, rows (pairs interleaved) back to (first half, second half). Getting
    this wrong fails silently (the text stays plausible, perplexity about 6x)."""
    return w.reshape(n_head, w.shape[0] // n_head // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def permute_rope_rows(w: torch.Tensor, n_head: int) -> torch.Tensor:
    """llama.cpp's q/k row order (the inverse of :func:`unpermute_rope_rows`), used when writing GGUF files."""
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


class GGUFFile:
    """An open GGUF file: its metadata, config, tensors and tokenizer."""

    def __init__(self, path: str | Path) -> None:
        from gguf import GGUFReader

        self.path = Path(path)
        if not self.path.is_file():
            raise MissingFileError(f"GGUF file {self.path} not found")
        scan(self.path)  # every declared length against the file's size, before the reader believes them
        try:
            self.reader = GGUFReader(str(self.path))
        except Exception as e:  # the reader raises ValueError, struct errors, numpy errors on bad files
            raise CorruptFileError(f"{self.path} is not a readable GGUF file ({type(e).__name__}: {e}); it is "
                                   f"probably truncated or corrupt: download it again") from e
        self.arch = self.get("general.architecture")
        known = gguf_architectures()
        if not isinstance(self.arch, str) or self.arch not in known:
            raise UnsupportedModelError(f"{self.path.name}: GGUF architecture {self.arch!r} is not supported; "
                                        f"supported: {', '.join(known)}")
        self.architecture = known[self.arch]  # the registered entry whose GGUF names this file uses

    def get(self, key: str, default: Any = None) -> Any:
        field = self.reader.fields.get(key)
        if field is None:
            return default
        try:
            return field.contents()
        except Exception as e:  # UnicodeDecodeError on a damaged string, numpy errors on a damaged array
            raise CorruptFileError(f"{self.path.name}: metadata {key} could not be read ({type(e).__name__}: {e}); "
                                   f"the file is corrupt: download or convert it again") from e

    def metadata(self, fields: tuple[Field, ...], prefix: str = "") -> dict[str, Any]:
        """Checked values of ``fields`` (keys after ``prefix``), None where absent."""
        named = tuple(replace(f, key=prefix + f.key) for f in fields)
        raw = {f.key: self.get(f.key) for f in named if f.key in self.reader.fields}
        values = read(raw, named, f"{self.path.name} (GGUF metadata)")
        return {k[len(prefix):]: v for k, v in values.items()}

    @cached_property
    def _tokenizer_fields(self) -> dict[str, Any]:
        """``TOKENIZER_FIELDS``, checked, read once (the config and the tokenizer both need them)."""
        return self.metadata(TOKENIZER_FIELDS)

    def config(self) -> ModelConfig:
        a = self.arch
        if any(t.name == "rope_freqs.weight" for t in self.reader.tensors):
            raise UnsupportedModelError(f"{self.path.name}: per-frequency rope factors (rope_freqs.weight, as in "
                                        f"Llama 3.1 GGUFs) are not supported; load the Hugging Face folder instead")
        m = self.metadata(MODEL_FIELDS, f"{a}.")
        tk = self._tokenizer_fields
        scaling = None
        if m["rope.scaling.type"] not in ("none", None):
            scaling_type = m["rope.scaling.type"]
            if scaling_type != "linear":
                raise UnsupportedModelError(f"{self.path.name}: GGUF rope scaling {scaling_type!r} is not "
                                            f"supported; supported: linear")
            if m["rope.scaling.factor"] is None:
                raise ConfigError(f"{self.path.name} (GGUF metadata)", f"{a}.rope.scaling.factor", None,
                                  "a number > 0 (linear rope scaling needs its factor)")
            scaling = {"rope_type": "linear", "factor": m["rope.scaling.factor"]}
        tokens = tk["tokenizer.ggml.tokens"] or []
        eos, eps, theta = tk["tokenizer.ggml.eos_token_id"], m["attention.layer_norm_rms_epsilon"], m["rope.freq_base"]
        names = [t.name for t in self.reader.tensors]
        raw = {  # as config.json would say it, over what llama.cpp supplies for keys the file leaves out
            **self.architecture.gguf.defaults,
            "architectures": [self.architecture.hf_class],
            "vocab_size": m["vocab_size"] or len(tokens) or self._embedding_rows(),
            "hidden_size": m["embedding_length"], "intermediate_size": m["feed_forward_length"],
            "num_hidden_layers": m["block_count"], "num_attention_heads": m["attention.head_count"],
            "num_key_value_heads": m["attention.head_count_kv"],
            "head_dim": m["attention.key_length"] or m["rope.dimension_count"],
            "rms_norm_eps": None if eps is None else _float32_value(eps),
            "rope_theta": None if theta is None else _float32_value(theta), "rope_scaling": scaling,
            "max_position_embeddings": m["context_length"], "sliding_window": m["attention.sliding_window"],
            "tie_word_embeddings": "output.weight" not in names,
            "bos_token_id": tk["tokenizer.ggml.bos_token_id"], "eos_token_id": eos,
        }
        fields = fields_from_hf({k: v for k, v in raw.items() if v is not None}, f"{self.path.name} (GGUF metadata)")
        fields["qkv_bias"] = fields["qkv_bias"] or any(n.endswith("attn_q.bias") for n in names)
        return ModelConfig(**fields)

    def _embedding_rows(self) -> int:
        """The vocabulary size from the embedding's shape, for a file with neither vocab_size nor tokens."""
        embd = next((t for t in self.reader.tensors if t.name == "token_embd.weight"), None)
        if embd is None:
            raise LoadError(f"{self.path.name}: no vocab_size, no token list and no token_embd.weight: the file "
                            f"does not say how large the vocabulary is")
        return int(embd.shape[-1])

    def tensors(self, config: ModelConfig, dtype: torch.dtype = torch.float32,
                progress: Callable[[str], None] | None = None) -> dict[str, torch.Tensor]:
        """Every tensor under its Hugging Face name, dequantized, un-permuted, checked against ``config``."""
        from gguf import GGMLQuantizationType, quants

        by_name = {}
        arch = self.architecture
        check_layer_count([hf_name(t.name, arch) or "" for t in self.reader.tensors], config, self.path.name)
        for t in self.reader.tensors:
            name = hf_name(t.name, arch)
            if name is None:
                raise UnsupportedModelError(f"{self.path.name}: tensor {t.name!r} has no place in a "
                                            f"{config.architecture}; is this a {self.arch} model?")
            by_name[name] = t
        found = {n: tuple(int(d) for d in reversed(t.shape)) for n, t in by_name.items()}
        check_tensors(expected_shapes(config), found, config, self.path.name)
        permuted = arch.gguf.rope_rows_permuted
        out = {}
        for name, t in by_name.items():
            try:
                array = quants.dequantize(t.data, t.tensor_type)
            except NotImplementedError as e:
                qtype = GGMLQuantizationType(t.tensor_type).name
                raise UnsupportedModelError(f"{self.path.name}: tensor {t.name} uses quantization {qtype}, which the "
                                            f"gguf package cannot dequantize; use a file with another type") from e
            except Exception as e:
                raise CorruptFileError(f"{self.path.name}: tensor {t.name} could not be dequantized "
                                       f"({type(e).__name__}: {e}); the file is corrupt: download it again") from e
            w = torch.from_numpy(np.array(array, dtype=np.float32)).reshape(found[name])  # a writable copy
            if arch.gguf.norm_shift and name.endswith("norm.weight"):  # llama.cpp stored 1 + weight (Gemma)
                w -= arch.gguf.norm_shift
            if permuted and ".self_attn.q_proj." in name:
                w = unpermute_rope_rows(w, config.num_heads)
            elif permuted and ".self_attn.k_proj." in name:
                w = unpermute_rope_rows(w, config.num_kv_heads)
            out[name] = w.to(dtype)
            if progress is not None:
                progress(name)
        return out

    def tokenizer(self, config: ModelConfig) -> Tokenizer:
        tk = self.tokenizer_metadata()
        model = tk["tokenizer.ggml.model"]
        if model not in TOKENIZER_MODELS:
            raise UnsupportedModelError(f"{self.path.name}: tokenizer type {model!r} is not supported; supported: "
                                        f"gpt2 (byte-level BPE), llama (sentencepiece)")
        build, tok_kind, default_add_bos = TOKENIZER_MODELS[model]
        tokens = tk["tokenizer.ggml.tokens"]
        bos, eos = tk["tokenizer.ggml.bos_token_id"], tk["tokenizer.ggml.eos_token_id"]
        eos_ids = [i for i in (eos, tk["tokenizer.ggml.eot_token_id"]) if i is not None]
        add_bos = tk["tokenizer.ggml.add_bos_token"]
        tok = Tokenizer(build(self, tk), tok_kind, bos, list(dict.fromkeys(eos_ids)),
                        default_add_bos if add_bos is None else add_bos,
                        chat_template=tk["tokenizer.chat_template"] or self.architecture.gguf.chat_template,
                        bos_token=tokens[bos] if bos is not None else "",
                        eos_token=tokens[eos] if eos is not None else "")
        if tok.vocab_size > config.vocab_size:
            raise LoadError(f"{self.path.name}: the tokenizer has {tok.vocab_size} tokens but the model's vocab_size "
                            f"is {config.vocab_size}")
        return tok

    def tokenizer_metadata(self) -> dict[str, Any]:
        """The ``tokenizer.ggml.*`` metadata, checked: types, ids inside the token list, per-token lists as long
        as the token list (scores finite, token types known)."""
        where = f"{self.path.name} (GGUF metadata)"
        tk = dict(self._tokenizer_fields)
        tokens = tk["tokenizer.ggml.tokens"]
        if tk["tokenizer.ggml.model"] is None or not tokens:
            raise LoadError(f"{where}: no tokenizer (tokenizer.ggml.model and tokenizer.ggml.tokens are needed); "
                            f"convert the model again with its tokenizer")
        n = len(tokens)
        for key in ("bos_token_id", "eos_token_id", "eot_token_id", "unknown_token_id"):
            i = tk[f"tokenizer.ggml.{key}"]
            if i is not None and i >= n:
                raise ConfigError(where, f"tokenizer.ggml.{key}", i, f"a token id in 0..{n - 1} (the token list "
                                  f"has {n} tokens)")
        for key, ok, expected in (("scores", np.isfinite, "finite numbers"),
                                  ("token_type", lambda a: np.isin(a, list(TOKEN_TYPES)), "token types 1..6")):
            field = f"tokenizer.ggml.{key}"
            values = self.get(field)
            if values is None:
                tk[field] = None
                continue
            try:
                array = np.asarray(values, dtype=np.float64)
            except (TypeError, ValueError) as e:
                raise ConfigError(where, field, values[:3], f"a list of {expected}") from e
            if array.ndim != 1 or len(array) != n:
                raise ConfigError(where, field, f"{array.size} entries", f"one entry per token ({n})")
            if not ok(array).all():
                first = array[~ok(array)][0]
                raise ConfigError(where, field, float(first), f"{expected} (entry {int(np.argmin(ok(array)))})")
            tk[field] = array.tolist() if key == "scores" else array.astype(int).tolist()
        return tk

    def _bpe_tokenizer(self, tk: dict[str, Any]):
        from tokenizers import AddedToken, Tokenizer as HFTokenizer, decoders, models, pre_tokenizers

        pre = tk["tokenizer.ggml.pre"] or "default"
        byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
        pre_tokenizer = {
            "default": byte_level, "gpt2": byte_level,
            # SmolLM: every digit on its own, then GPT-2's byte-level split
            "smollm": pre_tokenizers.Sequence([pre_tokenizers.Digits(individual_digits=True), byte_level]),
        }.get(pre)
        if pre_tokenizer is None:
            raise UnsupportedModelError(f"{self.path.name}: BPE pre-tokenizer {pre!r} is not supported (supported: "
                                        f"default, gpt2, smollm); its text would be split differently")
        tokens = tk["tokenizer.ggml.tokens"]
        where = f"{self.path.name} (GGUF metadata)"
        vocab = {t: i for i, t in enumerate(tokens)}
        if len(vocab) != len(tokens):
            dup = next(t for i, t in enumerate(tokens) if vocab[t] != i)
            raise ConfigError(where, "tokenizer.ggml.tokens", dup, "each token once (this one is listed twice)")
        merges = [tuple(m.split(" ", 1)) for m in tk["tokenizer.ggml.merges"] or []]
        for i, m in enumerate(merges):
            if len(m) != 2 or m[0] not in vocab or m[1] not in vocab:
                raise ConfigError(where, f"tokenizer.ggml.merges[{i}]", " ".join(m),
                                  "two tokens of the token list separated by one space")
        try:
            tok = HFTokenizer(models.BPE(vocab=vocab, merges=merges))
        except Exception as e:  # tokenizers raises a bare Exception
            raise CorruptFileError(f"{where}: the BPE tokenizer could not be built ({e}); the token list or the "
                                   f"merges are damaged: convert the model again") from e
        tok.pre_tokenizer = pre_tokenizer
        tok.decoder = decoders.ByteLevel()
        types = tk["tokenizer.ggml.token_type"] or []
        tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t, token_type in zip(tokens, types)
                                if token_type in SPECIAL_TOKEN_TYPES])
        return tok

    def _sentencepiece_tokenizer(self, tk: dict[str, Any]):
        import sentencepiece as spm
        from sentencepiece import sentencepiece_model_pb2 as pb

        tokens = tk["tokenizer.ggml.tokens"]
        scores = tk["tokenizer.ggml.scores"] or [0.0] * len(tokens)
        types = tk["tokenizer.ggml.token_type"] or [1] * len(tokens)
        proto = pb.ModelProto()
        proto.trainer_spec.model_type = pb.TrainerSpec.BPE
        proto.trainer_spec.vocab_size = len(tokens)
        proto.trainer_spec.byte_fallback = 6 in types
        unk, bos, eos = (tk[f"tokenizer.ggml.{k}"] for k in ("unknown_token_id", "bos_token_id", "eos_token_id"))
        proto.trainer_spec.unk_id = 0 if unk is None else unk
        proto.trainer_spec.bos_id = -1 if bos is None else bos
        proto.trainer_spec.eos_id = -1 if eos is None else eos
        proto.trainer_spec.pad_id = -1  # padding plays no part in generation (and may repeat the eos id)
        proto.normalizer_spec.name = "identity"
        space = tk["tokenizer.ggml.add_space_prefix"]
        proto.normalizer_spec.add_dummy_prefix = True if space is None else space
        proto.normalizer_spec.remove_extra_whitespaces = False
        proto.normalizer_spec.escape_whitespaces = True
        top = max((s for s, t in zip(scores, types) if t == NORMAL), default=0.0)
        for i, (piece, score, token_type) in enumerate(zip(tokens, scores, types)):
            if token_type == USER_DEFINED and piece and not piece.strip(" "):
                # Gemma's runs of "▁", which llama.cpp wrote as spaces and user-defined: merges of "▁" ranked by
                # their place in the file, ahead of the normal pieces (as transformers reads the same file: 32
                # spaces are 16 + 16, not the longest run of 31 + 1)
                piece, score, token_type = "\u2581" * len(piece), top + len(tokens) - i, NORMAL
            elif token_type == USER_DEFINED:  # sentencepiece matches them in the escaped text: "▁", not " "
                piece = piece.replace(" ", "\u2581")
            proto.pieces.add(piece=piece, score=float(score), type=int(token_type))
        sp = spm.SentencePieceProcessor()
        try:
            sp.load_from_serialized_proto(proto.SerializeToString())
        except Exception as e:  # RuntimeError, or protobuf's errors on an impossible vocabulary
            raise CorruptFileError(f"{self.path.name}: its sentencepiece vocabulary could not be rebuilt ({e}); the "
                                   f"token list is damaged: convert the model again") from e
        return sp


#: tokenizer.ggml.model -> (how the tokenizer is rebuilt, the Tokenizer backend it gives, whether bos is added
#: when the file does not say)
TOKENIZER_MODELS = {"gpt2": (GGUFFile._bpe_tokenizer, "tokenizers", False),
                    "llama": (GGUFFile._sentencepiece_tokenizer, "sentencepiece", True)}
