"""``TensorParallel``: a model run over ``tp`` rank processes on this machine (each spawned, joined by
``torch.distributed`` on a free loopback port, holding its shard and its own cache), driven from the calling process
(a script, a notebook's kernel, the explorer) one forward pass at a time. The driver never joins the group: a rank
that dies or hangs cannot hang it. Every command waits at most ``timeout_s``; a rank that exits or does not answer
stops every rank and raises :class:`RankError` naming it. Closing the driver (``close()``, ``with``, garbage
collection, the interpreter's exit) stops the ranks; a driver killed outright closes their pipes, which ends them."""

from __future__ import annotations

import multiprocessing
import socket
import time
import weakref
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from ..errors import RankError, SettingsError
from .reduce import Traffic
from .worker import RankJob, main

START_TIMEOUT_S = 120.0  # loading the model in every rank (a real model takes seconds each on 2 cores)


@dataclass(frozen=True)
class Pass:
    """One forward pass over the ranks: at ``position``, ``tokens`` fed, ``seconds`` the driver waited for it (the
    pipe included), ``traffic`` each rank's collectives in it (bytes, calls, the seconds spent in them)."""

    position: int
    tokens: int
    seconds: float
    traffic: list[Traffic]

    @property
    def collective_share(self) -> float:
        """The largest share of the pass any rank spent in its collectives (waiting for the others included)."""
        return max(t.seconds for t in self.traffic) / self.seconds if self.seconds else 0.0


