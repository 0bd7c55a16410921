"""Tensor and context parallelism over rank processes on this machine, side by side with one process in one run.

    python benchmarks/distributed.py                                   # tiny: 64 prompt tokens, 32 decode steps
    python benchmarks/distributed.py --model smollm2-135m --prompt 32 --steps 16
    python benchmarks/distributed.py --tp 1,2,4 --cp 2 --interleaves 1,16 --rounds 3

Configurations (every one started before the first timed step, all alive together; an idle rank blocks on its
pipe and takes no CPU):

* ``one process``: ``kvexplore.load`` + ``kvexplore.make_cache("preallocated", ...)`` and the model's forward pass
  one token at a time in this process, on ``torch.set_num_threads(1)`` (one rank's thread);
* ``tp N`` (``kvexplore.distributed.TensorParallel``, pre-allocated caches): every ``--tp`` the model's heads and
  MLP width allow (a refused one is printed with the reason); ``tp 1`` is one rank behind the pipe, the same
  arithmetic as one process, so its difference from one process is what crossing the process boundary costs;
* ``cp N, interleave I`` (``kvexplore.distributed.ContextParallel``) for each ``--cp`` and ``--interleaves``.

Each round runs every configuration in a rotating order: the prompt's pass (untimed), then ``--steps`` decode steps
on the same tokens (one process's greedy continuation, so every configuration decodes the same ids), each step's
wall clock measured in the driver around ``decode``. A configuration's figure is the median of all its steps over
``--rounds`` rounds, after one untimed warm-up round. Per configuration, from the API: the collectives of a step
(rank 0's ``last_traffic``: calls, bytes, and the seconds rank 0 spent in them, its share of the step's wall time;
the largest share among the ranks beside it), and the bytes each rank's cache holds (``memory()``) against one
process's cache. The logits of every decode step are compared with one process's (largest absolute difference).

The rank's part of a step that is neither arithmetic nor collectives: the driver pickles the ids into every rank's
pipe, each rank runs the pass, builds its memory report (``worker.memory``: the cache's report and every tensor
reachable from it, every command), pickles its answer (rank 0 the float32 logits over the vocabulary) and the driver
polls the pipes. The API does not time a rank's pass, so this part is estimated: ``tp 1`` step - one process's step -
``tp 1``'s collective seconds, with the memory report's own cost timed here on one process's cache.

The machine may be shared: the script reports the cores processes other than this one and its ranks kept busy
during the timed rounds (from /proc).
"""

from __future__ import annotations

import argparse
import datetime
import os
import platform
import statistics
import time
from types import SimpleNamespace

import torch

import kvexplore
from kvexplore.distributed import ContextParallel, TensorParallel
from kvexplore.errors import KVExploreError


# -- load from other processes: the machine's busy ticks less this process's and its ranks' ----------------------
def _busy_ticks() -> int | None:
    try:
        with open("/proc/stat") as f:
            parts = [int(x) for x in f.readline().split()[1:]]
        return sum(parts[:8]) - parts[3] - parts[4]
    except (OSError, ValueError, IndexError):
        return None


def _pid_ticks(pid: int | str) -> int:
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
        return int(fields[11]) + int(fields[12])
    except (OSError, ValueError, IndexError):
        return 0


class Load:
    """Cores kept busy by processes other than this one and the given rank processes, over a stretch of time."""

    def __init__(self, pids: list[int]) -> None:
        self.pids, self.samples = ["self", *pids], []

    def _ticks(self):
        machine = _busy_ticks()
        return None if machine is None else (machine, sum(_pid_ticks(p) for p in self.pids))

    def start(self) -> None:
        self._t0, self._ticks0 = time.perf_counter(), self._ticks()

    def stop(self) -> None:
        ticks = self._ticks()
        if ticks is None or self._ticks0 is None:
            return
        other = ((ticks[0] - self._ticks0[0]) - (ticks[1] - self._ticks0[1])) / os.sysconf("SC_CLK_TCK")
        self.samples.append(max(0.0, other / max(time.perf_counter() - self._t0, 1e-9)))

    def summary(self) -> str:
        if not self.samples:
            return "other-process load: unknown (no /proc)"
        return (f"other-process load during the timed rounds (not this process nor its ranks): mean "
                f"{statistics.mean(self.samples):.2f} cores, max {max(self.samples):.2f} (of {os.cpu_count()})")


def fmt_bytes(n: float) -> str:
    for unit, size in (("MiB", 2 ** 20), ("KiB", 2 ** 10)):
        if n >= size:
            return f"{n / size:.1f} {unit}"
    return f"{n:.0f} B"


