import pytest
import torch

from helpers import make_checkpoint

# the test models are tiny: one thread is fastest, and immune to other processes contending for cores
torch.set_num_threads(1)

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


@pytest.fixture(scope="session")
def checkpoint(tmp_path_factory):
    """``checkpoint(name) -> (folder, transformers reference model)``, each built once per session."""
    built = {}

    def get(name):
        if name not in built:
            arch, options = VARIANTS[name]
            folder = tmp_path_factory.mktemp(name)
            built[name] = (folder, make_checkpoint(folder, arch, **options))
        return built[name]

    return get


@pytest.fixture(scope="session")
def tiny(checkpoint):
    """The default small model for cache and generator tests, loaded by kvexplore."""
    import kvexplore

    folder, _ = checkpoint("llama-gqa2")
    return kvexplore.load(folder)
