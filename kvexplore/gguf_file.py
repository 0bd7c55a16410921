"""Reading a GGUF file (llama.cpp's format) into a :class:`ModelConfig`, Hugging Face named tensors and a tokenizer.

- The config comes from the ``{arch}.*`` metadata; tensors are dequantized with the ``gguf`` package to float32.
- GGUF lists shapes in ggml order (``[in, out]``); a tensor's array is ``reversed(shape)``, the torch layout.
- llama.cpp stores the q/k projections of ``llama`` models with rows in its own rope order; they are un-permuted
  back to the Hugging Face layout. Getting this wrong fails silently (text stays plausible, perplexity ~6x).
- The tokenizer is rebuilt from ``tokenizer.ggml.*``: a byte-level BPE (``gpt2``) as a ``tokenizers`` tokenizer,
  or a sentencepiece (``llama``) vocabulary as a sentencepiece model.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import torch

from .config import ModelConfig
from .errors import LoadError, UnsupportedModelError
from .tokenizer import Tokenizer
from .weights import check_tensors, expected_shapes

# GGUF general.architecture -> (Hugging Face architecture, whether q/k rows are in llama.cpp's rope order)
GGUF_ARCHITECTURES = {"llama": ("LlamaForCausalLM", True), "qwen2": ("Qwen2ForCausalLM", False)}

_LAYER_NAMES = {
    "attn_norm": "input_layernorm", "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj", "ffn_down": "mlp.down_proj",
}
_GLOBAL_NAMES = {"token_embd.weight": "model.embed_tokens.weight", "output_norm.weight": "model.norm.weight",
                 "output.weight": "lm_head.weight"}


def _float32_value(x: float) -> float:
    """GGUF stores floats as float32: 1e-5 comes back as 9.99999974e-06. Keep the float32's shortest decimal."""
    return float(np.format_float_positional(np.float32(x), unique=True, trim="-"))


def hf_name(gguf_name: str) -> str | None:
    """``blk.3.attn_q.weight`` -> ``model.layers.3.self_attn.q_proj.weight`` (None for an unknown name)."""
    if gguf_name in _GLOBAL_NAMES:
        return _GLOBAL_NAMES[gguf_name]
    parts = gguf_name.split(".")
    if len(parts) == 4 and parts[0] == "blk" and parts[2] in _LAYER_NAMES:
        return f"model.layers.{parts[1]}.{_LAYER_NAMES[parts[2]]}.{parts[3]}"
    return None


