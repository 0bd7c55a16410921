"""A serving engine's KV event stream replayed: :class:`KVEventReplay` is fed batches as they come, keeps each cache
(rank, medium, group) as it is now and gives one frame per batch; sequence numbers are checked per rank for gaps,
repeats and restarts (docs/prefix.md)."""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, replace
from typing import Any

from ...errors import SettingsError
from .frame_maker import FrameMaker, capped, describe
from . import dialects
from .schema import DEFAULT_MEDIUM, Batch, Cleared, Hash, Removed, Stored, decode_msgpack, decode_payload, read_batch
from .state import CacheState, HashNames
from ..frames import PoolFrame
from ..result import count

Key = tuple[int, str, int]  # (data-parallel rank, medium, KV cache group)


@dataclass(frozen=True)
class Received:
    """One batch as it was fed: its sequence number, the rank it is of, and what came before it."""

    seq: int
    rank: int
    batch: Batch
    gap: tuple[int, int] | None = None  # the sequence numbers missing just before it (first, last)
    restart: bool = False               # the publisher started over at 0


@dataclass
class RankStats:
    batches: int = 0
    first_seq: int = 0
    last_seq: int = 0
    events: int = 0
    gaps: int = 0
    lost: int = 0      # batches missing in the gaps
    restarts: int = 0


