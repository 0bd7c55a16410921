"""Reading weights from safetensors, single file or sharded, with every tensor checked before use."""

from __future__ import annotations

import re
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open

from ..config.model_config import ModelConfig
from ..errors import ConfigError, CorruptFileError, LoadError, MissingFileError, NonFiniteWeightsError
from ..config.fields import read_json_object
from ..config.layer_plan import SHARED, STATE, LayerSpec, layer_plan

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
    """Refuse a tensor holding NaN or Inf. One float32 sum per tensor (NaN and Inf survive a sum; a finite
    tensor only sums to Inf when its values are near float32's limit, and then the exact elementwise check
    decides): on SmolLM2-135M here, a fraction of a second, see docs/errors.md."""
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
    """Every tensor a checkpoint of this config must hold, by Hugging Face name, with its shape."""
    c = config
    d = c.hidden_size
    shapes: dict[str, tuple[int, ...]] = {"model.embed_tokens.weight": (c.vocab_size, d), "model.norm.weight": (d,)}
    if not c.tie_word_embeddings:
        shapes["lm_head.weight"] = (c.vocab_size, d)
    plan = layer_plan(c)
    for i in range(c.num_layers):
        shapes.update(_layer_shapes(c, plan[i]))
    return shapes


def _latent_shapes(c: ModelConfig, p: str) -> dict[str, tuple[int, ...]]:
    """DeepSeek's latent attention (see kvexplore/latent.py)."""
    d, nh, a = c.hidden_size, c.num_heads, f"{p}self_attn."
    shapes: dict[str, tuple[int, ...]] = {}
    if c.q_lora_rank:
        shapes.update({f"{a}q_a_proj.weight": (c.q_lora_rank, d), f"{a}q_a_layernorm.weight": (c.q_lora_rank,),
                       f"{a}q_b_proj.weight": (nh * c.qk_head_dim, c.q_lora_rank)})
    else:
        shapes[f"{a}q_proj.weight"] = (nh * c.qk_head_dim, d)
    shapes.update({f"{a}kv_a_proj_with_mqa.weight": (c.kv_lora_rank + c.qk_rope_head_dim, d),
                   f"{a}kv_a_layernorm.weight": (c.kv_lora_rank,),
                   f"{a}kv_b_proj.weight": (nh * (c.qk_nope_head_dim + c.v_head_dim), c.kv_lora_rank),
                   f"{a}o_proj.weight": (d, nh * c.v_head_dim)})
    if c.index_topk:  # DeepSeek-V3.2's lightning indexer
        i, n = f"{a}indexer.", c.index_heads * c.index_head_dim
        shapes.update({f"{i}wq_b.weight": (n, c.q_lora_rank), f"{i}wk.weight": (c.index_head_dim, d),
                       f"{i}k_norm.weight": (c.index_head_dim,), f"{i}k_norm.bias": (c.index_head_dim,),
                       f"{i}weights_proj.weight": (c.index_heads, d)})
    if c.o_bias:
        shapes.update({f"{a}q_a_proj.bias": (c.q_lora_rank,)} if c.q_lora_rank else {})
        shapes.update({f"{a}kv_a_proj_with_mqa.bias": (c.kv_lora_rank + c.qk_rope_head_dim,), f"{a}o_proj.bias": (d,)})
    return shapes


def _deepseek_expert_shapes(c: ModelConfig, p: str) -> dict[str, tuple[int, ...]]:
    e, d, f, m = c.num_experts, c.hidden_size, c.moe_intermediate_size, f"{p}mlp."
    shapes = {f"{m}gate.weight": (e, d), f"{m}gate.e_score_correction_bias": (e,)}
    for i in range(e):
        shapes.update({f"{m}experts.{i}.gate_proj.weight": (f, d), f"{m}experts.{i}.up_proj.weight": (f, d),
                       f"{m}experts.{i}.down_proj.weight": (d, f)})
    if c.shared_experts:
        s = f * c.shared_experts
        shapes.update({f"{m}shared_experts.gate_proj.weight": (s, d), f"{m}shared_experts.up_proj.weight": (s, d),
                       f"{m}shared_experts.down_proj.weight": (d, s)})
    return shapes


def _deltanet_shapes(c: ModelConfig, p: str) -> dict[str, tuple[int, ...]]:
    """Qwen3-Next's gated DeltaNet (see kvexplore/deltanet.py)."""
    d, a, r = c.hidden_size, f"{p}linear_attn.", c.linear_value_heads // c.linear_key_heads
    return {f"{a}in_proj_qkvz.weight": (c.linear_key_heads * (2 * c.linear_key_dim + 2 * r * c.linear_value_dim), d),
            f"{a}in_proj_ba.weight": (c.linear_key_heads * 2 * r, d),
            f"{a}conv1d.weight": (c.conv_channels, 1, c.conv_kernel), f"{a}A_log": (c.linear_value_heads,),
            f"{a}dt_bias": (c.linear_value_heads,), f"{a}norm.weight": (c.linear_value_dim,),
            f"{a}out_proj.weight": (d, c.linear_value_heads * c.linear_value_dim)}


