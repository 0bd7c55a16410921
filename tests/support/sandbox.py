"""Run test cases each in its own process, with a timeout and a memory limit, forked from a warm interpreter.

A forkserver process imports torch and kvexplore once; every case is a fork of it (milliseconds, not the seconds
a fresh interpreter takes to import torch). A case is ``(name, function, args)`` with ``function`` a module-level
callable of ``tests/support/hostile_cases.py`` (defined in ``hostile_files.py`` or ``hostile_misuses.py``); it returns a
short string (its outcome). What comes back per case:

- ``ok:<outcome>``: it returned;
- ``kvx:<ErrorType>:<message>``: it raised a kvexplore error (what bad input must give);
- ``foreign:<ErrorType>:<message>\\n<traceback>``: it raised anything else (a defect);
- ``hang``: it ran past the timeout and was killed;
- ``crash:<exit code>``: the process died without an answer (a signal, an abort, the memory limit).
"""

from __future__ import annotations

import multiprocessing as mp
import os
import resource
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass

PRELOAD = ["torch", "sandbox_warmup", "kvexplore", "kvexplore.explorer.session", "safetensors", "gguf", "sentencepiece",
           "tokenizers", "hostile_files", "hostile_misuses", "hostile_cases"]
_context: mp.context.BaseContext | None = None


def context() -> mp.context.BaseContext:
    global _context
    if _context is None:
        from multiprocessing import forkserver

        _context = mp.get_context("forkserver")
        _context.set_forkserver_preload(PRELOAD)
        # the server imports PRELOAD with its own sys.path (not the caller's): let it find these test modules (its
        # products run on F.linear, as in every process the suite starts: tests/conftest.py)
        saved = os.environ.get("PYTHONPATH")
        here = os.path.dirname(os.path.abspath(__file__))
        os.environ["PYTHONPATH"] = here + (os.pathsep + saved if saved else "")
        try:
            forkserver.ensure_running()
        finally:
            if saved is None:
                del os.environ["PYTHONPATH"]
            else:
                os.environ["PYTHONPATH"] = saved
    return _context


@dataclass
class Result:
    name: str
    outcome: str
    seconds: float

    @property
    def kind(self) -> str:
        return self.outcome.split(":", 1)[0]


def _vm_bytes() -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmSize:"):
                return int(line.split()[1]) * 1024
    return 0


def _child(conn, function: Callable, args: tuple, extra_memory: int) -> None:
    limit = _vm_bytes() + extra_memory
    resource.setrlimit(resource.RLIMIT_AS, (limit, limit))
    import torch

    torch.set_num_threads(1)
    from kvexplore.errors import KVExploreError

    try:
        outcome = f"ok:{function(*args)}"
    except KVExploreError as e:
        outcome = f"kvx:{type(e).__name__}:{e}"
    except BaseException as e:  # noqa: BLE001 - classifying is the point
        outcome = f"foreign:{type(e).__name__}:{e}\n{traceback.format_exc()}"
    conn.send(outcome)
    conn.close()
    os._exit(0)


def run(cases: list[tuple[str, Callable, tuple]], timeout: float = 20.0, extra_memory: int = 3 << 30,
        workers: int = 2) -> list[Result]:
    """Every case, ``workers`` at a time; results in the order of ``cases``."""
    ctx = context()
    results: dict[int, Result] = {}
    pending = list(enumerate(cases))
    running: dict[int, tuple] = {}
    while pending or running:
        while pending and len(running) < workers:
            i, (name, function, args) = pending.pop(0)
            parent, child = ctx.Pipe(duplex=False)
            proc = ctx.Process(target=_child, args=(child, function, args, extra_memory), daemon=True)
            proc.start()
            child.close()
            running[i] = (name, proc, parent, time.monotonic())
        for i, (name, proc, conn, start) in list(running.items()):
            elapsed = time.monotonic() - start
            outcome = None
            if conn.poll():
                try:
                    outcome = conn.recv()
                except EOFError:
                    outcome = None
                proc.join(5)
                if outcome is None:
                    outcome = f"crash:{proc.exitcode}"
            elif not proc.is_alive():
                proc.join()
                outcome = conn.recv() if conn.poll() else f"crash:{proc.exitcode}"
            elif elapsed > timeout:
                proc.kill()
                proc.join()
                outcome = "hang"
            if outcome is not None:
                conn.close()
                results[i] = Result(name, outcome, elapsed)
                del running[i]
        time.sleep(0.005)
    return [results[i] for i in range(len(cases))]