class One:
    """The model in this process, one pre-allocated cache: the reference."""

    name = "one process"

    def __init__(self, model, max_seq_len: int) -> None:
        self.model = model
        self.cache = kvexplore.make_cache("preallocated", model, max_seq_len=max_seq_len)

    def prefill(self, ids: list[int]) -> torch.Tensor:
        self.cache.truncate(0)
        return self.model(torch.tensor([ids]), self.cache, 0)[0].float()

    def decode(self, token: int) -> torch.Tensor:
        return self.model(torch.tensor([[token]]), self.cache, self.cache.length)[0, -1].float()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="tiny")
    ap.add_argument("--prompt", type=int, default=64, help="prompt tokens (random ids)")
    ap.add_argument("--steps", type=int, default=32, help="decode steps per round")
    ap.add_argument("--rounds", type=int, default=3, help="timed rounds (after one untimed warm-up round)")
    ap.add_argument("--tp", default="1,2,3,4", help="tensor-parallel sizes to try (refused ones are reported)")
    ap.add_argument("--cp", default="2", help="context-parallel sizes")
    ap.add_argument("--interleaves", default="1,16", help="context-parallel runs of positions per rank")
    ap.add_argument("--timeout", type=float, default=60.0, help="a rank's answer to one command, seconds")
    args = ap.parse_args()
    torch.set_num_threads(1)
    torch.set_grad_enabled(False)
    capacity = args.prompt + args.steps + 1
    model = kvexplore.load(args.model, dtype=torch.float32, device="cpu")
    c = model.config
    g = torch.Generator().manual_seed(1)
    prompt = torch.randint(3, c.vocab_size, (args.prompt,), generator=g).tolist()

    one = One(model, capacity)
    logits = one.prefill(prompt)[-1]
    tokens = []  # one process's greedy continuation: the ids every configuration decodes
    for _ in range(args.steps):
        tokens.append(int(logits.argmax()))
        logits = one.decode(tokens[-1])
    ref = []
    one.prefill(prompt)
    for t in tokens:
        ref.append(one.decode(t))
    one_held = one.cache.inspect.memory_report().held_bytes

    from kvexplore.distributed.split import split
    from kvexplore.distributed.worker import memory as rank_memory
    stand_in = SimpleNamespace(split=split(c, 1, 0))
    rank_memory(stand_in, one.cache)
    t0 = time.perf_counter()
    for _ in range(20):
        rank_memory(stand_in, one.cache)
    report_s = (time.perf_counter() - t0) / 20

    print(f"# {args.model} over rank processes: {args.prompt} prompt tokens, {args.steps} decode steps, float32, "
          f"{args.rounds} rounds; {os.cpu_count()} cores ({platform.machine()}), torch {torch.__version__}, "
          f"{datetime.date.today()}")
    print(f"  the model: {c.num_heads} query heads, {c.num_kv_heads} KV heads, MLP width {c.intermediate_size}, "
          f"{len(model.model.layers)} layers, vocabulary {c.vocab_size}")
    configs: list = [one]
    try:
        for tp in [int(x) for x in args.tp.split(",") if x]:
            try:
                r = TensorParallel(args.model, tp, cache="preallocated", max_seq_len=capacity, timeout_s=args.timeout)
            except KVExploreError as e:
                print(f"  tp {tp} refused: {e}")
                continue
            r.name = f"tp {tp}"
            configs.append(r)
        for cp in [int(x) for x in args.cp.split(",") if x]:
            for interleave in [int(x) for x in args.interleaves.split(",") if x]:
                try:
                    r = ContextParallel(args.model, cp, interleave=interleave, max_seq_len=capacity,
                                        timeout_s=args.timeout)
                except KVExploreError as e:
                    print(f"  cp {cp}, interleave {interleave} refused: {e}")
                    continue
                r.name = f"cp {cp}, interleave {interleave}"
                configs.append(r)
        run(args, configs, prompt, tokens, ref, one_held, report_s)
    finally:
        for r in configs[1:]:
            r.close()


