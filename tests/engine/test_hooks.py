"""Hook points fire in the pinned order; the explicit attention path agrees with SDPA; hooks can edit tensors."""

import torch

import kvexplore
from kvexplore import PreallocatedCache


class Recorder:
    def __init__(self, attention_layers=(), edit=None):
        self.names, self.tensors = [], {}
        self.attention_layers, self.edit = set(attention_layers), edit or {}

    def hook(self, name, t):
        self.names.append(name)
        self.tensors[name] = t.clone()
        return self.edit[name](t) if name in self.edit else None

    def wants_attention(self, layer):
        return layer in self.attention_layers


def run(model, tracer=None, ids=(3, 4, 5, 6, 7, 8), prefill=4):
    cache = PreallocatedCache(model.config, 16)
    first = model(torch.tensor([list(ids[:prefill])]), cache, 0, tracer=tracer)
    rest = [model(torch.tensor([[t]]), cache, prefill + i, tracer=tracer) for i, t in enumerate(ids[prefill:])]
    return torch.cat([first, *rest], 1)


def test_every_hook_point_fires_in_order(tiny):
    assert tiny.config.num_layers == 2
    rec = Recorder(attention_layers={0, 1})
    tiny(torch.tensor([[3, 4, 5]]), PreallocatedCache(tiny.config, 8), 0, tracer=rec)
    assert rec.names == kvexplore.hook_point_names(2)
    assert rec.tensors["layers.1.attn.probs"].shape == (1, tiny.config.num_heads, 3, 3)
    assert rec.tensors["logits"].shape == (1, 3, tiny.config.vocab_size)


def test_explicit_attention_matches_sdpa_and_rows_sum_to_one(tiny):
    plain = run(tiny)
    rec = Recorder(attention_layers={0, 1})
    explicit = run(tiny, rec)
    assert (plain - explicit).abs().max() < 1e-5
    probs = rec.tensors["layers.0.attn.probs"]  # last decode step: 1 query over 6 positions
    assert probs.shape == (1, tiny.config.num_heads, 1, 6)
    assert torch.allclose(probs.sum(-1), torch.ones(1, tiny.config.num_heads, 1))


def test_prefill_probabilities_are_causal(tiny):
    rec = Recorder(attention_layers={1})
    tiny(torch.tensor([[3, 4, 5, 6]]), PreallocatedCache(tiny.config, 8), 0, tracer=rec)
    probs = rec.tensors["layers.1.attn.probs"][0]  # (nh, T, S)
    below = torch.ones(4, 4, dtype=torch.bool).tril()
    assert torch.all(probs[:, ~below] == 0) and torch.all(probs[:, below] > 0)
    assert "layers.0.attn.probs" not in rec.names  # only the asked-for layers take the explicit path


def test_a_hook_can_change_the_computation(tiny):
    hd = tiny.config.head_dim

    def zero_head_0(q):
        q = q.clone()
        q[:, 0] = 0
        return q

    plain = run(tiny)
    edited = run(tiny, Recorder(edit={"layers.0.attn.q": zero_head_0}))
    assert (plain - edited).abs().max() > 1e-3
    rec = Recorder(attention_layers={0}, edit={"layers.0.attn.q": zero_head_0})
    run(tiny, rec)
    probs = rec.tensors["layers.0.attn.probs"][0, 0, 0]  # a zero query attends uniformly
    assert torch.allclose(probs, torch.full_like(probs, 1 / probs.numel())) and hd > 0