def unpermute_rope_rows(w: torch.Tensor, n_head: int) -> torch.Tensor:
    """Undo llama.cpp's q/k row order: per head, rows (pairs interleaved) back to (first half, second half)."""
    rows = w.shape[0]
    return w.reshape(n_head, rows // n_head // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def permute_rope_rows(w: torch.Tensor, n_head: int) -> torch.Tensor:
    """llama.cpp's q/k row order (the inverse of :func:`unpermute_rope_rows`), used when writing GGUF files."""
    rows = w.shape[0]
    return w.reshape(n_head, 2, rows // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


class GGUFFile:
    """An open GGUF file: its metadata, config, tensors and tokenizer."""

    def __init__(self, path: str | Path) -> None:
        from gguf import GGUFReader

        self.path = Path(path)
        if not self.path.is_file():
            raise LoadError(f"GGUF file {self.path} not found")
        try:
            self.reader = GGUFReader(str(self.path))
        except Exception as e:  # the reader raises ValueError, struct errors, numpy errors on bad files
            raise LoadError(f"{self.path} is not a readable GGUF file ({type(e).__name__}: {e}); it is probably "
                            f"truncated or corrupt: download it again") from None
        self.arch = self.get("general.architecture")
        if self.arch not in GGUF_ARCHITECTURES:
            raise UnsupportedModelError(f"{self.path.name}: GGUF architecture {self.arch!r} is not supported; "
                                        f"supported: {', '.join(GGUF_ARCHITECTURES)}")

    def get(self, key: str, default: Any = None) -> Any:
        field = self.reader.fields.get(key)
        return default if field is None else field.contents()

    def config(self) -> ModelConfig:
        a = self.arch
        need = [f"{a}.{k}" for k in ("block_count", "embedding_length", "feed_forward_length",
                                     "attention.head_count")]
        missing = [k for k in need if k not in self.reader.fields]
        if missing:
            raise LoadError(f"{self.path.name}: GGUF metadata lacks {missing}")
        if any(t.name == "rope_freqs.weight" for t in self.reader.tensors):
            raise UnsupportedModelError(f"{self.path.name}: per-frequency rope factors (rope_freqs.weight, as in "
                                        f"Llama 3.1 GGUFs) are not supported; load the Hugging Face folder instead")
        heads = int(self.get(f"{a}.attention.head_count"))
        hidden = int(self.get(f"{a}.embedding_length"))
        scaling = None
        if self.get(f"{a}.rope.scaling.type", "none") not in ("none", None):
            kind = self.get(f"{a}.rope.scaling.type")
            if kind != "linear":
                raise UnsupportedModelError(f"{self.path.name}: GGUF rope scaling {kind!r} is not supported; "
                                            f"supported: linear")
            scaling = {"rope_type": "linear", "factor": float(self.get(f"{a}.rope.scaling.factor"))}
        tokens = self.get("tokenizer.ggml.tokens") or []
        eos = self.get("tokenizer.ggml.eos_token_id")
        return ModelConfig(
            architecture=GGUF_ARCHITECTURES[a][0],
            vocab_size=int(self.get(f"{a}.vocab_size", len(tokens))),
            hidden_size=hidden,
            intermediate_size=int(self.get(f"{a}.feed_forward_length")),
            num_layers=int(self.get(f"{a}.block_count")),
            num_heads=heads,
            num_kv_heads=int(self.get(f"{a}.attention.head_count_kv", heads)),
            head_dim=int(self.get(f"{a}.attention.key_length", self.get(f"{a}.rope.dimension_count", 0)) or 0),
            rms_norm_eps=_float32_value(self.get(f"{a}.attention.layer_norm_rms_epsilon", 1e-6)),
            rope_theta=_float32_value(self.get(f"{a}.rope.freq_base", 10000.0)),
            rope_scaling=scaling,
            max_position_embeddings=int(self.get(f"{a}.context_length", 2048)),
            tie_word_embeddings=not any(t.name == "output.weight" for t in self.reader.tensors),
            qkv_bias=any(t.name.endswith("attn_q.bias") for t in self.reader.tensors),
            bos_token_id=self.get("tokenizer.ggml.bos_token_id"),
            eos_token_id=[] if eos is None else [int(eos)],
        )

    def tensors(self, config: ModelConfig, dtype: torch.dtype = torch.float32,
                progress: Callable[[str], None] | None = None) -> dict[str, torch.Tensor]:
        """Every tensor under its Hugging Face name, dequantized, un-permuted, checked against ``config``."""
        from gguf import GGMLQuantizationType, quants

        by_name = {}
        for t in self.reader.tensors:
            name = hf_name(t.name)
            if name is None:
                raise UnsupportedModelError(f"{self.path.name}: tensor {t.name!r} has no place in a "
                                            f"{config.architecture}; is this a {self.arch} model?")
            by_name[name] = t
        found = {n: tuple(int(d) for d in reversed(t.shape)) for n, t in by_name.items()}
        check_tensors(expected_shapes(config), found, config, self.path.name)
        permuted = GGUF_ARCHITECTURES[self.arch][1]
        out = {}
        for name, t in by_name.items():
            try:
                array = quants.dequantize(t.data, t.tensor_type)
            except NotImplementedError:
                kind = GGMLQuantizationType(t.tensor_type).name
                raise UnsupportedModelError(f"{self.path.name}: tensor {t.name} uses quantization {kind}, which the "
                                            f"gguf package cannot dequantize; use a file with another type") from None
            w = torch.from_numpy(np.array(array, dtype=np.float32)).reshape(found[name])  # a writable copy
            if permuted and ".self_attn.q_proj." in name:
                w = unpermute_rope_rows(w, config.num_heads)
            elif permuted and ".self_attn.k_proj." in name:
                w = unpermute_rope_rows(w, config.num_kv_heads)
            out[name] = w.to(dtype)
            if progress is not None:
                progress(name)
        return out

    def tokenizer(self, config: ModelConfig) -> Tokenizer:
        kind = self.get("tokenizer.ggml.model")
        if kind == "gpt2":
            backend, tok_kind = self._bpe_tokenizer(), "tokenizers"
            default_add_bos = False
        elif kind == "llama":
            backend, tok_kind = self._sentencepiece_tokenizer(), "sentencepiece"
            default_add_bos = True
        else:
            raise UnsupportedModelError(f"{self.path.name}: tokenizer type {kind!r} is not supported; supported: "
                                        f"gpt2 (byte-level BPE), llama (sentencepiece)")
        tokens = self.get("tokenizer.ggml.tokens")
        bos, eos = self.get("tokenizer.ggml.bos_token_id"), self.get("tokenizer.ggml.eos_token_id")
        eos_ids = [int(i) for i in (eos, self.get("tokenizer.ggml.eot_token_id")) if i is not None]
        tok = Tokenizer(backend, tok_kind, None if bos is None else int(bos), list(dict.fromkeys(eos_ids)),
                        bool(self.get("tokenizer.ggml.add_bos_token", default_add_bos)),
                        chat_template=self.get("tokenizer.chat_template"),
                        bos_token=tokens[bos] if bos is not None else "",
                        eos_token=tokens[eos] if eos is not None else "")
        if tok.vocab_size > config.vocab_size:
            raise LoadError(f"{self.path.name}: the tokenizer has {tok.vocab_size} tokens but the model's vocab_size "
                            f"is {config.vocab_size}")
        return tok

    def _bpe_tokenizer(self):
        from tokenizers import AddedToken, Tokenizer as HFTokenizer, decoders, models, pre_tokenizers

        pre = self.get("tokenizer.ggml.pre", "default")
        byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
        pre_tokenizer = {
            "default": byte_level, "gpt2": byte_level,
            # SmolLM: every digit on its own, then GPT-2's byte-level split
            "smollm": pre_tokenizers.Sequence([pre_tokenizers.Digits(individual_digits=True), byte_level]),
        }.get(pre)
        if pre_tokenizer is None:
            raise UnsupportedModelError(f"{self.path.name}: BPE pre-tokenizer {pre!r} is not supported (supported: "
                                        f"default, gpt2, smollm); its text would be split differently")
        tokens = self.get("tokenizer.ggml.tokens")
        merges = [tuple(m.split(" ", 1)) for m in self.get("tokenizer.ggml.merges")]
        tok = HFTokenizer(models.BPE(vocab={t: i for i, t in enumerate(tokens)}, merges=merges))
        tok.pre_tokenizer = pre_tokenizer
        tok.decoder = decoders.ByteLevel()
        types = self.get("tokenizer.ggml.token_type") or []
        special = [AddedToken(t, special=True, normalized=False) for t, kind in zip(tokens, types) if kind in (3, 4)]
        tok.add_special_tokens(special)
        return tok

    def _sentencepiece_tokenizer(self):
        import sentencepiece as spm
        from sentencepiece import sentencepiece_model_pb2 as pb

        tokens = self.get("tokenizer.ggml.tokens")
        scores = self.get("tokenizer.ggml.scores") or [0.0] * len(tokens)
        types = self.get("tokenizer.ggml.token_type") or [1] * len(tokens)
        proto = pb.ModelProto()
        proto.trainer_spec.model_type = pb.TrainerSpec.BPE
        proto.trainer_spec.vocab_size = len(tokens)
        proto.trainer_spec.byte_fallback = 6 in types
        proto.trainer_spec.unk_id = int(self.get("tokenizer.ggml.unknown_token_id", 0))
        proto.trainer_spec.bos_id = int(self.get("tokenizer.ggml.bos_token_id", -1))
        proto.trainer_spec.eos_id = int(self.get("tokenizer.ggml.eos_token_id", -1))
        proto.trainer_spec.pad_id = -1  # padding plays no part in generation (and may repeat the eos id)
        proto.normalizer_spec.name = "identity"
        proto.normalizer_spec.add_dummy_prefix = bool(self.get("tokenizer.ggml.add_space_prefix", True))
        proto.normalizer_spec.remove_extra_whitespaces = False
        proto.normalizer_spec.escape_whitespaces = True
        for piece, score, kind in zip(tokens, scores, types):
            proto.pieces.add(piece=piece, score=float(score), type=int(kind))
        sp = spm.SentencePieceProcessor()
        try:
            sp.load_from_serialized_proto(proto.SerializeToString())
        except RuntimeError as e:
            raise LoadError(f"{self.path.name}: its sentencepiece vocabulary could not be rebuilt ({e})") from None
        return sp
