"""What one rank process runs: join the process group (gloo on CPU, NCCL where there are GPUs), build its shard of
the model (:func:`~.shard.shard_model`) and a cache of the strategy asked, then serve the driver's commands one at a
time through its pipe (:class:`~.ranks.TensorParallel`): every rank runs every forward pass, and rank 0 answers with
the logits. A closed pipe (the driver gone: its kernel restarted or was killed) ends the process."""

from __future__ import annotations

import importlib
import os
import signal
import socket
import traceback
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from ..errors import SettingsError
from .reduce import Traffic


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
    start_s: float = 120.0  # the wait for every rank to meet (loading the model included)
    layouts: tuple = ()  # pd: each side's PageLayout (rank 0 prefills, rank 1 decodes)
    led: bool = False  # rank 0 is the driver's own process (an explorer lane, .lead): the group is made explicitly


#: how long a rank led by the driver's own process waits in a collective for rank 0 (the driver)
FOLLOWER_WAIT_S = 600.0


def loopback_interface() -> str | None:
    """The loopback interface's name (``lo`` on Linux, ``lo0`` on macOS), for gloo to bind its pairs to."""
    names = [name for _, name in socket.if_nameindex()] if hasattr(socket, "if_nameindex") else []
    return next((n for n in names if n.startswith("lo")), None)


def _loopback_only() -> None:
    if "GLOO_SOCKET_IFNAME" not in os.environ and (lo := loopback_interface()):
        os.environ["GLOO_SOCKET_IFNAME"] = lo  # only the loopback address, never another interface


def join(rank: int, tp: int, port: int, timeout_s: float) -> None:
    """Join the process's default group (every rank a process of its own)."""
    _loopback_only()
    backend = "nccl" if torch.cuda.is_available() else "gloo"
    if backend == "nccl":  # one GPU a rank (NCCL needs each rank's tensors on its own device)
        torch.cuda.set_device(rank % torch.cuda.device_count())
    dist.init_process_group(backend, init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=tp,
                            timeout=timedelta(seconds=timeout_s))


def group_at(port: int, rank: int, size: int, timeout_s: float, start_s: float) -> tuple[Any, Any]:
    """A group of its own, not the process's default one: ``(store, group)``, rank 0 serving the store on the
    loopback port. What an explorer lane's ranks meet in: the kernel (rank 0) may lead several lanes, each its own
    group, and a group whose rank died is simply dropped (gloo; NCCL where there are GPUs). A collective that waits
    longer than ``timeout_s`` raises; ``start_s`` bounds the meeting."""
    _loopback_only()
    store = dist.TCPStore("127.0.0.1", port, size, rank == 0, timeout=timedelta(seconds=start_s))
    if torch.cuda.is_available():
        torch.cuda.set_device(rank % torch.cuda.device_count())
        return store, dist.ProcessGroupNCCL(store, rank, size)
    return store, dist.ProcessGroupGloo(store, rank, size, timedelta(seconds=timeout_s))


def build(job: RankJob, group: Any = None):
    """The rank's model and cache (its collectives in ``group``; None: the default group)."""
    from ..caches.factory import make_cache
    from ..formats.loading import load

    device = f"cuda:{job.rank % torch.cuda.device_count()}" if torch.cuda.is_available() else "cpu"  # join()'s
    full = load(job.source, dtype=job.dtype, device=device)
    if job.mode == "pd":  # each side the whole model, on a paged cache of its own block size
        full.role, full.traffic = ("prefill" if job.rank == 0 else "decode"), Traffic()
        cache = make_cache("paged", full, max_seq_len=job.max_seq_len, block_size=job.layouts[job.rank].block_size)
        if len(cache.full_layers) != full.config.num_layers:
            raise SettingsError(f"{job.source}: prefill and decode apart sends pages of every layer; this model has "
                                f"layers the paged cache keeps outside its pages")
        return full, cache
    if job.mode == "cp":
        from .context import ContextParallelCache, Layout, context_parallel

        layout = Layout(job.tp, job.interleave, job.rank)
        model = context_parallel(full, layout, group)
        return model, ContextParallelCache(model.config, job.max_seq_len, layout, dtype=model.dtype)
    from .shard import shard_model
    from .split import split

    model = shard_model(full, split(full.config, job.tp, job.rank), group)
    del full
    return model, make_cache(job.cache, model, max_seq_len=job.max_seq_len, **job.cache_options)


