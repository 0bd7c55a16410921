"""Property tests: any chunking of a sequence through the cache, with rewinds, gives the no-cache logits;
the sampling filters keep exactly the tokens they promise."""

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from kvexplore import PreallocatedCache
from kvexplore.runtime.sampling import SamplingSettings, filtered_probs
from helpers import no_cache_logits

IDS = list(range(3, 43))


@settings(max_examples=25, deadline=None)
@given(data=st.data())
def test_any_chunking_and_rewinds_match_the_no_cache_reference(tiny, data):
    want = no_cache_logits(tiny, IDS)
    cache = PreallocatedCache(tiny.config, len(IDS))
    got = torch.empty_like(want)
    while cache.length < len(IDS):
        pos = cache.length
        n = data.draw(st.integers(1, len(IDS) - pos), label="chunk")
        got[pos:pos + n] = tiny(torch.tensor([IDS[pos:pos + n]]), cache, pos)[0]
        if data.draw(st.booleans(), label="rewind"):
            cache.truncate(data.draw(st.integers(0, cache.length), label="to"))
    assert (got - want).abs().max() < 1e-4


@settings(max_examples=200, deadline=None)
@given(logits=st.lists(st.floats(-20, 20), min_size=2, max_size=50), k=st.integers(1, 60),
       p=st.floats(0.01, 0.99), temperature=st.floats(0.1, 3.0))
def test_top_k_and_top_p_filters(logits, k, p, temperature):
    logits = torch.tensor(logits)
    probs = filtered_probs(logits, SamplingSettings(temperature, top_k=k, top_p=p))
    assert abs(probs.sum().item() - 1) < 1e-5
    kept = probs > 0
    assert 1 <= kept.sum() <= k
    tempered = filtered_probs(logits, SamplingSettings(temperature))
    assert tempered[kept].max() == tempered.max()  # the most likely token always survives
    base = filtered_probs(logits, SamplingSettings(temperature, top_k=k))
    order = base.argsort(descending=True, stable=True)
    mass_before = base[order].cumsum(0) - base[order]
    assert torch.equal(kept[order], (mass_before < p) & (base[order] > 0))


def test_top_p_of_one_keeps_everything():
    logits = torch.tensor([0.0, 3.0, -30.0])
    probs = filtered_probs(logits, SamplingSettings(1.0, top_p=1.0))
    assert torch.equal(probs, logits.softmax(-1))
