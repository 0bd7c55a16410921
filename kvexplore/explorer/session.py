"""Several cache strategies in lockstep on one model, prompt and seed: the state the explorer widget shows.

A :class:`Session` holds one :class:`Lane` per strategy. The first lane is the reference: by default every other lane
is fed its tokens (teacher forcing), so their next-token distributions can be compared step by step; forked lanes run
freely. Every operation succeeds on all lanes or changes none, except that a lane whose cache is full sits out the
steps (:attr:`Lane.full` says why) while the others go on; a step no lane can take is refused as a whole.
"""

from __future__ import annotations

import gc
import math
import time
import weakref
from collections.abc import Sequence
from typing import Any

from ..runtime.generator import Generator
from ..models.model import Model
from ..trace.parting import kl_divergence
from ..trace.records import StepRecord
from ..runtime.sampling import SamplingSettings
from .lane import Lane
from .lanes import COMPILED, LaneSpec, check_strategies, lane_kind, split_options
from . import aligned, checkup, shared_pass
from .probe import LaneTracer
from .recompute import LaneAttention
from .fit import growth_note, slots_for
from . import timing
from ..errors import CacheFullError, RankError, SettingsError, StateError

__all__ = ["COMPILED", "Lane", "Session", "check_strategies"]

IDLE_S = 0.05  # a step that does not follow the last one at once first runs the model once, untimed (Session.step)


