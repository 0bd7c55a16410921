"""A KV event stream checked for drift (``kvexplore kv-events check``): each way the stream departs from what its
engine's schema and vLLM's caching promise, with the batch and event where it was first seen and how often
(docs/engine-events.md lists them). A finding is a drift (the exit code is 1) or information (a known engine
behaviour, blocks still stored at the end)."""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from . import dialects
from .files import raw_batches
from .replay import KVEventReplay
from .schema import FIELDS, NO_TOKENS, Batch, Cleared, Hash, Removed, Stored, decode_msgpack
from .state import HashNames
from .vllm_hashes import vllm_chain_hashes
from ..result import count

DRIFT, INFO = "drift", "info"
SHA = 32  # bytes of a sha256_cbor block hash
MAP_ENGINES = ("vllm", "lmcache")  # engines whose events are maps (vLLM >= 0.30; LMCache sends vLLM's classes)
KEYED = ("group_idx", "medium")    # fields a stream should carry on every event once it carries them on some
UNKNOWN = object()                 # a block's parent that its store does not say


def _same(a: tuple, b: tuple) -> bool:
    """Two stores of one hash are of the same block: the same tokens, under the same parent where both say."""
    return a[1] == b[1] and (a[0] is UNKNOWN or b[0] is UNKNOWN or a[0] == b[0])


@dataclass(frozen=True)
class Finding:
    """One kind of drift (or information) in a stream: ``code`` names it, ``first`` is where it was first seen
    (``batch N (seq S), event E``), ``count`` how often, ``message`` what it is (as first seen)."""

    code: str
    level: str
    message: str
    first: str = ""
    count: int = 1

    def line(self) -> str:
        where = f", first at {self.first}" if self.first else ""
        return f"{self.level:<5}  {self.code}: {self.count}x{where}: {self.message}"


@dataclass
class CheckReport:
    name: str
    engine: str
    findings: list[Finding]
    replay: KVEventReplay

    @property
    def drift(self) -> list[Finding]:
        return [f for f in self.findings if f.level == DRIFT]

    @property
    def exit_code(self) -> int:
        """0: nothing wrong (information only); 1: drift found."""
        return 1 if self.drift else 0

    def codes(self) -> dict[str, int]:
        """Each finding's code -> its count."""
        return {f.code: f.count for f in self.findings}

    def text(self) -> str:
        batches = sum(st.batches for st in self.replay.stats.values())
        events = sum(st.events for st in self.replay.stats.values())
        head = (f"{self.name}: read as {self.engine}, {count(batches, 'batch')}, {count(events, 'event')}, "
                f"{count(len(self.replay.caches()), 'cache')}")
        drift = self.drift
        tail = (f"{count(len(drift), 'kind')} of drift found" if drift
                else "no drift found" + (" (information only)" if self.findings else ""))
        return "\n".join([head] + ["  " + f.line() for f in self.findings] + [tail])


def check_kv_events(path: str | Path, engine: str | None = None, block_size: int | None = None,
                    allow_truncated: bool = False) -> CheckReport:
    """A file of KV event batches (as :func:`~kvexplore.prefix.events.files.read_kv_events` reads it) checked."""
    items = ((seq, rank, obj) for _, seq, rank, obj in raw_batches(path, allow_truncated, decode=True))
    return check_batches(items, engine, block_size, name=str(path))


def check_batches(items: Iterable[Any], engine: str | None = None, block_size: int | None = None,
                  name: str = "stream") -> CheckReport:
    """Decoded batches (or msgpack payloads, or ``(seq, rank, batch)`` triples) checked, in order."""
    triples = [x if isinstance(x, tuple) and len(x) == 3 else (None, None, x) for x in items]
    triples = [(s, r, decode_msgpack(o, name) if isinstance(o, (bytes, bytearray)) else o) for s, r, o in triples]
    engine = dialects.engine_name(engine) or dialects.detect(o for _, _, o in triples)
    checker = _Checker(engine, block_size)
    for seq, rank, obj in triples:
        checker.feed(seq, rank, obj)
    return CheckReport(name, engine, checker.finish(), checker.replay)


@dataclass
class _Tally:
    level: str
    message: str
    first: str
    count: int = 0


