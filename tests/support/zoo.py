"""The model zoo the tests share: random-weight checkpoints and loaded models, each built once per session (the
transformers classes and small configs come from kvexplore's architecture registry, see helpers.architectures)."""

from __future__ import annotations

from pathlib import Path

import torch

from helpers import make_checkpoint

# name -> (architecture, options): small random-weight checkpoints covering every supported variant
VARIANTS = {
    "llama-gqa2": ("llama", dict(heads=4, kv_heads=2)),
    "llama-mha": ("llama", dict(heads=4, kv_heads=4)),
    "llama3-rope-tied": ("llama", dict(heads=8, kv_heads=2, tied=True, rope={
        "rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
        "original_max_position_embeddings": 32, "rope_theta": 50000.0})),
    "llama-linear-rope-bias": ("llama", dict(heads=4, kv_heads=1, attention_bias=True, mlp_bias=True,
                                             rope={"rope_type": "linear", "factor": 4.0, "rope_theta": 10000.0})),
    "mistral-head-dim": ("mistral", dict(heads=4, kv_heads=2, head_dim=24, sliding_window=None)),
    "qwen2-gqa8": ("qwen2", dict(heads=8, kv_heads=1, tied=True)),
}


def _key(value):
    """A hashable form of checkpoint options (dicts and lists inside)."""
    if isinstance(value, dict):
        return tuple(sorted((k, _key(v)) for k, v in value.items()))
    if isinstance(value, (list, tuple)):
        return tuple(_key(v) for v in value)
    return value


class Zoo:
    """Random-weight checkpoints and loaded models, each built once per session (per worker).

    ``zoo.checkpoint(arch, **options) -> (folder, transformers reference)`` (options as
    :func:`helpers.make_checkpoint`), ``zoo.load(arch, load_options=None, **options)`` the kvexplore model on that
    checkpoint, ``zoo.variant(name)`` one of :data:`VARIANTS`, ``zoo.get(key, build)`` anything else built once,
    ``zoo.trained`` the packaged ``tiny`` model.
    Tests must not change a model's weights (they are shared); one that needs to builds its own.
    """

    def __init__(self, tmp_path_factory):
        self._tmp = tmp_path_factory
        self._checkpoints: dict = {}
        self._models: dict = {}
        self._trained = None

    def checkpoint(self, arch: str, **options) -> tuple[Path, torch.nn.Module]:
        key = (arch, _key(options))
        if key not in self._checkpoints:
            folder = self._tmp.mktemp(arch.replace("_", "-"))
            self._checkpoints[key] = (folder, make_checkpoint(folder, arch, **options))
        return self._checkpoints[key]

    def load(self, arch: str, load_options: dict | None = None, **options):
        import kvexplore

        key = (arch, _key(options), _key(load_options or {}))
        if key not in self._models:
            folder, _ = self.checkpoint(arch, **options)
            self._models[key] = kvexplore.load(folder, **(load_options or {}))
        return self._models[key]

    def get(self, key, build):
        """Anything else built once: ``build()``'s result under ``key`` (e.g. a transformers model built in memory)."""
        if key not in self._models:
            self._models[key] = build()
        return self._models[key]

    def variant(self, name: str) -> tuple[Path, torch.nn.Module]:
        arch, options = VARIANTS[name]
        return self.checkpoint(arch, **options)

    @property
    def trained(self):
        """The packaged ``tiny`` model (trained weights), loaded once."""
        if self._trained is None:
            import kvexplore

            self._trained = kvexplore.load("tiny")
        return self._trained
