"""A serving engine's KV event stream, live from its ZMQ sockets (pyzmq): :class:`KVEventSubscriber` feeds every
batch to a :class:`~kvexplore.prefix.events.replay.KVEventReplay` and asks the engine's replay socket for the batches
it missed (the sockets vLLM binds: docs/prefix.md)."""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ...errors import SettingsError
from .files import KVEventRecorder
from .replay import KVEventReplay
from .schema import KVEventFormatError, decode_payload

END_SEQ = -1


def _zmq() -> Any:
    try:
        import zmq
    except ImportError as e:
        raise SettingsError("reading KV events live needs pyzmq: pip install pyzmq (or pip install "
                            "'kvexplore[events]')") from e
    return zmq


def rank_endpoint(endpoint: str, rank: int) -> str:
    """The endpoint of data-parallel rank ``rank``, by vLLM's rule: tcp port + rank, ``inproc://x_dp{rank}``."""
    if rank == 0:
        return endpoint
    if endpoint.startswith("inproc://"):
        return f"{endpoint}_dp{rank}"
    head, _, port = endpoint.rpartition(":")
    if endpoint.startswith("tcp://") and port.isdigit() and int(port) > 0:
        return f"{head}:{int(port) + rank}"
    raise SettingsError(f"{endpoint}: cannot work out rank {rank}'s endpoint (vLLM adds the rank to a tcp port); "
                        f"pass one endpoint per rank as a list")


@dataclass
class _Source:
    endpoint: str
    rank: int
    replay_endpoint: str | None
    socket: Any = None
    replay_ok: bool = True