def free_port() -> int:
    """A TCP port free on the loopback address now (the group's meeting point)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _stop(processes: list, conns: list) -> None:
    for conn in conns:
        try:
            conn.send(("close",))
        except (OSError, ValueError, BrokenPipeError):
            pass
    for p in processes:
        if p.is_alive() and _stopped(p.pid):  # stopped by a signal or a debugger: it will not read "close"
            p.kill()
    deadline = time.monotonic() + 3.0
    for p in processes:
        p.join(max(0.0, deadline - time.monotonic()))
    for p in processes:
        if p.is_alive():
            p.kill()
            p.join(5.0)
    for conn in conns:
        conn.close()


class Ranks:
    """A model over ``tp`` rank processes (:class:`TensorParallel`, :class:`ContextParallel`): ``prefill(ids)`` and
    ``decode(token)`` give the float32 logits, ``generate(prompt, n)`` greedy tokens, ``memory()`` each rank's bytes,
    ``traffic`` each rank's collectives."""

    mode = "tp"
    what = "tensor parallel"
    layouts: tuple = ()
    logits_rank = 0  # the rank whose logits a pass answers
    first = 0  # the first rank spawned (1: the driver is rank 0 itself, .lead)

    def __init__(self, source: str, tp: int, cache: str = "preallocated", max_seq_len: int = 256,
                 dtype: str | None = None, timeout_s: float = 30.0, threads: int = 1, interleave: int = 1,
                 **cache_options: Any) -> None:
        from ..formats.loading import load_config

        self.config = load_config(source)
        self.check(self.config, tp, interleave, cache)  # refused here, before any process starts
        self.source, self.tp, self.timeout_s, self.interleave = source, tp, timeout_s, interleave
        self.cache_kind, self.cache_options = cache, dict(cache_options)
        self.tokens: list[int] = []
        self.steps: list[Pass] = []  # every pass: its tokens, the driver's wall time, each rank's traffic
        port = free_port()
        ctx = multiprocessing.get_context("spawn")  # a fresh interpreter per rank: safe from a notebook's kernel
        self._conns, self.processes = [], []
        for rank in range(self.first, tp):
            here, there = ctx.Pipe()
            job = RankJob(rank, tp, port, str(source), cache, dict(cache_options), max_seq_len, dtype, threads,
                          timeout_s, self.mode, interleave, START_TIMEOUT_S, self.layouts, led=self.first > 0)
            p = ctx.Process(target=main, args=(job, there), name=f"kvexplore rank {rank} of {tp}", daemon=True)
            p.start()
            there.close()
            self._conns.append(here)
            self.processes.append(p)
        self._finalizer = weakref.finalize(self, _stop, self.processes, self._conns)
        self._meet(port)
        self._memory = [a[0] for a in self._gather("start", START_TIMEOUT_S)]

    def _meet(self, port: int) -> None:
        """What the driver does while its ranks start (a leader joins them as rank 0: :mod:`.lead`)."""

    @staticmethod
    def check(config, tp: int, interleave: int, cache: str) -> None:
        """Refuse what cannot be split, before any process starts."""

    # -- commands ----------------------------------------------------------------------------------------------
    def _gather(self, command: str, timeout_s: float) -> list[tuple]:
        """Every rank's answer to the command just sent (in rank order). Every rank refusing it alike (a full
        cache, checked before any collective) raises that error and keeps the ranks; a rank that failed alone,
        exited or did not answer within ``timeout_s`` stops them all (:class:`RankError`)."""
        answers: list[tuple | None] = [None] * len(self._conns)
        deadline = time.monotonic() + timeout_s
        while any(a is None for a in answers):
            for i, conn in enumerate(self._conns):
                if answers[i] is None and conn.poll(0.02):
                    try:
                        answers[i] = conn.recv()
                    except (EOFError, OSError):  # its end of the pipe closed: the process is ending
                        self.processes[i].join(2.0)
                        self._fail(f"rank {i + self.first} of {self.tp} stopped "
                                   f"({_exit(self.processes[i].exitcode)}) during {command!r}")
            for i, p in enumerate(self.processes):
                if answers[i] is None and not p.is_alive():
                    self._fail(f"rank {i + self.first} of {self.tp} stopped ({_exit(p.exitcode)}) during {command!r}")
            if time.monotonic() > deadline:
                late = [str(i + self.first) for i, a in enumerate(answers) if a is None]
                stopped = [str(i + self.first) for i, p in enumerate(self.processes) if _stopped(p.pid)]
                why = (f"rank{'s' if len(stopped) > 1 else ''} {', '.join(stopped)} stopped by a signal or a "
                       f"debugger; " if stopped else "")
                self._fail(f"rank{'s' if len(late) > 1 else ''} {', '.join(late)} of {self.tp} did not answer "
                           f"{command!r} within {timeout_s:g} s ({why}a collective waits for every rank: one rank "
                           f"that hangs holds up the rest)")
        errors = {a[1] for a in answers if a[0] == "error"}
        if len(errors) == 1 and all(a[0] == "error" for a in answers) and command != "start":
            raise SettingsError(f"every rank refused {command!r}, and each kept its cache as it was: "
                                f"{errors.pop()}")
        for i, a in enumerate(answers):
            if a[0] == "error":
                self._fail(f"rank {i + self.first} of {self.tp} failed during {command!r}: {a[1]}", a[2])
        return [a[1:] for a in answers]

    @property
    def again(self) -> str:
        """What starts the ranks again, in words."""
        return f"start a new {type(self).__name__}"

    def _fail(self, why: str, detail: str = "") -> None:
        self.close()
        raise RankError(f"{why}; every rank was stopped: {self.again}" + (f"\n{detail}" if detail else ""))

    def _send(self, *command: Any) -> None:
        gone = [i for i, p in enumerate(self.processes) if not p.is_alive()]
        if self._finalizer.alive and gone:  # one exited (killed, say) since the last command
            self._fail(f"rank {gone[0] + self.first} of {self.tp} stopped "
                       f"({_exit(self.processes[gone[0]].exitcode)}) before {command[0]!r}")
        if not self.alive:
            raise RankError(f"the ranks were stopped (closed, or after a rank failed): {self.again}")
        for i, conn in enumerate(self._conns):
            try:
                conn.send(command)
            except (OSError, BrokenPipeError):
                self._fail(f"rank {i + self.first} of {self.tp} is gone ({_exit(self.processes[i].exitcode)})")

    def forward(self, ids: Sequence[int]) -> torch.Tensor:
        """Run ``ids`` at the cache's length on every rank; the float32 logits ``(len(ids), vocab)``."""
        ids = [int(t) for t in ids]
        if not ids:
            raise SettingsError("forward needs at least one token id")
        start = time.perf_counter()
        self._send("forward", ids)
        answers = self._gather("forward", self.timeout_s)
        self.steps.append(Pass(len(self.tokens), len(ids), time.perf_counter() - start,
                               [a[1] for a in answers]))
        self._memory = [a[2] for a in answers]
        self.tokens += ids
        return answers[self.logits_rank][0]

    def prefill(self, ids: Sequence[int]) -> torch.Tensor:
        """The prompt's pass from position 0 (the caches emptied first)."""
        if self.tokens:
            self.truncate(0)
        return self.forward(ids)

    def decode(self, token: int) -> torch.Tensor:
        """One token's pass; its logits ``(vocab,)``."""
        return self.forward([token])[-1]

    def truncate(self, n: int) -> None:
        self._send("truncate", int(n))
        self._memory = [a[0] for a in self._gather("truncate", self.timeout_s)]
        del self.tokens[n:]

    def greedy(self, prompt: Sequence[int], n: int) -> tuple[list[int], list[torch.Tensor]]:
        """``n`` greedy tokens after ``prompt`` (every rank computes the same logits; rank 0's choose), and the logits
        of each pass: the prompt's ``(len(prompt), vocab)``, then one ``(vocab,)`` row a token."""
        logits = [self.prefill(prompt)]
        tokens = [int(logits[-1][-1].argmax())]
        while len(tokens) < n:
            logits.append(self.decode(tokens[-1]))
            tokens.append(int(logits[-1].argmax()))
        return tokens, logits

    def generate(self, prompt: Sequence[int], n: int) -> list[int]:
        """``n`` greedy tokens after ``prompt``."""
        return self.greedy(prompt, n)[0]

    @property
    def traffic(self) -> list[Traffic]:
        """Each rank's collectives over every pass so far (the sum of :attr:`steps`)."""
        total = [Traffic() for _ in range(self.tp)]
        for step in self.steps:
            for t, more in zip(total, step.traffic):
                t.calls, t.bytes, t.seconds = t.calls + more.calls, t.bytes + more.bytes, t.seconds + more.seconds
        return total

    @property
    def last_traffic(self) -> list[Traffic]:
        """Each rank's collectives in the last pass."""
        return list(self.steps[-1].traffic) if self.steps else [Traffic() for _ in range(self.tp)]

    def memory(self) -> list[dict[str, Any]]:
        """Each rank's cache bytes now: ``held_bytes`` (its report), ``reachable_bytes`` (every tensor storage
        reachable from its cache, counted apart), what it holds (``describe``, ``replicas``, ``positions``)."""
        self._send("memory")
        self._memory = [a[0] for a in self._gather("memory", self.timeout_s)]
        return [dict(m) for m in self._memory]

    def describe(self) -> str:
        lines = [f"{self.source} over {self.tp} ranks ({self.what}), {self.cache_kind} caches, "
                 f"{len(self.tokens)} positions:"]
        if (replicas := self._memory[0]["replicas"]) > 1:
            lines.append(f"  tp {self.tp} > the model's {self.config.num_kv_heads} KV heads: each KV head is held by "
                         f"{replicas} ranks (replicated, as vLLM does), so a rank holds 1/{self.config.num_kv_heads} "
                         f"of the cache, not 1/{self.tp}")
        total = sum(m["held_bytes"] for m in self._memory)
        for m, t in zip(self._memory, self.traffic):
            lines.append(f"  {m['describe']}: {m['held_bytes']:,} bytes held ({m['held_bytes'] / max(total, 1):.0%}); "
                         f"{self.collective} {t.calls:,}, {t.bytes:,} bytes, {t.seconds * 1e3:.1f} ms")
        return "\n".join(lines)

    # -- life ----------------------------------------------------------------------------------------------------
    @property
    def alive(self) -> bool:
        return self._finalizer.alive and all(p.is_alive() for p in self.processes)

    def close(self) -> None:
        """Stop every rank (waits for them to exit; kills one that does not within 3 s)."""
        self._finalizer()

    def __enter__(self) -> "Ranks":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class TensorParallel(Ranks):
    """``source`` (a named model or folder) split over ``tp`` ranks by tensor parallelism (:mod:`.split`): each rank
    computes its share of the heads and the MLP, and holds a cache of strategy ``cache`` (its options as keywords)
    of only its KV heads; ``traffic`` counts the all-reduces."""

    collective = "all-reduces"

    @staticmethod
    def check(config, tp: int, interleave: int, cache: str) -> None:
        from .split import check_splittable

        check_splittable(config, tp)