def _shared_expert_shapes(c: ModelConfig, p: str) -> dict[str, tuple[int, ...]]:
    e, d, f, s, m = c.num_experts, c.hidden_size, c.moe_intermediate_size, c.shared_expert_size, f"{p}mlp."
    shapes = {f"{m}gate.weight": (e, d), f"{m}shared_expert_gate.weight": (1, d),
              f"{m}shared_expert.gate_proj.weight": (s, d), f"{m}shared_expert.up_proj.weight": (s, d),
              f"{m}shared_expert.down_proj.weight": (d, s)}
    for i in range(e):
        shapes.update({f"{m}experts.{i}.gate_proj.weight": (f, d), f"{m}experts.{i}.up_proj.weight": (f, d),
                       f"{m}experts.{i}.down_proj.weight": (d, f)})
    return shapes


def _layer_shapes(c: ModelConfig, spec: LayerSpec) -> dict[str, tuple[int, ...]]:
    p, d, f = f"model.layers.{spec.index}.", c.hidden_size, c.layer_intermediate_size(spec.index)
    hd, kv = spec.head_dim, spec.kv_heads
    shapes: dict[str, tuple[int, ...]] = {}
    if c.kv_lora_rank:
        shapes.update(_latent_shapes(c, p))
    elif spec.kind == STATE:
        shapes.update(_deltanet_shapes(c, p))
    else:
        q = c.num_heads * hd * (2 if c.gated_attention else 1)  # Qwen3-Next: each head's output gate too
        proj = {"q_proj": q} if spec.kind == SHARED else {"q_proj": q, "k_proj": kv * hd, "v_proj": kv * hd}
        for name, out in proj.items():
            shapes[f"{p}self_attn.{name}.weight"] = (out, d)
            if c.qkv_bias:
                shapes[f"{p}self_attn.{name}.bias"] = (out,)
        shapes[f"{p}self_attn.o_proj.weight"] = (d, c.num_heads * hd)
        if c.o_bias:
            shapes[f"{p}self_attn.o_proj.bias"] = (d,)
    if c.qk_norm and spec.kind != STATE:
        shapes[f"{p}self_attn.q_norm.weight"] = (hd,)
        if spec.kind != SHARED:
            shapes[f"{p}self_attn.k_norm.weight"] = (hd,)
    if c.attention_sinks:
        shapes[f"{p}self_attn.sinks"] = (c.num_heads,)
    if c.uses_experts(spec.index) and c.kv_lora_rank:
        shapes.update(_deepseek_expert_shapes(c, p))
    elif c.uses_experts(spec.index) and c.shared_expert_size:
        shapes.update(_shared_expert_shapes(c, p))
    elif c.uses_experts(spec.index):
        e = c.num_experts
        shapes.update({f"{p}mlp.router.weight": (e, d), f"{p}mlp.router.bias": (e,),
                       f"{p}mlp.experts.gate_up_proj": (e, d, 2 * f), f"{p}mlp.experts.gate_up_proj_bias": (e, 2 * f),
                       f"{p}mlp.experts.down_proj": (e, f, d), f"{p}mlp.experts.down_proj_bias": (e, d)})
    else:
        for name, shape in {"gate_proj": (f, d), "up_proj": (f, d), "down_proj": (d, f)}.items():
            shapes[f"{p}mlp.{name}.weight"] = shape
            if c.mlp_bias:
                shapes[f"{p}mlp.{name}.bias"] = (shape[0],)
    norms = ["input_layernorm", "post_attention_layernorm"]
    if c.sandwich_norms:
        norms += ["pre_feedforward_layernorm", "post_feedforward_layernorm"]
    shapes.update({f"{p}{n}.weight": (d,) for n in norms})
    if c.layer_scalar:
        shapes[f"{p}layer_scalar"] = (1,)
    return shapes


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
        bad = [f for f in set(weight_map.values()) if Path(f).name != f or not f.endswith(".safetensors")]
        if bad:
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
    missing = [n for n in expected if n not in found]
    if missing:
        more = f" and {len(missing) - 5} more" if len(missing) > 5 else ""
        raise LoadError(f"{where}: tensors missing from the checkpoint: {', '.join(missing[:5])}{more}")
    unexpected = [n for n in found if n not in expected and not ignorable(n, config)]
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
