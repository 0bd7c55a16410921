"""Shared pieces of the benchmark scripts: model shapes, random-weight checkpoints, timing helpers.

Not a benchmark itself. The scripts in this folder import it as ``_common`` (``python benchmarks/x.py`` puts
this folder first on ``sys.path``).
"""

from __future__ import annotations

import statistics
import time
from pathlib import Path

import torch

# name -> Llama config fields. "24M" is the llama2.c stories shape with untied embeddings (~24.4M parameters);
# "135M" is SmolLM2-135M (GQA 9:3, tied embeddings, rope_theta 1e5).
SHAPES: dict[str, dict] = {
    "24M": dict(hidden_size=288, num_hidden_layers=6, num_attention_heads=6, num_key_value_heads=6,
                intermediate_size=768, vocab_size=32000, tie_word_embeddings=False, rope_theta=10000.0),
    "135M": dict(hidden_size=576, num_hidden_layers=30, num_attention_heads=9, num_key_value_heads=3,
                 intermediate_size=1536, vocab_size=49152, tie_word_embeddings=True, rope_theta=100000.0),
}

DTYPES = {"float32": torch.float32, "fp32": torch.float32, "bfloat16": torch.bfloat16, "bf16": torch.bfloat16,
          "float16": torch.float16, "fp16": torch.float16}


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).replace("torch.", "")


def build_checkpoint(shape: str, folder: Path, seed: int = 0, max_positions: int = 4096,
                     initializer_range: float = 0.02) -> torch.nn.Module:
    """Random-weight ``LlamaForCausalLM`` of ``shape`` saved (safetensors, float32) to ``folder``.

    The config has no bos/eos/pad token, so ``generate`` cannot stop early on an end-of-sequence token.
    Returns the float32 transformers model (eval mode) on the CPU.
    """
    import transformers

    s = dict(SHAPES[shape])
    theta = s.pop("rope_theta")
    config = transformers.LlamaConfig(
        **s, max_position_embeddings=max_positions, initializer_range=initializer_range, rms_norm_eps=1e-5,
        rope_parameters={"rope_type": "default", "rope_theta": theta},
        bos_token_id=None, eos_token_id=None, pad_token_id=None,
    )
    torch.manual_seed(seed)
    model = transformers.LlamaForCausalLM(config).float().eval()
    folder.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(folder)
    return model


def sync(device: torch.device | str) -> None:
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize(device)


def now(device: torch.device | str) -> float:
    sync(device)
    return time.perf_counter()


def median(xs: list[float]) -> float:
    return statistics.median(xs) if xs else float("nan")


def spread(xs: list[float]) -> str:
    """``min..max`` of a list of seconds, in milliseconds."""
    return f"{min(xs) * 1e3:.1f}..{max(xs) * 1e3:.1f} ms" if xs else "-"


def prompt_ids(n: int, vocab: int, seed: int = 1) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(3, vocab, (n,), generator=g).tolist()
