"""The RMSNorm styles architectures choose between (a config field, ``norm_style``)."""

from __future__ import annotations

# RMSNorm styles: how the weight is applied after normalising in float32
LLAMA_NORM = "llama"  # cast back to the dtype, then * weight
GEMMA_NORM = "gemma"  # * (1 + weight) in float32, then cast (the checkpoint stores weight - 1)
FLOAT32_NORM = "float32"  # * weight in float32, then cast
