"""Notebook 03 (why not disable the cache): the tokens every forward pass feeds without a cache, and the key and value
projections a step without one recomputes."""

from __future__ import annotations

from ..exercise import Exercise
from ..tiny import tiny

PROMPT, STEPS = 8, 24
CONTEXT = 256  # 03.2: the decode step's context


def _fed(kind: str) -> int:
    """Tokens fed by every forward pass of a prefill and STEPS decode steps of the tiny model, through ``kind``."""
    from ...caches.factory import make_cache
    from ...runtime.generator import Generator

    model = tiny()
    gen = Generator(model, make_cache(kind, model, max_seq_len=PROMPT + STEPS + 8))
    records = [gen.prefill(list(range(5, 5 + PROMPT)))] + gen.run(STEPS, stop_at_eos=False)
    return sum(r.input_len for r in records)


def _kv_projections(cached: bool) -> int:
    """Multiply-adds the key and value projections (every layer's k_proj and v_proj) do in one decode step of the
    tiny model at CONTEXT positions: counted by hooks on the projections as the step runs, without a cache (the whole
    sequence fed) or with one (the prefill of the CONTEXT - 1 tokens before it not counted)."""
    import torch

    from ...caches.factory import make_cache
    from ...caches.strategies.none import NoCache

    model = tiny()
    ids = torch.tensor([[5 + t % 1000 for t in range(CONTEXT)]], device=model.device)
    counted = [0]

    def count(module, args, out):
        counted[0] += args[0].shape[:-1].numel() * module.in_features * module.out_features

    with torch.no_grad():
        if cached:
            cache = make_cache("preallocated", model, max_seq_len=CONTEXT)
            model(ids[:, :-1], cache, 0)
            step = (ids[:, -1:], cache, CONTEXT - 1)
        else:
            step = (ids, NoCache(model.config, dtype=model.dtype, device=model.device), 0)
        hooks = [m.register_forward_hook(count) for name, m in model.named_modules()
                 if name.endswith(("k_proj", "v_proj"))]
        try:
            model(*step, last_only=True)
        finally:
            for h in hooks:
                h.remove()
    return counted[0]


def _recomputed() -> int:
    return _kv_projections(cached=False) - _kv_projections(cached=True)


def _by_hand(tokens: int = CONTEXT - 1, layers: int | None = None, heads: int | None = None, tensors: int = 2,
             per_mac: int = 1) -> int:
    c = tiny().config
    layers = c.num_layers if layers is None else layers
    heads = c.num_kv_heads if heads is None else heads
    return tokens * layers * c.hidden_size * tensors * heads * c.head_dim * per_mac


EXERCISES = [
    Exercise("03.1", "number", "The tiny model runs without a cache (NoCache): a prefill of an 8-token prompt, then 24 "
                               "decode steps. How many tokens do all those forward passes feed in total?",
             unit="tokens"),
    Exercise("03.2", "number", "The tiny model takes one decode step at a context of 256 positions: without a cache "
                               "it feeds all 256 tokens, with one only the newest. How many more multiply-adds do the "
                               "key and value projections (k_proj and v_proj, every layer) do without a cache than "
                               "with one?", unit="multiply-adds"),
]
ANSWERS = {"03.1": lambda: _fed("none"), "03.2": _recomputed}
MISTAKES = {"03.1": [
    (lambda: _fed("preallocated"), "that is what a cache feeds: every token once. Without a cache nothing is kept, "
                                   "so every pass feeds the whole sequence so far."),
    (lambda: sum(range(PROMPT + 1, PROMPT + STEPS + 1)), "the prefill is a forward pass too: it feeds the prompt's "
                                                         "tokens."),
    (lambda: (STEPS + 1) * (PROMPT + STEPS), "the sequence grows by one token a step: each pass feeds the sequence "
                                             "as it is then, not as long as it ends."),
    (lambda: sum(range(PROMPT, PROMPT + STEPS + 2)), "the last token generated is never fed: the last pass feeds "
                                                     "the sequence before it."),
], "03.2": [
    (lambda: _by_hand(tokens=CONTEXT), "the step with a cache projects its new token too: the difference is the keys "
                                       "and values of the tokens before it, which the cache kept."),
    (lambda: _by_hand(heads=tiny().config.num_heads), "the tiny model uses grouped-query attention: k_proj and "
                                                      "v_proj each output num_kv_heads x head_dim numbers, not "
                                                      "num_heads x head_dim."),
    (lambda: _by_hand(per_mac=2), "multiply-adds, not FLOPs: a multiply-add counts once here (section 2 counts it "
                                  "as 2 FLOPs)."),
    (lambda: _by_hand(layers=1), "every layer has projections of its own: multiply by the number of layers."),
    (lambda: _by_hand(tensors=1), "keys and values both: k_proj and v_proj are two projections of the same size."),
]}
HINTS = {"03.1": "the prefill feeds the prompt; each decode step without a cache feeds the whole sequence so far, "
                 "one token longer than the step before (record.input_len says it per step). Add them up.",
         "03.2": "a projection of one token is hidden_size x (num_kv_heads x head_dim) multiply-adds; count the tokens "
                 "projected without a cache and with one, for k_proj and v_proj, in every layer, and subtract."}
