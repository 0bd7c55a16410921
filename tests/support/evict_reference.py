"""An independent reference for the ``evict`` cache, written from the papers, not from kvexplore/caches/presses.

Everything here starts from what the model computes (its queries and keys after RoPE, captured with a tracer) and
recomputes with plain loops:

- :func:`simulate`: the score each press gives each KV head's held positions at each press of a run, following
  the held sets and the rotations step by step (KNorm, SnapKV, TOVA, H2O, StreamingLLM, KeyDiff, each from its
  paper), the rotation each held key has (``positions="rerotate"``: contiguous ``L - n .. L - 1`` after a press at
  length ``L``) and H2O's accumulated attention;
- :func:`recompute`: the logits of the whole sequence in one pass with no cache, every pressed layer's attention
  scores computed here (per KV head, over the keys that head held when the query ran, each at its rotation);
- :func:`turn`: RoPE's rotate-half turn, from the model's frequency table.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch
from helpers import no_cache_logits



def turn(x: torch.Tensor, delta: torch.Tensor, inv_freq: torch.Tensor) -> torch.Tensor:
    """``x`` ``(..., S, hd)`` rotated by ``delta`` ``(S,)`` more positions (rotate half, first ``2 len(inv_freq)``
    channels turn)."""
    rot = 2 * inv_freq.shape[0]
    ang = delta.double().unsqueeze(-1) * inv_freq.double()  # (S, rot/2)
    cos, sin = torch.cat([ang.cos(), ang.cos()], -1), torch.cat([ang.sin(), ang.sin()], -1)
    head, tail = x[..., :rot].double(), x[..., rot:]
    half = rot // 2
    rotated = torch.cat([-head[..., half:], head[..., :half]], -1)
    return torch.cat([(head * cos + rotated * sin).to(x.dtype), tail], -1)


class Recorder:
    """A tracer recording each layer's queries and keys (after RoPE) of every pass, first sequence."""

    def __init__(self) -> None:
        self.q: dict[int, list[torch.Tensor]] = {}
        self.k: dict[int, list[torch.Tensor]] = {}

    def hook(self, name: str, t: torch.Tensor):
        parts = name.split(".")
        if len(parts) == 4 and parts[2] == "attn" and parts[3] in ("q", "k_new"):
            store = self.q if parts[3] == "q" else self.k
            store.setdefault(int(parts[1]), []).append(t[0].detach().float().clone())
        return None

    def wants_attention(self, layer: int) -> bool:
        return False

    def queries(self, layer: int) -> torch.Tensor:  # (nh, positions, hd)
        return torch.cat(self.q[layer], 1)

    def keys(self, layer: int) -> torch.Tensor:  # (H, positions, hd)
        return torch.cat(self.k[layer], 1)


@dataclass
class Run:
    """A run of the evict cache step by step: ``steps`` (pos, q_len), and after each step the cache's kept
    positions, rotations, press count and last press scores per pressed layer."""

    logits: torch.Tensor
    steps: list[tuple[int, int]]
    kept: list[dict[int, list[list[int]]]]
    rope: list[dict[int, list[list[int]]]]
    events: list[int]  # press count after each step
    presses: list  # the cache's PressEvents at the end
    scores: list[dict[int, tuple[torch.Tensor, torch.Tensor] | None]]
    rec: Recorder
    layers: list[int]
    cache: object = None


def run(model, cache, ids: torch.Tensor, prompt: int, chunks: list[int] | None = None) -> Run:
    """Feed ``ids`` (1, N): the prompt, then ``chunks`` tokens at a time (1 each by default)."""
    rec, layers = Recorder(), list(cache.full_layers)
    sizes = [prompt] + (chunks or [1] * (ids.shape[1] - prompt))
    out = Run(torch.empty(0), [], [], [], [], [], [], rec, layers, cache)
    logits, pos = [], 0
    for n in sizes:
        logits.append(model(ids[:, pos:pos + n], cache, pos, tracer=rec))
        out.steps.append((pos, n))
        out.kept.append({i: cache.eviction.kept_positions(i) for i in layers})
        out.rope.append({i: cache.eviction.rope_positions(i) for i in layers})
        out.events.append(len(cache.eviction.press_events))
        out.scores.append({i: cache.eviction.press_scores(i) for i in layers})
        pos += n
    out.logits = torch.cat(logits, 1)
    out.presses = cache.eviction.press_events
    return out


# -- the presses, from the papers ----------------------------------------------------------------------------

