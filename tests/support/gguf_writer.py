"""Write a transformers model (and its tokenizer) as a GGUF file the way llama.cpp's converter lays it out:
ggml tensor names, q/k rows permuted into rope order for llama, optional quantization."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import sentencepiece as spm
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType, GGUFWriter, quants

from kvexplore.formats.gguf_file import gguf_architectures, permute_rope_rows


def _names(arch: str):
    """The GGUF names ``arch`` declares in kvexplore's registry (Llama's for an architecture kvexplore does not read:
    a file that claims another architecture)."""
    known = gguf_architectures()
    return (known.get(arch) or known["llama"]).gguf


def gguf_name(hf: str, arch: str = "llama") -> str:
    """The ggml name of a Hugging Face tensor name, by the GGUF names the architecture declares (the registry)."""
    names = _names(arch)
    top = {v: k for k, v in names.globals.items()}
    if hf in top:
        return top[hf]
    _, _, layer, rest = hf.split(".", 3)
    module, suffix = rest.rsplit(".", 1)
    return f"blk.{layer}.{ {v: k for k, v in names.layer.items()}[module]}.{suffix}"


def write_gguf(path: Path, hf_model, arch: str = "llama", qtype: GGMLQuantizationType = GGMLQuantizationType.F32,
               spm_model: Path | None = None, bpe_tokenizer=None, chat_template: str | None = None,
               raw_override: dict[str, GGMLQuantizationType] | None = None, edit=None) -> Path:
    """``edit(writer)``, when given, runs last before writing: it can overwrite or drop metadata (``kv_data``)."""
    cfg = hf_model.config
    w = GGUFWriter(str(path), arch)
    w.add_block_count(cfg.num_hidden_layers)
    w.add_context_length(cfg.max_position_embeddings)
    w.add_embedding_length(cfg.hidden_size)
    w.add_feed_forward_length(cfg.intermediate_size)
    w.add_head_count(cfg.num_attention_heads)
    w.add_head_count_kv(cfg.num_key_value_heads)
    w.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    w.add_rope_freq_base(cfg.rope_parameters["rope_theta"])
    w.add_vocab_size(cfg.vocab_size)
    if spm_model is not None:
        sp = spm.SentencePieceProcessor(model_file=str(spm_model))
        pieces = [sp.id_to_piece(i) for i in range(sp.get_piece_size())]
        kinds = [1 + (sp.is_unknown(i)) + 2 * sp.is_control(i) + 5 * sp.is_byte(i) for i in range(len(pieces))]
        pad = cfg.vocab_size - len(pieces)  # llama.cpp pads the vocabulary to the embedding size
        w.add_tokenizer_model("llama")
        w.add_token_list(pieces + [f"[PAD{i}]" for i in range(pad)])
        w.add_token_scores([sp.get_score(i) for i in range(len(pieces))] + [-1000.0] * pad)
        w.add_token_types(kinds + [5] * pad)
        w.add_bos_token_id(sp.bos_id())
        w.add_eos_token_id(sp.eos_id())
        w.add_unk_token_id(sp.unk_id())
        w.add_add_bos_token(True)
    if bpe_tokenizer is not None:
        model = json.loads(bpe_tokenizer.to_str())["model"]
        tokens = [t for t, _ in sorted(model["vocab"].items(), key=lambda kv: kv[1])]
        merges = [m if isinstance(m, str) else " ".join(m) for m in model["merges"]]
        special = {a.content for a in bpe_tokenizer.get_added_tokens_decoder().values()}
        w.add_tokenizer_model("gpt2")
        w.add_tokenizer_pre("default")
        w.add_token_list(tokens)
        w.add_token_merges(merges)
        w.add_token_types([3 if t in special else 1 for t in tokens])
        w.add_bos_token_id(0)
        w.add_eos_token_id(2)
        w.add_add_bos_token(False)
    if chat_template:
        w.add_chat_template(chat_template)
    permuted = arch in gguf_architectures() and _names(arch).rope_rows_permuted  # llama.cpp's rope row order
    for name, p in hf_model.state_dict().items():
        if name == "lm_head.weight" and cfg.tie_word_embeddings:
            continue
        x = p.detach().float().clone()
        if permuted and ".q_proj." in name:
            x = permute_rope_rows(x, cfg.num_attention_heads)
        elif permuted and ".k_proj." in name:
            x = permute_rope_rows(x, cfg.num_key_value_heads)
        x = x.numpy()
        qt = (raw_override or {}).get(name, qtype if x.ndim == 2 else GGMLQuantizationType.F32)
        target = gguf_name(name, arch)
        if qt == GGMLQuantizationType.F32:
            w.add_tensor(target, x)
        elif qt == GGMLQuantizationType.F16:
            w.add_tensor(target, x.astype(np.float16))
        elif qt == GGMLQuantizationType.Q8_1:  # no quantizer in gguf: write zero blocks of the right size
            block, size = GGML_QUANT_SIZES[qt]
            blocks = np.zeros((x.shape[0], x.shape[1] // block * size), dtype=np.uint8)
            w.add_tensor(target, blocks, raw_dtype=qt)
        else:
            w.add_tensor(target, quants.quantize(x, qt), raw_dtype=qt)
    if edit is not None:
        edit(w)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path
