"""The tables and the figure of ``eviction_quality.py report``: read the saved results (``docs/img/eviction_*.json``),
write the frontier figure (plotly HTML; a static SVG too when kaleido is installed) and print the markdown tables of
docs/benchmarks.md."""

from __future__ import annotations

import json
from pathlib import Path

MARK = {True: "✓", False: "✗"}


def _frontier_table(rows: list[dict]) -> str:
    head, rows = rows[0], rows[1:]
    model = {"smollm2-135m": "SmolLM2-135M"}.get(head.get("model", "smollm2-135m"), head.get("model"))
    out = [f"{model} float32, {head['context']} context tokens, {head['continuation']} continuation tokens "
           f"(full cache: {head['full_used_bytes'] / 2**20:.1f} MiB used at the end, perplexity "
           f"{head['full_perplexity']:.2f}).", "",
           "| cache | budget | bytes used (of full) | reserved (of full) | KL mean (nats) | KL max | top-1 | "
           "perplexity | attention mass on kept |", "|---|---|---:|---:|---:|---:|---:|---:|---:|"]
    for r in rows:
        budget = f"ratio {r['ratio']}" if r["ratio"] is not None and r["kind"] != "full" else "—"
        if r["kind"] == "sink":
            budget = f"{r['name']} (as ratio {r['ratio']})"
        name = r["name"] if r["kind"] in ("evict", "evict decode") else r["kind"] if r["kind"] in ("full", "sink") \
            else f"{r['kind']} {r['name']}"
        out.append(f"| {name} | {budget} | {r['used_bytes'] / 2**20:.1f} MiB ({r['used_fraction']:.0%}) | "
                   f"{r['reserved_fraction']:.0%} | {r['kl_mean']:.3g} | {r['kl_max']:.2g} | {r['top1']:.3f} | "
                   f"{r['perplexity']:.2f} | {r['attention_mass']:.3f} |")
    return "\n".join(out)


def _series(rows: list[dict]) -> dict[str, list[dict]]:
    out: dict[str, list[dict]] = {}
    for r in rows[1:]:
        key = r["name"] if r["kind"] == "evict" else r["kind"] if r["kind"] != "evict decode" else r["name"]
        key = "quantized (KIVI)" if key == "quantized" else key
        out.setdefault(key, []).append(r)
    return out


COLORS = ("#1f77b4", "#ff7f0e", "#2ca02c", "#d62728", "#9467bd", "#8c564b", "#e377c2", "#7f7f7f", "#bcbd22",
          "#17becf", "#393b79", "#637939", "#843c39")


def frontier_svg(rows: list[dict], path: Path) -> Path:
    """The KL panel as a plain SVG (no kaleido needed): mean KL (log scale) against bytes used, one line per cache."""
    import math

    W, H, left, right, top, bottom = 760, 440, 70, 200, 40, 50
    series = _series(rows)
    kls = [r["kl_mean"] for ss in series.values() for r in ss if r["kl_mean"] > 0]
    lo, hi = math.floor(math.log10(min(kls))), math.ceil(math.log10(max(kls)))

    def x(f: float) -> float:
        return left + f * (W - left - right)

    def y(kl: float) -> float:
        v = math.log10(max(kl, 10 ** lo))
        return top + (hi - v) / (hi - lo) * (H - top - bottom)

    out = [f'<svg xmlns="http://www.w3.org/2000/svg" width="{W}" height="{H}" font-family="sans-serif" '
           f'font-size="12"><rect width="{W}" height="{H}" fill="white"/>',
           f'<text x="{left}" y="22" font-size="14">Mean KL(full || compressed) per token against bytes used, '
           f'SmolLM2-135M (full cache: KL 0 at 100%)</text>']
    for e in range(lo, hi + 1):
        out.append(f'<line x1="{left}" x2="{W - right}" y1="{y(10 ** e):.1f}" y2="{y(10 ** e):.1f}" stroke="#ddd"/>'
                   f'<text x="{left - 6}" y="{y(10 ** e) + 4:.1f}" text-anchor="end">1e{e}</text>')
    for i in range(0, 11, 2):
        out.append(f'<line x1="{x(i / 10):.1f}" x2="{x(i / 10):.1f}" y1="{top}" y2="{H - bottom}" stroke="#eee"/>'
                   f'<text x="{x(i / 10):.1f}" y="{H - bottom + 16}" text-anchor="middle">{i * 10}%</text>')
    out.append(f'<text x="{(left + W - right) / 2}" y="{H - 12}" text-anchor="middle">bytes used at the end, share '
               f'of the full cache</text>')
    for k, (name, ss) in enumerate(series.items()):
        c = COLORS[k % len(COLORS)]
        pts = sorted((r["used_fraction"], r["kl_mean"]) for r in ss if r["kl_mean"] > 0)  # the full cache: KL 0
        if not pts:
            continue
        if len(pts) > 1:
            path_d = " ".join(f"{x(f):.1f},{y(v):.1f}" for f, v in pts)
            out.append(f'<polyline points="{path_d}" fill="none" stroke="{c}" stroke-width="2"/>')
        out += [f'<circle cx="{x(f):.1f}" cy="{y(v):.1f}" r="4" fill="{c}"/>' for f, v in pts]
        ly = top + 10 + 18 * k
        out.append(f'<circle cx="{W - right + 20}" cy="{ly}" r="4" fill="{c}"/>'
                   f'<text x="{W - right + 30}" y="{ly + 4}">{name}</text>')
    out.append("</svg>")
    path.write_text("\n".join(out))
    return path