@dataclass
class _Checker:
    engine: str
    block_size: int | None
    tallies: dict[str, _Tally] = field(default_factory=dict)
    extra: list[Finding] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.replay = KVEventReplay(engine=self.engine, block_size=self.block_size)
        self.names = HashNames()
        self.where: list[str] = []                     # each applied batch's label, as replay.history
        self.held: dict[tuple, dict[Hash, list]] = {}   # (rank, medium, group) -> hash -> [copies, (parent, tokens)]
        self.keyed = {k: [0, 0, ""] for k in KEYED}     # field -> [events carrying it, lacking it, first lacking]
        self.forms: dict[str, tuple[str, int]] = {}     # a batch's form -> (where first, how many)
        self.n = 0

    def note(self, code: str, level: str, where: str, message: str, times: int = 1) -> None:
        t = self.tallies.setdefault(code, _Tally(level, message, where))
        t.count += times

    # one batch ----------------------------------------------------------------------------------------------------
    def feed(self, seq: int | None, rank: int | None, obj: Any) -> None:
        self.n += 1
        label = f"batch {self.n}" + (f" (seq {seq})" if seq is not None else "")
        if not self.replay.feed(obj, seq=seq, rank=rank, where=label):
            return
        rec = self.replay.history[-1]
        label = f"batch {self.n} (seq {rec.seq})"
        self.where.append(label)
        if self.engine in MAP_ENGINES + ("sglang",):
            self._raw(obj, label)
        first, times = self.forms.get(rec.batch.form, (label, 0))
        self.forms[rec.batch.form] = (first, times + 1)
        if rec.restart:
            self._clear(rec.rank)
        self._batch(rec.batch, rec.rank, label)

    def _raw(self, obj: Any, label: str) -> None:
        """What only the decoded batch shows: events in array form, fields some events carry and others lack."""
        for i, ev in enumerate(dialects.common.raw_events(obj)):
            where = f"{label}, event {i}"
            if isinstance(ev, (list, tuple)) and ev and isinstance(ev[0], str):
                tag, names = ev[0], FIELDS.get(ev[0], ((), 0))[0]
                fields = dict(zip(names, ev[1:]))
                if self.engine in MAP_ENGINES:
                    self.note("array-events", DRIFT, where, "events in array form where maps are expected: vLLM "
                              "0.30 and later send each event as a map (msgspec array_like off); arrays come from an "
                              "older vLLM or a re-encoder, and a field added by a newer version shifts their meaning")
            elif isinstance(ev, dict):
                tag, fields = ev.get("type"), ev
            else:
                continue
            if tag not in ("BlockStored", "BlockRemoved"):
                continue
            for k in KEYED:
                has = fields.get(k) is not None
                tally = self.keyed[k]
                tally[0 if has else 1] += 1
                if not has and not tally[2]:
                    tally[2] = f"{where} ({tag})"

    def _batch(self, batch: Batch, rank: int, label: str) -> None:
        for i, ev in enumerate(batch.events):
            where = f"{label}, event {i}"
            if isinstance(ev, Cleared):
                self._clear(rank)
            elif isinstance(ev, Stored):
                self._stored(ev, rank, where)
            elif isinstance(ev, Removed):
                self._removed(ev, rank, where)
        if batch.skipped:
            self.note("skipped-events", INFO, label, f"events of types kvexplore does not read: "
                      f"{', '.join(sorted(set(batch.skipped)))}", len(batch.skipped))

    def _removed(self, ev: Removed, rank: int, where: str) -> None:
        held = self.held.setdefault((rank, ev.medium, ev.group), {})
        unknown = []
        for h in ev.hashes:
            copies = held.get(h)
            if copies is None or not copies[0]:
                unknown.append(h)
            else:
                copies[0] -= 1
        if unknown:
            self.note("unknown-removal", DRIFT, where, f"BlockRemoved of {self.names(unknown[0])} in {ev.medium} group "
                      f"{ev.group}, a hash this stream never stored there (or removed already): stored before the "
                      f"stream began, in a missing batch, or the engine lost track", len(unknown))

    def _clear(self, rank: int) -> None:
        for key in self.held:
            if key[0] == rank:
                self.held[key] = {}

    def _stored(self, ev: Stored, rank: int, where: str) -> None:
        held = self.held.setdefault((rank, ev.medium, ev.group), {})
        tail = ev.tokens[len(ev.tokens) - len(ev.hashes) * ev.block_size:] if ev.tokens else ()
        # the kept tail of a longer store (vLLM 0.32's sliding groups) hangs under a block the event does not name
        parent = UNKNOWN if len(tail) < len(ev.tokens) else ev.parent
        again, other = [], []
        for i, h in enumerate(ev.hashes):
            block = (parent, tail[i * ev.block_size:(i + 1) * ev.block_size])
            copies = held.setdefault(h, [0, block])
            if copies[0]:
                (again if _same(copies[1], block) else other).append(h)
            copies[0] += 1
            parent = h
        if again:
            self.note("stored-again", INFO, where, f"BlockStored of {self.names(again[0])} in {ev.medium} group "
                      f"{ev.group}, held already with the same parent and tokens: vLLM keeps a copy per computation (a "
                      f"block recomputed, as one holding generated tokens, which a later prompt cannot hit), each "
                      f"removed on its own", len(again))
        if other:
            self.note("double-store", DRIFT, where, f"BlockStored of {self.names(other[0])} in {ev.medium} group "
                      f"{ev.group}, a hash stored there already, not removed since, under another parent or with "
                      f"other tokens: two blocks under one hash", len(other))
        if NO_TOKENS in ev.extra:
            self.note("no-token-ids", INFO, where, f"{ev.extra[NO_TOKENS]}: blocks drawn without text, token counts "
                      f"and hashes not checked")
            return
        n, bs, tokens = len(ev.hashes), ev.block_size, ev.tokens
        if len(tokens) != n * bs:
            if len(tokens) > n * bs and len(tokens) % bs == 0 and ev.extra.get("kv_cache_spec_kind") == \
                    "sliding_window":
                self.note("vllm032-sliding-tokens", INFO, where, f"{len(tokens)} token ids for {count(n, 'block')} of "
                          f"{bs} in sliding-window group {ev.group}: vLLM 0.32's sliding-window groups send the token "
                          f"ids of every block the step computed and the hashes of the ones they keep (a known "
                          f"behaviour, not corruption: the kept blocks are the last ones)")
            else:
                self.note("token-count", DRIFT, where, f"{len(tokens)} token ids for {count(n, 'block')} of {bs} "
                          f"(expected {n * bs}): token_ids do not match the hashes' blocks (vLLM issue #44451)")
                return
        self._hashes(ev, where)

    def _hashes(self, ev: Stored, where: str) -> None:
        """32-byte hashes: the sha256_cbor chain recomputed from the parent (or the seed) and the tokens."""
        keys = ev.extra.get("extra_keys")
        if not ev.hashes or ev.lora or (keys and any(k is not None for k in keys)):
            return  # LoRA, images, cache salts enter the hash: not recomputed here
        if not all(isinstance(h, bytes) and len(h) == SHA for h in ev.hashes) or \
                not (ev.parent is None or (isinstance(ev.parent, bytes) and len(ev.parent) == SHA)):
            return
        chain = vllm_chain_hashes(ev.tokens, ev.block_size, ev.parent)[-len(ev.hashes):]
        wrong = [k for k, (h, c) in enumerate(zip(ev.hashes, chain)) if h != c]
        if wrong:
            seed = " (a first block: if the engine ran with PYTHONHASHSEED set, the chain's seed differs)" \
                if ev.parent is None and wrong[0] == 0 else ""
            self.note("hash-mismatch", DRIFT, where, f"block {wrong[0]} ({self.names(ev.hashes[wrong[0]])}) is not the "
                      f"sha256_cbor hash of its tokens under its parent{seed}", len(wrong))

    # the end ------------------------------------------------------------------------------------------------------
    def finish(self) -> list[Finding]:
        out = [Finding(c, t.level, t.message, t.first, t.count) for c, t in self.tallies.items()]
        if len(self.forms) > 1:
            (main, _), = sorted(self.forms.items(), key=lambda x: -x[1][1])[:1]
            others = [(form, first, times) for form, (first, times) in self.forms.items() if form != main]
            form, first, times = min(others, key=lambda x: self.where.index(x[1]))
            out.append(Finding("mixed-forms", DRIFT, f"batches in {len(self.forms)} forms ({', '.join(self.forms)}): "
                               f"most are \"{main}\", {count(sum(t for *_, t in others), 'batch')} not, the first "
                               f"\"{form}\": two publishers or versions on one stream?", first,
                               sum(t for *_, t in others)))
        for k, (has, lacks, first) in self.keyed.items():
            if has and lacks:
                out.append(Finding(f"missing-{k}", DRIFT, f"{lacks} of {has + lacks} stores and removals lack {k} "
                                   f"while the others carry it: theirs read as "
                                   f"{'group 0' if k == 'group_idx' else 'GPU'}, maybe not where the engine meant",
                                   first, lacks))
        out += self._sequence()
        for (r, m, g), held in sorted(self.held.items()):
            if n := sum(copies for copies, _ in held.values()):
                out.append(Finding("never-removed", INFO, f"rank {r} {m} group {g}: {count(n, 'block')} stored and "
                                   f"not removed by the end (still cached when the stream stopped)", count=n))
        return sorted(out, key=lambda f: (f.level != DRIFT,))

    def _sequence(self) -> list[Finding]:
        out = []
        gaps = [(i, rec) for i, rec in enumerate(self.replay.history) if rec.gap]
        if gaps:
            lost = sum(b - a + 1 for _, rec in gaps for a, b in [rec.gap])
            i, rec = gaps[0]
            out.append(Finding("seq-gap", DRIFT, f"{count(lost, 'batch')} missing in {count(len(gaps), 'gap')} (the "
                               f"first: seq {rec.gap[0]}..{rec.gap[1]}): the blocks they stored or removed are unknown",
                               self.where[i], len(gaps)))
        restarts = [i for i, rec in enumerate(self.replay.history) if rec.restart]
        if restarts:
            out.append(Finding("seq-restart", DRIFT, "the publisher started over at seq 0 (the engine restarted): its "
                               "caches start empty", self.where[restarts[0]], len(restarts)))
        if self.replay.duplicates:
            out.append(Finding("duplicate-batch", DRIFT, "batches with a sequence number seen already (skipped): a "
                               "replay overlapping the live stream, or two publishers", count=self.replay.duplicates))
        return out
