"""The ``kvexplore`` command: ``kvexplore generate SOURCE --prompt TEXT ...`` streams text, then speed and cache
bytes."""

from __future__ import annotations

import argparse
import os
import sys
import time
from collections.abc import Sequence
from contextlib import nullcontext

from ..caches.factory import STRATEGIES
from ..errors import KVExploreError
from . import bugs, cache_options, course, distributed, kv_events


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> None:  # one line, not usage + traceback
        self.exit(2, f"{self.prog}: error: {message} (see {self.prog} --help)\n")


def _positive(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be a positive integer, got {value}")
    return value


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="kvexplore", description="Explore the KV cache of Llama-family models.")
    sub = parser.add_subparsers(dest="command", required=True, parser_class=_Parser)
    gen = sub.add_parser("generate", help="generate text from a model, streaming tokens")
    gen.add_argument("source", help="named model (kvexplore models list), model folder (config.json + "
                                    "model.safetensors) or .gguf file")
    gen.add_argument("--prompt", required=True, help="prompt text")
    gen.add_argument("--chat", action="store_true", help="wrap the prompt as a user message in the chat template")
    gen.add_argument("--max-new-tokens", type=_positive, default=64)
    gen.add_argument("--cache", choices=list(STRATEGIES), default="preallocated")
    gen.add_argument("--max-seq-len", type=_positive, default=None,
                     help="cache slots (default: prompt + max new tokens)")
    cache_options.add_arguments(gen)  # each strategy's options (--window, --bits, --press ...)
    gen.add_argument("--dtype", choices=("float32", "bfloat16", "float16"), default=None)
    gen.add_argument("--device", default=None, help="cpu or cuda (default: cuda when available)")
    gen.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default)")
    gen.add_argument("--top-k", type=_positive, default=None)
    gen.add_argument("--top-p", type=float, default=None)
    gen.add_argument("--seed", type=int, default=0)
    gen.add_argument("--no-stop", action="store_true", help="keep going after an end-of-sequence token")
    gen.add_argument("--compile", action="store_true",
                     help="decode with the compiled one-token step (pre-allocated cache; compiled on the first step)")
    gen.add_argument("--no-kernels", dest="kernels", action="store_false",
                     help="plain F.linear products (by default one-row float32 products on the CPU take compiled "
                          "kernels: kvexplore.fast.kernels)")
    gen.add_argument("--trace", action="store_true",
                     help="print each step's cache map (slots free, filled, written, stale, shared) and memory")
    gen.add_argument("--save-trace", default=None, metavar="PATH",
                     help="record the run (cache, attention, q/k/v, memory) and save it to PATH (.kvtrace), for "
                          "kvexplore export and kvexplore diff")
    gen.add_argument("--tp", type=_positive, default=None, metavar="N",
                     help="split the model over N tensor-parallel ranks (processes on this machine, or those "
                          "torchrun started) and print each rank's cache bytes")
    export = sub.add_parser("export", help="write a self-contained HTML replay of recorded runs (no kernel, no "
                                           "network)")
    export.add_argument("traces", nargs="+", metavar="TRACE", help="one or more .kvtrace files (one lane each)")
    export.add_argument("-o", "--output", required=True, metavar="HTML")
    export.add_argument("--layer", type=int, default=0, help="the layer whose attention is drawn (default 0)")
    export.add_argument("--head", type=int, default=0, help="the query head whose attention is drawn (default 0)")
    export.add_argument("--pick", action="append", default=[], metavar="LAYER,HEAD", type=_pick,
                        help="one more layer and head the page can switch to (and a link can name: "
                             "#layer=3&head=1); repeat for more")
    export.add_argument("--title", default=None)
    diff = sub.add_parser("diff", help="compare two recorded runs of one prompt: where do they part? (exit 0: they "
                                       "agree, 1: they part, 2: bad input)")
    diff.add_argument("a", metavar="A.kvtrace")
    diff.add_argument("b", metavar="B.kvtrace")
    diff.add_argument("--tolerance", type=float, default=None,
                      help="relative for keys and values, absolute for probabilities (default by dtype: float32 1e-4, "
                           "float16 5e-3, bfloat16 3e-2)")
    diff.add_argument("--html", default=None, metavar="HTML",
                      help="also write the two replays side by side, the divergence marked")
    diff.add_argument("--layer", type=int, default=None, help="--html: the layer whose attention is drawn (default: "
                                                              "where they part, else 0)")
    doc = sub.add_parser("doctor", help="step a model through a cache and compare every cached pass with a full "
                                        "recomputation: where does cached decoding depart? (exit 0: clean, 1: it "
                                        "departs, 2: bad input)")
    doc.add_argument("model", help="a named model, or a Hugging Face style folder (run by transformers for a "
                                   "transformers cache, by kvexplore for a kvexplore strategy)")
    doc.add_argument("--cache", default="dynamic",
                     help="transformers: dynamic, static, hf:quantized (fp8), hf:quantized-quanto, hf:quantized-hqq, "
                          f"offloaded; kvexplore: {', '.join(STRATEGIES)} (default dynamic)")
    doc.add_argument("--prompt", default=None, help="the prompt (default: 'The capital of France is')")
    doc.add_argument("--steps", type=_positive, default=64, help="tokens to check (default 64)")
    doc.add_argument("--tolerance", type=float, default=None,
                     help="relative (default by dtype: float32 1e-4, float16 5e-3, bfloat16 3e-2)")
    doc.add_argument("--dtype", default=None, help="float32 (default on the CPU), bfloat16 or float16")
    models = sub.add_parser("models", help="named models: list, fetch, path")
    verbs = models.add_subparsers(dest="verb", required=True, parser_class=_Parser)
    verbs.add_parser("list", help="named models, whether present, size on disk")
    for verb, text in (("fetch", "download and convert a named model now"), ("path", "print a named model's folder")):
        verbs.add_parser(verb, help=text).add_argument("name")
    verbs.choices["fetch"].add_argument("--accept-license", action="store_true",
                                        help="accept the model's license terms (gemma3-270m: the Gemma Terms of "
                                             "Use), which it is fetched only with")
    lab = sub.add_parser("lab", help="copy the bundled notebooks to a folder of yours (missing ones only) and open "
                                     "JupyterLab there; other arguments go to jupyter lab",
                         description="Copies the bundled notebooks into DIR (only those missing there: yours are never "
                                     "overwritten), then starts JupyterLab on DIR. Unknown arguments are passed to "
                                     "jupyter lab.")
    lab.add_argument("--dir", default=None, metavar="DIR", help="notebooks folder (default: ~/kvexplore-notebooks)")
    lab.add_argument("--port", type=_port, default=None)
    lab.add_argument("--no-browser", action="store_true", help="do not open a browser")
    app = sub.add_parser("app", help="serve the KV cache explorer as a standalone page (Voila); other arguments go "
                                     "to voila",
                         description="Serves the explorer on 127.0.0.1 with Voila, code hidden. Unknown arguments are "
                                     "passed to voila.")
    app.add_argument("--model", default="tiny", help="named model, model folder or .gguf file (default: tiny)")
    app.add_argument("--strategies", type=_strategies, default=None, metavar="A,B",
                     help=f"cache strategies to compare, comma-separated (default: preallocated,concat,paged), "
                          f"from: {', '.join(STRATEGIES)}; tp:N or cp:N runs the model over N processes "
                          f"(by heads, by positions)")
    app.add_argument("--prompt", default="Call me Ishmael.", help="the prompt prefilled when the page opens "
                                                                  "(empty: none)")
    app.add_argument("--max-seq-len", type=_positive, default=128, metavar="N",
                     help="slots of each cache (default: 128); a longer prompt grows them to fit, up to the model's "
                          "context")
    app.add_argument("--strategy-option", action="append", default=[], metavar="LANE.OPTION=VALUE",
                     help="an option of one lane's cache, repeatable: sink.window=256, quantized.bits=2, "
                          "evict.press=snapkv, evict.decode_every=16 (the app's own: paged.block_size=8, sink.sinks=4, "
                          "sink.window=252)")
    app.add_argument("--port", type=_port, default=None, help="default: voila's (8866)")
    app.add_argument("--no-browser", action="store_true", help="do not open a browser")
    kv_events.add_parser(sub, _Parser)
    bugs.add_parser(sub, _Parser)
    course.add_parser(sub, _Parser)
    return parser


