"""The chunked gated delta rule equals the token-by-token one (outputs and final state within 1e-5, float32), from a
zero or a given state, at lengths around the chunk size and at the gates' and betas' extremes; a Qwen3-Next model
prefilling in chunks matches transformers and its own token-by-token prefill, also when a prefill continues one."""

import pytest
import torch
import torch.nn.functional as F

import kvexplore
from kvexplore.models import delta_rule
from kvexplore.models.delta_rule import CHUNK, chunked, recurrent
from test_parity_state import qwen3_next  # noqa: F401  (the fixture: a checkpoint whose decays matter)

TOL = 1e-5
B, H, DK, DV = 2, 3, 32, 16


def inputs(T, seed=0, state=True, g=None, beta=None, k=None):
    gen = torch.Generator().manual_seed(seed)
    q = F.normalize(torch.randn(B, T, H, DK, generator=gen), dim=-1) * DK ** -0.5
    k = F.normalize(torch.randn(B, T, H, DK, generator=gen), dim=-1) if k is None else k
    v = torch.randn(B, T, H, DV, generator=gen)
    g = -torch.rand(B, T, H, generator=gen) * 3 if g is None else g
    beta = torch.rand(B, T, H, generator=gen) if beta is None else beta
    S = torch.randn(B, H, DK, DV, generator=gen) if state else torch.zeros(B, H, DK, DV)
    return q, k, v, g, beta, S


def errors(args):
    (o1, s1), (o2, s2) = recurrent(*args), chunked(*args)
    assert o2.shape == o1.shape == args[2].shape and s2.shape == s1.shape == args[5].shape
    return (o1 - o2).abs().max().item(), (s1 - s2).abs().max().item()


@pytest.mark.parametrize("state", [False, True], ids=["zero-state", "given-state"])
@pytest.mark.parametrize("T", [1, CHUNK - 1, CHUNK, CHUNK + 1, 200])
def test_chunked_equals_token_by_token(T, state):
    args = inputs(T, seed=T, state=state)
    before = args[5].clone()
    out, S = errors(args)
    assert out < TOL and S < TOL, (out, S)
    assert torch.equal(args[5], before)  # the given state is not changed in place


def extreme(name, T=200):
    gen = torch.Generator().manual_seed(7)
    shape = (B, T, H)
    if name == "no-decay":  # g = 0: the pure delta rule, the state never forgets
        return inputs(T, g=torch.zeros(shape))
    if name == "full-forget":  # exp(g) underflows to 0: each token starts from an empty state
        return inputs(T, g=torch.full(shape, -1e4))
    if name == "spike-then-slow":  # a huge negative gate among gates near 0 (cancellation in running sums)
        g = -torch.rand(shape, generator=gen) * 1e-3
        g[:, 5::CHUNK] = -1e3
        return inputs(T, g=g)
    if name == "beta-0":  # sigmoid(-40): nothing is written, the state only decays
        return inputs(T, beta=torch.sigmoid(torch.full(shape, -40.0)))
    if name == "beta-1-no-decay":  # sigmoid(40) = 1: each token overwrites what its key reads
        return inputs(T, beta=torch.sigmoid(torch.full(shape, 40.0)), g=torch.zeros(shape))
    # the same key for every token, beta 1, no decay: the triangular system is all ones below the diagonal
    key = F.normalize(torch.randn(B, 1, H, DK, generator=gen), dim=-1).expand(B, T, H, DK)
    return inputs(T, beta=torch.ones(shape), g=torch.zeros(shape), k=key)


@pytest.mark.parametrize("name", ["no-decay", "full-forget", "spike-then-slow", "beta-0", "beta-1-no-decay",
                                  "one-key"])
def test_chunked_equals_token_by_token_at_the_extremes(name):
    args = extreme(name)
    out, S = errors(args)
    assert out < TOL and S < TOL, (out, S)
    if name == "beta-0":  # only decayed: the state is the given one times the product of the gates
        want = args[5] * args[3].sum(1).exp()[..., None, None]
        assert (chunked(*args)[1] - want).abs().max().item() < TOL


def test_the_layer_chooses_by_length(monkeypatch):
    calls = []
    for name in ("recurrent", "chunked"):
        real = getattr(delta_rule, name)
        monkeypatch.setattr(delta_rule, name, lambda *a, _n=name, _f=real: calls.append(_n) or _f(*a))
    for T in (1, delta_rule.CHUNKED_FROM - 1, delta_rule.CHUNKED_FROM, 200):
        delta_rule.gated_delta_rule(*inputs(T))
    assert calls == ["recurrent", "recurrent", "chunked", "chunked"]


# --- in a model: Qwen3-Next prefilling in chunks --------------------------------------------------------------------

class States:
    """A tracer that keeps each DeltaNet layer's ``attn.state`` (and ``attn.out``)."""

    def __init__(self):
        self.tensors = {}

    def hook(self, name, t):
        if name.endswith((".attn.state", ".attn.out")):
            self.tensors[name] = t.clone()

    def wants_attention(self, layer):
        return False


def prefill(model, ids, splits, chunked_from, monkeypatch):
    """Logits of ``ids`` prefilled in pieces ending at ``splits``, the cache and the traced states."""
    monkeypatch.setattr(delta_rule, "CHUNKED_FROM", chunked_from)
    cache, tracer, out, start = kvexplore.make_cache("preallocated", model, 256), States(), [], 0
    for end in [*splits, len(ids)]:
        out.append(model(torch.tensor([ids[start:end]]), cache, start, tracer=tracer)[0])
        start = end
    return torch.cat(out), cache, tracer.tensors


@pytest.mark.parametrize("splits", [(), (30,)], ids=["one-prefill", "a-prefill-that-continues"])
def test_a_chunked_prefill_matches_transformers_and_the_token_by_token_prefill(qwen3_next, splits, monkeypatch):
    folder, ref = qwen3_next
    model = kvexplore.load(folder)
    ids = torch.randint(3, 300, (150,), generator=torch.Generator().manual_seed(3)).tolist()
    with torch.no_grad():
        want = ref(torch.tensor([ids])).logits[0].float()
        fast, cache, traced = prefill(model, ids, splits, 1, monkeypatch)
        slow, slow_cache, slow_traced = prefill(model, ids, splits, 10 ** 9, monkeypatch)
    assert (fast - want).abs().max().item() < 2e-4
    assert (fast - slow).abs().max().item() < 1e-4
    layers = [i for i, s in enumerate(cache.plan) if s.kind == "state"]
    assert layers == [0, 2]
    for i in layers:  # layer 0 has the same input both ways; later ones carry the rounding of those before
        tol = TOL if i == 0 else 1e-4
        (conv, state), (slow_conv, slow_state) = cache.states.read(i), slow_cache.states.read(i)
        assert (conv - slow_conv).abs().max().item() < tol and (state - slow_state).abs().max().item() < tol
        assert torch.equal(traced[f"layers.{i}.attn.state"], state)  # the hook point: the state after the step
        out, slow_out = traced[f"layers.{i}.attn.out"], slow_traced[f"layers.{i}.attn.out"]
        assert out.shape == (1, len(ids) - (splits or (0,))[-1], model.config.hidden_size)
        assert (out - slow_out).abs().max().item() < tol