class KVEventReplay:
    """The prefix caches of a serving engine, as its KV cache events tell them. ``keep_history=False`` keeps only
    the caches as they are now and the counts (a long recording's replay, whose batches are in its file): no
    frames then. ``engine``: whose events it is fed (``"vllm"``, ``"sglang"``, ``"lmcache"``, ``"dynamo"``,
    ``"mooncake"``: docs/engine-events.md), unless :meth:`feed` says; ``block_size``: the engine's, for an engine
    whose events do not carry it (Dynamo)."""

    def __init__(self, keep_history: bool = True, engine: str | None = None, block_size: int | None = None) -> None:
        self.engine = dialects.engine_name(engine) or dialects.VLLM
        self.context = dialects.Context(block_size)  # what the engine's dialect keeps between batches
        self.history: list[Received] = []      # every batch fed, all ranks, in the order they came
        self.keep_history = keep_history
        self.names = HashNames()
        self.duplicates = 0                    # batches skipped because their sequence number was seen already
        self.notes: list[str] = []             # about the stream (the subscriber's replay requests, ...)
        self.stats: dict[int, RankStats] = {}  # rank -> its counts
        self._states: dict[Key, CacheState] = {}

    # feeding ---------------------------------------------------------------------------------------------------
    def feed(self, batch: bytes | dict | list | Batch, seq: int | None = None, rank: int | None = None,
             where: str | None = None, engine: str | None = None) -> bool:
        """Apply one batch: a msgpack payload, a decoded batch (map or array form) or a :class:`Batch`. ``seq``: its
        sequence number (None: the one the batch carries, as Dynamo's event_id, else the next one); ``rank``: the
        data-parallel rank when the batch does not say (the socket it came from); ``engine``: whose schema it is in
        (None: the replay's). Returns False for a duplicate (a sequence number this rank has had), which is skipped;
        a bad batch raises :class:`~kvexplore.prefix.events.schema.KVEventFormatError` and changes nothing."""
        label = where or f"batch {sum(st.batches for st in self.stats.values()) + self.duplicates}"
        engine = dialects.engine_name(engine) or self.engine
        if isinstance(batch, Batch):
            pass
        elif engine == dialects.VLLM:
            batch = decode_payload(bytes(batch), label) if isinstance(batch, (bytes, bytearray, memoryview)) \
                else read_batch(batch, label, text_hashes=True)
        else:
            obj = decode_msgpack(bytes(batch), label) if isinstance(batch, (bytes, bytearray, memoryview)) else batch
            batch, carried = dialects.read(engine, obj, label, self.context)
            seq = carried if seq is None else seq
        r = batch.rank if batch.rank is not None else (rank or 0)
        last = self.last_seq(r)
        seq = (0 if last is None else last + 1) if seq is None else seq
        gap, restart = None, False
        if last is not None:
            if seq == 0 and last > 0:
                restart = True
            elif seq <= last:
                self.duplicates += 1
                return False
            elif seq > last + 1:
                gap = (last + 1, seq - 1)
        rec = Received(seq, r, batch, gap, restart)
        st = self.stats.setdefault(r, RankStats(first_seq=seq))
        st.batches, st.last_seq, st.events = st.batches + 1, seq, st.events + len(batch.events)
        st.gaps, st.lost, st.restarts = st.gaps + bool(gap), st.lost + (gap[1] - gap[0] + 1 if gap else 0), \
            st.restarts + restart
        if self.keep_history:
            self.history.append(rec)
        states = {k[1:]: s for k, s in self._states.items() if k[0] == r}
        apply(rec, states, st.batches, create=True)
        self._states.update({(r, *k): s for k, s in states.items()})
        return True

    def feed_all(self, batches: Iterable[Any]) -> KVEventReplay:
        """Feed batches in order (their sequence numbers: one after another per rank); returns self."""
        for b in batches:
            self.feed(b)
        return self

    def last_seq(self, rank: int = 0) -> int | None:
        """The last sequence number applied for ``rank`` (None: none yet)."""
        st = self.stats.get(rank)
        return None if st is None else st.last_seq

    # reading ---------------------------------------------------------------------------------------------------
    def caches(self) -> list[Key]:
        """Every cache the stream touched: ``(rank, medium, group)``, sorted."""
        return sorted(self._states)

    def ranks(self) -> list[int]:
        return sorted(self.stats)

    def state(self, rank: int | None = None, medium: str | None = None, group: int | None = None) -> CacheState:
        """One cache as it is now (``.blocks``: hash -> Block, ``.slots``, ``.totals``, ``.depth()``)."""
        return self._states.get(self._pick(rank, medium, group)) or CacheState()

    def stored(self, rank: int | None = None, medium: str | None = None, group: int | None = None
               ) -> dict[Hash, tuple[int, ...]]:
        """The blocks one cache holds now: hash (as the engine sent it) -> its token ids."""
        return {h: b.tokens for h, b in self.state(rank, medium, group).blocks.items()}

    def full_hash(self, name: str) -> Hash | None:
        """The hash (bytes or int) a short name in the frames stands for."""
        return self.names.full(name)

    def frames(self, tokenizer: Any = None, rank: int | None = None, medium: str | None = None,
               group: int | None = None) -> list[PoolFrame]:
        """One cache's frames: frame 0 empty, then one per batch of its rank (a batch that changed only another
        medium or group of that rank gives a frame that says so, so the frames of one rank line up). ``rank``,
        ``medium``, ``group``: which cache (None: the lowest rank, GPU, the lowest group of full-attention layers where
        the engine names its groups' kinds, else the lowest; frame 0's notes name the others). ``tokenizer``:
        anything with ``decode(ids) -> str``, for the blocks' text."""
        if not self.keep_history:
            raise SettingsError("this replay keeps no batches (keep_history=False), so it has no frames; a "
                                "recording keeps them: read_kv_events(path).frames()")
        key = self._pick(rank, medium, group)
        r, m, g = key
        decode = None if tokenizer is None else (lambda ids: tokenizer.decode(list(ids)))
        maker, state = FrameMaker(self.names, decode), CacheState()
        # the same group in the rank's other media (offload tiers): a block whose parent is held there is reachable
        # (an engine's lookup continues from one tier into the next)
        tiers = {(k[1], g): CacheState() for k in self._states if k[0] == r and k[2] == g and k[1] != m}
        several = len({k[2] for k in self._states if k[:2] == (r, m)}) > 1
        label = f"rank {r} · {m}" + (f" · group {g}" if several else "")
        mine = [rec for rec in self.history if rec.rank == r]
        t0 = mine[0].batch.ts if mine else 0.0
        frames = []
        for n, rec in enumerate(mine, 1):
            for s in (state, *tiers.values()):
                s.begin()
            notes = apply(rec, {(m, g): state, **tiers}, n, create=False)
            held_in = {h: medium for (medium, _), s in tiers.items() for h in s.blocks}
            notes += describe(state.change, self.names, held_in) + skipped(rec.batch)
            if state.change.empty:
                notes.append(f"nothing changed in {m}" + (f" group {g}" if several else "") + " in this batch"
                             + _elsewhere(rec.batch, m, g))
            title = f"batch {n} (seq {rec.seq}) · {label} · +{rec.batch.ts - t0:.3f} s"
            meta = {"dp_rank": r, "medium": m, "group": g, "seq": rec.seq, "ts": rec.batch.ts,
                    "held": len(state.blocks), "form": rec.batch.form, "source": "engine KV events"}
            frames.append(maker.frame(state, n, title, capped(notes), meta, held_in))
        others = [f"rank {k[0]} {k[1]} group {k[2]}" for k in self.caches() if k != key]
        first = [f"{len(mine)} batches of {label}"] + (
            [f"this stream also has {', '.join(others)} (frames(rank=..., medium=..., group=...))"] if others else [])
        frame0 = PoolFrame(index=0, title=f"before the first batch · {label}", policy="events",
                           block_size=state.block_size, num_blocks=0, blocks=(), tree=(), free_queue=(),
                           notes=tuple(first + self.notes), meta={"dp_rank": r, "medium": m, "group": g})
        return [frame0] + [replace(f, block_size=state.block_size) for f in frames]

    def summary(self) -> str:
        """Each cache in a few words: blocks stored now, stored and removed in all, clears, tree depth, gaps."""
        if not self.stats:
            return "no KV event batches"
        lines = []
        for r in self.ranks():
            st = self.stats[r]
            gaps = f", {count(st.lost, 'batch')} missing in {count(st.gaps, 'gap')}" if st.gaps else ", no gaps"
            lines.append(f"rank {r}: {count(st.batches, 'batch')}, seq {st.first_seq}..{st.last_seq}, "
                         f"{count(st.events, 'event')}{gaps}"
                         + (f", {count(st.restarts, 'restart')}" if st.restarts else ""))
            for (_, m, g), s in sorted((k, s) for k, s in self._states.items() if k[0] == r):
                t = s.totals
                held = sum(len(b.tokens) for b in s.blocks.values())
                depth = s.depth()
                lines.append(f"  {m} group {g}: {count(len(s.blocks), 'block')} stored now ({held} tokens, block size "
                             f"{s.block_size}); {t['stored']} stored, {t['removed']} removed, cleared "
                             f"{count(t['cleared'], 'time')} ({count(t['cleared_blocks'], 'block')}); tree depth "
                             f"{count(depth, 'block')} ({depth * s.block_size} tokens)"
                             + (f"; {t['unknown_removed']} removals of blocks never seen stored"
                                if t["unknown_removed"] else ""))
        if self.duplicates:
            lines.append(f"{count(self.duplicates, 'duplicate batch')} skipped")
        return "\n".join(lines + self.notes)

    # ---------------------------------------------------------------------------------------------------------------
    def _pick(self, rank: int | None, medium: str | None, group: int | None) -> Key:
        keys = self.caches()
        if not keys:
            return (rank or 0, medium or DEFAULT_MEDIUM, group or 0)
        ranks = sorted({k[0] for k in keys})
        r = ranks[0] if rank is None else rank
        if r not in ranks:
            raise SettingsError(f"rank {rank} has no KV events in this stream; its ranks: "
                                f"{', '.join(map(str, ranks))}")
        media = sorted({k[1] for k in keys if k[0] == r}, key=lambda x: (x != DEFAULT_MEDIUM, x))
        m = media[0] if medium is None else medium
        if m not in media:
            raise SettingsError(f"medium {medium!r} has no KV events on rank {r}; its media: {', '.join(media)}")
        groups = sorted(k[2] for k in keys if k[:2] == (r, m))
        full = [k for k in groups if self._states[(r, m, k)].spec_kind == "full_attention"]
        g = (full or groups)[0] if group is None else group  # a hybrid model's full layers first (every block)
        if g not in groups:
            raise SettingsError(f"group {group} has no KV events on rank {r} {m}; its groups: "
                                f"{', '.join(map(str, groups))}")
        return (r, m, g)


