"""Qwen3-Next: gated DeltaNet layers whose cache is a fixed-size state, between gated full-attention layers.

Against transformers 5.24 (random weights, float32, within 2e-4: transformers' own chunked prefill and recurrent
decode differ by about 1e-5 here), with A_log and dt_bias spread so the decay matters.
"""

import re

import pytest
import torch

import kvexplore
from helpers import greedy_tokens_match, make_checkpoint

TOL = 2e-4


@pytest.fixture(scope="module")
def qwen3_next(tmp_path_factory):
    folder = tmp_path_factory.mktemp("qwen3-next")
    ref = make_checkpoint(folder, "qwen3_next", layers=4)
    with torch.no_grad():  # decays from fast to slow, and dt offsets, so the state's memory matters
        for name, p in ref.named_parameters():
            if name.endswith("A_log"):
                p.uniform_(-3, 1.3)
            elif name.endswith("dt_bias"):
                p.normal_()
    ref.save_pretrained(folder)
    return folder, ref


def ids_for(n=40):
    return torch.randint(3, 300, (n,), generator=torch.Generator().manual_seed(1)).tolist()


def stepped(model, kind, ids, prefill=5):
    cache = kvexplore.make_cache(kind, model, 512)
    if kind == "none":
        return torch.cat([model(torch.tensor([ids[:prefill]]), cache, 0)[0]] + [
            model(torch.tensor([ids[:end]]), cache, 0)[0, -1:] for end in range(prefill + 1, len(ids) + 1)]), cache
    out = [model(torch.tensor([ids[:prefill]]), cache, 0)[0]]
    for pos in range(prefill, len(ids)):
        out.append(model(torch.tensor([[ids[pos]]]), cache, pos)[0])
    return torch.cat(out), cache


def test_prefill_and_decode_match_transformers(qwen3_next):
    folder, ref = qwen3_next
    model = kvexplore.load(folder)
    assert [s.kind for s in kvexplore.make_cache("preallocated", model, 8).plan] == ["state", "full"] * 2
    ids = ids_for()
    with torch.no_grad():
        want = ref(torch.tensor([ids])).logits[0].float()
    for kind in ("preallocated", "concat", "paged", "none"):
        got, _ = stepped(model, kind, ids)
        assert (got - want).abs().max().item() < TOL, kind


@pytest.mark.long  # 64 tokens against transformers
def test_64_greedy_tokens_match_transformers(qwen3_next):
    folder, ref = qwen3_next
    model = kvexplore.load(folder)
    greedy_tokens_match(model, ref)


@pytest.mark.long  # 400 tokens
def test_the_recurrent_layers_hold_the_same_bytes_after_8_and_400_tokens(qwen3_next):
    model = kvexplore.load(qwen3_next[0])
    c = model.config
    gen = kvexplore.Generator(model, kvexplore.make_cache("preallocated", model, 512))
    gen.prefill(ids_for(8))
    first = gen.history[-1].memory
    gen.run(392, stop_at_eos=False)
    last = gen.history[-1].memory
    state = (c.conv_channels * (c.conv_kernel - 1) + c.linear_value_heads * c.linear_key_dim * c.linear_value_dim) * 4
    assert state == c.state_bytes() == 3200
    for a, b in zip(first.per_layer(), last.per_layer()):
        if a.kind == "state":
            assert (a.logical_bytes == b.logical_bytes == a.reserved_bytes == b.reserved_bytes == a.analytic_bytes
                    == state)
        else:  # a full layer: one more position's keys and values a step
            per_pos = 2 * c.num_kv_heads * c.head_dim * 4
            assert (a.logical_bytes, b.logical_bytes) == (8 * per_pos, 400 * per_pos)
    assert [t.data_ptr() for t in gen.cache.inspect.storage(0)] == [t.data_ptr() for t in gen.cache.states.read(0)]


