"""GGUF files written like llama.cpp's converter: config, de-quantization, q/k un-permutation, tokenizers."""

import dataclasses

import pytest
import sentencepiece as spm
import torch
from gguf import GGMLQuantizationType as Q

import kvexplore
from gguf_writer import write_gguf
from helpers import make_checkpoint
from kvexplore import UnsupportedModelError
from kvexplore.config import families
from kvexplore.errors import CorruptFileError
from kvexplore.formats import gguf_file
from helpers import no_cache_logits

IDS = list(range(3, 45))
TEXTS = ["Call me Ishmael.", "  two  spaces\tand a tab\n\nnewlines", "naïve café 🐋 12345", "x", ""]


def logits_of(model, ids=IDS):
    return no_cache_logits(model, ids).float()


def reference(ref, ids=IDS):
    with torch.no_grad():
        return ref(torch.tensor([ids])).logits[0]


@pytest.fixture(scope="module")
def llama(tmp_path_factory):
    folder = tmp_path_factory.mktemp("gguf-llama")
    ref = make_checkpoint(folder, "llama", heads=8, kv_heads=2, vocab_size=330)
    return folder, ref


@pytest.mark.parametrize("tied", [False, True])
def test_llama_gguf_matches_transformers(tmp_path, tied):
    ref = make_checkpoint(tmp_path, "llama", heads=8, kv_heads=2, tied=tied)
    model = kvexplore.load(write_gguf(tmp_path / "m.gguf", ref, spm_model=tmp_path / "tokenizer.model"))
    assert model.config.tie_word_embeddings is tied and model.config.num_kv_heads == 2
    assert (logits_of(model) - reference(ref)).abs().max() < 1e-4


def test_qwen2_gguf_is_not_unpermuted(tmp_path):
    ref = make_checkpoint(tmp_path, "qwen2", heads=4, kv_heads=1)
    model = kvexplore.load(write_gguf(tmp_path / "m.gguf", ref, arch="qwen2", spm_model=tmp_path / "tokenizer.model"))
    assert model.config.architecture == "Qwen2ForCausalLM" and model.config.qkv_bias
    assert (logits_of(model) - reference(ref)).abs().max() < 1e-4


def test_wrong_unpermutation_is_visible(llama, tmp_path, monkeypatch):
    """If the q/k rows were left in llama.cpp's order the logits would be far off: the check above has teeth."""
    folder, ref = llama
    path = write_gguf(tmp_path / "m.gguf", ref, spm_model=folder / "tokenizer.model")
    llama = families.lookup("LlamaForCausalLM")
    monkeypatch.setitem(families.ARCHITECTURES, "LlamaForCausalLM",
                        dataclasses.replace(llama, gguf=dataclasses.replace(llama.gguf, rope_rows_permuted=False)))
    assert (logits_of(kvexplore.load(path)) - reference(ref)).abs().max() > 0.1


def test_quantized_gguf_is_dequantized(llama, tmp_path):
    """Each format loses more than the last (random weights quantize badly: 4 bits loses much)."""
    folder, ref = llama
    want = reference(ref)
    errors = {}
    for qtype in (Q.F16, Q.Q8_0, Q.Q4_1):
        path = write_gguf(tmp_path / f"{qtype.name}.gguf", ref, qtype=qtype, spm_model=folder / "tokenizer.model")
        errors[qtype.name] = ((logits_of(kvexplore.load(path)) - want).abs().max() / want.abs().max()).item()
    assert 0 < errors["F16"] < 0.01 < errors["Q8_0"] < 0.15 < errors["Q4_1"], errors
    bf16 = kvexplore.load(tmp_path / "Q8_0.gguf", dtype=torch.bfloat16)
    assert bf16.dtype == torch.bfloat16 and (logits_of(bf16) - want).abs().max() < 0.1 * want.abs().max()


def test_sentencepiece_vocabulary_is_rebuilt(llama, tmp_path):
    folder, ref = llama
    model = kvexplore.load(write_gguf(tmp_path / "m.gguf", ref, spm_model=folder / "tokenizer.model",
                                      chat_template="{{ messages[0]['content'] }}"))
    sp = spm.SentencePieceProcessor(model_file=str(folder / "tokenizer.model"))
    tok = model.tokenizer
    assert tok.kind == "sentencepiece" and tok.bos_id == 1 and tok.eos_ids == [2] and tok.add_bos
    assert tok.vocab_size == 330  # padded like llama.cpp does
    for text in TEXTS:
        assert tok.encode(text) == sp.encode(text)
        assert tok.decode(tok.encode(text)) == text
    assert tok.apply_chat_template([{"role": "user", "content": "hi"}]) == "hi"


def test_bpe_vocabulary_is_rebuilt(tmp_path):
    from test_tokenizer import byte_level_bpe

    bpe = byte_level_bpe(bos_post_processor=False)
    ref = make_checkpoint(tmp_path, "llama", vocab_size=bpe.get_vocab_size(), tokenizer=False)
    model = kvexplore.load(write_gguf(tmp_path / "m.gguf", ref, bpe_tokenizer=bpe))
    tok = model.tokenizer
    assert tok.kind == "tokenizers" and not tok.add_bos and tok.eos_ids == [2]
    for text in TEXTS + ["<|im_start|>user\nhi<|im_end|>"]:
        assert tok.encode(text) == bpe.encode(text, add_special_tokens=False).ids
        assert tok.decode(tok.encode(text)) == text


def test_unsupported_quantization_names_the_type(llama, tmp_path):
    folder, ref = llama
    path = write_gguf(tmp_path / "m.gguf", ref, spm_model=folder / "tokenizer.model",
                      raw_override={"model.layers.1.mlp.up_proj.weight": Q.Q8_1})
    with pytest.raises(UnsupportedModelError, match=r"m.gguf: tensor blk.1.ffn_up.weight uses quantization Q8_1, "
                                                    r"which the gguf package cannot dequantize"):
        kvexplore.load(path)


def test_unsupported_architecture(llama, tmp_path):
    folder, ref = llama
    path = write_gguf(tmp_path / "m.gguf", ref, arch="gpt2", spm_model=folder / "tokenizer.model")
    with pytest.raises(UnsupportedModelError,
                       match="GGUF architecture 'gpt2' is not supported; supported: llama, qwen2"):
        kvexplore.load(path)


def test_corrupt_gguf(llama, tmp_path):
    folder, ref = llama
    path = write_gguf(tmp_path / "m.gguf", ref, spm_model=folder / "tokenizer.model")
    data = path.read_bytes()
    path.write_bytes(data[: len(data) // 3])
    with pytest.raises(CorruptFileError, match=r"m.gguf: tensor blk\.\S+ needs bytes \d+\.\.\d+, past the end of the "
                                               r"file \(at byte \d+ of \d+\); the file is truncated or corrupt"):
        kvexplore.load(path)
    path.write_bytes(b"GGUF" + b"\xff" * 64)
    with pytest.raises(CorruptFileError, match="GGUF version 4294967295 is not 2 or 3"):
        kvexplore.load(path)
    with pytest.raises(FileNotFoundError, match="GGUF file .*missing.gguf not found"):
        kvexplore.load(tmp_path / "missing.gguf")


def test_permutation_round_trip():
    w = torch.randn(6 * 8, 5)
    assert torch.equal(gguf_file.unpermute_rope_rows(gguf_file.permute_rope_rows(w, 6), 6), w)
    assert not torch.equal(gguf_file.permute_rope_rows(w, 6), w)