def _port(text: str) -> int:
    value = int(text)
    if not 0 <= value <= 65535:
        raise argparse.ArgumentTypeError(f"must be a port number (0-65535), got {value}")
    return value


def _strategies(text: str) -> tuple[str, ...]:
    names = tuple(s.strip() for s in text.split(",") if s.strip())
    from ..distributed.lead import parse

    unknown = [n for n in names if n not in STRATEGIES and parse(n) is None]  # tp:N, cp:N: over N processes
    if not names or unknown:
        raise argparse.ArgumentTypeError(f"unknown cache strategy {', '.join(map(repr, unknown)) or repr(text)}; "
                                         f"available: {', '.join(STRATEGIES)}, or tp:N / cp:N (the model over N "
                                         f"processes)")
    return names


def _models(args: argparse.Namespace) -> None:
    from ..formats import store

    if args.verb == "list":
        for name, spec in store.MODELS.items():
            present = store.is_present(name)
            size = f"{store.size_on_disk(name) / 2**20:8.1f} MiB" if present else "       -    "
            print(f"{name:14s} {'present' if present else 'absent ':7s} {size}  {spec.description}")
    elif args.verb == "fetch":
        print(store.fetch(args.name, accept_license=args.accept_license))
    else:
        print(store.model_path(args.name))  # an unknown name raises with the list of names


