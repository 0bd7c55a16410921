"""How fast a KV event stream is read: kvexplore's decode (msgspec to plain objects, then checked and normalised)
beside msgspec's typed decode into Structs that mirror vLLM's (what vLLM's own subscriber example does, and the
fastest a Python reader of this schema gets), then feeding a replay and making its frames.

A synthetic stream like a busy engine's: each batch stores a 4-block prefix extension (block size 16, sha256
hashes) under an earlier block and removes 2 old blocks, so the cache holds a few hundred blocks.

    python benchmarks/kv_events_replay.py [--batches 5000] [--reps 3]
"""

from __future__ import annotations

import argparse
import hashlib
import statistics
import time

import msgspec

from kvexplore.prefix.events import KVEventReplay, decode_payload


class BlockStored(msgspec.Struct, tag=True, omit_defaults=True):
    block_hashes: list[bytes | int]
    parent_block_hash: bytes | int | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None
    medium: str | None
    lora_name: str | None
    group_idx: int | None = None


class BlockRemoved(msgspec.Struct, tag=True, omit_defaults=True):
    block_hashes: list[bytes | int]
    medium: str | None
    group_idx: int | None = None


class AllBlocksCleared(msgspec.Struct, tag=True, omit_defaults=True):
    pass


class KVEventBatch(msgspec.Struct, array_like=True, omit_defaults=True):
    ts: float
    events: list[BlockStored | BlockRemoved | AllBlocksCleared]
    data_parallel_rank: int | None = None


def stream(n: int) -> list[bytes]:
    enc, out, live = msgspec.msgpack.Encoder(), [], []
    h = lambda i: hashlib.sha256(i.to_bytes(8, "big")).digest()  # noqa: E731
    for b in range(n):
        hashes = [h(4 * b + k) for k in range(4)]
        parent = live[-7] if len(live) > 8 else None
        events = [BlockStored(hashes, parent, list(range(64)), 16, None, "GPU", None)]
        if len(live) > 300:
            events.append(BlockRemoved([live.pop(0) for _ in range(4)], "GPU"))
        live += hashes
        out.append(enc.encode(KVEventBatch(1.7e9 + b, events, 0)))
    return out


def best(fn, reps: int) -> float:
    times = []
    for _ in range(reps):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return min(times)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--batches", type=int, default=5000)
    ap.add_argument("--reps", type=int, default=3)
    args = ap.parse_args()
    payloads = stream(args.batches)
    typed = msgspec.msgpack.Decoder(KVEventBatch)
    n, mb = len(payloads), sum(map(len, payloads)) / 2**20
    t_typed = best(lambda: [typed.decode(p) for p in payloads], args.reps)
    t_ours = best(lambda: [decode_payload(p) for p in payloads], args.reps)
    t_feed = best(lambda: KVEventReplay().feed_all(payloads), args.reps)
    replay = KVEventReplay().feed_all(payloads)
    t_frames = best(replay.frames, 1)
    held = len(replay.state().blocks)
    print(f"{n} batches, {mb:.1f} MiB of msgpack, {held} blocks held at the end")
    print(f"decode, msgspec typed (vLLM's Structs):  {t_typed * 1e6 / n:7.1f} us/batch  ({n / t_typed:9.0f} batches/s)")
    print(f"decode, kvexplore (plain + checked):     {t_ours * 1e6 / n:7.1f} us/batch  ({n / t_ours:9.0f} batches/s)"
          f"  {t_ours / t_typed:.1f}x typed")
    print(f"decode + feed a KVEventReplay:           {t_feed * 1e6 / n:7.1f} us/batch  ({n / t_feed:9.0f} batches/s)")
    print(f"frames() of the whole stream:            {t_frames * 1e6 / n:7.1f} us/frame ({n / t_frames:9.0f} frames/s)")
    print(f"median payload {statistics.median(map(len, payloads))} bytes")


if __name__ == "__main__":
    main()
