"""``kvexplore generate ... --tp N``: generate over N tensor-parallel ranks and print each rank's bytes. Run plainly,
it spawns the ranks itself (:class:`kvexplore.distributed.TensorParallel`); launched by ``torchrun --nproc-per-node N
-m kvexplore generate ... --tp N``, every process is one rank (the group from torchrun's environment) and rank 0
prints."""

from __future__ import annotations

import argparse
import os
import sys
import time

from ..errors import SettingsError


def refuse_unsupported(args: argparse.Namespace) -> None:
    """What ``--tp`` does not combine with yet, refused with the flag named."""
    given = [flag for flag, on in (("--temperature", args.temperature > 0), ("--top-k", args.top_k),
                                   ("--top-p", args.top_p), ("--compile", args.compile), ("--trace", args.trace),
                                   ("--save-trace", args.save_trace), ("--chat", args.chat),
                                   ("--device", args.device not in (None, "cpu"))) if on]
    if given:
        raise SettingsError(f"--tp decodes greedily on the CPU ranks of this machine, without {', '.join(given)}; "
                            f"drop {'it' if len(given) == 1 else 'them'}, or drop --tp")


def prompt_ids(source: str, prompt: str) -> tuple[list[int], object]:
    from ..formats.loading import load_tokenizer

    tok = load_tokenizer(source)
    if tok is None:
        raise SettingsError(f"{source} has no tokenizer; generate needs one to read the prompt")
    return encode(tok, prompt), tok


def encode(tok, prompt: str) -> list[int]:
    """The prompt's ids, with the BOS token where the tokenizer adds one."""
    return ([tok.bos_id] if tok.add_bos else []) + tok.encode(prompt)


def generate(args: argparse.Namespace, options: dict) -> None:
    """The ranks spawned here, driven from this process."""
    from ..distributed import TensorParallel

    refuse_unsupported(args)
    ids, tok = prompt_ids(args.source, args.prompt)
    out = sys.stdout
    start = time.perf_counter()
    with TensorParallel(args.source, args.tp, cache=args.cache, dtype=args.dtype,
                        max_seq_len=args.max_seq_len or len(ids) + args.max_new_tokens, **options) as ranks:
        started = time.perf_counter()
        tokens = [int(ranks.prefill(ids)[-1].argmax())]
        _stream(out, tok, tokens, "")
        while len(tokens) < args.max_new_tokens and (args.no_stop or tokens[-1] not in ranks.config.eos_token_id):
            tokens.append(int(ranks.decode(tokens[-1]).argmax()))
            _stream(out, tok, tokens, tok.decode(tokens[:-1]))
        end = time.perf_counter()
        out.write(f"\n\n[{len(tokens)} tokens in {end - started:.2f} s over {args.tp} ranks (started in "
                  f"{started - start:.1f} s)]\n{ranks.describe()}\n")


def _stream(out, tok, tokens: list[int], before: str) -> None:
    text = tok.decode(tokens)
    out.write(text[len(before):] if text.startswith(before) else "\n" + text)
    out.flush()


def launched_by_torchrun() -> bool:
    return "TORCHELASTIC_RUN_ID" in os.environ or ("RANK" in os.environ and "WORLD_SIZE" in os.environ)


def generate_as_rank(args: argparse.Namespace, options: dict) -> None:
    """One rank of a group torchrun started: every rank runs every pass; rank 0 prints the text and every rank's
    bytes (gathered)."""
    import torch
    import torch.distributed as dist

    from ..caches.factory import make_cache
    from ..distributed.shard import shard_model
    from ..distributed.split import split
    from ..distributed.worker import memory
    from ..formats.loading import load

    refuse_unsupported(args)
    world, rank = int(os.environ["WORLD_SIZE"]), int(os.environ["RANK"])
    if world != args.tp:
        raise SettingsError(f"torchrun started {world} processes but --tp is {args.tp}: give --nproc-per-node "
                            f"{args.tp}")
    dist.init_process_group("nccl" if torch.cuda.is_available() else "gloo")
    try:
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // world))
        full = load(args.source, dtype=args.dtype)
        model = shard_model(full, split(full.config, world, rank))
        tok = full.tokenizer
        del full
        ids = encode(tok, args.prompt)
        cache = make_cache(args.cache, model, max_seq_len=args.max_seq_len or len(ids) + args.max_new_tokens,
                           **options)
        tokens: list[int] = []
        feed = ids
        while len(tokens) < args.max_new_tokens:
            with torch.no_grad():
                logits = model(torch.tensor([feed]), cache, cache.length, last_only=True)
            choice = logits[0, -1].argmax().reshape(1)
            dist.broadcast(choice, 0)  # every rank computed the same; rank 0's decides, so none can drift
            tokens.append(int(choice))
            if rank == 0:
                _stream(sys.stdout, tok, tokens, tok.decode(tokens[:-1]))
            if not args.no_stop and tokens[-1] in model.config.eos_token_id:
                break
            feed = tokens[-1:]
        gathered = [None] * world if rank == 0 else None
        dist.gather_object(memory(model, cache), gathered, dst=0)
        if rank == 0:
            total = sum(m["held_bytes"] for m in gathered)
            sys.stdout.write(f"\n\n[{len(tokens)} tokens over {world} ranks launched by torchrun]\n")
            for m in gathered:
                sys.stdout.write(f"  {m['describe']}: {m['held_bytes']:,} bytes held ({m['held_bytes'] / total:.0%})\n")
    finally:
        dist.destroy_process_group()