def _generate(args: argparse.Namespace) -> None:
    from ..caches.factory import make_cache
    from ..formats.loading import load
    from ..runtime.generator import Generator
    from ..trace.tracer import Tracer
    from ..trace.textview import LEGEND, step_view
    from ..caches.memory import kv_bytes

    options = cache_options.given(args)  # checked before the model loads
    if args.tp:
        run = distributed.generate_as_rank if distributed.launched_by_torchrun() else distributed.generate
        return run(args, options)
    model = load(args.source, dtype=args.dtype, device=args.device)
    if model.tokenizer is None:
        raise KVExploreError(f"{args.source} has no tokenizer (tokenizer.model or tokenizer.json); "
                             f"generate needs one to read the prompt")
    tok = model.tokenizer
    ids = tok.encode_chat([{"role": "user", "content": args.prompt}]) if args.chat else None
    if ids is None:
        ids = distributed.encode(tok, args.prompt)
    cache = make_cache(args.cache, model, max_seq_len=args.max_seq_len or len(ids) + args.max_new_tokens, **options)
    tracer = Tracer(capture={"cache", "attention", "qkv", "memory", "timing"}) if args.save_trace else None
    gen = Generator(model, cache, temperature=args.temperature, top_k=args.top_k, top_p=args.top_p,
                    seed=args.seed, tracer=tracer, compile=args.compile, kernels=args.kernels)
    out = sys.stdout
    shown = ""
    if args.trace:
        out.write(f"cache map, one symbol per slot: {LEGEND}\n")

    def show() -> None:
        nonlocal shown
        if args.trace:
            out.write(step_view(gen.history[-1], cache.inspect.slot_views(), model.config.num_layers) + "\n")
            return
        text = gen.text
        if text.startswith(shown):  # print only what is new (decoding token by token would drop spaces)
            out.write(text[len(shown):])
        else:
            out.write("\n" + text)
        out.flush()
        shown = text

    start = time.perf_counter()
    first = gen.prefill(ids)
    show()
    decode_start = time.perf_counter()
    for i in range(args.max_new_tokens - 1):
        if not args.no_stop and gen.history[-1].is_eos:
            break
        compiling = args.compile and gen.compile_s is None and gen.compiled_step(1)
        if compiling:
            from ..fast.progress import compile_progress
        with compile_progress() if compiling else nullcontext():
            gen.step()
        show()
        if i == 0 and gen.compile_s is not None:  # the first compiled step compiles: the rate starts after it
            decode_start = time.perf_counter()
    end = time.perf_counter()
    if args.trace:
        out.write(f"\ntext: {gen.text!r}")
    n_decode = len(gen.history) - 1 - (gen.compile_s is not None)
    rate = n_decode / (end - decode_start) if n_decode > 0 else float("nan")
    if args.compile:
        out.write(f"\n\n[decode step compiled in {gen.compile_s:.1f} s: {gen.compile_reuse}]"
                  if gen.compile_s is not None else
                  f"\n\n[not compiled: {gen.compile_note or 'tracing runs eager'}]")
    mib = 1024 * 1024
    out.write(
        f"\n\n[{len(gen.history)} tokens in {end - start:.2f} s: prefill {len(ids)} tokens in "
        f"{first.forward_s * 1000:.0f} ms, decode {rate:.1f} tokens/s | cache {cache.kind}: "
        f"{cache.inspect.reserved_bytes / mib:.2f} MiB reserved, {cache.inspect.used_bytes / mib:.2f} MiB used for "
        f"{cache.length} positions ({kv_bytes(model.config, 1, 1, model.dtype)} bytes per token)]\n"
    )
    if note := cache.inspect.what_it_did():
        out.write(f"[{note}]\n")
    if args.save_trace:
        out.write(f"trace saved to {gen.history.save(args.save_trace)}\n")


