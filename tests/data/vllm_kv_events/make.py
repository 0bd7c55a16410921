"""Builds the KV event streams in this folder with vLLM's own code: its KV cache manager (prefix caching on, events
on) serves scripted requests on the CPU, each scheduler-like step's events become one ``KVEventBatch`` encoded by
msgspec as vLLM's publisher does, and the manager's own table of cached blocks after each step is written down as
the expected state. Not run by the test suite (vLLM is not a dependency): run it in a throwaway virtual
environment that has vLLM (see README.md), from this folder:

    python make.py OLD        # the files; OLD: a vLLM 0.9.2 wheel (or its vllm/distributed/kv_events.py), whose
                              # event classes write the all-array form
    python make.py publish P  # vLLM's ZmqEventPublisher on tcp://*:P (rank 0) and P+1 (rank 1), replay on P+10..,
                              # for kvexplore kv-events record (see README.md)
"""

from __future__ import annotations

import json
import os
import struct
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
BS = 4
SYSTEM = [101, 102, 103, 104, 105, 106, 107, 108]  # a shared system prompt of two blocks


def steps(rank: int) -> list[list[list[int]]]:
    """The requests of each step (each step: the prompts scheduled together)."""
    if rank == 0:
        return [
            [SYSTEM + [1, 2, 3, 4, 5, 6]],                        # 3 blocks in one event
            [SYSTEM + [9, 9, 9, 9, 9]],                           # hits the system prompt, one block more
            [list(range(200, 226))],                              # 6 blocks: evicts cached ones
            [SYSTEM + [1, 2, 3, 4, 5], [300, 301, 302, 303, 304]],  # two requests in one step
            "reset",                                              # AllBlocksCleared
            [SYSTEM + [7, 7, 7, 7, 7]],
        ]
    return [                                                      # rank 1: a hybrid model (two groups)
        [SYSTEM + [50, 51, 52, 53, 54]],
        [SYSTEM + [60, 61, 62, 63, 64, 65]],
        [list(range(400, 418))],
    ]


def run(rank: int, int_hashes: bool):
    os.environ["VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES"] = "1" if int_hashes else "0"
    import torch
    from vllm import SamplingParams
    from vllm.distributed.kv_events import KVEventBatch
    from vllm.utils.hashing import sha256_cbor
    from vllm.v1.core.kv_cache_manager import KVCacheManager
    from vllm.v1.core.kv_cache_utils import (get_block_hash, get_group_id, get_request_block_hasher, init_none_hash,
                                             maybe_convert_block_hash)
    from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec, SlidingWindowSpec
    from vllm.v1.request import Request

    init_none_hash(sha256_cbor)
    full = FullAttentionSpec(block_size=BS, num_kv_heads=1, head_size=1, dtype=torch.float32)
    groups = [KVCacheGroupSpec(["full"], full)]
    if rank == 1:
        sw = SlidingWindowSpec(block_size=BS, num_kv_heads=1, head_size=1, dtype=torch.float32, sliding_window=8)
        groups.append(KVCacheGroupSpec(["window"], sw))
    config = KVCacheConfig(num_blocks=11 * len(groups), kv_cache_tensors=[], kv_cache_groups=groups)
    manager = KVCacheManager(config, max_model_len=64, scheduler_block_size=BS, hash_block_size=BS,
                             enable_caching=True, enable_kv_cache_events=True)
    hasher = get_request_block_hasher(BS, sha256_cbor)
    ext = maybe_convert_block_hash
    batches, expected, tokens, n = [], [], {}, 0
    for step in steps(rank):
        if step == "reset":
            assert manager.reset_prefix_cache()
        else:
            reqs = []
            for prompt in step:
                req = Request(f"r{rank}-{n}", prompt, SamplingParams(max_tokens=1), None, block_hasher=hasher)
                n += 1
                blocks, hit, *_ = manager.get_computed_blocks(req)
                assert manager.allocate_slots(req, len(prompt) - hit, hit, blocks) is not None
                for i, h in enumerate(req.block_hashes):
                    tokens[_key(ext(h))] = prompt[i * BS:(i + 1) * BS]
                reqs.append(req)
            for req in reqs:
                manager.free(req)
        events = manager.take_events()
        if not events:
            continue
        batches.append(KVEventBatch(ts=1_700_000_000.0 + len(batches), events=events, data_parallel_rank=rank))
        cached = sorted((get_group_id(k), _key(ext(get_block_hash(k))))
                        for k in manager.block_pool.cached_block_hash_to_block._cache)
        expected.append([[g, h] for g, h in cached])
    return batches, expected, tokens


def _key(h) -> str | int:
    return h.hex() if isinstance(h, bytes) else h