def test_rewind_recomputes_fork_copies_and_a_failed_pass_restores_the_state(qwen3_next):
    from helpers import FailingTracer

    model = kvexplore.load(qwen3_next[0])
    gen = kvexplore.Generator(model, kvexplore.make_cache("preallocated", model, 64))
    gen.prefill(ids_for(6))
    gen.run(10, stop_at_eos=False)
    cache = gen.cache
    with pytest.raises(ValueError, match="linear-attention layers keep one state"):
        cache.truncate(8)
    kept = gen.tokens[:-4]
    gen.rewind(4)  # the state cannot go back: one pass over the kept tokens rebuilds it
    fresh = kvexplore.Generator(model, kvexplore.make_cache("preallocated", model, 64))
    fresh.prefill(kept)
    got, want = gen.step(), fresh.history[-1]
    assert got.token_id == want.token_id
    twin = gen.fork()
    before = [t.clone() for t in gen.cache.inspect.storage(0)]
    twin.step()
    assert all(torch.equal(a, b) for a, b in zip(gen.cache.inspect.storage(0), before))  # the fork has its own state
    with pytest.raises(RuntimeError, match="boom"):
        model(torch.tensor([[5]]), gen.cache, gen.cache.length, tracer=FailingTracer("layers.3.attn.q"))
    # layer 0 wrote, then rolled back
    assert all(torch.equal(a, b) for a, b in zip(gen.cache.inspect.storage(0), before))


def test_the_explorer_draws_the_state_as_a_fixed_block(qwen3_next):
    ex = kvexplore.Explorer(str(qwen3_next[0]), strategies=("preallocated", "paged"), max_seq_len=64)
    ex.run(5)
    ex.view = "memory"
    memory = ex.specs()["memory"]
    state = [t for t in memory.traces if t.get("name") == "state layers logical"][0]
    assert len(set(state["y"])) == 1 and state["y"][0] == 2 * 3200  # flat: two state layers of 3200 B
    cache_map = ex.specs()["cache_map"]
    notes = [a["text"] for a in cache_map.layout["annotations"]]
    assert notes.count("a fixed state of 3200 B (recurrent 4x16x8), rewritten each step") == 2  # rows 0 and 2
    import numpy as np

    heat = cache_map.trace("slots")
    z, rows = np.asarray(heat["z"]), np.asarray(heat["y"])
    assert set(rows.tolist()) == {0, 1, 2, 3}  # every layer has its row (no neighbour stretched over a state row)
    assert np.isnan(z[rows == 0]).all() and np.isnan(z[rows == 2]).all() and not np.isnan(z[rows == 1]).any()
    ex.view = "tensors"
    tensors = ex.specs()["tensors"]
    assert (tensors.layout["title"]["text"].startswith("recurrent state · layer 0")
            and tensors.traces[0]["z"].size == 4 * 5)
    ex.rewind(2)  # recomputed; the state drawn is the one of the kept steps
    assert ex.error == "" and ex.specs()["tensors"].traces[0]["z"].size == 4 * 3


def test_states_answer_for_the_linear_attention_layers_only(qwen3_next):
    """``cache.states`` reads the state layers; any other layer is refused naming the layers that have one."""
    folder, _ = qwen3_next
    model = kvexplore.load(folder)
    cache = kvexplore.make_cache("preallocated", model, 16)
    model(torch.tensor([ids_for(6)]), cache, 0)
    recurrent = [s.index for s in cache.plan if s.recurrent]
    full = next(s.index for s in cache.plan if not s.recurrent)
    conv, state = cache.states.read(recurrent[0])
    assert [t.data_ptr() for t in cache.inspect.storage(recurrent[0])] == [conv.data_ptr(), state.data_ptr()]
    msg = f"layer {full} is not a linear-attention layer; it has no state (those that do: {recurrent})"
    with pytest.raises(kvexplore.SettingsError, match=re.escape(msg)):
        cache.states.read(full)
