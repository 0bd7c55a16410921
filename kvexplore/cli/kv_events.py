"""``kvexplore kv-events``: record a serving engine's KV event stream to a file, show what a file holds, and check it
for drift (vLLM's events, or SGLang's, LMCache's, Dynamo's, Mooncake's: docs/engine-events.md)."""

from __future__ import annotations

import argparse


def add_parser(sub: argparse._SubParsersAction, parser_class: type) -> None:
    events = sub.add_parser("kv-events", help="a serving engine's (vLLM's) KV cache events: record a live stream, "
                                              "show a file")
    verbs = events.add_subparsers(dest="verb", required=True, parser_class=parser_class)
    rec = verbs.add_parser("record", help="record the events published at ENDPOINT (vLLM: --kv-events-config) to a "
                                          "file, until --seconds or --batches or Ctrl-C")
    rec.add_argument("endpoint", metavar="ENDPOINT", help="the engine's PUB socket, e.g. tcp://localhost:5557")
    rec.add_argument("-o", "--output", required=True, metavar="FILE")
    rec.add_argument("--seconds", type=float, default=None, help="stop after this long")
    rec.add_argument("--batches", type=int, default=None, help="stop after this many batches")
    rec.add_argument("--replay-endpoint", default=None, metavar="ENDPOINT",
                     help="the engine's replay (ROUTER) socket: missed batches are asked for there")
    rec.add_argument("--ranks", type=int, default=1, help="data-parallel ranks (rank r publishes on port + r)")
    rec.add_argument("--topic", default="", help="the topic the engine publishes under (default: all)")
    show = verbs.add_parser("show", help="each cache of a recorded or JSON lines file in a few lines: blocks stored "
                                         "now, removed, cleared, tree depth, gaps")
    show.add_argument("file", metavar="FILE")
    show.add_argument("--batches", action="store_true", help="also each batch of each cache in words")
    show.add_argument("--html", default=None, metavar="OUT", help="also write the replay page of one cache (a slider "
                                                                   "over the batches: block pool, tree, timeline)")
    show.add_argument("--rank", type=int, default=None, help="the data-parallel rank drawn by --html (default: the "
                                                             "lowest)")
    show.add_argument("--medium", default=None, help="the medium drawn by --html (default: GPU)")
    show.add_argument("--group", type=int, default=None, help="the KV cache group drawn by --html (default: 0)")
    check = verbs.add_parser("check", help="list each drift in a file's events (array forms, missing fields, token "
                                           "ids that do not fill the blocks, hashes that are not their tokens', "
                                           "double stores, unknown removals, gaps), where first seen and how often; "
                                           "exit 1 when there is drift")
    check.add_argument("file", metavar="FILE")
    for p in (show, check):
        _engine_arguments(p)


def _engine_arguments(p: argparse.ArgumentParser) -> None:
    from ..prefix.events.dialects import ENGINES

    p.add_argument("--engine", choices=ENGINES, default=None, help="whose events the file holds (default: told "
                                                                   "from the content where it is sure, else vllm)")
    p.add_argument("--block-size", type=int, default=None, metavar="N", help="the engine's block size, for one "
                                                                              "whose events lack it (dynamo)")


def run(args: argparse.Namespace) -> int:
    from ..prefix.events import read_kv_events, record

    if args.verb == "record":
        forever = args.seconds is None and args.batches is None
        if forever:
            print(f"recording {args.endpoint} to {args.output} until Ctrl-C", flush=True)
        replay = record(args.endpoint, args.output, seconds=float("inf") if forever else args.seconds,
                        max_batches=args.batches, replay_endpoint=args.replay_endpoint, topic=args.topic,
                        ranks=args.ranks)
        print(f"{sum(st.batches for st in replay.stats.values())} batches recorded to {args.output}")
        if not replay.stats:
            print(f"nothing arrived from {args.endpoint}: is the engine running with --kv-events-config "
                  f"(enable_kv_cache_events, publisher zmq), and is this its endpoint and topic?")
            return 1
        print(replay.summary())
        return 0
    if args.verb == "check":
        from ..prefix.events.check import check_kv_events

        report = check_kv_events(args.file, engine=args.engine, block_size=args.block_size)
        print(report.text())
        return report.exit_code
    replay = read_kv_events(args.file, engine=args.engine, block_size=args.block_size)
    print(replay.summary())
    if args.batches:
        for r, m, g in replay.caches():
            print(f"\nrank {r} · {m} · group {g}")
            for f in replay.frames(rank=r, medium=m, group=g)[1:]:
                print(f"  {f.title}")
                for note in f.notes:
                    print(f"    {note}")
    if args.html:
        from ..views.prefix_page import save_prefix_html

        frames = replay.frames(rank=args.rank, medium=args.medium, group=args.group)
        path = save_prefix_html(frames, args.html, title=f"{args.file} · KV cache events")
        print(f"{len(frames) - 1} batches drawn to {path}")
    return 0
