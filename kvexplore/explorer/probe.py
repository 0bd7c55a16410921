"""The explorer's tracer: a :class:`~kvexplore.Tracer` that also keeps, per lane, the norm of every key and value
written (by layer, KV head and position) and the log-probabilities of the newest token (to compare strategies)."""

from __future__ import annotations

import torch

from ..trace.tracer import Tracer


class LaneTracer(Tracer):
    """Records everything the views draw: cache events and slots, attention of every layer, K/V norms, logits."""

    def __init__(self, num_layers: int, num_kv_heads: int, attention: bool = True) -> None:
        # attention=False: a compiled lane's (its steps run as one graph, which no hook sees inside)
        super().__init__(capture={"cache", "memory", "timing"} | ({"attention"} if attention else set()))
        # (layer, k/v, kv head, position); NaN where nothing was recorded (e.g. before the explorer attached, or
        # past a layer's own kv heads when layers differ: num_kv_heads is the most any layer has)
        self.norms = torch.full((num_layers, 2, num_kv_heads, 0), float("nan"))
        self.last_logprobs: torch.Tensor | None = None
        # linear-attention layers: the norm of each value head's recurrent state, by the sequence length it holds
        self.state_norms: dict[int, dict[int, torch.Tensor]] = {}
        # without a cache every decode step recomputes all rows of attention; only the newest is new, and keeping
        # them all would grow the buffer with the cube of the length. The session sets this after a prefill.
        self.last_row_only = False

    def hook(self, name: str, t: torch.Tensor) -> None:
        # what the views draw is computed on the device here and lands on the host with the rest of the step
        if self._step is not None:
            if name == "logits":
                self.later(t[0, -1].detach().float().log_softmax(-1), self._land_logprobs)
            elif name.endswith(".attn.state"):
                layer, end = int(name.split(".")[1]), self._pos + self._q_len
                self.later(t[0].detach().float().norm(dim=(-2, -1)),
                           lambda h: self.state_norms.setdefault(layer, {}).__setitem__(end, h))
            elif name.endswith((".attn.k_new", ".attn.v_new")):
                layer, which, start = int(name.split(".")[1]), 0 if name.endswith("k_new") else 1, self._pos
                self.later(t[0].detach().float().norm(dim=-1), lambda h: self._record_norms(layer, which, start, h))
            elif self.last_row_only and name.endswith(".attn.probs"):
                return super().hook(name, t[:, :, -1:])  # records the newest row; the model keeps its tensor
        return super().hook(name, t)

    def _land_logprobs(self, logprobs: torch.Tensor) -> None:
        self.last_logprobs = logprobs

    def _record_norms(self, layer: int, which: int, start: int, norms: torch.Tensor) -> None:
        """``norms`` (kv heads, positions from ``start``) of one layer's new keys (0) or values (1)."""
        end = start + norms.shape[1]
        if end > self.norms.shape[-1]:
            grown = torch.full((*self.norms.shape[:-1], max(end, 2 * self.norms.shape[-1], 64)), float("nan"))
            grown[..., : self.norms.shape[-1]] = self.norms
            self.norms = grown
        self.norms[layer, which, : norms.shape[0], start:end] = norms

    def clone(self) -> "LaneTracer":
        """A tracer for a forked lane: the norms so far, its own attention buffer from now on."""
        twin = LaneTracer(self.norms.shape[0], self.norms.shape[2], "attention" in self.capture)
        twin.norms = self.norms.clone()
        twin.state_norms = {layer: dict(by_end) for layer, by_end in self.state_norms.items()}
        return twin

    def state_history(self, layer: int, length: int) -> tuple[list[int], torch.Tensor] | None:
        """The sequence lengths at which ``layer``'s state was recorded (at most ``length``: later ones were
        rewound) and the norm of each value head's state then, ``(steps, heads)``; None for a layer without."""
        by_end = {n: v for n, v in self.state_norms.get(layer, {}).items() if n <= length}
        if not by_end:
            return None
        ends = sorted(by_end)
        return ends, torch.stack([by_end[n] for n in ends])

