"""A toy architecture added from this module alone, without touching the package: registered, saved as a
Hugging Face style folder, loaded, generated with two cache strategies exactly as recomputation without a cache,
shown by the explorer's snapshot and the HTML replay.

The toy, "ReluSquared", is a Llama whose feed-forward block is ungated, ``down(relu(up(x)) ** p)`` (as in Primer
and Nemotron), and whose ``config.json`` has its own names: ``d_model``, ``n_layer``, ``ffn_dim`` for the common
sizes, and ``relu_power`` for ``p``. Its weight names and shapes are not declared anywhere: the loader takes them
from the model built on the meta device (``mlp.up_proj``, ``mlp.down_proj``, no ``mlp.gate_proj``).
"""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import save_file
from torch import nn

import kvexplore
from helpers import train_sentencepiece, no_cache_logits
from kvexplore import ConfigError, LoadError, UnsupportedModelError
from kvexplore.config.fields import INT, Field
from kvexplore.formats.weights import expected_shapes
from kvexplore.models.architectures import Architecture, register, unregister

PROMPT = "Call me Ishmael. Some years ago"


class ReluSquaredMLP(nn.Module):
    """``down(relu(up(x)) ** p)``: no gate, so no ``gate_proj`` weight."""

    def __init__(self, config, width: int) -> None:
        super().__init__()
        self.up_proj = nn.Linear(config.hidden_size, width, bias=False)
        self.down_proj = nn.Linear(width, config.hidden_size, bias=False)
        self.power = config.arch_options["relu_power"]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(torch.relu(self.up_proj(x)) ** self.power)


def _read(values, fields, where):
    return {"arch_options": {"relu_power": values["relu_power"] or 2}}


def _check(config, where):
    if config.intermediate_size % 8:
        raise ConfigError(where, "ffn_dim", config.intermediate_size, "a multiple of 8 (the toy's plausibility check)")


TOY = Architecture(
    "relu_squared", "ReluSquaredForCausalLM", "relu_squared", "toy",
    aliases={"d_model": "hidden_size", "n_layer": "num_hidden_layers", "ffn_dim": "intermediate_size"},
    fields=(Field("relu_power", INT, 1, 4),), read=_read, check=_check, mlp=ReluSquaredMLP,
    to_hf=lambda config: {"relu_power": config.arch_options["relu_power"]})


@pytest.fixture(scope="module")
def toy():
    register(TOY)
    yield TOY
    unregister(TOY.hf_class)


def toy_config(vocab_size: int, **changes) -> dict:
    """The toy's config.json: its own names for the sizes, the common ones for the rest."""
    return {"architectures": ["ReluSquaredForCausalLM"], "model_type": "relu_squared", "vocab_size": vocab_size,
            "d_model": 48, "n_layer": 3, "ffn_dim": 96, "num_attention_heads": 4, "num_key_value_heads": 2,
            "relu_power": 2, "rms_norm_eps": 1e-5, "rope_theta": 10000.0, "max_position_embeddings": 256,
            "bos_token_id": 1, "eos_token_id": 2, "torch_dtype": "float32", **changes}


@pytest.fixture(scope="module")
def folder(toy, tmp_path_factory):
    """A random-weight toy checkpoint: config.json, model.safetensors and a sentencepiece tokenizer."""
    folder = tmp_path_factory.mktemp("toy")
    vocab = train_sentencepiece(folder / "tokenizer.model")
    raw = toy_config(vocab)
    (folder / "config.json").write_text(json.dumps(raw))
    (folder / "tokenizer_config.json").write_text(json.dumps({"bos_token": "<s>", "eos_token": "</s>",
                                                              "add_bos_token": True}))
    torch.manual_seed(0)
    model = kvexplore.Model(kvexplore.ModelConfig.from_hf(raw))  # nn.Linear's random init
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:  # away from 1, so that a norm applied wrong cannot pass
                p.add_(torch.randn_like(p) * 0.1)
    save_file({n: t.contiguous() for n, t in model.state_dict().items()}, folder / "model.safetensors")
    return folder


@pytest.fixture(scope="module")
def model(folder):
    return kvexplore.load(folder)


def test_the_toy_reads_its_own_config_names_and_builds_its_own_block(model):
    c = model.config
    assert (c.architecture, c.hidden_size, c.num_layers, c.intermediate_size) == ("ReluSquaredForCausalLM", 48, 3, 96)
    assert c.arch_options == {"relu_power": 2}
    assert all(isinstance(layer.mlp, ReluSquaredMLP) for layer in model.model.layers)
    names = expected_shapes(c)  # from the meta-device model: the toy's MLP, never listed by hand
    assert names["model.layers.0.mlp.up_proj.weight"] == (96, 48)
    assert names["model.layers.2.mlp.down_proj.weight"] == (48, 96)
    assert not any("gate_proj" in n for n in names)
    assert kvexplore.ModelConfig.from_hf(c.to_hf()) == c  # written back with its own keys, read back the same


