"""Model files: safetensors folders, GGUF files, tokenizers, the weight check, and :func:`~.loading.load`."""
