"""docs/extending.md's worked example: a press of one's own, registered from outside the package."""

from __future__ import annotations

import pytest
import torch

import kvexplore
from kvexplore.caches.presses import Press, register_press, unregister_press


class ValueNormPress(Press):
    """Keep the positions whose values are largest: what a position would add to the output, at most."""
    name = "vnorm"

    def score(self, obs):
        return obs.values.float().norm(dim=-1)


@pytest.fixture
def vnorm():
    register_press(ValueNormPress)
    yield
    unregister_press("vnorm")


def _values(model, ids):
    """Every layer's values, written without a cache in the way (the reference)."""
    seen = {}

    class Probe:
        def wants_attention(self, layer):
            return False

        def hook(self, name, t):
            if name.endswith("attn.v_new"):
                seen[int(name.split(".")[1])] = t[0].clone()

    model(ids, kvexplore.make_cache("concat", model), 0, tracer=Probe())
    return seen


def test_a_registered_press_keeps_the_largest_values(trained, vnorm):
    ids = torch.tensor([list(range(5, 45))])
    cache = kvexplore.make_cache("evict", trained, max_seq_len=64, press="vnorm", compression_ratio=0.5)
    trained(ids, cache, 0)
    values = _values(trained, ids)
    for layer in cache.full_layers:
        norms = values[layer].norm(dim=-1)  # (kv_heads, 40)
        want = [sorted(norms[h].topk(20).indices.tolist()) for h in range(norms.shape[0])]
        assert cache.eviction.kept_positions(layer) == want


def test_a_registered_press_runs_through_the_generator_and_the_doctor(trained, vnorm):
    gen = kvexplore.Generator(trained, kvexplore.make_cache("evict", trained, max_seq_len=64, press="vnorm"))
    gen.prefill("Once upon a time there was a little girl")
    assert len(gen.run(6, stop_at_eos=False)) == 6
    report = kvexplore.doctor(trained, prompt="Once upon a time there was a little girl", steps=6,
                              cache=kvexplore.make_cache("evict", trained, max_seq_len=64, press="vnorm"))
    assert not report.diverged, report.summary()


def test_an_unknown_press_names_the_known_ones(trained):
    with pytest.raises(ValueError, match=r"unknown press 'vnorm'; available: knorm, snapkv, tova, h2o, streaming, "
                                         r"keydiff \(or a Press object\)"):
        kvexplore.make_cache("evict", trained, max_seq_len=64, press="vnorm")