def memory(model, cache, walk: bool = False) -> dict[str, Any]:
    """The rank's cache bytes: its report's, and with ``walk`` every tensor storage reachable from it, counted apart
    (a walk of the garbage collector's referents: asked for, not done every pass)."""
    from ..caches.held import referents_bytes

    report = cache.inspect.memory_report()
    part = _part(model)
    split = getattr(model, "split", None)
    return {"rank": part.rank, "describe": part.describe(), "replicas": getattr(part, "replicas", 1),
            "kv_heads": list(split.kv_heads) if split else None, "q_heads": list(split.q_heads) if split else None,
            "model_kv_heads": split.model_kv_heads if split else None,
            "positions": _held_positions(cache) if hasattr(model, "layout") else None,
            "length": cache.length, "held_bytes": report.held_bytes,
            "reachable_bytes": referents_bytes(cache) if walk else None, "logical_bytes": report.logical_bytes,
            "reserved_bytes": report.reserved_bytes}


def serve(job: RankJob, conn) -> None:
    """The rank's loop: commands in, answers out, until ``close`` or the driver's end of the pipe closes."""
    # a rank ends with its driver, not on the SIGINT its process group gets: a notebook's interrupt (the kernel's
    # group) or a server shutting its kernels down would otherwise end it with a KeyboardInterrupt traceback
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    torch.set_num_threads(job.threads)
    try:
        if job.led:  # the driver is rank 0: an explicit group, kept alive here until the loop ends
            # rank 0 watches the others within timeout_s; these wait for rank 0, which may spend longer between two
            # collectives (recording a long prefill's attention for the explorer) and whose end ends them at once
            _store, group = group_at(job.port, job.rank, job.tp, max(job.timeout_s, FOLLOWER_WAIT_S), job.start_s)
        else:
            join(job.rank, job.tp, job.port, job.timeout_s)
            group = None
        model, cache = build(job, group)
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
    if command == "forward" and getattr(model, "role", None) == "prefill":  # prefill and decode apart: it rests
        return (None, Traffic(), memory(model, cache))
    if command == "forward":  # (ids) at the cache's length, or (ids, position): the leader's cache may have been
        ids, *at = args       # cut back (a rewind, an undone step) since: follow it first
        if at and cache.length != at[0]:
            if cache.length < at[0]:
                raise SettingsError(f"the leader's pass is at position {at[0]}, this rank's cache holds only "
                                    f"{cache.length}")
            cache.truncate(at[0])
        answers = _part(model).rank == 0 or getattr(model, "role", None) == "decode"  # the rank whose logits count
        before = model.traffic.copy()
        with torch.no_grad():  # the others' output head (not split: no collective in it) on the last row only
            logits = model(torch.tensor([ids]), cache, cache.length, last_only=not answers)
        return (logits[0].cpu() if answers else None, model.traffic.since(before), memory(model, cache))
    if command == "handoff":
        return handoff(model, cache, *args)
    if command == "positions":  # every full layer's keys and values, positions 0..length-1 (a paged cache)
        from .handoff import tokens_of

        return ([tuple(t.cpu() for t in tokens_of(cache, layer, cache.length)) for layer in cache.full_layers],)
    if command == "memory":
        return (memory(model, cache, walk=True),)
    if command == "truncate":
        cache.truncate(args[0])
        return (memory(model, cache),)
    raise ValueError(f"unknown command {command!r}")


def _held_positions(cache) -> list[int]:
    """The positions layer 0's slots hold, as the cache says (a context-parallel rank's share)."""
    return [p for p in cache.inspect.slot_view(0).positions if p >= 0]


def _part(model):
    """What the rank holds: its tensor-parallel split, its context-parallel layout, or its side of a pair."""
    return getattr(model, "split", None) or getattr(model, "layout", None) or _Side(model.role)


class _Side:
    """The prefill or decode side of a pair, as the memory report names it."""

    def __init__(self, role: str) -> None:
        self.rank = 0 if role == "prefill" else 1
        self.role = role

    def describe(self) -> str:
        return f"rank {self.rank}: the {self.role} side"


def handoff(model, cache, ids: list[int], layouts: tuple, convert: bool, reading: str) -> tuple:
    """Prefill and decode apart: the two sides exchange their page layouts and each asks ``reading`` (a function's
    ``module:name``, :func:`~.handoff.agreed_reading` by default) how the decode side reads the bytes, which may
    refuse a mismatch (both sides alike, before anything is computed); then the prefill side computes the prompt and
    sends its pages, and the decode side installs them. Rank 0 answers the prompt's logits; each side what it sent
    or received."""
    from .handoff import receive, send

    theirs = [None, None]
    dist.all_gather_object(theirs, layouts[0 if model.role == "prefill" else 1])
    sender, receiver = theirs
    module, name = reading.split(":")
    read = getattr(importlib.import_module(module), name)(sender, receiver, model.config.num_layers, convert)
    if model.role == "prefill":
        if cache.length:
            cache.truncate(0)
        with torch.no_grad():
            logits = model(torch.tensor([ids]), cache, 0)
        return logits[0].cpu(), send(cache, sender, len(ids), to=1), memory(model, cache)
    return None, receive(cache, len(ids), 0, read), memory(model, cache)


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