def frontier_figure(rows: list[dict], folder: Path) -> list[Path]:
    """Quality (KL, top-1) against bytes used, one line per press, the quantized and sink caches as their own."""
    import plotly.graph_objects as go
    from plotly.subplots import make_subplots

    fig = make_subplots(rows=1, cols=2, subplot_titles=("KL(full || compressed), mean per token",
                                                        "top-1 agreement with the full cache"))
    full = rows[1]
    for name, series in _series(rows).items():
        series = sorted(series, key=lambda r: r["used_fraction"])
        mode = "markers" if len(series) == 1 else "lines+markers"
        for col, key in ((1, "kl_mean"), (2, "top1")):
            fig.add_trace(go.Scatter(x=[r["used_fraction"] for r in series], y=[r[key] for r in series], mode=mode,
                                     name=name, legendgroup=name, showlegend=col == 1,
                                     text=[f"{name} {r['ratio']}: {r['used_bytes'] / 2**20:.1f} MiB" for r in series]),
                          row=1, col=col)
    fig.update_xaxes(title_text="bytes used at the end, share of the full cache", range=[0, 1.05])
    fig.update_yaxes(type="log", row=1, col=1)
    fig.update_layout(title=f"Eviction frontier: SmolLM2-135M, {rows[0]['context']} + {rows[0]['continuation']} "
                            f"tokens of Moby-Dick (full cache: KL 0, top-1 {full['top1']:.0f})",
                      width=1100, height=480)
    written = [folder / "eviction_frontier.html", frontier_svg(rows, folder / "eviction_frontier_kl.svg")]
    fig.write_html(written[0], include_plotlyjs="cdn")
    try:
        fig.write_image(folder / "eviction_frontier.svg")
        written.append(folder / "eviction_frontier.svg")
    except (ImportError, ValueError, RuntimeError):  # kaleido is not installed: the HTML and the table only
        pass
    return written


def _passkey_tables(rows: list[dict]) -> str:
    lengths = sorted({r["length"] for r in rows})
    depths = sorted({r["depth"] for r in rows})
    model = rows[0]["model"]
    out = [f"Uncompressed {model}: ✓ = the greedy answer holds the key's digits (depth: where the needle "
           f"starts).", "",
           "| length (tokens) | " + " | ".join(f"depth {d:.0%}" for d in depths) + " |",
           "|---:|" + "---|" * len(depths)]
    full = [r for r in rows if r["press"] == "full"]
    for n in lengths:
        cells = [next((MARK[r["passed"]] for r in full if r["length"] == n and r["depth"] == d), "") for d in depths]
        out.append(f"| {n} | " + " | ".join(cells) + " |")
    pressed = [r for r in rows if r["press"] != "full" and r["ratio"] is not None]
    quantized = [r for r in rows if r["press"] != "full" and r["ratio"] is None]  # passkey --quant: every position
    if quantized:
        q_lengths = sorted({r["length"] for r in quantized})
        q_depths = sorted({r["depth"] for r in quantized})
        out += ["", f"Quantized caches, passes out of {len(q_depths)} depths "
                    f"({', '.join(f'{d:.0%}' for d in q_depths)}; the failed depths in brackets):", "",
                "| cache | " + " | ".join(str(n) for n in q_lengths) + " |",
                "|---|" + "---:|" * len(q_lengths)]
        for name in dict.fromkeys(r["press"] for r in quantized):
            cells = []
            for n in q_lengths:
                sel = [r for r in quantized if r["press"] == name and r["length"] == n]
                failed = ", ".join(f"{r['depth']:.0%}" for r in sel if not r["passed"])
                cells.append(f"{sum(r['passed'] for r in sel)}/{len(sel)}" + (f" ({failed})" if failed else ""))
            out.append(f"| {name} | " + " | ".join(cells) + " |")
    if pressed:
        out += ["", f"Compression ratio {pressed[0]['ratio']}, passes out of {len(depths)} depths (the needle's "
                    f"tokens held, mean over layers, KV heads and depths):", "",
                "| press | question | " + " | ".join(str(n) for n in lengths) + " |",
                "|---|---|" + "---:|" * len(lengths)]
        for press in dict.fromkeys(r["press"] for r in pressed):
            for inside in (False, True):
                cells = []
                for n in lengths:
                    sel = [r for r in pressed if r["press"] == press and r["question_in_context"] == inside
                           and r["length"] == n]
                    if sel:
                        held = sum(r["needle"] for r in sel) / len(sel)
                        cells.append(f"{sum(r['passed'] for r in sel)}/{len(sel)} ({held:.0%})")
                    else:
                        cells.append("")
                where = "compressed with the context" if inside else "after the compressed context"
                out.append(f"| {press} | {where} | " + " | ".join(cells) + " |")
    return "\n".join(out)