def attention_rows(q: torch.Tensor, q_pos: list[int], keys: torch.Tensor, k_pos: list[int], scale: float,
                   softcap: float | None, sink: float | None = None) -> torch.Tensor:
    """Softmax ``(rows, S)`` of queries ``q`` ``(rows, hd)`` at ``q_pos`` over one head's ``keys`` ``(S, hd)`` at
    ``k_pos``, causal (a key after the query reads 0); a learned ``sink`` logit (gpt-oss) takes its share of each
    row's softmax and reads nothing."""
    s = torch.einsum("td,sd->ts", q.double(), keys.double()) * scale
    if softcap is not None:
        s = torch.tanh(s / softcap) * softcap
    allowed = torch.tensor(k_pos).view(1, -1) <= torch.tensor(q_pos).view(-1, 1)
    s = s.masked_fill(~allowed, -math.inf)
    if sink is not None:
        return torch.cat([s, torch.full((s.shape[0], 1), sink, dtype=s.dtype)], 1).softmax(-1)[:, :-1]
    return s.softmax(-1).nan_to_num(0.0)


def sinks_of(model, layer: int) -> list[float | None]:
    """The learned sink logit of each query head of ``layer`` (None for each when the model has none)."""
    attn = model.model.layers[layer].self_attn
    return attn.sinks.tolist() if getattr(attn, "has_sinks", False) else [None] * model.config.num_heads


def pool(x: list[float], kernel: int, how: str) -> list[float]:
    """Pooling over ``kernel`` neighbours, centred, stride 1 (max: the edges see fewer; avg: zero padded)."""
    r, n = kernel // 2, len(x)
    if how == "max":
        return [max(x[max(0, i - r):i + r + 1]) for i in range(n)]
    return [sum(x[max(0, i - r):i + r + 1]) / kernel for i in range(n)]


@dataclass
class Held:
    """One layer's held keys in the reference: per KV head the positions and the rotation of each."""

    positions: list[list[int]]
    rot: list[dict[int, int]]
    acc: list[dict[int, float]] = field(default_factory=list)


def stored(keys: torch.Tensor, h: int, positions: list[int], rot: dict[int, int], inv_freq) -> torch.Tensor:
    """Head ``h``'s stored keys at ``positions``: the model's key turned from its position to its rotation."""
    k = keys[h, positions]
    delta = torch.tensor([rot[p] - p for p in positions], dtype=torch.float64)
    return turn(k, delta, inv_freq) if bool((delta != 0).any()) else k