def write_recording(path: Path, records) -> None:
    """kvexplore's recording layout (kvexplore/prefix/events/files.py), written here from its description."""
    with open(path, "wb") as f:
        f.write(b"KVEVREC1")
        for seq, rank, payload in records:
            f.write(struct.pack(">qhI", seq, rank, len(payload)) + payload)


def old_classes(path: str) -> dict:
    """vLLM 0.9.2's event classes (all array_like, int hashes), run from its own kv_events.py: ``path`` is a vLLM 0.9.2
    wheel or that file taken from one (its first part, the msgspec Structs, is run)."""
    import typing
    import zipfile

    import msgspec

    if path.endswith(".whl"):
        with zipfile.ZipFile(path) as wheel:
            source = wheel.read("vllm/distributed/kv_events.py").decode()
    else:
        source = Path(path).read_text()
    structs = source[source.index("class EventBatch("):source.index("class EventPublisher(")]
    namespace = {"msgspec": msgspec, "Any": typing.Any, "Optional": typing.Optional, "Union": typing.Union}
    exec(compile(structs, "vllm-0.9.2/kv_events.py", "exec"), namespace)
    return namespace


def main(old_path: str) -> None:
    import msgspec
    import vllm

    enc = msgspec.msgpack.Encoder()
    old = old_classes(old_path)
    out = {"vllm_version": vllm.__version__, "block_size": BS, "streams": {}}
    for form, ints in (("bytes", False), ("int", True)):
        per_rank = {r: run(r, ints) for r in (0, 1)}
        out["streams"][form] = {str(r): {"cached": e, "tokens": t} for r, (_, e, t) in per_rank.items()}
        # the two ranks interleaved, as one recorder of both would see them
        batches = sorted(((seq, r, b) for r, (bs, _, _) in per_rank.items() for seq, b in enumerate(bs)),
                         key=lambda x: (x[0], x[1]))
        if form == "bytes":
            write_recording(HERE / "vllm034_bytes.kvev", [(seq, r, enc.encode(b)) for seq, r, b in batches])
            with open(HERE / "vllm034_bytes_base64.jsonl", "wb") as f:  # msgspec's JSON writes bytes as base64
                f.writelines(msgspec.json.encode(b) + b"\n" for _, _, b in batches)
            continue
        with open(HERE / "vllm034_int.jsonl", "wb") as f:
            f.writelines(msgspec.json.encode(b) + b"\n" for _, _, b in batches)
        conv = []  # the same batches as vLLM 0.9.2 sent them: no medium, no groups (group 0 only)
        for seq, r, b in batches:
            events = [old["BlockStored"](e.block_hashes, e.parent_block_hash, e.token_ids, e.block_size, e.lora_id)
                      if type(e).__name__ == "BlockStored" else old["BlockRemoved"](e.block_hashes)
                      if type(e).__name__ == "BlockRemoved" else old["AllBlocksCleared"]()
                      for e in b.events if getattr(e, "group_idx", None) in (0, None)]
            conv.append((seq, r, enc.encode(old["KVEventBatch"](b.ts, events, r))))
        write_recording(HERE / "vllm092_array.kvev", conv)
    (HERE / "expected.json").write_text(json.dumps(out, indent=1) + "\n")
    print("wrote", sorted(p.name for p in HERE.iterdir() if p.suffix in (".kvev", ".jsonl", ".json")))


def publish(port: int) -> None:
    """vLLM's own ZmqEventPublisher, rank 0 and rank 1, bytes hashes: the first two batches of each rank are
    published before a subscriber is told to start (they reach it only through the replay socket), the rest after
    the file ``go`` appears here."""
    from vllm.distributed.kv_events import ZmqEventPublisher

    per_rank = {r: run(r, False) for r in (0, 1)}
    pubs = {r: ZmqEventPublisher(r, endpoint=f"tcp://*:{port}", replay_endpoint=f"tcp://*:{port + 10}")
            for r in (0, 1)}
    go = HERE / "go"
    for r, (batches, _, _) in per_rank.items():
        for b in batches[:2]:
            pubs[r].publish(b)
    print("published the first batches; waiting for", go, flush=True)
    deadline = time.time() + 60
    while not go.exists() and time.time() < deadline:
        time.sleep(0.05)
    time.sleep(1.0)
    for i in range(2, max(len(b) for b, _, _ in per_rank.values())):
        for r, (batches, _, _) in per_rank.items():
            if i < len(batches):
                pubs[r].publish(batches[i])
        time.sleep(0.1)
    time.sleep(3.0)  # serve replay requests a while
    for p in pubs.values():
        p.shutdown()
    go.unlink(missing_ok=True)
    print("published", {r: len(b) for r, (b, _, _) in per_rank.items()}, flush=True)


if __name__ == "__main__":
    if sys.argv[1:2] == ["publish"]:
        publish(int(sys.argv[2]))
    else:
        main(sys.argv[1] if len(sys.argv) > 1 else "kv_events_0.9.2.py")
