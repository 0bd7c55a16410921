"""Bytes a Step sends to the page, per figure, at 128, 1,024 and 4,096 tokens: does it depend on the screen or on
the context?

    python benchmarks/step_payload.py                          # this checkout only
    python benchmarks/step_payload.py --before /work/main      # and another checkout, side by side, with ratios
    python benchmarks/step_payload.py --model smollm2-135m --tokens 128,1024

Each checkout runs in its own process whose ``PYTHONPATH`` is that checkout. There an explorer (two lanes,
pre-allocated and paged, one torch thread) prefills the first N tokens of the project's own docs, then for each view
on the tabs (attention, memory, stored K/V, compare) shows it and takes ``--steps`` Steps. What is measured is what
the widgets really send: every figure widget's ``_send`` (ipywidgets' last stop before the comm) is wrapped and
counts the message's JSON and its binary buffers. The cache map is on screen throughout; its figures are over all the
Steps, each other figure's over the Steps while its tab was shown: the median Step, and the most any Step sent (a
new base: the first Step after the prefill, or one that changes the bins). ``strip`` is the token strip's HTML (not a
figure), for comparison.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent.parent
TABS = ("attention", "memory", "tensors", "compare")


def measure(model: str, tokens: list[int], steps: int) -> dict[int, dict[str, list[float]]]:
    """Bytes per Step per figure at each length, the median and the most of any Step (run inside the checkout's
    process)."""
    import torch

    torch.set_num_threads(1)
    import kvexplore

    text = "\n".join(p.read_text() for p in sorted((HERE / "docs").glob("*.md")) + [HERE / "README.md"])
    out = {}
    for n in tokens:
        ex = kvexplore.Explorer(model, strategies=("preallocated", "paged"), max_seq_len=n + 8 * steps + 16)
        ids = ex.model.tokenizer.encode(text)[:n]
        assert len(ids) == n, f"the docs have only {len(ids)} tokens"
        widgets = {**ex.figures, "strip": ex.controls["tokens"]}  # (the token strip: not a figure, for comparison)
        sent: dict[str, list[int]] = {name: [] for name in widgets}
        for name, fig in widgets.items():
            def counted(msg, buffers=None, _name=name, _send=fig._send):
                sent[_name].append(len(json.dumps(msg, default=str)) + sum(memoryview(b).nbytes
                                                                          for b in buffers or ()))
                return _send(msg, buffers=buffers)
            fig._send = counted
        ex.prefill(ids)
        per: dict[str, list[int]] = {name: [] for name in widgets}
        for tab in TABS:
            ex.view = tab
            for _ in range(steps):
                marks = {k: len(v) for k, v in sent.items()}
                ex.step()
                for k in ("cache_map", "strip", tab):
                    per[k].append(sum(sent[k][marks[k]:]))
        out[n] = {k: [statistics.median(v), max(v)] for k, v in per.items() if v}
        del ex
    return out


def run(checkout: Path, args) -> dict[int, dict[str, list[float]]]:
    cmd = [sys.executable, str(Path(__file__).resolve()), "--measure", "--model", args.model, "--tokens",
           args.tokens, "--steps", str(args.steps)]
    res = subprocess.run(cmd, env={**os.environ, "PYTHONPATH": str(checkout)}, cwd=checkout, capture_output=True,
                         text=True)
    if res.returncode != 0:
        raise SystemExit(f"the measurement failed in {checkout}:\n{res.stderr[-4000:]}")
    return {int(k): v for k, v in json.loads(res.stdout.strip().splitlines()[-1]).items()}


def _kb(b: float) -> str:
    return f"{b / 1e6:.2f} MB" if b >= 1e6 else f"{b / 1e3:.1f} KB"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default="tiny")
    ap.add_argument("--tokens", default="128,1024,4096")
    ap.add_argument("--steps", type=int, default=6)
    ap.add_argument("--before", type=Path, help="another checkout to compare with (this one is 'after')")
    ap.add_argument("--measure", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args()
    tokens = [int(t) for t in args.tokens.split(",")]
    if args.measure:
        print(json.dumps(measure(args.model, tokens, args.steps)))
        return
    after = run(HERE, args)
    before = run(args.before.resolve(), args) if args.before else None
    print(f"bytes sent per Step per figure · {args.model} · lanes preallocated + paged · median and most of "
          f"{args.steps} Steps per tab (the first after the prefill among them)")
    head = f"{'tokens':>7} {'figure':<10} {'after: median':>14} {'most':>10}"
    print(head + (f" {'before: median':>15} {'most':>10} {'after/before (median)':>22}" if before else ""))
    for n in tokens:
        for fig in ("cache_map", *TABS, "strip"):
            a = after[n].get(fig, [0.0, 0.0])
            line = f"{n:>7} {fig:<10} {_kb(a[0]):>14} {_kb(a[1]):>10}"
            if before:
                b = before[n].get(fig, [0.0, 0.0])
                line += f" {_kb(b[0]):>15} {_kb(b[1]):>10} {a[0] / b[0] if b[0] else float('nan'):>22.3f}"
            print(line)


if __name__ == "__main__":
    main()
