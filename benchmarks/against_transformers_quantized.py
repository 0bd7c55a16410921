"""transformers' own QuantizedCache (optimum-quanto's backend) beside kvexplore's quantized cache with the same bits,
group size, axes and residual (issue 41, item 5).

    pip install optimum-quanto==0.2.7                       # not a dependency of kvexplore; it leaves torch alone
    python benchmarks/against_transformers_quantized.py     # SmolLM2-135M, 1,024 context + 160 continuation tokens

Both sides run the same float32 weights (transformers' ``AutoModelForCausalLM`` on the folder kvexplore converted
SmolLM2 into), prefill the first ``--context`` ids of kvexplore's Moby-Dick chapter (BOS first) and are then fed the
next ``--continuation`` ids one at a time (teacher forcing). Each side's KL is from its own full-precision cache
(transformers' ``DynamicCache``, kvexplore's pre-allocated cache), mean over the continuation's tokens.

The options map one to one: transformers' ``axis_key`` / ``axis_value`` 0 groups ``q_group_size`` consecutive
channels of one token under a scale (kvexplore's ``"token"`` axis), -1 one channel over ``q_group_size`` consecutive
tokens (``"channel"``, KIVI's keys); ``residual_length`` is ``residual``. What the two caches do with them is not the
same, and the table shows what that costs: transformers quantizes the whole prompt as soon as the prefill has read
it (its window starts empty) and, each time ``residual_length`` new tokens have gathered, quantizes everything again
(read back, concatenated with the window, quantized anew); kvexplore quantizes each block of ``group_size`` positions
once, when ``residual`` newer positions follow it, and keeps the newest ones exact. (quanto's per-channel scales
group ``q_group_size`` consecutive rows of all heads' tokens, so the context and every re-quantized length must be
multiples of it: 1,024 and 1,024 + 128 are; the continuation of 160 crosses one re-quantization.)
"""

from __future__ import annotations

import argparse
import datetime
from pathlib import Path

import torch

from _common import passage_arguments

# (label, nbits, transformers axis_key, axis_value, kvexplore's exact_prefill)
CONFIGS = [("K per token, V per token (transformers' default)", 4, 0, 0, False),
           ("K per channel, V per token (KIVI)", 4, -1, 0, False),
           ("K per token, V per token (transformers' default)", 2, 0, 0, False),
           ("K per channel, V per token (KIVI)", 2, -1, 0, False),
           ("K per channel, V per token (KIVI); kvexplore exact_prefill=True", 2, -1, 0, True)]
AXES = {0: "token", -1: "channel"}


def transformers_kl(hf, ids: list[int], context: int, cache_for) -> float:
    """Mean KL(full || cache) over the continuation, transformers' side (``cache_for()`` a fresh cache, None: full)."""
    def run(cache) -> torch.Tensor:
        rows = []
        with torch.no_grad():
            out = hf(torch.tensor([ids[:context]]), past_key_values=cache, use_cache=True)
            rows.append(out.logits[0, -1])
            for p in range(context, len(ids) - 1):
                out = hf(torch.tensor([[ids[p]]]), past_key_values=cache, use_cache=True)
                rows.append(out.logits[0, -1])
        return torch.log_softmax(torch.stack(rows).float(), -1)

    import transformers

    full = run(transformers.DynamicCache(config=hf.config))
    got = run(cache_for())
    return float((full.exp() * (full - got)).sum(-1).clamp_min(0).mean())


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    passage_arguments(ap, context=1024, continuation=160)
    ap.add_argument("--group-size", type=int, default=64)
    ap.add_argument("--residual", type=int, default=128)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    import importlib.util

    if importlib.util.find_spec("optimum") is None or importlib.util.find_spec("optimum.quanto") is None:
        print("optimum-quanto is not installed: pip install optimum-quanto==0.2.7 (transformers' quanto backend)")
        return
    import transformers  # its quanto backend imports optimum.quanto

    import kvexplore
    from kvexplore.formats import store
    from kvexplore.compression.quality import compression_quality, full_reference

    model = kvexplore.load(args.model)
    hf = transformers.AutoModelForCausalLM.from_pretrained(store.model_path(args.model), torch_dtype=torch.float32)
    hf.eval()
    text = (Path(kvexplore.__file__).parent / "data" / "texts" / "moby_dick_chapter_4.txt").read_text()
    ids = [model.tokenizer.bos_id, *model.tokenizer.encode(text)][:args.context + args.continuation]
    context, continuation = ids[:args.context], ids[args.context:]
    reference = full_reference(model, context, continuation)
    G, R = args.group_size, args.residual
    print(f"{args.model}, {len(context)} context + {len(continuation)} continuation tokens, float32, group {G}, "
          f"residual {R}; {datetime.date.today()}, transformers {transformers.__version__}, optimum-quanto "
          f"{__import__('importlib.metadata').metadata.version('optimum-quanto')}")
    print("| bits | axes | transformers KL | kvexplore KL | kvexplore / transformers |")
    print("|---:|---|---:|---:|---:|")
    for label, bits, axis_key, axis_value, exact_prefill in CONFIGS:
        theirs = transformers_kl(hf, ids, len(context), lambda: transformers.QuantizedCache(
            "quanto", config=hf.config, nbits=bits, axis_key=axis_key, axis_value=axis_value, q_group_size=G,
            residual_length=R))
        ours = compression_quality(model, context, continuation, lambda m, n: kvexplore.make_cache(
            "quantized", m, max_seq_len=n, key_bits=bits, value_bits=bits, key_axis=AXES[axis_key],
            value_axis=AXES[axis_value], group_size=G, residual=R, exact_prefill=exact_prefill), reference,
            stepwise=True).kl_mean
        print(f"| {bits} | {label} | {theirs:.3g} | {ours:.3g} | {ours / theirs:.2f} |", flush=True)


if __name__ == "__main__":
    main()
