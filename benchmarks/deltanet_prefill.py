"""Prefill time of a Qwen3-Next style model (gated DeltaNet layers) against an attention model of the same size, with
the delta rule chunked (now) and token by token (before); and where chunking starts to pay (``--crossover``).

    python benchmarks/deltanet_prefill.py                        # 512, 1024, 4096 tokens, 3 reps, 2 threads
    python benchmarks/deltanet_prefill.py --lengths 512 --reps 1 --no-before
    python benchmarks/deltanet_prefill.py --crossover            # the delta rule alone, token by token vs chunked

Models (random weights, float32, built with transformers and saved to a temporary folder, loaded with
``kvexplore.load``), both at SmolLM2-135M's size: hidden 576, 30 layers, 9 heads of 64 (3 key/value heads), a
dense MLP of 1536, vocabulary 49152, tied embeddings.

* ``attention``: the Llama config of that shape (benchmarks/_common.py's "135M");
* ``qwen3-next``: Qwen3NextConfig with the same fields; every 4th layer attention (7 of 30, gated, partial rope),
  the other 23 gated DeltaNet with 3 key heads and 9 value heads of 64 (the 1:3 key-to-value heads of GQA 9:3);
  the MLP dense in every layer (``mlp_only_layers``), so both models have the same MLP.

What is timed: one ``model(ids, cache, 0, last_only=True)`` over the whole prompt (the same call as
``Generator.prefill``), under ``torch.no_grad``, into a pre-allocated cache made before the clock starts. Each
repetition runs every (length, model) pair, the models' order rotating, after one untimed warm-up of each;
medians of the wall time, and of the CPU time of this process (all its threads: less disturbed by other processes
on a shared machine, with one thread). ``before`` is the same Qwen3-Next model with the delta rule run token by token
(``delta_rule.CHUNKED_FROM`` set past the length); the script checks that both give the same last logits.

``--crossover`` times the delta rule alone (``recurrent`` vs ``chunked`` of :mod:`kvexplore.models.delta_rule`,
9 value heads of 64, one sequence) at a few lengths: the shortest length where chunked wins is where
``CHUNKED_FROM`` belongs.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.nn.functional as F

from _common import SHAPES, OtherLoad, build_checkpoint, median, now, prompt_ids, wait_quiet

import kvexplore
from kvexplore.models import delta_rule

HEAD_DIM, KEY_HEADS, VALUE_HEADS = 64, 3, 9


def build_qwen3_next(folder: Path, seed: int = 0) -> None:
    """The Qwen3-Next style checkpoint at the "135M" shape (see the module docstring), saved to ``folder``."""
    import transformers

    transformers.utils.logging.disable_progress_bar()
    s = dict(SHAPES["135M"])
    theta = s.pop("rope_theta")
    layers = s["num_hidden_layers"]
    config = transformers.Qwen3NextConfig(
        **s, head_dim=HEAD_DIM, max_position_embeddings=8192, initializer_range=0.02, rms_norm_eps=1e-6,
        rope_parameters={"rope_type": "default", "rope_theta": theta, "partial_rotary_factor": 0.25},
        linear_num_key_heads=KEY_HEADS, linear_num_value_heads=VALUE_HEADS, linear_key_head_dim=HEAD_DIM,
        linear_value_head_dim=HEAD_DIM, linear_conv_kernel_dim=4, num_experts=4, num_experts_per_tok=2,
        moe_intermediate_size=64, shared_expert_intermediate_size=64, mlp_only_layers=list(range(layers)),
        layer_types=["full_attention" if (i + 1) % 4 == 0 else "linear_attention" for i in range(layers)],
        bos_token_id=None, eos_token_id=None, pad_token_id=None)
    torch.manual_seed(seed)
    model = transformers.Qwen3NextForCausalLM(config).float().eval()
    folder.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(folder)


def prefill_once(model, ids: torch.Tensor, chunked_from: int) -> tuple[float, float, torch.Tensor]:
    """Wall and CPU seconds (this process, all threads) for one prefill of ``ids`` (the cache made first, untimed)
    and its last logits."""
    delta_rule.CHUNKED_FROM = chunked_from
    cache = kvexplore.make_cache("preallocated", model, ids.shape[1])
    with torch.no_grad():
        t0, c0 = now("cpu"), time.process_time()
        logits = model(ids, cache, 0, last_only=True)
        return now("cpu") - t0, time.process_time() - c0, logits[0, -1]


def compare(lengths: list[int], reps: int, before: bool, wait: float) -> None:
    chunked_from = delta_rule.CHUNKED_FROM
    with tempfile.TemporaryDirectory() as tmp:
        build_checkpoint("135M", Path(tmp) / "attention", max_positions=8192)
        build_qwen3_next(Path(tmp) / "qwen3-next")
        models = {"attention": kvexplore.load(Path(tmp) / "attention"),
                  "qwen3-next": kvexplore.load(Path(tmp) / "qwen3-next")}
    for name, m in models.items():
        print(f"{name}: {sum(p.numel() for p in m.parameters()) / 1e6:.1f}M parameters, layer kinds "
              f"{[s.kind for s in kvexplore.make_cache('preallocated', m, 8).plan][:4]}...")
    runs = [("attention", chunked_from), ("qwen3-next", chunked_from)] + ([("before", 10 ** 9)] if before else [])
    times: dict[tuple[str, int], list[float]] = {}
    cpu: dict[tuple[str, int], list[float]] = {}
    load = OtherLoad()
    for rep in range(reps + 1):  # rep 0 is the warm-up
        for n in lengths:
            ids = torch.tensor([prompt_ids(n, 49152)])
            order = runs[rep % len(runs):] + runs[:rep % len(runs)]
            last = {}
            for label, cf in order:
                wait_quiet(wait)
                load.start()
                wall, busy, last[label] = prefill_once(
                    models["attention" if label == "attention" else "qwen3-next"], ids, cf)
                load.stop()
                if rep:
                    times.setdefault((label, n), []).append(wall)
                    cpu.setdefault((label, n), []).append(busy)
            if before:
                gap = (last["before"] - last["qwen3-next"]).abs().max().item()
                assert gap < 1e-3, f"chunked and token-by-token last logits differ by {gap} at {n} tokens"
        print(f"rep {rep}{' (warm-up)' if not rep else ''} done", file=sys.stderr)
    delta_rule.CHUNKED_FROM = chunked_from
    print(f"\nprefill, {torch.get_num_threads()} threads, float32, medians of {reps}: wall seconds (CPU seconds)")
    head = "| tokens | attention | Qwen3-Next chunked | ratio (CPU) | " + (
        "token by token (before) | before / after (CPU) |" if before else "")
    print(head)
    print("|" + "---|" * (head.count("|") - 1))
    for n in lengths:
        (a, ac), (q, qc) = ((median(times[k, n]), median(cpu[k, n])) for k in ("attention", "qwen3-next"))
        row = f"| {n} | {a:.2f} ({ac:.2f}) | {q:.2f} ({qc:.2f}) | **{q / a:.2f}x** ({qc / ac:.2f}x) |"
        if before:
            b, bc = median(times["before", n]), median(cpu["before", n])
            row += f" {b:.2f} ({bc:.2f}) | {b / q:.1f}x ({bc / qc:.1f}x) |"
        print(row)
    print(load.summary() + ("  (disturbed: rerun on a quiet machine)" if load.busy else ""))


def crossover(reps: int) -> None:
    gen = torch.Generator().manual_seed(0)
    print("\nthe delta rule alone (9 value heads of 64, one sequence), CPU milliseconds, medians of", reps)
    print("| tokens | token by token | chunked | chunked / token by token |\n|---|---|---|---|")
    for T in (1, 2, 4, 6, 8, 12, 16, 32, 64, 128):
        q = F.normalize(torch.randn(1, T, VALUE_HEADS, HEAD_DIM, generator=gen), dim=-1) * HEAD_DIM ** -0.5
        k = F.normalize(torch.randn(1, T, VALUE_HEADS, HEAD_DIM, generator=gen), dim=-1)
        v, g = torch.randn(1, T, VALUE_HEADS, HEAD_DIM, generator=gen), -torch.rand(1, T, VALUE_HEADS, generator=gen)
        beta, S = torch.rand(1, T, VALUE_HEADS, generator=gen), torch.randn(1, VALUE_HEADS, HEAD_DIM, HEAD_DIM)
        times: dict[str, list[float]] = {"recurrent": [], "chunked": []}
        for rep in range(reps + 1):
            for name in ("recurrent", "chunked") if rep % 2 else ("chunked", "recurrent"):
                t0 = time.process_time()
                for _ in range(10):
                    getattr(delta_rule, name)(q, k, v, g, beta, S)
                if rep:
                    times[name].append((time.process_time() - t0) / 10)
        r, c = median(times["recurrent"]), median(times["chunked"])
        print(f"| {T} | {r * 1e3:.2f} | {c * 1e3:.2f} | {c / r:.2f} |")
    print(f"CHUNKED_FROM is {delta_rule.CHUNKED_FROM}")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--lengths", default="512,1024,4096")
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--no-before", action="store_true", help="skip the token-by-token prefill (slow at 4096)")
    p.add_argument("--crossover", action="store_true", help="only time the delta rule alone at short lengths")
    p.add_argument("--wait-quiet", type=float, default=0.0, help="wait up to S seconds for a quiet machine per run")
    a = p.parse_args()
    torch.set_num_threads(a.threads)
    if a.crossover:
        return crossover(a.reps * 3)
    compare([int(x) for x in a.lengths.split(",")], a.reps, not a.no_before, a.wait_quiet)


if __name__ == "__main__":
    main()
