"""KV cache events read live: a ZMQ stream from a publisher that behaves as vLLM's ZmqEventPublisher, a missed
batch recovered through the replay socket, a recorder that catches up (and a silent replay socket whose gap is told),
endpoints per data-parallel rank, the optional pyzmq and msgspec, and ``kvexplore kv-events record``."""

from __future__ import annotations

import threading

import pytest

from kvexplore.errors import SettingsError
from kvexplore.prefix.events import (KVEventReplay, KVEventSubscriber, decode_payload, rank_endpoint, read_kv_events,
                                     record)
from prefix_events_support import H, batch, pack, removed, stored, stored_now


# live: a ZMQ publisher that behaves as vLLM's ZmqEventPublisher ---------------------------------------------------
class Publisher:
    """vLLM's ZmqEventPublisher's wire behaviour (vllm/distributed/kv_events.py, 0.34): PUB (topic, seq, payload);
    a ROUTER answering (b"", start) with (b"", topic, seq, payload) per buffered batch, then seq -1. ``drop``: seqs
    buffered but not published (lost on the way). An XPUB socket (a PUB that also hears subscriptions), so that the
    test publishes once the subscriber is listening."""

    def __init__(self, zmq, ctx, topic=b"kv", drop=()):
        self.zmq, self.topic, self.drop, self.buffer = zmq, topic, set(drop), []
        self.pub = ctx.socket(zmq.XPUB)
        self.port = self.pub.bind_to_random_port("tcp://127.0.0.1")
        self.router = ctx.socket(zmq.ROUTER)
        self.replay_port = self.router.bind_to_random_port("tcp://127.0.0.1")
        self.requests, self._stop = [], threading.Event()
        self._thread = threading.Thread(target=self._serve, daemon=True)

    def wait_for_subscriber(self):
        assert self.pub.poll(10_000), "no subscriber within 10 s"
        self.pub.recv()  # the subscription message

    def publish(self, seq, b):
        payload = pack(b)
        self.buffer.append((seq, payload))
        if seq not in self.drop:
            self.pub.send_multipart([self.topic, seq.to_bytes(8, "big"), payload])

    def _serve(self):
        while not self._stop.is_set():
            if self.router.poll(20):
                client, _, start = self.router.recv_multipart()
                start = int.from_bytes(start, "big")
                self.requests.append(start)
                for seq, payload in self.buffer:
                    if seq >= start:
                        self.router.send_multipart([client, b"", self.topic, seq.to_bytes(8, "big"), payload])
                self.router.send_multipart([client, b"", b"", (-1).to_bytes(8, "big", signed=True), b""])

    def __enter__(self):
        self._thread.start()
        return self

    def __exit__(self, *exc):
        self._stop.set()
        self._thread.join()
        self.pub.close(0)
        self.router.close(0)


BATCHES = [batch(stored(H[1:3], None, range(8))), batch(stored([H[3]], H[2], range(8, 12))),
           batch(removed([H[1]])), batch(stored([H[4]], H[3], range(12, 16))), batch({"type": "AllBlocksCleared"}),
           batch(stored([H[5]], None, range(4)))]


def test_live_stream_with_a_missed_batch_recovered_through_replay(tmp_path):
    zmq = pytest.importorskip("zmq")
    ctx = zmq.Context()
    with Publisher(zmq, ctx, drop={3}) as pub:
        written = []
        sub = KVEventSubscriber(f"tcp://127.0.0.1:{pub.port}", f"tcp://127.0.0.1:{pub.replay_port}", topic="kv",
                                sink=lambda seq, payload, rank: written.append(seq))
        pub.wait_for_subscriber()
        for seq, b in enumerate(BATCHES):
            pub.publish(seq, b)
        replay = sub.collect(duration_s=10, max_batches=len(BATCHES))
        sub.close()
    ctx.term()
    assert [x.seq for x in replay.history] == [0, 1, 2, 3, 4, 5] and written == [0, 1, 2, 3, 4, 5]
    assert sub.recovered == 1 and pub.requests == [3] and all(x.gap is None for x in replay.history)
    want = KVEventReplay().feed_all(BATCHES)
    assert [f.to_dict() for f in replay.frames()] == [f.to_dict() for f in want.frames()]
    assert stored_now(replay.frames()[4]) == {"02020202": (4, 5, 6, 7), "03030303": (8, 9, 10, 11),
                                              "04040404": (12, 13, 14, 15)}


