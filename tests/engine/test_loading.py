"""Loading checks every file and tensor before anything runs, and says what is wrong and how to fix it."""

import json
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

import kvexplore
from kvexplore import LoadError, UnsupportedModelError


@pytest.fixture
def folder(checkpoint, tmp_path):
    """A private copy of a good checkpoint, to break."""
    src, _ = checkpoint("llama-gqa2")
    dst = tmp_path / "model"
    shutil.copytree(src, dst)
    return dst


def edit_config(folder, **changes):
    cfg = json.loads((folder / "config.json").read_text())
    cfg.update(changes)
    (folder / "config.json").write_text(json.dumps(cfg))


def edit_weights(folder, fn):
    tensors = load_file(folder / "model.safetensors")
    fn(tensors)
    save_file(tensors, folder / "model.safetensors")


def test_loads_config_tokenizer_and_weights(folder):
    model = kvexplore.load(folder)
    c = model.config
    assert (c.architecture, c.num_layers, c.num_heads, c.num_kv_heads, c.head_dim, c.kv_groups) == (
        "LlamaForCausalLM", 2, 4, 2, 16, 2)
    assert model.dtype == torch.float32 and model.device == torch.device("cpu")
    tok = model.tokenizer
    assert tok.kind == "sentencepiece" and tok.bos_id == 1 and tok.eos_ids == [2] and tok.add_bos
    assert tok.decode(tok.encode("Call me Ishmael.")) == "Call me Ishmael."
    assert c.vocab_size >= tok.vocab_size


def test_missing_tensor_is_named(folder):
    edit_weights(folder, lambda t: t.pop("model.layers.1.mlp.up_proj.weight"))
    with pytest.raises(LoadError, match="tensors missing from the checkpoint: model.layers.1.mlp.up_proj.weight"):
        kvexplore.load(folder)


def test_wrong_shape_names_file_tensor_and_both_shapes(folder):
    def shrink(t):
        t["model.layers.0.self_attn.k_proj.weight"] = t["model.layers.0.self_attn.k_proj.weight"][:16].contiguous()
    edit_weights(folder, shrink)
    with pytest.raises(LoadError) as err:
        kvexplore.load(folder)
    assert str(err.value) == (f"{folder / 'model.safetensors'}: tensor model.layers.0.self_attn.k_proj.weight has "
                              f"shape [16, 64], expected [32, 64] from the config")


def test_config_disagreeing_with_weights(folder):
    edit_config(folder, num_key_value_heads=4)
    with pytest.raises(LoadError, match=r"k_proj.weight has shape \[32, 64\], expected \[64, 64\]"):
        kvexplore.load(folder)


def test_unexpected_tensors(folder):
    edit_weights(folder, lambda t: t.update({"model.layers.0.self_attn.q_norm.weight": torch.ones(16)}))
    with pytest.raises(LoadError, match="tensors a LlamaForCausalLM of this config does not use: "
                                        "model.layers.0.self_attn.q_norm.weight"):
        kvexplore.load(folder)


def test_unsupported_architecture_lists_the_supported_ones(folder):
    edit_config(folder, architectures=["GPT2LMHeadModel"])
    with pytest.raises(UnsupportedModelError, match="architecture 'GPT2LMHeadModel' is not supported; supported: "
                                                    "LlamaForCausalLM, MistralForCausalLM, Qwen2ForCausalLM"):
        kvexplore.load(folder)


def test_unsupported_rope_scaling(folder):
    edit_config(folder, rope_parameters={"rope_type": "longrope", "factor": 4.0, "rope_theta": 10000.0})
    with pytest.raises(UnsupportedModelError, match="rope scaling type 'longrope' is not supported; supported: "
                                                    "default, linear, llama3, yarn, proportional"):
        kvexplore.load(folder)


def test_old_style_rope_keys_are_read(folder):
    cfg = json.loads((folder / "config.json").read_text())
    rope = cfg.pop("rope_parameters")
    cfg.update(rope_theta=rope["rope_theta"] * 2, rope_scaling={"type": "linear", "factor": 2.0})
    (folder / "config.json").write_text(json.dumps(cfg))
    c = kvexplore.load(folder).config
    assert c.rope_theta == rope["rope_theta"] * 2 and c.rope_scaling == {"type": "linear", "factor": 2.0,
                                                                         "rope_type": "linear"}


