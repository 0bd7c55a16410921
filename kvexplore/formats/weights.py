"""Reading weights from safetensors, single file or sharded, with every tensor checked before use."""

from __future__ import annotations

import re
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open

from ..config.model_config import ModelConfig
from ..errors import ConfigError, CorruptFileError, LoadError, MissingFileError, NonFiniteWeightsError
from ..config.fields import read_json_object
from ..models.model import Model

# tensors some checkpoints carry that the model recomputes or ignores
_IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)


_LAYER = re.compile(r"model\.layers\.(\d+)\.")


def check_layer_count(names: list[str], config: ModelConfig, where: str) -> None:
    """The checkpoint's layers are ``0..num_layers-1``, checked from its tensor names before any per-layer work
    (a damaged ``num_hidden_layers: 1000000000`` must not build a billion names first)."""
    found = {int(m.group(1)) for n in names if (m := _LAYER.match(n))}
    n = config.num_layers
    if found != set(range(n)):
        held = f"layers {min(found)}..{max(found)} ({len(found)} of them)" if found else "no layers"
        gaps = sorted(set(range(max(found, default=-1) + 1)) - found)
        gap = f", missing {gaps[:5]}" if gaps else ""
        raise ConfigError(config.source, "num_hidden_layers", n,
                          f"the number of layers the weights hold: {where} has {held}{gap}",
                          fix="is the config the one saved with these weights?")


def check_finite(tensors: dict[str, torch.Tensor], where: str) -> None:
    """Refuse a tensor holding NaN or Inf: one float32 sum per tensor (NaN and Inf survive a sum), an elementwise
    check only where the sum is not finite (its cost: docs/errors.md)."""
    for name, t in tensors.items():
        if not t.is_floating_point() or bool(torch.isfinite(t.sum(dtype=torch.float32))):
            continue
        if not bool(torch.isfinite(t).all()):
            bad = t[~torch.isfinite(t)]
            raise NonFiniteWeightsError(
                f"{where}: tensor {name} holds {bad.numel()} non-finite value{'s' * (bad.numel() > 1)} (first: "
                f"{float(bad[0])}); the model would give NaN logits. The file is probably damaged: download or "
                f"convert it again, or pass allow_nonfinite=True to load it anyway (to study a broken checkpoint)")


def expected_shapes(config: ModelConfig) -> dict[str, tuple[int, ...]]:
    """Every tensor a checkpoint of this config must hold, by Hugging Face name, with its shape: the state of the
    model built on the meta device (no memory, no initialisation), so the names and shapes are declared once, by
    the modules the architecture builds, and a checkpoint that passes loads with ``strict=True``."""
    return {name: tuple(t.shape) for name, t in Model.skeleton(config).state_dict().items()}


def ignorable(name: str, config: ModelConfig) -> bool:
    """Tensors a checkpoint may hold that the model does not use: a tied output head, rotary buffers, and the
    key/value weights of layers that share another layer's cache (Gemma 4 checkpoints keep them)."""
    if name.endswith(_IGNORED_SUFFIXES) or (name == "lm_head.weight" and config.tie_word_embeddings):
        return True
    parts = name.split(".")
    if len(parts) > 4 and parts[:2] == ["model", "layers"] and parts[2].isdigit() and parts[3] == "self_attn":
        layer = int(parts[2])
        shared = config.num_layers - config.num_kv_shared_layers <= layer < config.num_layers
        return shared and parts[4] in ("k_proj", "v_proj", "k_norm")
    return False


def checkpoint_files(folder: Path) -> dict[str, Path]:
    """Map each tensor name to the safetensors file that holds it (``model.safetensors`` or sharded)."""
    index = folder / "model.safetensors.index.json"
    if index.exists():
        weight_map = read_json_object(index).get("weight_map")
        if not isinstance(weight_map, dict) or not all(
                isinstance(k, str) and isinstance(v, str) for k, v in weight_map.items()):
            raise ConfigError(str(index), "weight_map", weight_map, "an object mapping each tensor name to the "
                              "shard file that holds it", fix="save the model again with save_pretrained")
        if bad := [f for f in set(weight_map.values()) if Path(f).name != f or not f.endswith(".safetensors")]:
            raise ConfigError(str(index), "weight_map", bad[0], "a .safetensors file name in the model folder")
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
        raise MissingFileError(f"weights file {path} is missing (listed in the shard index); download it again")
    try:
        return safe_open(str(path), framework="pt", device="cpu")
    except Exception as e:  # SafetensorError, OSError, and a bare Exception for some header damage
        raise CorruptFileError(
            f"{path} is not a readable safetensors file ({e}); it is probably truncated or corrupt: "
            f"download or convert it again"
        ) from e


def _shape(handle, path: Path, name: str) -> tuple[int, ...]:
    try:
        return tuple(handle.get_slice(name).get_shape())
    except Exception as e:
        raise CorruptFileError(f"{path}: tensor {name} is not in that file ({e}), though the shard index "
                               f"puts it there; the index and the shards do not match: download them again") from e


def check_tensors(expected: dict[str, tuple[int, ...]], found: dict[str, tuple[int, ...]],
                  config: ModelConfig, where: str, file_of: dict[str, str] | None = None) -> None:
    """Every expected tensor present with its shape, and nothing the model would not use; else a LoadError
    that names the file, the tensor and both shapes."""
    if missing := [n for n in expected if n not in found]:
        more = f" and {len(missing) - 5} more" if len(missing) > 5 else ""
        raise LoadError(f"{where}: tensors missing from the checkpoint: {', '.join(missing[:5])}{more}")
    if unexpected := [n for n in found if n not in expected and not ignorable(n, config)]:
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
    the CPU; :func:`kvexplore.formats.loading.assemble` moves them to the device, as it does for GGUF tensors."""
    where = checkpoint_files(folder)
    check_layer_count(list(where), config, str(folder))
    expected = expected_shapes(config)
    handles = {path: _open(path) for path in {where[n] for n in expected if n in where}}
    found = {n: _shape(handles[where[n]], where[n], n) if where[n] in handles else () for n in where}
    check_tensors(expected, found, config, str(folder), {n: str(where[n]) for n in where})
    tensors = {}
    for name in expected:
        path = where[name]
        try:
            t = handles[path].get_tensor(name)
        except (SafetensorError, OSError, RuntimeError, ValueError) as e:
            raise CorruptFileError(f"{path}: tensor {name} could not be read ({e}); the file is probably "
                                   f"truncated or corrupt: download or convert it again") from e
        if not t.is_floating_point():
            raise CorruptFileError(f"{path}: tensor {name} is stored as {t.dtype}, but weights are floating "
                                   f"point; the file is damaged or not this model's: convert it again")
        tensors[name] = t.to(dtype=dtype)
    return tensors