def test_record_catches_up_then_a_silent_replay_socket_leaves_the_gap_told(tmp_path):
    zmq = pytest.importorskip("zmq")
    ctx = zmq.Context()
    with Publisher(zmq, ctx) as pub:
        for seq, b in enumerate(BATCHES[:2]):  # before anyone listens: only the replay socket has them
            pub.publish(seq, b)
        done = {}
        thread = threading.Thread(target=lambda: done.setdefault("r", record(
            f"tcp://127.0.0.1:{pub.port}", tmp_path / "rec.kvev", seconds=10, max_batches=len(BATCHES),
            replay_endpoint=f"tcp://127.0.0.1:{pub.replay_port}")))
        thread.start()
        pub.wait_for_subscriber()
        for seq, b in enumerate(BATCHES[2:], 2):
            pub.publish(seq, b)
        thread.join()
    ctx.term()
    assert pub.requests == [0] and "2 of the batches came through the replay socket" in done["r"].summary()
    assert done["r"].history == [] and done["r"].stats[0].batches == 6  # a recorder keeps counts, not batches
    with pytest.raises(SettingsError, match=r"keeps no batches .* read_kv_events\(path\).frames\(\)"):
        done["r"].frames()
    back = read_kv_events(tmp_path / "rec.kvev")
    assert [f.to_dict() for f in back.frames()] == [f.to_dict() for f in KVEventReplay().feed_all(BATCHES).frames()]
    # a replay endpoint nobody serves: one request times out, the gap is told in the frame after it
    ctx = zmq.Context()
    pub = ctx.socket(zmq.XPUB)
    port = pub.bind_to_random_port("tcp://127.0.0.1")
    with KVEventSubscriber(f"tcp://127.0.0.1:{port}", "tcp://127.0.0.1:1", replay_timeout_s=0.2) as sub:
        assert pub.poll(10_000) and pub.recv() == b"\x01"  # subscribed (to every topic)
        for seq in (0, 2):
            pub.send_multipart([b"", seq.to_bytes(8, "big"), pack(BATCHES[seq])])
        sub.collect(duration_s=5, max_batches=2)
    pub.close(0)
    ctx.term()
    assert "did not answer a replay request within 0.2 s" in sub.replay.notes[0]
    assert sub.replay.frames()[2].notes[0].startswith("batch with seq 1 missing")


def test_endpoints_pyzmq_and_arguments(monkeypatch):
    assert rank_endpoint("tcp://host:5557", 0) == "tcp://host:5557"
    assert rank_endpoint("tcp://host:5557", 2) == "tcp://host:5559"
    assert rank_endpoint("inproc://cache", 1) == "inproc://cache_dp1"
    with pytest.raises(SettingsError, match="pass one endpoint per rank as a list"):
        rank_endpoint("ipc:///tmp/x", 1)
    with pytest.raises(SettingsError, match=r"tcp://\*:5557 is a bind address .* tcp://localhost:5557"):
        KVEventSubscriber("tcp://*:5557")
    with KVEventSubscriber("tcp://127.0.0.1:1") as sub, pytest.raises(SettingsError, match="duration_s or max_batches"):
        sub.collect()
    monkeypatch.setitem(__import__("sys").modules, "zmq", None)
    with pytest.raises(SettingsError, match=r"needs pyzmq: pip install pyzmq"):
        KVEventSubscriber()
    monkeypatch.setitem(__import__("sys").modules, "msgspec", None)
    with pytest.raises(SettingsError, match=r"needs msgspec: pip install msgspec"):
        decode_payload(b"\x90")


def test_cli_records_a_live_stream(tmp_path, capsys):
    import queue

    from kvexplore.cli import main

    zmq = pytest.importorskip("zmq")
    ports, recorded = queue.Queue(), threading.Event()

    def engine():  # its sockets live in this thread only
        ctx = zmq.Context()
        with Publisher(zmq, ctx, topic=b"") as pub:
            ports.put(pub.port)
            pub.wait_for_subscriber()
            for seq, b in enumerate(BATCHES):
                pub.publish(seq, b)
            recorded.wait(30)  # closing at once could drop what is still queued
        ctx.term()

    thread = threading.Thread(target=engine)
    thread.start()
    port = ports.get(timeout=10)
    out = tmp_path / "cli.kvev"
    assert main(["kv-events", "record", f"tcp://127.0.0.1:{port}", "-o", str(out), "--batches", "6",
                 "--seconds", "20"]) == 0
    recorded.set()
    thread.join()
    assert capsys.readouterr().out.startswith(f"6 batches recorded to {out}\nrank 0: 6 batches, seq 0..5")
    assert [f.to_dict() for f in read_kv_events(out).frames()] == \
        [f.to_dict() for f in KVEventReplay().feed_all(BATCHES).frames()]
    assert main(["kv-events", "record", "tcp://127.0.0.1:1", "-o", str(tmp_path / "none.kvev"),
                 "--seconds", "0.2"]) == 1
    assert "nothing arrived from tcp://127.0.0.1:1: is the engine running with --kv-events-config" in \
        capsys.readouterr().out