class Session:
    def __init__(self, model: Model, strategies: Sequence[str] = ("preallocated",), max_seq_len: int = 256,
                 temperature: float = 0.0, top_k: int | None = None, top_p: float | None = None, seed: int = 0,
                 top_candidates: int = 5, strategy_options: dict[str, dict[str, Any]] | None = None,
                 follow_reference: bool = True, generator: Generator | None = None, hf: Any = None,
                 grow: bool = True) -> None:
        strategies = list(strategies)
        if not strategies:
            raise SettingsError("give at least one strategy, e.g. strategies=('preallocated',)")
        check_strategies(strategies, model, hf)
        if len(set(strategies)) != len(strategies):
            raise SettingsError(f"strategies repeat: {strategies}; give each once (use fork() for a second sequence)")
        options = dict(strategy_options or {})
        bad = [k for k in options if k not in strategies]
        if bad:
            raise SettingsError(f"strategy_options for {bad[0]!r}, which is not among the strategies {strategies}")
        self.model = model  # a kvexplore Model, or (transformers lanes only) the HFModel
        self.hf = hf  # the transformers model the hf:... lanes run (kvexplore.hf.HFModel), if any
        self.max_seq_len = max_seq_len  # the caches' size now (grown for a long prompt, see .fit)
        self.asked_seq_len = max_seq_len  # the size asked for: a prefill that fits in it uses it
        self.grow = grow  # False: a prompt that does not fit is refused by the caches (CacheFullError)
        self.grew = ""  # what the last prefill's growth was, in words ("" when the caches kept the size asked)
        self.strategies = strategies
        self.options = options
        self.seed = seed
        self.top_candidates = top_candidates
        self.sampling = SamplingSettings(temperature, top_k, top_p)
        self.follow_reference = follow_reference
        self.lanes: dict[str, Lane] = {}
        self._steps = 0  # steps taken: the order in which the lanes step rotates with it
        self._active = 0.0  # perf_counter() at the end of the last step
        self.last_op = ""  # the last operation that succeeded: prefill, step, rewind, reset, fork
        self._forks: dict[str, int] = {}  # strategy -> forks of it made since the last prefill or reset
        for strategy in strategies:
            self.lanes[strategy] = self._new_lane(strategy, follows=follow_reference)
        if generator is not None:  # an existing generator becomes the reference lane, as it is
            name = generator.cache.kind
            tracer = generator.tracer if isinstance(generator.tracer, LaneTracer) else self._tracer()
            generator.tracer = tracer
            lane = Lane(name, name, generator, tracer, follows=False)
            self.lanes = {name: lane, **{k: v for k, v in self.lanes.items() if k != name}}
            if generator.history:  # the other strategies are fed its sequence, token for token
                for other in list(self.lanes.values())[1:]:
                    other.generator.prefill(generator.prompt_tokens, force=generator.history[0].token_id)
                    for record in generator.history[1:]:
                        other.generator.step(force=record.token_id)
                    other.forced_at = {r.step for r in other.history}
                    self._trace_options(other)

    # -- lanes -----------------------------------------------------------------------------------------
    @property
    def reference(self) -> Lane:
        return next(iter(self.lanes.values()))

    @property
    def prompt_tokens(self) -> list[int]:
        return self.reference.generator.prompt_tokens

    @property
    def tokens(self) -> list[int]:
        return self.reference.generator.tokens

    def _tracer(self, attention: bool = True) -> LaneTracer:
        c = self.model.config
        return LaneTracer(c.num_layers, max(c.layer_kv_heads(i) for i in range(c.num_layers)), attention)

    def _new_lane(self, strategy: str, follows: bool, slots: int | None = None, reuse: Any = None) -> Lane:
        """A fresh lane of ``strategy`` built by its kind (:mod:`.lanes`), ``slots`` long (default: the session's),
        on what its last build left (``reuse``, :meth:`LaneKind.reusable`)."""
        kind = lane_kind(strategy, self.hf)
        spec = LaneSpec(self.model, self.hf, slots or self.max_seq_len, self.options.get(strategy, {}),
                        self.sampling, self.seed, self.top_candidates, reuse)
        tracer = self._tracer(attention=kind.records_attention)
        generator = kind.build(strategy, spec, tracer)
        # a lane that drafts runs free (a forced step would be a plain step): see .aligned
        return Lane(strategy, strategy, generator, tracer, follows and generator.speculation is None)

    def cache_options(self, strategy: str) -> dict[str, Any]:
        """The options lane ``strategy``'s cache was made with (its drafting options left out)."""
        return split_options(self.options.get(strategy, {}))[0]

    def lane_attention(self, lane: Lane) -> LaneAttention:
        """``lane``'s attention as the views ask for it: its bounded store, and rows recomputed on a zoom when the lane
        runs kvexplore's own model (the snapshot's ``LaneDetail.attention``)."""
        model = self.model if isinstance(self.model, Model) and lane.lane_kind.in_process \
            and not lane.lane_kind.transformers else None
        generator = lane.generator
        return LaneAttention(lane.tracer.store, model, (lambda: generator.tokens) if model is not None else None,
                             lane.cache.kind, self.cache_options(lane.kind))

    @staticmethod
    def _trace_options(lane: Lane) -> None:
        """Set the lane's tracer options its kind asks for, now that it has prefilled."""
        for name, value in lane.lane_kind.trace_options(lane.generator).items():
            setattr(lane.tracer, name, value)

    def set_sampling(self, temperature: float, top_k: int | None = None, top_p: float | None = None) -> None:
        """New sampling settings for every lane, from the next step on (checked first)."""
        self.sampling = settings = SamplingSettings(temperature, top_k, top_p)
        for lane in self.lanes.values():
            lane.generator.sampling = settings

    # -- operations ------------------------------------------------------------------------------------
    def prefill(self, prompt: str | Sequence[int], chat: bool = False, progress: Any = None) -> None:
        """Start every lane on ``prompt`` (text, or ids; ``chat`` wraps text as a user message). Forks are dropped.
        The prompt is checked first (a bad one changes nothing); then the old lanes are let go before the new ones
        are built (the peak is one set of caches), so a failure after that leaves every lane empty. ``progress``, if
        given, is called as ``progress(lane index, lanes, lane name, layer or None, tokens)`` as each lane starts and
        as its pass reaches each layer."""
        if chat:
            tok = self.model.tokenizer
            if tok is None or not tok.chat_template:
                raise SettingsError("this model has no chat template: untick chat and give plain text")
            prompt = tok.encode_chat([{"role": "user", "content": str(prompt)}])
        slots, grew = self._slots_for(prompt)
        # forks end with the sequence they forked from; the old lanes go before the new ones are built, so that the
        # peak holds one set of caches, not two
        plan = [(name, lane.kind, lane.follows) for name, lane in self.lanes.items() if not lane.is_fork]
        tokens = len(self.reference.generator.prompt_ids(prompt)) if progress is not None else 0
        reuse = {name: lane.lane_kind.reusable(lane.generator) if lane.stopped is None and not lane.is_fork else
                 lane.lane_kind.release(lane.generator) for name, lane in self.lanes.items()}
        old = [weakref.ref(lane.cache) for lane in self.lanes.values()]
        self.lanes, self._forks = {}, {}
        if any(ref() is not None for ref in old):  # held in a cycle: freed now, not at a later collection (a full
            gc.collect()  # collection costs a few tenths of a second in a kernel, so only where one is needed)
        fresh: dict[str, Lane] = {}
        shared: list[tuple[shared_pass.Pass, Lane]] = []  # passes the lanes after them may reuse (.shared_pass)
        try:
            for i, (name, strategy, follows) in enumerate(plan):
                new = self._new_lane(strategy, follows, slots, reuse.get(name))
                if progress is not None:
                    progress(i, len(plan), name, None, tokens)
                    new.tracer.on_layer = lambda layer, i=i, name=name: progress(i, len(plan), name, layer, tokens)
                ref = next(iter(fresh.values()), None)
                force = ref.history[0].token_id if (ref is not None and new.follows) else None
                new = shared_pass.prefill_lane(new, prompt, force, shared,
                                               lambda lane: self._new_lane(lane.kind, lane.follows, slots))
                new.tracer.on_layer = None
                if force is not None:
                    new.forced_at.add(0)
                self._trace_options(new)
                fresh[name] = new
        except BaseException:  # past the prompt's checks (out of memory, say): every lane, empty, as after reset
            self.lanes = {name: self._new_lane(strategy, follows, slots) for name, strategy, follows in plan}
            raise
        self.lanes = fresh
        self.max_seq_len, self.grew = slots, grew
        self._compare_last()
        self.last_op = "prefill"
        self._active = time.perf_counter()

    def _slots_for(self, prompt: str | Sequence[int]) -> tuple[int, str]:
        """The caches' size for ``prompt`` and the note saying they grew (:mod:`.fit`); checks the prompt."""
        generator = self.reference.generator
        n = len(generator.prompt_ids(prompt))
        if not self.grow:
            return self.asked_seq_len, ""
        slots = slots_for(n, self.asked_seq_len, generator.executor.config.max_position_embeddings)
        return slots, growth_note(n, self.asked_seq_len, slots)

    def step(self) -> dict[str, StepRecord]:
        """One token on every lane (with a lane that drafts: one verification on it and as many tokens on every
        other lane, :mod:`.aligned`); if any lane fails, the lanes that stepped take their step back exactly
        (:meth:`Generator.undo_step`) and the error is raised."""
        ref = self.reference
        if not ref.generator.tokens:
            raise StateError("nothing to continue: enter a prompt and prefill first")
        full = self._full_lanes()  # the checks a step makes before writing, on every lane first
        stopped = {lane.name: lane.stopped for lane in self.lanes.values() if lane.stopped is not None}
        pace = self.pace
        if len(full) + len(stopped) == len(self.lanes) or (full and pace is not None):  # (drafting: all in step)
            raise next(iter({**full, **stopped}.values()))
        full_or_stopped = {**full, **stopped}
        done: list[tuple[Lane, int]] = []
        out = {}
        try:
            with timing.quiet():  # the kernel's output sent, no garbage collection while the lanes are timed
                if time.perf_counter() - self._active >= IDLE_S:
                    timing.warm_up(self.model)
                if pace is not None:
                    out = aligned.step(self, pace, [lane for lane in self.step_order() if lane is not pace], done)
                else:
                    context = list(ref.generator.tokens)  # what a follower must hold to be fed the reference's token
                    for lane in self.step_order():
                        if lane.name in full_or_stopped:
                            continue
                        forced = (lane.follows and lane is not ref and ref.name not in full_or_stopped
                                  and lane.generator.tokens == context)
                        force = ref.history[-1].token_id if forced else None
                        try:
                            out[lane.name] = lane.generator.step(force=force, keep_undo=True)
                        except RankError as e:  # a rank died or hung (within the lane's bound): it sits out
                            lane.stopped = full_or_stopped[lane.name] = e
                            continue
                        done.append((lane, len(lane.history) - 1))
                        if force is not None:
                            lane.forced_at.add(out[lane.name].step)
        except BaseException:  # unexpected (the checks passed): undo exactly what the other lanes did
            for lane, before in reversed(done):
                aligned.take_back(lane, before)
            raise
        for lane, _ in done:
            lane.generator.settle()
        for name, error in full.items():
            self.lanes[name].full = error
        aligned.settle_rows(self.lanes.values())
        self._compare_last({lane.name for lane, _ in done})
        self._checkups()
        self.last_op = "step"
        self._steps += 1
        self._active = time.perf_counter()
        return {name: out[name] for name in self.lanes if name in out}

    def _full_lanes(self) -> dict[str, CacheFullError]:
        """Each lane whose cache cannot take the next step, and why (other refusals raise: the caller's to fix)."""
        full = {}
        for lane in self.lanes.values():
            if lane.stopped is not None:
                continue
            try:
                lane.generator.check_step()
            except CacheFullError as e:
                full[lane.name] = e
        return full

    def _checkups(self) -> None:
        """The doctor's check on each lane that drafts, after a verification that took positions back (up to
        :data:`~.checkup.AUTO_TOKENS` tokens; longer, :meth:`checkup` runs it on demand)."""
        for lane in self.lanes.values():
            spec = lane.speculation
            if spec is None or not spec.verifications or not self._checkable(lane):
                continue
            v = spec.verifications[-1]
            if v.rolled_back and v.index not in lane.checkups and len(lane.generator.tokens) <= checkup.AUTO_TOKENS:
                lane.checkups[v.index] = checkup.safely(lane.generator.model, lane.generator, v.index)

    def _checkable(self, lane: Lane) -> bool:
        """The doctor checks kvexplore's own model and caches (not a transformers lane); a lane's own model (a zoo bug's
        lane may run a twin of the session's)."""
        return isinstance(lane.generator.model, Model) and lane.lane_kind.in_process and not lane.lane_kind.transformers

    @property
    def pace(self) -> Lane | None:
        """The lane whose verification sets how many tokens a Step gives (None: no lane drafts; see .aligned)."""
        return aligned.pace_lane(self.lanes.values())

    def checkup(self, name: str | None = None) -> "checkup.Checkup":
        """Run the doctor's check on lane ``name``'s cache now (default: the first lane that drafts)."""
        lane = self.lanes[name] if name is not None else self.pace
        if lane is None or not self._checkable(lane):
            raise StateError("the doctor's check runs on a kvexplore lane: pick one (and prefill first)")
        if not lane.history:
            raise StateError("nothing to check yet: prefill first")
        spec = lane.speculation
        index = spec.verifications[-1].index if spec is not None and spec.verifications else -1
        lane.checkups[index] = checkup.check(lane.generator.model, lane.generator, index)  # an error raises, not kept
        return lane.checkups[index]

    def step_order(self) -> list[Lane]:
        """The order the lanes take the next step in: the reference first (the others may be fed its token), then
        the others in an order that rotates every step, so no lane is always the one timed first or last."""
        ref, others = self.reference, [lane for lane in self.lanes.values() if lane is not self.reference]
        k = self._steps % len(others) if others else 0
        return [ref, *others[k:], *others[:k]]

    def rewind(self, n: int = 1) -> None:
        """Forget the last ``n`` tokens on every lane (all checked before any moves; a full lane steps again)."""
        for lane in self.lanes.values():
            lane.generator.check_rewind(n)
        for lane in self.lanes.values():
            lane.generator.rewind(n)
            lane.forget_after(len(lane.history))
            if n:
                lane.full = None
        if n:
            self.last_op = "rewind"

    def runs(self) -> dict[str, list[StepRecord]]:
        """Each lane's records, for the lanes that have any (what the replay page shows)."""
        return {name: lane.history for name, lane in self.lanes.items() if lane.history}

    def reset(self) -> None:
        """Empty every lane (forks are dropped; a lane whose rank stopped is started again)."""
        self.lanes = {name: lane for name, lane in self.lanes.items() if not lane.is_fork}
        self._forks = {}
        for name, lane in self.lanes.items():
            if lane.stopped is not None:
                lane.lane_kind.release(lane.generator)
                self.lanes[name] = self._new_lane(lane.kind, lane.follows)
        for lane in self.lanes.values():
            lane.generator.reset()
            lane.forget_after(0)
            lane.full = None
        self.last_op = "reset"

    def fork(self, name: str | None = None) -> Lane:
        """A new free-running lane continuing the sequence of lane ``name`` (default: the reference) with the
        cache's ``fork()`` (the paged cache shares its pages until the two diverge)."""
        src = self.lanes[name] if name is not None else self.reference
        twin = src.lane_kind.fork(src.generator)
        twin.tracer = tracer = src.tracer.clone()
        count = self._forks[src.kind] = self._forks.get(src.kind, 0) + 1
        lane = Lane(f"{src.kind} fork {count}", src.kind, twin, tracer, follows=False,
                    kl_at=dict(src.kl_at), top1_at=dict(src.top1_at), forced_at=set(src.forced_at), fork_of=src.name)
        self.lanes[lane.name] = lane
        self.last_op = "fork"
        return lane

    def close(self) -> None:
        """Let go of what the lanes hold outside this process (the ranks of a lane over several processes stop)."""
        for lane in self.lanes.values():
            lane.lane_kind.release(lane.generator)

    # -- comparison ------------------------------------------------------------------------------------
    def _compare_last(self, stepped: set[str] | None = None) -> None:
        """Each lane's last step against the reference's, where both took it (``stepped``: the lanes that did; by
        default all) on the same context."""
        ref = self.reference
        p_log = ref.tracer.last_logprobs
        context = ref.generator.tokens[:-1]  # what the reference's last step read
        for lane in self.lanes.values():
            q_log = lane.tracer.last_logprobs
            if lane is ref or p_log is None or q_log is None or not lane.history:
                continue
            if stepped is not None and not {lane.name, ref.name} <= stepped:
                continue
            step = lane.last.step
            if lane.generator.tokens[:-1] != context:
                if not lane.follows:
                    lane.forget_after(step)  # a fork that took another path answers a different context
                continue
            kl = kl_divergence(p_log, q_log)  # the gap .parting's rule reads (views.divergence: KL_PARTS)
            lane.kl_at[step] = kl if math.isfinite(kl) else None  # (a token the lane rules out: KL is infinite)
            lane.top1_at[step] = lane.last.top[0].token_id == ref.last.top[0].token_id

    def __repr__(self) -> str:
        lanes = ", ".join(f"{n}: {len(l.history)} tokens" for n, l in self.lanes.items())
        return f"Session({lanes})"