def test_the_toy_config_and_weights_are_checked(folder, tmp_path):
    with pytest.raises(ConfigError, match="relu_power"):  # its own field, typed and bounded
        kvexplore.ModelConfig.from_hf(toy_config(320, relu_power=9))
    with pytest.raises(ConfigError, match="ffn_dim.*multiple of 8"):  # its own plausibility check
        kvexplore.ModelConfig.from_hf(toy_config(320, ffn_dim=100))
    broken = tmp_path / "broken"
    broken.mkdir()
    for name in ("config.json", "tokenizer.model"):
        (broken / name).write_bytes((folder / name).read_bytes())
    from safetensors.torch import load_file

    tensors = load_file(folder / "model.safetensors")
    tensors.pop("model.layers.1.mlp.up_proj.weight")
    tensors["model.layers.1.mlp.gate_proj.weight"] = torch.zeros(96, 48)
    save_file(tensors, broken / "model.safetensors")
    with pytest.raises(LoadError, match="model.layers.1.mlp.up_proj.weight"):
        kvexplore.load(broken)


def test_unregistered_the_toy_is_refused_with_the_supported_list(folder):
    unregister(TOY.hf_class)
    try:
        with pytest.raises(UnsupportedModelError, match="ReluSquaredForCausalLM.*not supported.*LlamaForCausalLM"):
            kvexplore.load(folder)
    finally:
        register(TOY)


def run(model, strategy: str, steps: int = 12):
    gen = kvexplore.Generator(model, kvexplore.make_cache(strategy, model, max_seq_len=64),
                              tracer=kvexplore.Tracer(capture={"cache", "attention"}))
    gen.prefill(PROMPT)
    gen.run(steps - 1, stop_at_eos=False)
    return gen


@pytest.mark.parametrize("strategy", ["preallocated", "concat"])
def test_the_toy_generates_exactly_as_recomputation_without_a_cache(model, strategy):
    want = run(model, "none")
    gen = run(model, strategy)
    assert gen.tokens == want.tokens
    for got, ref in zip(gen.history, want.history, strict=True):
        assert got.token_id == ref.token_id and abs(got.prob - ref.prob) < 1e-5
    # every position's logits, prefill then one token at a time, against one full forward without a cache
    ids = gen.tokens
    cache = kvexplore.make_cache(strategy, model, max_seq_len=64)
    cached = [model(torch.tensor([ids[:9]]), cache, 0)[0]]
    cached += [model(torch.tensor([[t]]), cache, pos)[0] for pos, t in enumerate(ids[9:], start=9)]
    full = no_cache_logits(model, ids)
    assert (torch.cat(cached) - full).abs().max().item() < 1e-5


def test_the_toy_in_the_explorer_snapshot(model):
    pytest.importorskip("plotly")
    pytest.importorskip("ipywidgets")
    ex = kvexplore.Explorer(model, strategies=("preallocated", "concat"), max_seq_len=48, prompt=PROMPT, layer=2)
    ex.step()
    snap = ex.snapshot()
    assert snap.config.architecture == "ReluSquaredForCausalLM"
    assert set(snap.lanes) == {"preallocated", "concat"}
    lane = snap.lane
    assert len(lane.history) == 2 and lane.detail is not None
    assert len(lane.detail.slots) == model.config.num_layers
    assert [r.token_id for r in lane.history] == [r.token_id for r in snap.lanes["concat"].history]


def test_the_toy_in_the_replay(model, tmp_path):
    pytest.importorskip("plotly")
    from kvexplore.replay import frames, save_html, snapshot_at
    from kvexplore.views import attention

    runs = {"preallocated": run(model, "preallocated", steps=6).history, "concat": run(model, "concat", 6).history}
    all_frames, _ = frames(runs, layer=1, head=2)
    assert len(all_frames) == 6
    assert set(all_frames[3]["figures"]) == {"cache_map:preallocated", "attention:preallocated", "cache_map:concat",
                                            "attention:concat", "memory"}
    spec = attention.from_snapshot(snapshot_at(runs, 3, "concat", layer=1, head=2))
    want = runs["concat"][3].trace.physical_attention(1)[-1, 2]  # the toy's own attention at that step
    assert spec.trace("current")["y"].tolist() == pytest.approx(want.tolist())
    path = save_html(runs, tmp_path / "toy.html")
    assert path.stat().st_size > 10_000 and path.read_text().count("<script") == 3