def test_vocab_size_smaller_than_tokenizer(folder):
    def shrink(t):
        for name in ("model.embed_tokens.weight", "lm_head.weight"):
            t[name] = t[name][:100].contiguous()
    edit_weights(folder, shrink)
    edit_config(folder, vocab_size=100)
    with pytest.raises(LoadError, match=r"the tokenizer has \d+ tokens but config.json says vocab_size 100"):
        kvexplore.load(folder)


def test_truncated_safetensors(folder):
    data = (folder / "model.safetensors").read_bytes()
    (folder / "model.safetensors").write_bytes(data[: len(data) // 2])
    with pytest.raises(LoadError, match=r"model.safetensors is not a readable safetensors file \(.*\); it is "
                                        r"probably truncated or corrupt: download or convert it again"):
        kvexplore.load(folder)


def test_garbage_safetensors(folder):
    (folder / "model.safetensors").write_bytes(b"\x00\x01not a safetensors file at all" * 10)
    with pytest.raises(LoadError, match="is not a readable safetensors file"):
        kvexplore.load(folder)


def test_missing_files(folder, tmp_path):
    with pytest.raises(LoadError, match="is not a named model, a folder or a .gguf file"):
        kvexplore.load(tmp_path / "nope")
    (folder / "model.safetensors").rename(folder / "weights.safetensors")
    with pytest.raises(LoadError, match=r"expected model.safetensors or model.safetensors.index.json "
                                        r"\(safetensors files found: \['weights.safetensors'\]\)"):
        kvexplore.load(folder)
    (folder / "config.json").unlink()
    with pytest.raises(LoadError, match="config.json not found: a model folder needs a config.json"):
        kvexplore.load(folder)


def test_sharded_with_a_missing_shard(tmp_path):
    from helpers import make_checkpoint

    make_checkpoint(tmp_path, "llama", layers=3, shard_bytes="60KB", tokenizer=False)
    shard = sorted(tmp_path.glob("model-*.safetensors"))[-1]
    shard.unlink()
    with pytest.raises(LoadError, match=f"weights file .*{shard.name} is missing"):
        kvexplore.load(tmp_path)


def test_no_tokenizer_means_ids_only(tmp_path):
    from helpers import make_checkpoint

    make_checkpoint(tmp_path, "llama", tokenizer=False)
    model = kvexplore.load(tmp_path)
    assert model.tokenizer is None
    gen = kvexplore.Generator(model, kvexplore.PreallocatedCache(model.config, 16))
    with pytest.raises(ValueError, match="loaded without a tokenizer: pass token ids instead of text"):
        gen.prefill("hello")
    assert gen.prefill([1, 5, 6]).position == 3


def test_bad_dtype_and_device(folder):
    with pytest.raises(ValueError, match="dtype 'float8' is not supported"):
        kvexplore.load(folder, dtype="float8")
    if not torch.cuda.is_available():
        with pytest.raises(ValueError, match="no CUDA device here; use device='cpu'"):
            kvexplore.load(folder, device="cuda")
    with pytest.raises(ValueError, match="is not a device torch knows"):
        kvexplore.load(folder, device="gpu0")


def family_configs():
    """(short name, field key) for every config.json key an architecture declares beyond the common ones."""
    from kvexplore.models.architectures import registered

    return [(a.name, f.key) for a in registered() if a.transformers[0] for f in a.fields]


@pytest.mark.parametrize("arch,key", family_configs())
def test_every_field_an_architecture_declares_is_checked(arch, key):
    """Each family's own keys go through the checked reader: a wrong type names the file, the key and the value."""
    import transformers

    from helpers import ARCHITECTURES

    cfg_cls, _, example = ARCHITECTURES[arch]
    sizes = dict(vocab_size=300, hidden_size=64, intermediate_size=128, num_attention_heads=4, num_key_value_heads=2)
    raw = getattr(transformers, cfg_cls)(**{**sizes, **example}).to_dict()
    kvexplore.ModelConfig.from_hf(raw)  # the example reads as it is
    with pytest.raises(kvexplore.ConfigError, match=f"{key}.*'abc'"):
        kvexplore.ModelConfig.from_hf({**raw, key: "abc"}, where="family.json")