class ContextParallel(Ranks):
    """``source`` over ``cp`` ranks by context parallelism (:mod:`.context`): each rank holds the whole model and
    the positions ``p`` with ``(p // interleave) % cp == rank``; attention merges the ranks' shares by log-sum-exp
    (``traffic`` counts the all-gathers)."""

    mode, what, collective = "cp", "context parallel", "all-gathers"

    def __init__(self, source: str, cp: int, interleave: int = 1, max_seq_len: int = 256, dtype: str | None = None,
                 timeout_s: float = 30.0, threads: int = 1) -> None:
        super().__init__(source, cp, "context-parallel", max_seq_len, dtype, timeout_s, threads, interleave)

    @staticmethod
    def check(config, tp: int, interleave: int, cache: str) -> None:
        from .context import Layout, check_mergeable

        Layout(tp, interleave, 0)
        check_mergeable(config)


def _stopped(pid: int | None) -> bool:
    """The process is stopped (SIGSTOP, a debugger), where /proc says (Linux); False where it cannot tell."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[-1].split()[0] in ("T", "t")
    except (OSError, IndexError):
        return False


def _exit(code: int | None) -> str:
    if code is None:
        return "still running"
    return f"killed by signal {-code}" if code < 0 else f"exit code {code}"


class Disaggregated(Ranks):
    """Prefill and decode apart (:mod:`.handoff`): rank 0 computes a prompt into its paged cache and sends the pages
    to rank 1, which continues decoding; ``prefill`` and ``decode`` side laid out as their :class:`PageLayout` says
    (a mismatch is refused naming both, before anything is computed). ``handoff``: what the last prompt's transfer
    carried; ``positions()``: the decode side's keys and values, every layer, to compare with one process."""

    mode, what, collective = "pd", "prefill and decode apart", "transfers"
    logits_rank = 1
    #: how the decode side reads what it was sent (``module:function``, run in the rank processes): kvexplore's
    #: checks the two layouts agree; the bug zoo's subclasses name planted readings
    reading = "kvexplore.distributed.handoff:agreed_reading"

    def __init__(self, source: str, prefill=None, decode=None, max_seq_len: int = 256, dtype: str | None = None,
                 timeout_s: float = 30.0, threads: int = 1, convert: bool = False) -> None:
        from .handoff import PageLayout

        self.layouts = (prefill or PageLayout(), decode or PageLayout())
        self.convert = convert  # read the sender's layout rather than refuse it
        self.handoff = None
        super().__init__(source, 2, "paged", max_seq_len, dtype, timeout_s, threads)

    @staticmethod
    def check(config, tp: int, interleave: int, cache: str) -> None:
        pass

    def prefill(self, ids: Sequence[int]) -> torch.Tensor:
        """The prompt computed on the prefill side, its pages sent to the decode side; the prompt's logits."""
        ids = [int(t) for t in ids]
        if not ids:
            raise SettingsError("prefill needs at least one token id")
        self._send("handoff", ids, self.layouts, self.convert, self.reading)
        answers = self._gather("handoff", self.timeout_s)
        (logits, self.handoff, first), (_, self.received, second) = answers
        self._memory = [first, second]
        self.tokens = list(ids)
        return logits

    def describe(self) -> str:
        lines = [f"{self.source}, prefill and decode apart, {len(self.tokens)} positions:"]
        for m, layout in zip(self._memory, self.layouts):
            lines.append(f"  {m['describe']} ({layout.describe()}): {m['held_bytes']:,} bytes held")
        if self.handoff is not None:
            h = self.handoff
            lines.append(f"  the prompt's transfer: {h.positions} positions in {h.pages} pages, {h.bytes:,} bytes, "
                         f"{h.seconds * 1e3:.1f} ms")
        return "\n".join(lines)

    def positions(self, side: str = "decode") -> list[tuple[torch.Tensor, torch.Tensor]]:
        """One side's keys and values per layer, ``(kv_heads, length, head_dim)`` each."""
        if side not in ("prefill", "decode"):
            raise SettingsError(f"side is 'prefill' or 'decode', got {side!r}")
        self._send("positions")
        return self._gather("positions", self.timeout_s)[side == "decode"][0]
