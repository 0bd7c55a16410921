"""Reading weights from safetensors, single file or sharded, with every tensor checked before use."""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open

from .config import ModelConfig
from .errors import LoadError

# tensors some checkpoints carry that the model recomputes or ignores
_IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)


def expected_shapes(config: ModelConfig) -> dict[str, tuple[int, ...]]:
    """Every tensor a checkpoint of this config must hold, by Hugging Face name, with its shape."""
    c = config
    d, f, hd = c.hidden_size, c.intermediate_size, c.head_dim
    shapes: dict[str, tuple[int, ...]] = {"model.embed_tokens.weight": (c.vocab_size, d), "model.norm.weight": (d,)}
    if not c.tie_word_embeddings:
        shapes["lm_head.weight"] = (c.vocab_size, d)
    for i in range(c.num_layers):
        p = f"model.layers.{i}."
        proj = {"q_proj": c.num_heads * hd, "k_proj": c.num_kv_heads * hd, "v_proj": c.num_kv_heads * hd}
        for name, out in proj.items():
            shapes[f"{p}self_attn.{name}.weight"] = (out, d)
            if c.qkv_bias:
                shapes[f"{p}self_attn.{name}.bias"] = (out,)
        shapes[f"{p}self_attn.o_proj.weight"] = (d, c.num_heads * hd)
        if c.o_bias:
            shapes[f"{p}self_attn.o_proj.bias"] = (d,)
        for name, shape in {"gate_proj": (f, d), "up_proj": (f, d), "down_proj": (d, f)}.items():
            shapes[f"{p}mlp.{name}.weight"] = shape
            if c.mlp_bias:
                shapes[f"{p}mlp.{name}.bias"] = (shape[0],)
        shapes[f"{p}input_layernorm.weight"] = (d,)
        shapes[f"{p}post_attention_layernorm.weight"] = (d,)
    return shapes


def checkpoint_files(folder: Path) -> dict[str, Path]:
    """Map each tensor name to the safetensors file that holds it (``model.safetensors`` or sharded)."""
    index = folder / "model.safetensors.index.json"
    if index.exists():
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
        except (json.JSONDecodeError, KeyError, TypeError) as e:
            raise LoadError(f"{index} is not a valid shard index (needs a 'weight_map' object): {e}") from None
        return {name: folder / file for name, file in weight_map.items()}
    single = folder / "model.safetensors"
    if not single.exists():
        found = sorted(p.name for p in folder.glob("*.safetensors")) or "none"
        raise LoadError(
            f"no weights in {folder}: expected model.safetensors or model.safetensors.index.json "
            f"(safetensors files found: {found}); save the model with save_pretrained(safe_serialization=True)"
        )
    with _open(single) as f:
        return {name: single for name in f.keys()}


def _open(path: Path):
    if not path.exists():
        raise LoadError(f"weights file {path} is missing (listed in the shard index)")
    try:
        return safe_open(str(path), framework="pt", device="cpu")
    except (SafetensorError, OSError) as e:
        raise LoadError(
            f"{path} is not a readable safetensors file ({e}); it is probably truncated or corrupt: "
            f"download or convert it again"
        ) from None


def check_tensors(expected: dict[str, tuple[int, ...]], found: dict[str, tuple[int, ...]],
                  config: ModelConfig, where: str, file_of: dict[str, str] | None = None) -> None:
    """Every expected tensor present with its shape, and nothing the model would not use; else a LoadError
    that names the file, the tensor and both shapes."""
    missing = [n for n in expected if n not in found]
    if missing:
        more = f" and {len(missing) - 5} more" if len(missing) > 5 else ""
        raise LoadError(f"{where}: tensors missing from the checkpoint: {', '.join(missing[:5])}{more}")
    unexpected = [n for n in found if n not in expected and not n.endswith(_IGNORED_SUFFIXES)
                  and not (n == "lm_head.weight" and config.tie_word_embeddings)]
    if unexpected:
        raise LoadError(
            f"{where}: the checkpoint has tensors a {config.architecture} of this config does not use: "
            f"{', '.join(sorted(unexpected)[:5])}; is the config the one saved with these weights?"
        )
    for name, shape in expected.items():
        if tuple(found[name]) != shape:
            file = (file_of or {}).get(name, where)
            raise LoadError(f"{file}: tensor {name} has shape {list(found[name])}, expected {list(shape)} "
                            f"from the config")


def load_weights(folder: Path, config: ModelConfig, dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """Read and check every tensor (all present with the expected shape before any is loaded), as ``dtype`` on
    the CPU; :func:`kvexplore.loading.assemble` moves them to the device, as it does for GGUF tensors."""
    where = checkpoint_files(folder)
    expected = expected_shapes(config)
    handles = {path: _open(path) for path in {where[n] for n in expected if n in where}}
    found = {n: tuple(handles[where[n]].get_slice(n).get_shape()) if where[n] in handles else () for n in where}
    check_tensors(expected, found, config, str(folder), {n: where[n].name for n in where})
    tensors = {}
    for name in expected:
        path = where[name]
        try:
            t = handles[path].get_tensor(name)
        except (SafetensorError, OSError, RuntimeError) as e:
            raise LoadError(f"{path.name}: tensor {name} could not be read ({e}); the file is probably "
                            f"truncated or corrupt: download or convert it again") from None
        tensors[name] = t.to(dtype=dtype)
    return tensors