def apply(rec: Received, states: dict[tuple[str, int], CacheState], number: int, create: bool) -> list[str]:
    """Apply one batch to the caches of its rank (``states``: (medium, group) -> state; new ones made when
    ``create``, else only those given change). Returns the notes about the batch as a whole."""
    notes = []
    if rec.gap:
        a, b = rec.gap
        notes.append(f"batch{'es' if b > a else ''} with seq {a}{f'..{b}' if b > a else ''} missing (a gap in "
                     f"the stream): the blocks they stored or removed are not shown")
    if rec.restart:
        notes.append("the publisher started over at seq 0 (the engine restarted): its caches start empty")
    if create:
        for s in states.values():
            s.begin()
    for ev in ([Cleared()] if rec.restart else []) + list(rec.batch.events):
        if isinstance(ev, Cleared):
            for s in states.values():
                s.clear()
            continue
        key = (ev.medium, ev.group)
        if create and key not in states:
            states[key] = CacheState()
        s = states.get(key)
        if s is None:
            continue
        if isinstance(ev, Stored):
            s.store(ev, number)
        elif isinstance(ev, Removed):
            s.remove(ev)
    return notes


def skipped(batch: Batch) -> list[str]:
    if not batch.skipped:
        return []
    return [f"skipped {len(batch.skipped)} event(s) of a type kvexplore does not read "
            f"({', '.join(sorted(set(batch.skipped)))}): it reads BlockStored, BlockRemoved and AllBlocksCleared, "
            f"as vLLM up to 0.34 sends them; a newer vLLM may send more"]


def _elsewhere(batch: Batch, medium: str, group: int) -> str:
    other = sorted({f"{e.medium} group {e.group}" for e in batch.events if not isinstance(e, Cleared)
                    and (e.medium, e.group) != (medium, group)})
    return f" (it changed {', '.join(other)})" if other else ""