def press_scores(press: str, opts: dict, keys_h: list[torch.Tensor], pos_h: list[list[int]], queries: torch.Tensor,
                 q_pos: list[int], acc_h: list[dict[int, float]], length: int, n_kept: int, scale: float,
                 softcap: float | None, sinks: list[float | None]) -> list[list[float]]:
    """Each KV head's score of each held position (in ``pos_h``'s order), from the papers."""
    H = len(keys_h)
    nh = queries.shape[0]
    g = nh // H
    if press == "knorm":  # Devoto et al. 2024: low key norm, high attention
        return [(-k.double().norm(dim=-1)).tolist() for k in keys_h]
    if press == "keydiff":  # Park et al. 2025: -cos to the mean of the normalised keys
        out = []
        for k in keys_h:
            unit = k.double() / k.double().norm(dim=-1, keepdim=True)
            anchor = unit.mean(0)
            out.append((-(unit @ anchor) / anchor.norm()).tolist())
        return out
    if press == "streaming":  # Xiao et al. 2024: sinks and the most recent
        sinks = opts.get("sinks", 4)
        return [[math.inf if p < sinks else float(p) for p in ps] for ps in pos_h]
    if press == "tova":  # Oren et al. 2024: the last query's attention, averaged over every query head
        per_q = [attention_rows(queries[qh, -1:], q_pos[-1:], keys_h[qh // g], pos_h[qh // g], scale, softcap,
                                sinks[qh])[0] for qh in range(nh)]
        return [(sum(per_q) / nh).tolist() for _ in range(H)] if all(p == pos_h[0] for p in pos_h) else \
            [_tova_by_position(per_q, pos_h, h, g) for h in range(H)]
    if press == "h2o":  # Zhang et al. 2023: accumulated attention, recent share kept
        recent = int(n_kept * opts.get("recent_ratio", 0.5))
        return [[math.inf if p >= length - recent else acc_h[h][p] for p in pos_h[h]] for h in range(H)]
    if press == "snapkv":  # Li et al. 2024: the window's votes for the keys before it, pooled, group-summed
        W, kernel, how = opts.get("window", 32), opts.get("kernel", 5), opts.get("pooling", "avg")
        qw, pw = queries[:, -W:], q_pos[-W:]
        out = []
        for h in range(H):
            before = [i for i, p in enumerate(pos_h[h]) if p < length - len(pw)]  # held keys before the window
            total = [0.0] * len(before)
            for qh in range(h * g, (h + 1) * g):
                vote = attention_rows(qw[qh], pw, keys_h[h], pos_h[h], scale, softcap, sinks[qh]).sum(0).tolist()
                total = [a + b for a, b in zip(total, pool([vote[i] for i in before], kernel, how))]
            out.append(total + [math.inf] * (len(pos_h[h]) - len(before)))
        return out
    raise ValueError(press)


def _tova_by_position(per_q, pos_h, h, g):
    """TOVA when heads hold different positions: the mean over every query head of the attention on a position,
    a head that does not hold it giving 0."""
    nh = len(per_q)
    return [sum(float(per_q[qh][pos_h[qh // g].index(p)]) for qh in range(nh) if p in pos_h[qh // g]) / nh
            for p in pos_h[h]]


@dataclass
class PressCheck:
    """One press of one layer: the reference scores by position and the cache's, and the cache's kept set."""

    layer: int
    length: int
    want: dict[int, dict[int, float]]  # head -> position -> score
    got: torch.Tensor  # (H, length) NaN where not held
    kept: torch.Tensor  # (H, length) bool
    n_kept: int


def simulate(model, r: Run, press: str, opts: dict | None = None, rerotate: bool = False) -> list[PressCheck]:
    """Follow the run step by step: the held keys (the cache's kept sets after each press), their rotations and
    H2O's accumulated attention, the reference scores at each press."""
    opts = opts or {}
    cfg = model.config
    inv = model.rotary.inv_freq.cpu()
    checks: list[PressCheck] = []
    held: dict[int, Held] = {}
    for l in r.layers:
        H = r.rec.keys(l).shape[0]
        held[l] = Held([[] for _ in range(H)], [{} for _ in range(H)], [{} for _ in range(H)])
    presses = 0
    for s, (pos, n) in enumerate(r.steps):
        new = list(range(pos, pos + n))
        pressed = r.events[s] > presses
        presses = r.events[s]
        for l in r.layers:
            keys, queries = r.rec.keys(l), r.rec.queries(l)
            H, nh = keys.shape[0], queries.shape[0]
            g = nh // H
            hl, scale, sinks = held[l], cfg.attention_scale(l), sinks_of(model, l)
            for h in range(H):
                hl.positions[h] = [p for p in hl.positions[h] if p < pos] + new
                hl.rot[h].update({p: p for p in new})
            keys_h = [stored(keys, h, hl.positions[h], hl.rot[h], inv) for h in range(H)]
            if press == "h2o":  # every query of the step over what its head holds now, summed over the group
                for h in range(H):
                    for p in new:
                        hl.acc[h].setdefault(p, 0.0)
                    for qh in range(h * g, (h + 1) * g):
                        a = attention_rows(queries[qh, pos:pos + n], new, keys_h[h], hl.positions[h], scale,
                                           cfg.attn_logit_softcapping, sinks[qh]).sum(0)
                        for p, x in zip(hl.positions[h], a.tolist()):
                            hl.acc[h][p] += x
            if not pressed:
                continue
            end = pos + n
            got, kept = r.scores[s][l]
            kept_now = r.kept[s][l]
            n_kept = r.presses[presses - 1].kept[r.layers.index(l)]
            W = {"snapkv": opts.get("window", 32), "tova": 1, "h2o": 1}.get(press, 1)
            qp = list(range(max(0, end - W), end))
            sc = press_scores(press, opts, keys_h, hl.positions, queries[:, qp], qp, hl.acc, end, n_kept, scale,
                              cfg.attn_logit_softcapping, sinks)
            want = {h: dict(zip(hl.positions[h], sc[h])) for h in range(H)}
            checks.append(PressCheck(l, end, want, got, kept, n_kept))
            for h in range(H):  # continue from the cache's choice (near-ties may break either way)
                hl.positions[h] = list(kept_now[h])
                if rerotate:
                    m = len(kept_now[h])
                    hl.rot[h] = {p: end - m + i for i, p in enumerate(kept_now[h])}
                hl.acc[h] = {p: hl.acc[h].get(p, 0.0) for p in kept_now[h]}
    return checks


def expected_rotations(r: Run, rerotate: bool) -> list[dict[int, list[dict[int, int]]]]:
    """After each step, per pressed layer and KV head, the rotation of each held position by the rule: its own
    position, or after a press at length ``L`` keeping ``n``: ``L - n + rank``."""
    out, rot, presses = [], {l: None for l in r.layers}, 0
    for s, (pos, n) in enumerate(r.steps):
        pressed, presses = r.events[s] > presses, r.events[s]
        now = {}
        for l in r.layers:
            kept = r.kept[s][l]
            if rot[l] is None:
                rot[l] = [{} for _ in kept]
            for h, ps in enumerate(kept):
                rot[l][h] = {p: rot[l][h].get(p, p) if p < pos else p for p in ps}
                if pressed and rerotate:
                    rot[l][h] = {p: pos + n - len(ps) + i for i, p in enumerate(ps)}
            now[l] = [dict(d) for d in rot[l]]
        out.append(now)
    return out


# -- decoding after eviction, recomputed ------------------------------------------------------------------------

class Restrict:
    """A tracer that computes every pressed layer's attention scores itself: query ``t`` of KV head ``h`` reads the
    positions ``allowed[l][h][t]`` (a dict position -> rotation), each key turned from its position to that rotation.
    A layer that reads a pressed layer's cache (Gemma 4's shared layers, ``readers``: layer -> source) reads the
    source's keys under the source's restriction."""

    def __init__(self, model, allowed: dict[int, list[list[dict[int, int]]]], readers: dict[int, int]) -> None:
        self.cfg, self.readers = model.config, {**{l: l for l in allowed}, **readers}
        self.allowed = {l: allowed[src] for l, src in self.readers.items()}
        self.inv = model.rotary.inv_freq.cpu()
        self.q: dict[int, torch.Tensor] = {}
        self.k: dict[int, torch.Tensor] = {}

    def wants_attention(self, layer: int) -> bool:
        return layer in self.allowed

    def hook(self, name: str, t: torch.Tensor):
        parts = name.split(".")
        if len(parts) != 4 or int(parts[1]) not in self.allowed:
            return None
        l, what = int(parts[1]), parts[3]
        if what == "q":
            self.q[l] = t
        elif what == "k_new":
            self.k[l] = t
        elif what == "scores":
            return self._scores(l, t)
        return None

    def _scores(self, l: int, like: torch.Tensor) -> torch.Tensor:
        q, k = self.q[l][0].double(), self.k[self.readers[l]][0].double()  # (nh, T, hd), (H, T, hd)
        nh, T, _ = q.shape
        H = k.shape[0]
        g, scale, cap = nh // H, self.cfg.attention_scale(l), self.cfg.attn_logit_softcapping
        out = torch.full((1, nh, T, T), -math.inf, dtype=torch.float64)
        for h in range(H):
            for t in range(T):
                rot = self.allowed[l][h][t]
                ps = sorted(rot)
                delta = torch.tensor([rot[p] - p for p in ps], dtype=torch.float64)
                kk = turn(k[h, ps], delta, self.inv)
                s = q[h * g:(h + 1) * g, t] @ kk.T * scale
                if cap is not None:
                    s = torch.tanh(s / cap) * cap
                out[0, h * g:(h + 1) * g, t, ps] = s
        return out.to(like.dtype)


def recompute(model, ids: torch.Tensor, r: Run, rotations: list[dict[int, list[dict[int, int]]]]) -> torch.Tensor:
    """The logits of the whole run in one pass with no cache: query ``t`` (run in step ``s``) of KV head ``h``
    reads what the head held after step ``s - 1`` at its rotation then, and the step's own positions up to ``t``."""
    N = ids.shape[1]
    allowed: dict[int, list[list[dict[int, int]]]] = {}
    for l in r.layers:
        H = len(r.kept[0][l])
        rows: list[list[dict[int, int]]] = [[{} for _ in range(N)] for _ in range(H)]
        for s, (pos, n) in enumerate(r.steps):
            before = rotations[s - 1][l] if s else [{} for _ in range(H)]
            for h in range(H):
                for t in range(pos, pos + n):
                    rows[h][t] = {**before[h], **{p: p for p in range(pos, t + 1)}}
        allowed[l] = rows
    from kvexplore.config.layer_plan import layer_plan

    readers = {s.index: s.source for s in layer_plan(model.config) if s.shares and s.source in allowed}
    return no_cache_logits(model, ids, tracer=Restrict(model, allowed, readers), batched=True)
