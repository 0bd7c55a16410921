"""What the speculative-decoding tests share: the architectures and cache kinds they cross, a draft model that
agrees with its target often but not always, prompts on which prompt lookup both hits and misses, and a reference
for the cache a verification leaves (the same kind of cache fed only what each verification kept)."""

from __future__ import annotations

import copy

import torch

import kvexplore
from kvexplore.caches.layers.quantized_layer import QuantizedLayer
from kvexplore.caches.layers.ring import RingLayer
from kvexplore.caches.layers.shared import SharedLayer
from kvexplore.caches.layout import PagedLayout
from kvexplore.caches.slots import FILLED, SHARED
from kvexplore.speculation.drafters import PromptLookup

# every architecture kvexplore implements, small (zoo.load(arch, **options)): plain GQA, sliding rings (window 8),
# shared layers and rings, attention sinks and rings, latent (MLA), latent and sparse (V3.2), recurrent states
ARCHS = {"llama": ("llama", dict(heads=4, kv_heads=2)), "gemma3": ("gemma3", dict(layers=3)),
         "gemma4": ("gemma4", {}), "gptoss": ("gpt_oss", dict(layers=2)), "deepseek": ("deepseek_v3", {}),
         "deepseek32": ("deepseek_v32", {}), "qwen3next": ("qwen3_next", dict(layers=4))}

# every cache kind, sized so a draft of a few tokens crosses what each must take back: a page boundary every 4
# positions, a quantized flush every 4 (residual 4, groups of 4), a sink window of 8 that evicts, a press after
# the prompt (the evict cache refuses presses while drafting)
KINDS = {"preallocated": dict(max_seq_len=128), "concat": {}, "none": {},
         "paged": dict(max_seq_len=128, block_size=4), "quantized": dict(max_seq_len=128, group_size=4, residual=4),
         "sink": dict(window=8, sinks=2), "evict": dict(max_seq_len=128, press="knorm", compression_ratio=0.5)}
N = 16  # tokens per run
# the pairs a cache kind refuses (the word its error gives): the greedy test asserts the refusal, the others skip
REFUSED = {("deepseek", "quantized"): "latent", ("deepseek", "evict"): "latent",
           ("deepseek32", "quantized"): "latent", ("deepseek32", "evict"): "latent"}


def load(zoo, name: str):
    arch, options = ARCHS[name]
    return zoo.load(arch, **options)


def perturbed(model, noise: float = 0.05):
    """A separate draft model on ``model``'s vocabulary and tokenizer: a copy of it with every weight moved by
    ``noise`` of its spread, so its greedy tokens agree with the target's often but not always (a random-weight
    model's first layers, or another random model, almost never agree)."""
    twin = copy.deepcopy(model)
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for p in twin.parameters():
            if p.numel() > 1:
                p.add_(torch.randn(p.shape, generator=g) * noise * p.std().clamp_min(1e-3))
    return twin


def draft_model(zoo, name: str, noise: float = 0.05):
    """:func:`perturbed` of the architecture ``name``'s test model, built once per session."""
    return zoo.get(("speculative draft", name, noise), lambda: perturbed(load(zoo, name), noise))


def make(model, kind: str, **options):
    return kvexplore.make_cache(kind, model, **{**KINDS[kind], **options})


def greedy(model, cache, prompt: list[int], n: int, **generator_options) -> kvexplore.Generator:
    gen = kvexplore.Generator(model, cache, **generator_options)
    gen.prefill(prompt)
    gen.run(n, stop_at_eos=False)
    return gen


def lookup_counts(tokens: list[int], prompt_len: int, k: int) -> tuple[int, int]:
    """(drafts accepted, verifications with a rejection) prompt lookup gets on a greedy sequence: greedy drafting
    gives the same tokens, so what it accepts is worked out from the tokens alone."""
    lookup, i, accepted, rejected = PromptLookup(), prompt_len + 1, 0, 0
    while i < len(tokens):
        draft = lookup.propose(tokens[:i], k, None, None).tokens[:len(tokens) - i]
        m = 0
        while m < len(draft) and draft[m] == tokens[i + m]:
            m += 1
        accepted, rejected, i = accepted + m, rejected + (m < len(draft)), i + m + 1
    return accepted, rejected


def candidate_prompts(model, seed: int) -> list[list[int]]:
    """Prompts with repetition where prompt lookup drafts at once: a passage, the model's own greedy continuation of
    it, the passage again and the continuation's first tokens (quoting); a token run; a triple repeated."""
    g = torch.Generator().manual_seed(seed)
    passage = [1, *torch.randint(3, 300, (6,), generator=g).tolist()]
    cont = greedy(model, make(model, "preallocated"), passage, 9).generated_tokens
    t = int(torch.randint(3, 300, (), generator=g))
    return [passage + cont + passage[1:] + cont[:2], [1] + [t] * 10, [1, 7, 8, 9] + [t, t + 1, t + 2] * 4]