def _questions_table(rows: list[dict]) -> str:
    out = ["| mode | press | question | answer | answer's tokens held | its fact held | other fact held |",
           "|---|---|---|---|---:|---:|---:|"]
    seen = set()
    for r in sorted(rows, key=lambda r: (r["question"], ("full", "once", "per question").index(r["mode"]))):
        if (r["mode"], r["press"], r["question"]) in seen:  # the full and per-question runs repeat per press
            continue
        seen.add((r["mode"], r["press"], r["question"]))
        others = [v for f, v in r["coverage"].items() if f != r["fact"] and f.endswith(".")]
        held = r["coverage"].get(r["expected"]) if "expected" in r else None
        q = r["question"].split("Answer:")[0].replace("Question:", "").strip()
        answer = r["answer"].strip().splitlines()[0]
        cells = ["" if held is None else f"{held:.0%}", f"{r['coverage'][r['fact']]:.0%}",
                 ", ".join(f"{v:.0%}" for v in others)]
        out.append(f"| {r['mode']} | {r['press']} | {q} | {MARK[r['passed']]} `{answer}` | " + " | ".join(cells) + " |")
    return "\n".join(out)


def merged_frontier(files: dict[str, list[dict]]) -> list[dict] | None:
    """The SmolLM2 frontier's runs (``eviction_frontier`` and its tagged parts, ``eviction_frontier_quant`` ...) as
    one: the first run's head, then every run's rows. A part must have measured the same context and continuation."""
    parts = [rows for stem, rows in files.items() if stem.startswith("eviction_frontier") and rows
             and rows[0].get("model", "smollm2-135m") == "smollm2-135m"]
    if not parts:
        return None
    head = parts[0][0]
    for rows in parts[1:]:
        if (rows[0]["context"], rows[0]["continuation"]) != (head["context"], head["continuation"]):
            raise ValueError(f"frontier parts measured different lengths: {rows[0]} and {head}")
    full = [r for rows in parts for r in rows[1:] if r["kind"] == "full"][:1]
    rows = [r for part in parts for r in part[1:] if r["kind"] != "full"]
    if any(r["kind"] == "KIVI" for r in rows):  # the same cache measured again with the other schemes: the newer run
        rows = [r for r in rows if r["kind"] != "quantized"]
    return [head, *full, *rows]


def report(folder: Path) -> None:
    files = {p.stem: json.loads(p.read_text()) for p in sorted(folder.glob("eviction_*.json"))}
    others = {stem: rows for stem, rows in files.items() if stem.startswith("eviction_frontier") and rows
              and rows[0].get("model", "smollm2-135m") != "smollm2-135m"}
    if (frontier := merged_frontier(files)) is not None:
        files["eviction_frontier"] = frontier
        print("### Frontier\n\n" + _frontier_table(files["eviction_frontier"]) + "\n")
        for p in frontier_figure(files["eviction_frontier"], folder):
            print(f"wrote {p}")
    for rows in others.values():  # another model's frontier: its table (the figure is SmolLM2's)
        print(f"### Frontier: {rows[0]['model']}\n\n" + _frontier_table(rows) + "\n")
    grids: dict[str, list[dict]] = {}
    for stem, rows in files.items():
        if stem.startswith("eviction_passkey"):
            grids.setdefault(rows[0]["model"] if rows else stem, []).extend(rows)
    for model, rows in grids.items():
        print(f"\n### Passkey grid: {model}\n\n" + _passkey_tables(rows) + "\n")
    for stem, rows in files.items():
        if stem.startswith("eviction_questions"):
            print(f"\n### Two questions ({rows[0]['model']}, ratio {rows[0]['ratio']}, "
                  f"{rows[0]['context_tokens']} context tokens)\n\n" + _questions_table(rows) + "\n")