class KVEventSubscriber:
    """Subscribes to an engine's KV events. ``endpoint``: the PUB socket to connect to (or a list, one per rank);
    ``ranks``: how many data-parallel ranks publish (endpoints derived by vLLM's port rule); ``replay_endpoint``: the
    ROUTER socket (or a list), for missed batches; ``sink(seq, payload, rank)``: called with every batch applied, in
    order (a :class:`~kvexplore.prefix.events.files.KVEventRecorder`'s ``write``)."""

    def __init__(self, endpoint: str | Sequence[str] = "tcp://localhost:5557",
                 replay_endpoint: str | Sequence[str] | None = None, topic: str = "", ranks: int = 1,
                 replay: KVEventReplay | None = None, catch_up: bool = True, replay_timeout_s: float = 2.0,
                 sink: Callable[[int, bytes, int], None] | None = None) -> None:
        zmq = self._zmq = _zmq()
        endpoints = [rank_endpoint(endpoint, r) for r in range(ranks)] if isinstance(endpoint, str) else \
            list(endpoint)
        if replay_endpoint is None or isinstance(replay_endpoint, str):
            replays = [None if replay_endpoint is None else rank_endpoint(replay_endpoint, r)
                       for r in range(len(endpoints))]
        else:
            replays = list(replay_endpoint)
        if len(replays) != len(endpoints):
            raise SettingsError(f"{len(endpoints)} endpoints and {len(replays)} replay endpoints: give one replay "
                                f"endpoint per endpoint")
        for ep in endpoints + [r for r in replays if r]:
            if "*" in ep:
                raise SettingsError(f"{ep} is a bind address (the engine's); connect to the engine's host, e.g. "
                                    f"{ep.replace('*', 'localhost')}")
        self.replay = replay if replay is not None else KVEventReplay()
        self.topic, self.catch_up, self.replay_timeout_s, self.sink = topic, catch_up, replay_timeout_s, sink
        self.received = 0   # messages taken from the PUB sockets
        self.recovered = 0  # batches applied from the replay socket
        self._ctx = zmq.Context()
        self._poller = zmq.Poller()
        self._sources = []
        for rank, (ep, rep) in enumerate(zip(endpoints, replays)):
            sock = self._ctx.socket(zmq.SUB)
            sock.setsockopt(zmq.SUBSCRIBE, topic.encode())
            sock.setsockopt(zmq.LINGER, 0)
            sock.connect(ep)
            self._poller.register(sock, zmq.POLLIN)
            self._sources.append(_Source(ep, rank, rep, sock))

    def poll(self, timeout_ms: int = 100) -> int:
        """Take what has arrived (waiting up to ``timeout_ms`` for the first message); returns batches applied."""
        ready = dict(self._poller.poll(timeout_ms))
        applied = 0
        for src in self._sources:
            while src.socket in ready:
                try:
                    frames = src.socket.recv_multipart(self._zmq.NOBLOCK)
                except self._zmq.Again:
                    break
                applied += self._take(src, frames)
        return applied

    def collect(self, duration_s: float | None = None, max_batches: int | None = None,
                poll_ms: int = 50) -> KVEventReplay:
        """Poll until ``duration_s`` has passed or ``max_batches`` batches were applied; returns the replay."""
        if duration_s is None and max_batches is None:
            raise SettingsError("collect needs duration_s or max_batches (or both): without either it would "
                                "never return")
        end = None if duration_s is None or math.isinf(duration_s) else time.monotonic() + duration_s
        applied = 0
        while (max_batches is None or applied < max_batches) and (end is None or time.monotonic() < end):
            wait = poll_ms if end is None else max(0, min(poll_ms, int((end - time.monotonic()) * 1000)))
            applied += self.poll(wait)
        return self.replay

    def close(self) -> None:
        for src in self._sources:
            src.socket.close(linger=0)
        self._ctx.term()

    def __enter__(self) -> KVEventSubscriber:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    # -------------------------------------------------------------------------------------------------------------
    def _take(self, src: _Source, frames: list[bytes]) -> int:
        self.received += 1
        if len(frames) != 3:
            raise KVEventFormatError(f"{src.endpoint}: a message of {len(frames)} frames, expected 3 (topic, seq, "
                                     f"payload): is this a vLLM KV event publisher?")
        seq = int.from_bytes(frames[1], "big", signed=True)
        batch = decode_payload(frames[2], f"{src.endpoint}, seq {seq}")
        rank = batch.rank if batch.rank is not None else src.rank
        last = self.replay.last_seq(rank)
        applied = 0
        if src.replay_endpoint and src.replay_ok and ((last is None and self.catch_up and seq > 0)
                                                      or (last is not None and seq > last + 1)):
            applied += self._recover(src, 0 if last is None else last + 1, seq)
        return applied + self._apply(seq, rank, batch, frames[2])

    def _apply(self, seq: int, rank: int, batch: Any, payload: bytes) -> int:
        if not self.replay.feed(batch, seq=seq, rank=rank):
            return 0
        if self.sink is not None:
            self.sink(seq, payload, rank)
        return 1

    def _recover(self, src: _Source, start: int, seen: int) -> int:
        """Ask the replay socket for every batch from ``start`` on; apply those before ``seen`` (the message that
        showed the gap) in order."""
        zmq = self._zmq
        dealer = self._ctx.socket(zmq.DEALER)
        dealer.setsockopt(zmq.LINGER, 0)
        dealer.connect(src.replay_endpoint)
        applied = 0
        try:
            dealer.send_multipart([b"", start.to_bytes(8, "big", signed=True)])
            while True:
                if not dealer.poll(int(self.replay_timeout_s * 1000)):
                    src.replay_ok = False
                    self.replay.notes.append(
                        f"{src.replay_endpoint} did not answer a replay request within {self.replay_timeout_s} s: "
                        f"no more replay requests to it (is the engine's replay_endpoint set to it?)")
                    break
                frames = dealer.recv_multipart()[1:]  # the empty delimiter first
                seq = int.from_bytes(frames[-2], "big", signed=True) if len(frames) >= 2 else END_SEQ
                if seq == END_SEQ:
                    break
                if seq < seen:
                    batch = decode_payload(frames[-1], f"{src.replay_endpoint}, replayed seq {seq}")
                    applied += self._apply(seq, batch.rank if batch.rank is not None else src.rank, batch,
                                           frames[-1])
        finally:
            dealer.close(linger=0)
        self.recovered += applied
        return applied


def record(endpoint: str | Sequence[str], path: str | Path, seconds: float | None = None,
           max_batches: int | None = None, replay_endpoint: str | Sequence[str] | None = None, topic: str = "",
           ranks: int = 1, catch_up: bool = True) -> KVEventReplay:
    """Record a live stream to ``path`` (a kvexplore recording, see :mod:`.files`) for ``seconds`` or
    ``max_batches``; returns the replay of what was recorded (its caches and counts; the batches are in the file:
    ``read_kv_events(path)`` for frames). A KeyboardInterrupt ends it with the file whole."""
    with KVEventRecorder(path) as out, KVEventSubscriber(endpoint, replay_endpoint, topic, ranks, catch_up=catch_up,
                                                         replay=KVEventReplay(keep_history=False),
                                                         sink=out.write) as sub:
        try:
            sub.collect(seconds, max_batches)
        except KeyboardInterrupt:
            sub.replay.notes.append("recording stopped by an interrupt")
        if sub.recovered:
            sub.replay.notes.append(f"{sub.recovered} of the batches came through the replay socket (sent before "
                                    f"the recording began, or missed)")
        return sub.replay
