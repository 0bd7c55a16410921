"""What one rank process runs: join the process group (gloo on CPU, NCCL where there are GPUs), build its shard of
the model (:func:`~.shard.shard_model`) and a cache of the strategy asked, then serve the driver's commands one at a
time through its pipe (:class:`~.ranks.TensorParallel`): every rank runs every forward pass, and rank 0 answers with
the logits. A closed pipe (the driver gone: its kernel restarted or was killed) ends the process."""

from __future__ import annotations

import os
import socket
import traceback
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import torch


@dataclass(frozen=True)
class RankJob:
    """Everything a rank needs to start: where the group meets, the model and the cache."""

    rank: int
    tp: int            # the number of ranks (tensor or context parallel)
    port: int
    source: str
    cache: str
    cache_options: dict
    max_seq_len: int
    dtype: str | None
    threads: int
    timeout_s: float
    mode: str = "tp"   # "tp": tensor parallel (a shard of the heads); "cp": context parallel (a share of positions)
    interleave: int = 1  # cp: positions in runs of this many per rank


def loopback_interface() -> str | None:
    """The loopback interface's name (``lo`` on Linux, ``lo0`` on macOS), for gloo to bind its pairs to."""
    names = [name for _, name in socket.if_nameindex()] if hasattr(socket, "if_nameindex") else []
    return next((n for n in names if n.startswith("lo")), None)


def join(rank: int, tp: int, port: int, timeout_s: float) -> None:
    import torch.distributed as dist

    if "GLOO_SOCKET_IFNAME" not in os.environ and (lo := loopback_interface()):
        os.environ["GLOO_SOCKET_IFNAME"] = lo  # only the loopback address, never another interface
    backend = "nccl" if torch.cuda.is_available() else "gloo"
    dist.init_process_group(backend, init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=tp,
                            timeout=timedelta(seconds=timeout_s))


def build(job: RankJob):
    """The rank's model and cache."""
    from ..caches.factory import make_cache
    from ..formats.loading import load

    full = load(job.source, dtype=job.dtype) if job.dtype else load(job.source)
    if job.mode == "cp":
        from .context import ContextParallelCache, Layout, context_parallel

        layout = Layout(job.tp, job.interleave, job.rank)
        model = context_parallel(full, layout)
        return model, ContextParallelCache(model.config, job.max_seq_len, layout, dtype=model.dtype)
    from .shard import shard_model
    from .split import split

    model = shard_model(full, split(full.config, job.tp, job.rank))
    del full
    return model, make_cache(job.cache, model, max_seq_len=job.max_seq_len, **job.cache_options)


def memory(model, cache) -> dict[str, Any]:
    """The rank's cache bytes: its report's and every tensor storage reachable from it, counted apart."""
    from ..caches.held import referents_bytes

    report = cache.inspect.memory_report()
    part = getattr(model, "split", None) or model.layout
    held = [p for p in cache.inspect.slot_view(0).positions if p >= 0]  # layer 0's slots, as the cache says
    return {"rank": part.rank, "describe": part.describe(), "replicas": getattr(part, "replicas", 1),
            "positions": held if hasattr(model, "layout") else None,
            "length": cache.length, "held_bytes": report.held_bytes,
            "reachable_bytes": referents_bytes(cache), "logical_bytes": report.logical_bytes,
            "reserved_bytes": report.reserved_bytes}


def serve(job: RankJob, conn) -> None:
    """The rank's loop: commands in, answers out, until ``close`` or the driver's end of the pipe closes."""
    torch.set_num_threads(job.threads)
    try:
        join(job.rank, job.tp, job.port, job.timeout_s)
        model, cache = build(job)
        conn.send(("ready", memory(model, cache)))
    except Exception as e:  # noqa: BLE001 (the driver says what failed, with the rank's traceback)
        conn.send(("error", f"{type(e).__name__}: {e}", traceback.format_exc()))
        return
    while True:
        try:
            command, *args = conn.recv()
        except (EOFError, OSError):  # the driver is gone
            return
        if command == "close":
            conn.send(("closed",))
            return
        try:
            conn.send(("ok", *run(command, args, model, cache)))
        except Exception as e:  # noqa: BLE001
            conn.send(("error", f"{type(e).__name__}: {e}", traceback.format_exc()))


def run(command: str, args: list, model, cache) -> tuple:
    """One command: ``forward`` (token ids at the cache's length; rank 0 answers the float32 logits), ``memory``
    or ``truncate`` (back to a length)."""
    if command == "forward":
        (ids,) = args
        before = model.traffic.copy()
        with torch.no_grad():
            logits = model(torch.tensor([ids]), cache, cache.length)
        rank = (getattr(model, "split", None) or model.layout).rank
        return (logits[0] if rank == 0 else None, model.traffic.since(before), memory(model, cache))
    if command == "memory":
        return (memory(model, cache),)
    if command == "truncate":
        cache.truncate(args[0])
        return (memory(model, cache),)
    raise ValueError(f"unknown command {command!r}")


def main(job: RankJob, conn) -> None:
    """The process's entry point (spawned by the driver)."""
    try:
        serve(job, conn)
    finally:
        try:
            import torch.distributed as dist

            if dist.is_initialized():
                dist.destroy_process_group()
        except Exception:  # noqa: BLE001 (a peer already gone: nothing to tear down)
            pass
        conn.close()
