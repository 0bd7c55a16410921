"""What the two storages of the ``evict`` cache share: keeping the recent queries and the accumulated attention a press
reads, running the press when the plan says so, and re-rotating the kept keys.

A subclass stores the keys (:class:`~.compact.CompactLayer`: each head's kept keys packed at the front of its storage;
:class:`~.masked.MaskedLayer`: every position where it was written, the evicted ones hidden) and gives the press its
held slots (:meth:`PressedLayer.held_slots`) and applies what was kept (:meth:`PressedLayer.keep`)."""

from __future__ import annotations

from typing import Any

import torch

from ..layer import FullLayer, Groups, Step
from ..presses import Observation, attention, per_kv_head, select
from .pressplan import PressPlan
from ...core import host

ROWS = 256  # query rows per chunk when the prompt's attention is accumulated (H2O)


class PressedLayer(FullLayer):
    """A full layer of the ``evict`` cache (see the module docstring). ``rot`` (in the subclass's slots): the position
    each stored key is rotated at (its own position, unless re-rotated)."""

    _held_names = {"pos": "positions", "rot": "positions", "read": "positions read", "scores": "press scores",
                  "scored_kept": "press scores", "acc": "press scores", "queries": "recent queries",
                  "query_pos": "recent queries", "visible": "masks", "mask": "masks", "plan": "press plan"}

    def __init__(self, spec, batch_size: int, dtype: torch.dtype, device: torch.device, plan: PressPlan,
                 config) -> None:
        super().__init__(spec, batch_size, dtype, device)
        self.plan = plan
        self.scale, self.softcap = config.attention_scale(spec.index), config.attn_logit_softcapping
        self.layer_type = config.layer_types[spec.index]
        self.queries: torch.Tensor | None = None  # (B, nh, W, hd) the last W queries
        self.query_pos: torch.Tensor | None = None  # (W,)
        self.acc: torch.Tensor | None = None  # (B, H, slots) float32 attention received (when the press accumulates)
        self.scores: torch.Tensor | None = None  # (H, length) the last press's scores by position, on the host
        self.scored_kept: torch.Tensor | None = None  # (H, length) what that press kept
        self._q_new: torch.Tensor | None = None

    # -- what subclasses provide ----------------------------------------------------------------------------
    def held_slots(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """``(keys, values, valid, positions, rot)`` over the slots in use, ``(B, H, S, ...)``."""
        raise NotImplementedError

    def keep(self, step: Step, keep: torch.Tensor, rot: torch.Tensor) -> None:
        """Keep only the slots ``keep`` ``(B, H, S)``, whose keys are now rotated at ``rot``."""
        raise NotImplementedError

    def _resize_acc(self, slots: int) -> None:
        raise NotImplementedError

    # -- the step -------------------------------------------------------------------------------------------
    def begin(self, step: Step) -> None:
        self.plan.begin(step)
        step.journal.remember(self._restore_press,
                              (self.queries, self.query_pos, self.acc, self.scores, self.scored_kept))
        self._q_new = None
        if step.pos == 0:  # a new sequence
            self.restart()

    def restart(self) -> None:
        """Forget what the presses of the previous sequence read and scored."""
        self.queries = self.query_pos = self.acc = self.scores = self.scored_kept = None

    def _restore_press(self, saved: tuple) -> None:
        self.queries, self.query_pos, self.acc, self.scores, self.scored_kept = saved

    def note_queries(self, q: torch.Tensor) -> None:
        """This step's queries ``(B, nh, T, hd)`` (after RoPE), for the press."""
        self._q_new = q

    def commit(self, step: Step) -> None:
        new, plan = self._q_new, self.plan
        if new is not None and plan.queries:
            new_pos = torch.arange(step.pos, step.end, device=new.device)
            q, qp = new, new_pos
            if self.queries is not None and self.query_pos is not None and step.pos > 0:
                q = torch.cat([self.queries[:, :, self.query_pos < step.pos], q], 2)
                qp = torch.cat([self.query_pos[self.query_pos < step.pos], qp])
            self.queries, self.query_pos = q[:, :, -plan.kept_queries:].clone(), qp[-plan.kept_queries:]
            if plan.press.accumulates:
                self._accumulate(new, new_pos)
        self._q_new = None
        decision = plan.decide(step)
        if decision is not None:
            self.press(step, decision[1][plan.slot(self.spec.index)])

    def _accumulate(self, q: torch.Tensor, q_pos: torch.Tensor) -> None:
        """Add the attention the new queries give every held key (summed over rows and each group's heads)."""
        k, _, valid, pos, _ = self.held_slots()
        self._resize_acc(k.shape[2])
        total = torch.zeros(valid.shape, dtype=torch.float32, device=k.device)
        for r in range(0, q.shape[2], ROWS):
            probs = attention(q[:, :, r:r + ROWS], q_pos[r:r + ROWS], k, pos, valid, self.scale, self.softcap,
                              self.plan.sink_logits(self.spec.index))
            total += per_kv_head(probs.sum(2), k.shape[1])
        acc = self.acc.clone()
        acc[:, :, :k.shape[2]] += total
        self.acc = acc

    def press(self, step: Step, n_kept: int) -> None:
        """Score the held keys and keep the best ``n_kept`` per head (on average, for adaptive heads)."""
        k, v, valid, pos, rot = self.held_slots()
        plan = self.plan
        W = plan.press.queries  # the window it reads (the layer keeps more, for a rewind within decode_every)
        obs = Observation(self.spec.index, k, v, valid, pos, self.queries[:, :, -W:] if W else None,
                          self.query_pos[-W:] if W else None,
                          None if self.acc is None else self.acc[:, :, :k.shape[2]], self.scale, self.softcap,
                          step.end, n_kept, plan.sink_logits(self.spec.index))
        scores = plan.press.score(obs)
        if int(self.head_counts().max()) <= n_kept and plan.budget.heads != "adaptive":  # the layer keeps all it holds
            self._note_scores(scores, valid, pos, valid, step.end)
            return
        # chosen in position order (slots may not be: a press while decoding fills holes in place), so of equal
        # scores the earliest position is kept and re-rotation ranks by position
        order = torch.sort(pos.masked_fill(~valid, torch.iinfo(pos.dtype).max), dim=-1, stable=True).indices
        chosen = select(scores.gather(-1, order), valid.gather(-1, order), n_kept, plan.budget.heads,
                        plan.budget.alpha)
        keep = torch.zeros_like(valid).scatter(-1, order, chosen)
        if plan.rerotate:  # contiguous positions ending at the last one written: rank among the kept, per head
            rank = torch.zeros_like(pos).scatter(-1, order, chosen.long().cumsum(-1) - 1)
            rot = torch.where(keep, step.end - keep.long().sum(-1, keepdim=True) + rank, rot)
        self._note_scores(scores, keep, pos, valid, step.end)
        self.keep(step, keep, rot)

    def _note_scores(self, scores, keep, pos, valid, length: int) -> None:
        """The press's scores and choice by position (the first sequence's), kept on the host for the views."""
        H = scores.shape[1]
        by_pos = torch.full((H, length), float("nan"))
        kept = torch.zeros((H, length), dtype=torch.bool)
        p, ok = pos[0].cpu(), valid[0].cpu()
        s, kk = scores[0].float().cpu(), keep[0].cpu()
        for h in range(H):
            by_pos[h, p[h][ok[h]]] = s[h][ok[h]]
            kept[h, p[h][ok[h]]] = kk[h][ok[h]]
        self.scores, self.scored_kept = by_pos, kept

    def turn(self, k: torch.Tensor, old: torch.Tensor, new: torch.Tensor) -> torch.Tensor:
        """``k`` ``(B, H, S, w)`` rotated at ``old`` turned to ``new`` (RoPE composes: a turn by ``new - old``)."""
        rotary = self.plan.rotary
        if rotary is None:
            from ...errors import SettingsError

            raise SettingsError("re-rotating kept keys needs the model's rotary embedding, attached when the model "
                                "runs a step with this cache (model(ids, cache, pos))")
        return rotary.turn(k, new - old, self.layer_type)

    # -- inspection -------------------------------------------------------------------------------------------
    def kept(self, batch: int = 0) -> list[list[int]]:
        """The positions each KV head holds, sorted."""
        _, _, valid, pos, _ = self.held_slots()
        p, ok = pos[batch].cpu(), valid[batch].cpu()
        return [sorted(p[h][ok[h]].tolist()) for h in range(p.shape[0])]

    def rope_positions(self, batch: int = 0) -> list[list[int]]:
        """The position each held key is rotated at, per KV head, in the order of :meth:`kept`."""
        _, _, valid, pos, rot = self.held_slots()
        p, r, ok = pos[batch].cpu(), rot[batch].cpu(), valid[batch].cpu()
        return [r[h][ok[h]][p[h][ok[h]].argsort()].tolist() for h in range(p.shape[0])]

    def head_counts(self) -> torch.Tensor:
        """``(B, H)`` positions each head holds, on the host (a layer that knows them there reads nothing from the
        device: the memory report asks every step)."""
        (counts,) = host.fetch([self.held_slots()[2].sum(-1)])
        return counts

    def head_totals(self) -> tuple[int, int]:
        """(positions held over every batch row and head, the most one head holds): the memory report's figures."""
        counts = self.head_counts()
        return int(counts.sum()), int(counts.max())

    def _held(self, length: int) -> int:
        return self.head_totals()[1] if length else 0

    def overhead_slots(self) -> int:
        """Slots of storage (over every batch row and head) that hold no kept position: a compacting layer's
        headroom and the padding of heads that keep fewer than the most; a masked layer's evicted and free ones."""
        B, H, S = self.k.shape[:3]
        return B * H * S - self.head_totals()[0]

    def _held_positions(self, length: int) -> list[int]:
        return sorted({p for head in self.kept() for p in head})

    def _used_bytes(self, length: int) -> int:
        """Bytes of the keys and values held, each head's own count (heads may hold different counts): also the
        formula ``Σ over heads of held positions × (key width + value width) × element size``."""
        return self.head_totals()[0] * sum(self._widths) * self._dtype.itemsize

    _analytic_bytes = _used_bytes

    def _truncate_error(self, n: int, length: int) -> str | None:
        """Why the layer cannot go back to ``n`` positions: a press evicted positions before ``n``; or, with presses
        to come while decoding, what the next one reads cannot be taken back to ``n`` (H2O's sums include the
        dropped tokens' queries; a window of recent queries lost those before ``n``)."""
        plan = self.plan
        horizon, press = plan.horizon, plan.press
        if n == 0:  # a new sequence: nothing evicted is needed
            return None
        if n < horizon:
            return (f"cannot truncate to {n}: the press at length {horizon} evicted positions before it; truncate to "
                    f"{horizon} or later")
        if n >= length or plan.decode_every is None:
            return None
        if press.accumulates:
            return (f"cannot truncate to {n}: {press.name} sums the attention of every query so far, those of "
                    f"positions {n}..{length - 1} included, and cannot take them back before its next press; "
                    f"truncate to {length}, or to 0 for a new sequence")
        if press.queries and self.query_pos is not None:
            have = int((self.query_pos < n).sum())
            if have < min(press.queries, n):
                first = int(self.query_pos.min()) + press.queries
                return (f"cannot truncate to {n}: {press.name} reads the last {press.queries} queries and only {have} "
                        f"of those before position {n} are kept; truncate to {first} or later")
        return None

    def read_positions_by_head(self, length: int, batch: int = 0) -> list[list[int]]:
        """For each KV head, the position in each key column the last step's attention read (-1: none)."""
        return [self._read_positions(length)] * self.spec.kv_heads

    def groups(self) -> Groups:
        # each layer reads its own kept positions, under a mask of its own; no view serves two
        i = self.spec.index
        return Groups(("pressed", i), (self.spec.kind, i), ("pressed", i))

    def describe(self, count: int, strategy: str, config) -> str:
        plan = self.plan
        how = "re-rotated" if plan.rerotate else "original positions"
        return f"{count} full layer{'s' * (count != 1)}: {strategy} ({plan.press.name}, {how})"

    def _copy_press_state(self, twin: "PressedLayer", memo: dict[int, Any]) -> None:
        plan = memo.get(id(self.plan))
        if plan is None:
            plan = memo[id(self.plan)] = self.plan.copy()
        twin.plan = plan
        twin.acc = None if self.acc is None else self.acc.clone()
