"""The gated delta rule, the state update of Qwen3-Next's DeltaNet layers, in two forms with the same result.

Per value head, with ``S`` the ``(key dim, value dim)`` state, ``g_t <= 0`` the log decay and ``beta_t`` in (0, 1),
each token does::

    S_t = exp(g_t) S_{t-1} + k_t u_t^T,   u_t = beta_t (v_t - k_t^T exp(g_t) S_{t-1}),   o_t = q_t^T S_t

:func:`recurrent` runs that token by token (``T`` small steps; what decoding uses). :func:`chunked` gives the same
outputs and final state with matrix products over chunks of :data:`CHUNK` tokens. Inside a chunk that starts from
state ``S_0``, with ``d(t, s) = exp(g_{s+1} + ... + g_t)`` the decay between positions ``s <= t`` (and ``d(t, -1)``
from the chunk's start), unrolling the recurrence gives::

    u_t + sum_{s<t} beta_t d(t, s) (k_t . k_s) u_s = beta_t v_t - beta_t d(t, -1) k_t^T S_0

a unit lower-triangular system ``(I + A) U = beta V - (beta d K) S_0`` solved once per chunk for both right-hand
sides (the WY / UT form), after which ``o_t = d(t, -1) q_t^T S_0 + sum_{s<=t} d(t, s) (q_t . k_s) u_s`` and the state
passed to the next chunk is ``d(C, -1) S_0 + sum_s d(C, s) k_s u_s^T``. Only that last step runs chunk after chunk.

The decays are sums of ``g`` over the positions between ``s`` and ``t`` (cumulative sums along each column and
backwards from the chunk's end), never differences of two running sums: a very negative gate followed by gates near
0 would otherwise lose float32 digits to cancellation. Everything runs in float32.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

CHUNK = 64
# decays below exp(-30) (about 1e-13) count as 0: left to exp, they and their products reach float32's subnormal
# range, whose arithmetic is many times slower on CPUs (random-weight gates get there within a chunk: a 1,024-token
# prefill of benchmarks/deltanet_prefill.py's model spent 1.4 s in the rule, 0.75 s with this floor)
FLOOR = -30.0
# prefills of at least this many tokens run chunked: on one CPU thread chunked costs 1.1x token by token at 4 tokens
# and 0.8x at 6 (benchmarks/deltanet_prefill.py --crossover; decoding, 1 token, stays token by token)
CHUNKED_FROM = 5


def recurrent(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
              state: torch.Tensor, states: list | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Token by token. ``q, k (B, T, H, dk)``, ``v (B, T, H, dv)``, ``g, beta (B, T, H)``, ``state (B, H, dk, dv)``;
    returns the outputs ``(B, T, H, dv)`` and the state after the last token (``states``, a list: every token's state
    is appended to it)."""
    decay = g.exp()
    S, out = state, []
    for t in range(q.shape[1]):
        S = S * decay[:, t, :, None, None]
        predicted = torch.einsum("bhk,bhkv->bhv", k[:, t], S)
        S = S + k[:, t, :, :, None] * (beta[:, t, :, None] * (v[:, t] - predicted))[:, :, None, :]
        out.append(torch.einsum("bhk,bhkv->bhv", q[:, t], S))
        if states is not None:
            states.append(S)
    return torch.stack(out, 1), S


def _in_chunks(x: torch.Tensor, size: int, pad: int) -> torch.Tensor:
    """``(B, T, H, ...)`` -> ``(B, H, chunks, size, ...)``, zero-padded at the end (a zero key, value and beta and a
    zero log decay leave the state as it is)."""
    x = x.transpose(1, 2)
    x = F.pad(x, (0, 0, 0, pad) if x.dim() == 4 else (0, pad))
    return x.reshape(x.shape[0], x.shape[1], -1, size, *x.shape[3:])


def _decay(log: torch.Tensor) -> torch.Tensor:
    return log.masked_fill(log < FLOOR, float("-inf")).exp()


def chunked(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
            state: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The same as :func:`recurrent` (same arguments and results), over chunks of :data:`CHUNK` tokens (one chunk of
    ``T`` tokens when ``T`` is shorter)."""
    B, T, H, dv = v.shape
    size = min(CHUNK, T)
    pad = -T % size
    q, k, v, g, beta = (_in_chunks(x, size, pad) for x in (q, k, v, g, beta))  # (B, H, N, C[, d])
    after = torch.ones(size, size, dtype=torch.bool, device=q.device).tril(-1)  # [t, s]: s < t
    # log d(t, s) = g_{s+1} + ... + g_t: each column s sums the gates after it, down the rows (0 on the diagonal)
    pairwise = _decay(torch.where(after, g[..., :, None], 0.0).cumsum(-2).masked_fill(after.T, float("-inf")))
    from_start = _decay(g.cumsum(-1))  # d(t, -1)
    to_end = _decay(F.pad(g.flip(-1).cumsum(-1).flip(-1)[..., 1:], (0, 1)))  # d(C - 1, s)
    through = from_start[..., -1, None, None]  # d(C - 1, -1), the whole chunk's decay
    kb = k * beta[..., None]
    system = (kb @ k.transpose(-1, -2)) * pairwise  # its strictly lower part is A; the diagonal is not read
    solved = torch.linalg.solve_triangular(system, torch.cat([v * beta[..., None], kb * from_start[..., None]], -1),
                                           upper=False, unitriangular=True)
    new_values, reads = solved[..., :dv], solved[..., dv:]  # U = new_values - reads @ S_0
    inner = (q @ k.transpose(-1, -2)) * pairwise
    q_start, k_end = q * from_start[..., None], k * to_end[..., None]
    S = state.to(torch.float32)
    out = torch.empty_like(new_values)
    for i in range(q.shape[2]):
        u = new_values[:, :, i] - reads[:, :, i] @ S
        out[:, :, i] = q_start[:, :, i] @ S + inner[:, :, i] @ u
        S = S * through[:, :, i] + k_end[:, :, i].transpose(-1, -2) @ u
    return out.reshape(B, H, -1, dv)[:, :, :T].transpose(1, 2), S


def gated_delta_rule(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
                     state: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`chunked` for ``T >= CHUNKED_FROM`` tokens, else :func:`recurrent`."""
    return (chunked if q.shape[1] >= CHUNKED_FROM else recurrent)(q, k, v, g, beta, state)