def lookup_prompt(zoo, name: str, n: int, k: int = 4) -> list[int]:
    """A repetitive prompt on which prompt lookup, drafting ``k``, gets both acceptances and rejections within
    ``n`` plain greedy tokens of ``name`` (the first of a fixed list that does), found once per session."""

    def find():
        model = load(zoo, name)
        best = (-1, -1, None)
        for seed in range(3):
            for prompt in candidate_prompts(model, seed):
                gen = greedy(model, make(model, "preallocated"), prompt, n)
                accepted, rejected = lookup_counts(gen.tokens, len(prompt), k)
                if accepted and rejected:
                    return prompt
                best = max(best, (accepted, rejected, prompt))
        return best[2]

    return zoo.get(("speculative prompt", name, n, k), find)


# -- what a cache holds, layer by layer, in a form two caches compare -----------------------------------------------

def layer_state(layer, length: int) -> dict[str, object]:
    """What one layer holds for a sequence of ``length``: the keys and values of each held position (by position,
    whatever slot or page holds it), a quantized layer's codes, scales and residual, a recurrent state."""
    if isinstance(layer, SharedLayer):
        return {}
    if callable(getattr(layer, "held_slots", None)):  # an evict layer: each KV head its own positions
        k, v, valid, pos, rot = layer.held_slots()
        out = {}
        for h in range(k.shape[1]):
            order = pos[0, h][valid[0, h]].argsort()
            sel = valid[0, h].nonzero().flatten()[order]
            out[f"head{h}"] = (pos[0, h, sel].tolist(), rot[0, h, sel].tolist(), k[0, h, sel], v[0, h, sel])
        return out
    if isinstance(layer, QuantizedLayer):
        q, G = layer.qf, layer.group_size
        return {"qf": q, "codes": (layer.kq[..., :q, :], layer.vq[..., :q, :]),
                "scales": (layer.ks[..., :q // G, :], layer.kz[..., :q // G, :], layer.vs[..., :q, :],
                           layer.vz[..., :q, :]),
                "residual": (layer.rk[..., :length - q, :], layer.rv[..., :length - q, :])}
    if layer.spec.recurrent:
        conv, recurrent = layer.read_state()
        return {"conv": conv, "recurrent": recurrent}
    view = layer.positions(length).slots()
    storage = layer.storage()
    if not storage:
        return {}
    k, v = storage
    if isinstance(view.layout, PagedLayout):  # (pages, heads, block, width) -> one row per slot, page-major
        k, v = (t.permute(0, 2, 1, 3).reshape(-1, *t.shape[1:2], t.shape[-1]) for t in (k, v))
        rows = lambda t, s: t[s]  # noqa: E731
    else:  # (batch, heads, slots, width)
        rows = lambda t, s: t[0, :, s]  # noqa: E731
    # a ring keeps the positions the next query reads (the last window - 1): a draft that was truncated may have
    # overwritten an older one, which no query reads again
    oldest = length - layer.slots.window + 1 if isinstance(layer, RingLayer) else 0
    held = sorted((p, s) for s, (p, st) in enumerate(zip(view.positions, view.states))
                  if st in (FILLED, SHARED) and p >= oldest)
    return {"positions": [p for p, _ in held],
            "kv": [(rows(k, s), rows(v, s)) for _, s in held]}


def cache_state(cache) -> list[dict[str, object]]:
    return [layer_state(layer, cache.length) for layer in cache.layers]


def differences(a, b, atol: float = 0.0) -> list[str]:
    """Where two :func:`cache_state` results differ (tensors bit for bit with ``atol=0``); empty when equal."""
    out: list[str] = []

    def walk(x, y, where):
        if isinstance(x, torch.Tensor):
            if x.shape != y.shape or x.dtype != y.dtype:
                out.append(f"{where}: shape/dtype {tuple(x.shape)} {x.dtype} vs {tuple(y.shape)} {y.dtype}")
            elif not (torch.equal(x, y) if atol == 0 else torch.allclose(x.double(), y.double(), rtol=0, atol=atol)):
                out.append(f"{where}: max diff {(x.double() - y.double()).abs().max().item():.3g}")
        elif isinstance(x, dict):
            if x.keys() != y.keys():
                out.append(f"{where}: keys {sorted(x)} vs {sorted(y)}")
            for key in x.keys() & y.keys():
                walk(x[key], y[key], f"{where}.{key}")
        elif isinstance(x, (list, tuple)) and x and isinstance(x[0], (torch.Tensor, list, tuple, dict)):
            if len(x) != len(y):
                out.append(f"{where}: {len(x)} vs {len(y)} entries")
            for i, (xi, yi) in enumerate(zip(x, y)):
                walk(xi, yi, f"{where}[{i}]")
        elif x != y:
            out.append(f"{where}: {x} vs {y}")

    walk(a, b, "cache")
    return out
