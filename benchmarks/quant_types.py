"""llama.cpp's KV cache types against the full-precision cache: what each costs in bytes and in quality, keys and
values apart (issue 41, item 4 in part).

    python benchmarks/quant_types.py                        # SmolLM2-135M, 1,000 context tokens + 64 teacher-forced
    python benchmarks/quant_types.py --model gemma3-270m --context 1000

The first ``--context`` tokens of Moby-Dick's chapter 4 (kvexplore/data/texts) as context, the next
``--continuation`` teacher-forced token by token (``kvexplore.compression.quality.compression_quality``): mean
KL(full || quantized) per token, top-1 agreement and perplexity, and the bytes the cache holds for its positions
against the full float32 cache's. Each type quantizes keys only (values f16), values only (keys f16), and both;
KIVI's cache (keys per channel, values per token, groups of 32, a full-precision window of 32 tokens) beside them, at
8, 4, 3 and 2 bits, keys and values at the same and at different widths.

    python benchmarks/quant_types.py --which schemes        # KIVI's cache with the other schemes (issue 41, item 1)

``--which schemes``: at 4 and 2 bits, KIVI's axes against keys per token, a Hadamard rotation (with either key axis),
pre-RoPE keys, 1% outliers kept exact, and KVQuant's combination (pre-RoPE keys per channel with 1% outliers).
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

import torch

import kvexplore
from kvexplore.caches.ggml_blocks import bits_per_value
from kvexplore.compression.quality import compression_quality, full_reference
from _common import passage_arguments

TEXT = Path(kvexplore.__file__).parent / "data" / "texts" / "moby_dick_chapter_4.txt"
TYPES = ("f16", "q8_0", "q5_1", "q5_0", "q4_1", "q4_0")


def schemes(which: str = "types") -> dict[str, dict]:
    if which == "schemes":
        return kivi_schemes()
    out = {}
    for t in TYPES:
        out[f"K {t}, V f16"] = dict(k_type=t, v_type="f16")
        out[f"K f16, V {t}"] = dict(k_type="f16", v_type=t)
        out[f"K {t}, V {t}"] = dict(k_type=t, v_type=t)
    for kb, vb in ((8, 8), (4, 4), (2, 2), (2, 4), (4, 2), (3, 3)):
        out[f"KIVI K {kb}-bit, V {vb}-bit"] = dict(key_bits=kb, value_bits=vb)
    return out


def kivi_schemes() -> dict[str, dict]:
    out = {}
    for b in (4, 2):
        out.update({
            f"KIVI {b}-bit (K per channel, V per token)": dict(key_bits=b, value_bits=b),
            f"{b}-bit, K per token": dict(key_bits=b, value_bits=b, key_axis="token"),
            f"{b}-bit, K per token, Hadamard": dict(key_bits=b, value_bits=b, key_axis="token", rotate="hadamard"),
            f"{b}-bit, K per channel, Hadamard": dict(key_bits=b, value_bits=b, rotate="hadamard"),
            f"{b}-bit, pre-RoPE K": dict(key_bits=b, value_bits=b, pre_rope_keys=True),
            f"{b}-bit, 1% outliers": dict(key_bits=b, value_bits=b, outliers=0.01),
            f"{b}-bit, pre-RoPE K + 1% outliers (KVQuant)": dict(key_bits=b, value_bits=b, pre_rope_keys=True,
                                                                 outliers=0.01),
        })
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    passage_arguments(ap)
    ap.add_argument("--which", choices=("types", "schemes"), default="types")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    model = kvexplore.load(args.model, accept_license=True) if args.model.startswith("gemma") else \
        kvexplore.load(args.model)
    tok = model.tokenizer
    ids = [tok.bos_id, *tok.encode(TEXT.read_text())]
    context, continuation = ids[:args.context], ids[args.context:args.context + args.continuation]
    t0 = time.perf_counter()
    reference = full_reference(model, context, continuation)
    print(f"{args.model}, {len(context)} context + {len(continuation)} teacher-forced tokens, float32; full-cache "
          f"perplexity {reference.perplexity:.3f}")
    print("| cache | bits a value (K / V) | bytes held vs full | mean KL (nats) | top-1 | perplexity |")
    print("|---|---|---|---|---|---|")
    seen = set()
    for name, options in schemes(args.which).items():
        key = tuple(sorted(options.items()))
        if key in seen:  # "K f16, V f16" three times
            continue
        seen.add(key)
        q = compression_quality(model, context, continuation,
                                lambda m, n, o=options: kvexplore.make_cache("quantized", m, max_seq_len=n, **o),
                                reference, stepwise=True)
        bits = (f"{bits_per_value(options['k_type']):g} / {bits_per_value(options['v_type']):g}"
                if "k_type" in options else f"{options['key_bits']} / {options['value_bits']} + scales"
                + (" + outliers" if options.get("outliers") else ""))
        print(f"| {name} | {bits} | {q.used_fraction:.1%} | {q.kl_mean:.2e} | {q.top1:.1%} | {q.perplexity:.3f} |",
              flush=True)
    print(f"({time.perf_counter() - t0:.0f} s)")


if __name__ == "__main__":
    main()