def run(args, configs, prompt, tokens, ref, one_held, report_s) -> None:
    names = [r.name for r in configs]
    steps = {n: [] for n in names}
    share = {n: [] for n in names}          # rank 0's collective seconds / the step's wall time
    top_share = {n: [] for n in names}      # the largest rank's
    coll_s = {n: [] for n in names}
    outside = {n: [] for n in names}        # the step's wall time less rank 0's collective seconds
    traffic = {}
    diff = {n: 0.0 for n in names}
    load = Load([p.pid for r in configs[1:] for p in r.processes])
    for rnd in range(args.rounds + 1):  # round 0: warm-up, untimed
        order = configs[rnd % len(configs):] + configs[:rnd % len(configs)]
        if rnd:
            load.start()
        for r in order:
            r.prefill(prompt)
            for i, t in enumerate(tokens):
                t0 = time.perf_counter()
                out = r.decode(t)
                dt = time.perf_counter() - t0
                if not rnd:
                    diff[r.name] = max(diff[r.name], float((out - ref[i]).abs().max()))
                    continue
                steps[r.name].append(dt)
                if r is not configs[0]:
                    last = r.last_traffic
                    traffic[r.name] = last[0]
                    coll_s[r.name].append(last[0].seconds)
                    outside[r.name].append(dt - last[0].seconds)
                    share[r.name].append(last[0].seconds / dt)
                    top_share[r.name].append(max(x.seconds for x in last) / dt)
        if rnd:
            load.stop()

    med = {n: statistics.median(steps[n]) for n in names}
    base = med[names[0]]
    print()
    print("| configuration | ms a decode step (min..max) | vs one process | collectives a step (rank 0) | "
          "in collectives: rank 0 (largest rank) | ms outside rank 0's collectives | held per rank | "
          "vs one process's cache | max logit diff |")
    print("|---|---:|---:|---|---:|---:|---|---:|---:|")
    for r in configs:
        n = r.name
        ms = f"{med[n] * 1e3:.2f} ({min(steps[n]) * 1e3:.1f}..{max(steps[n]) * 1e3:.1f})"
        if r is configs[0]:
            print(f"| {n} | {ms} | 1.00x | - | - | {med[n] * 1e3:.2f} | {fmt_bytes(one_held)} | 1.00x | 0 |")
            continue
        t = traffic[n]
        held = [m["held_bytes"] for m in r.memory()]
        same = len(set(held)) == 1
        held_s = fmt_bytes(held[0]) if same else " / ".join(fmt_bytes(h) for h in held)
        vs = f"{held[0] / one_held:.2f}x" if same else " / ".join(f"{h / one_held:.2f}" for h in held) + "x"
        what = "all-reduces" if isinstance(r, TensorParallel) else "all-gathers"
        print(f"| {n} | {ms} | **{med[n] / base:.2f}x** | {t.calls} {what}, {fmt_bytes(t.bytes)} | "
              f"{statistics.median(share[n]):.0%} ({statistics.median(top_share[n]):.0%}) | "
              f"{statistics.median(outside[n]) * 1e3:.2f} | {held_s} | {vs} | "
              f"{diff[n]:.1e} |")
    print()
    print(f"  wall time of a step measured in the driver around decode(); median over {args.rounds} rounds x "
          f"{args.steps} steps; 'in collectives': the seconds a rank spent inside its all-reduces or all-gathers "
          f"(waiting for the slowest rank included) / the step's wall time, median over steps; 'outside': the step "
          f"less rank 0's collective seconds (its share of the arithmetic, the pipes, the answer, and waiting for a "
          f"core), median over steps")
    tp1 = next((r.name for r in configs if r.name == "tp 1"), None)
    if tp1:
        c1 = statistics.median(coll_s[tp1])
        rest = med[tp1] - base - c1
        print(f"  crossing the process boundary (tp 1, same arithmetic as one process): {med[tp1] * 1e3:.2f} ms - "
              f"{base * 1e3:.2f} ms one process - {c1 * 1e3:.2f} ms in its one-rank all-reduces = "
              f"{rest * 1e3:.2f} ms a step for the pipe round trip and the rank's answer, of which its memory report "
              f"(built every command) takes {report_s * 1e3:.2f} ms")
    else:
        print(f"  (no tp 1 run: the pipe's share is not separated; the rank's memory report takes "
              f"{report_s * 1e3:.2f} ms a command)")
    print(f"  {load.summary()}")
    print("  why slower than one process here: every step crosses process boundaries (ids pickled into each rank's "
          "pipe, logits back from rank 0) and every layer waits on gloo collectives over the loopback address "
          f"(tp: 2 all-reduces a layer; cp: 2 all-gathers a layer); a configuration's ranks (one thread each) "
          f"share {os.cpu_count()} cores with the driver, so a rank often waits for a peer to be scheduled, which "
          "counts as collective time; and the products are too small for a share of them to save more than a "
          "collective costs.")


if __name__ == "__main__":
    main()
