"""``kvexplore.load``: a Hugging Face model folder to a ready :class:`~kvexplore.models.model.Model`."""

from __future__ import annotations

from pathlib import Path

import torch

from ..config.model_config import ModelConfig
from ..errors import LoadError, MissingFileError, SettingsError
from ..core.devices import resolve_device
from ..core.settings import choice
from ..models.model import Model
from ..models.rope import Rotary
from .store import MODELS, fetch
from .tokenizer import Tokenizer
from .weights import check_finite, load_weights

DTYPES = {"float32": torch.float32, "fp32": torch.float32, "bfloat16": torch.bfloat16, "bf16": torch.bfloat16,
          "float16": torch.float16, "fp16": torch.float16}


def resolve_dtype(dtype: str | torch.dtype | None, device: torch.device) -> torch.dtype:
    """``None`` means float32 on CPU and bfloat16 on CUDA."""
    if dtype is None:
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    if isinstance(dtype, torch.dtype):
        if dtype not in DTYPES.values():
            raise SettingsError(f"dtype {dtype} is not supported; use float32, bfloat16 or float16")
        return dtype
    if not isinstance(dtype, str) or dtype not in DTYPES:
        raise SettingsError(f"dtype {dtype!r} is not supported; use one of {', '.join(DTYPES)}")
    return DTYPES[dtype]


def load(source: str | Path, dtype: str | torch.dtype | None = None,
         device: str | torch.device | None = None, allow_nonfinite: bool = False, mla: str = "absorbed",
         accept_license: bool = False) -> Model:
    """Load a Llama-family model from a named model (``"tiny"``, ``"smollm2-135m"``, ``"gemma3-270m"``; see
    ``kvexplore models list``), a Hugging Face style folder or a ``.gguf`` file (docs/python-api.md#models).

    ``dtype``: float32 / bfloat16 / float16 (default float32 on CPU, bfloat16 on CUDA). Every config value, size and
    tensor is checked before any is used, and every weight for NaN and Inf (refused unless ``allow_nonfinite=True``, for
    studying a broken checkpoint); anything wrong raises a :class:`~kvexplore.errors.LoadError` that names the file and
    the fix. ``mla``: how a latent-attention model (DeepSeek-V3) reads its latent cache, ``"absorbed"`` (the
    up-projections folded into the query and the output) or ``"decompressed"`` (per-head keys and values every step);
    both are exact. ``accept_license``: a named model under terms to accept (``"gemma3-270m"``) is downloaded only with
    ``True``, the first time."""
    choice(mla, "mla", ("absorbed", "decompressed"))
    path = source_path(source, accept_license)
    device = resolve_device(device)
    dtype = resolve_dtype(dtype, device)
    if path.suffix == ".gguf":
        from .gguf_file import GGUFFile

        gguf = GGUFFile(path)
        config = gguf.config()
        tokenizer = gguf.tokenizer(config)
        tensors = gguf.tensors(config, dtype)
    elif path.is_dir():
        config = ModelConfig.from_file(path / "config.json", mla=mla)
        tokenizer = Tokenizer.from_folder(path, config)
        tensors = load_weights(path, config, dtype)
    else:
        raise _not_a_model(source, path)
    if not allow_nonfinite:
        check_finite(tensors, str(path))
    return assemble(config, tensors, tokenizer, device, str(path))


def source_path(source: str | Path, accept_license: bool = False) -> Path:
    """The file or folder a named model, a folder or a ``.gguf`` path loads from (a named model fetched first)."""
    if not isinstance(source, (str, Path)):
        raise SettingsError(f"model source must be a name, a folder or a .gguf path (str or Path), got "
                            f"{type(source).__name__}")
    path = Path(source).expanduser()
    if isinstance(source, str) and source in MODELS and not path.exists():
        path = fetch(source, accept_license=accept_license)
    return path


def load_config(source: str | Path, mla: str = "absorbed") -> ModelConfig:
    """The config of what :func:`load` would load from ``source``, without its weights."""
    path = source_path(source)
    if path.suffix == ".gguf":
        from .gguf_file import GGUFFile

        return GGUFFile(path).config()
    if path.is_dir():
        return ModelConfig.from_file(path / "config.json", mla=mla)
    raise _not_a_model(source, path)


def load_tokenizer(source: str | Path) -> Tokenizer | None:
    """The tokenizer :func:`load` would give the model of ``source`` (None: the model has none), without its
    weights."""
    path, config = source_path(source), load_config(source)
    if path.suffix == ".gguf":
        from .gguf_file import GGUFFile

        return GGUFFile(path).tokenizer(config)
    return Tokenizer.from_folder(path, config)


def _not_a_model(source: str | Path, path: Path) -> Exception:
    return (MissingFileError if not path.exists() else LoadError)(
        f"model source {str(source)!r} is not a named model, a folder or a .gguf file; give one of "
        f"{', '.join(MODELS)}, a Hugging Face style model folder (config.json + model.safetensors) or a GGUF file")


def assemble(config: ModelConfig, tensors: dict[str, torch.Tensor], tokenizer: Tokenizer | None,
             device: torch.device, source: str) -> Model:
    """A ready model from checked tensors (no random initialisation: modules are built on the meta device)."""
    if device.type == "cpu" and next(iter(tensors.values())).dtype == torch.float32:
        # the same [out, in] matmul weights stored transposed: on CPU in float32 F.linear of one token runs up to 2x
        # faster from this layout (bfloat16 and float16 are slower from it, so they keep row-major; docs/benchmarks.md)
        tensors = {n: t.t().contiguous().t() if _is_matmul_weight(n, config) else t for n, t in tensors.items()}
    model = Model.skeleton(config)
    model.load_state_dict({n: t.to(device) for n, t in tensors.items()}, strict=True, assign=True)
    model.rotary = Rotary(config).to(device)
    model.tokenizer = tokenizer
    model.source = source
    return model.eval()


def _is_matmul_weight(name: str, config: ModelConfig) -> bool:
    """Weights multiplied by activations: projections, the output head (the embedding when tied)."""
    return name.endswith("_proj.weight") or name == "lm_head.weight" or (
        name == "model.embed_tokens.weight" and config.tie_word_embeddings)