def _pick(text: str) -> tuple[int, int]:
    """``--pick 3,1``: a layer and a query head."""
    parts = text.replace(" ", "").split(",")
    if len(parts) != 2 or not all(p.isdigit() for p in parts):
        raise argparse.ArgumentTypeError(f"{text!r}: write a layer and a head, as 3,1")
    return int(parts[0]), int(parts[1])


def _export(args: argparse.Namespace) -> None:
    from ..views.page import save_html
    from ..trace.files import load_trace

    runs = {}
    for path in args.traces:
        run = load_trace(path)
        name = run.meta.get("kind") or path
        runs[name if name not in runs else f"{name} ({path})"] = run
    print(save_html(runs, args.output, layer=args.layer, head=args.head, title=args.title, picks=args.pick))


def _diff(args: argparse.Namespace) -> int:
    from ..trace.diff import diff_traces
    from ..trace.files import load_trace

    a, b = load_trace(args.a), load_trace(args.b)
    result = diff_traces(a, b, tolerance=args.tolerance)
    print(result.report())
    if args.html:
        from ..views.page import save_html

        layer = args.layer if args.layer is not None else (result.layer or 0)
        names = [f"A: {a.meta.get('kind', '')} ({args.a})", f"B: {b.meta.get('kind', '')} ({args.b})"]
        marks = {} if result.step is None else {result.step: "⚠ " + result.summary()}
        print(save_html(dict(zip(names, (a, b))), args.html, layer=layer, marks=marks, side_by_side=True,
                        title=f"kvexplore diff · {result.summary()}"))
    return 1 if result.diverged else 0


def _doctor(args: argparse.Namespace) -> int:
    from ..diagnosis import doctor
    from ..diagnosis.run import DEFAULT_PROMPT

    if args.cache in STRATEGIES:
        from ..formats.loading import load

        model = load(args.model, dtype=args.dtype)
    else:
        from ..hf import available, load_hf

        why = available(args.cache.removeprefix("hf:"))
        if why and "CUDA" not in why:
            raise ValueError(why)
        model = load_hf(args.model, dtype=args.dtype)
    t0 = time.perf_counter()
    report = doctor(model, prompt=args.prompt or DEFAULT_PROMPT, steps=args.steps, cache=args.cache,
                    tolerance=args.tolerance)
    print(report.summary())
    print(f"({report.steps} steps checked in {time.perf_counter() - t0:.1f} s)")
    return 1 if report.diverged else 0


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    """Parse the command line; ``lab`` and ``app`` keep unknown arguments in ``args.extra`` for jupyter / voila."""
    parser = build_parser()
    args, extra = parser.parse_known_args(argv)
    if extra and args.command not in ("lab", "app"):
        parser.error(f"unrecognized arguments: {' '.join(extra)}")
    args.extra = [a for a in extra if a != "--"] if args.command in ("lab", "app") else []
    return args


def main(argv: Sequence[str] | None = None) -> int:
    code = _run(parse_args(argv))
    try:
        sys.stdout.flush()  # a reader gone (kvexplore bugs list | head) shows here, not at the interpreter's exit
    except BrokenPipeError:
        _quiet()
    return code


def _quiet() -> None:
    """The reader went away: nothing more to say, nor at the interpreter's exit (stdout onto /dev/null)."""
    os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())


def _run(args: argparse.Namespace) -> int:
    try:
        if args.command == "generate":
            _generate(args)
        elif args.command == "models":
            _models(args)
        elif args.command == "export":
            _export(args)
        elif args.command in ("diff", "doctor"):  # exit 0: agree, 1: they part, 2: bad input
            try:
                return (_diff if args.command == "diff" else _doctor)(args)
            except (KVExploreError, ValueError, OSError) as e:
                print(f"kvexplore {args.command}: error: {e}", file=sys.stderr)
                return 2
        elif args.command == "kv-events":
            return kv_events.run(args)
        elif args.command == "bugs":
            return bugs.run(args)
        elif args.command == "course":
            return course.run(args)
        elif args.command == "lab":
            from .launch import lab

            return lab(args.dir, port=args.port, no_browser=args.no_browser, extra=args.extra)
        elif args.command == "app":
            from ..explorer.app_page import app_options
            from .launch import app

            return app(args.model, strategies=args.strategies, port=args.port, no_browser=args.no_browser,
                       extra=args.extra, prompt=args.prompt, max_seq_len=args.max_seq_len,
                       options=app_options(args.model, args.strategies, args.strategy_option))
    except BrokenPipeError:  # the reader went away while the command wrote
        _quiet()
        return 0
    except (KVExploreError, ValueError, OSError) as e:
        print(f"kvexplore {args.command}: error: {e}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        return 130
    return 0
