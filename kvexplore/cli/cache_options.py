"""``kvexplore generate``'s cache options, read from the strategies' own declarations
(:mod:`kvexplore.caches.options`): one flag per option a command line can give (``--window``, ``--press``,
``--cache-type-k``), checked as it is parsed by the option's own check, and refused naming the strategy that takes it
when another ``--cache`` is chosen. Nothing here names a strategy or an option."""

from __future__ import annotations

import argparse
from typing import Any, Callable

from ..caches.options import OptionSpec
from ..caches.registry import STRATEGIES
from ..errors import SettingsError


def _declared() -> dict[str, tuple[OptionSpec, list[str]]]:
    """Every option a command line can give, by name: its spec (the first strategy's) and the strategies taking it."""
    found: dict[str, tuple[OptionSpec, list[str]]] = {}
    for kind in STRATEGIES:
        declared = getattr(STRATEGIES[kind], "Options", None)
        for f, spec in declared.specs() if declared is not None else ():
            if spec.flag is not None:
                found.setdefault(f.name, (spec, []))[1].append(kind)
    return found


def flag_of(name: str, spec: OptionSpec) -> str:
    return spec.flag.name or f"--{name.replace('_', '-')}"


def _parsed(name: str, spec: OptionSpec) -> Callable[[str], Any]:
    """The flag's type: the text parsed, then the option's own check (its message, on the command line)."""
    def parse(text: str) -> Any:
        value = spec.flag.parse(text)
        if spec.check is not None and not spec.flag.choices:
            try:
                spec.check(value, name)
            except SettingsError as e:
                raise argparse.ArgumentTypeError(str(e)) from None
        return value
    parse.__name__ = spec.flag.parse.__name__  # argparse names it in "invalid int value"
    return parse


def _help(name: str, spec: OptionSpec, kinds: list[str]) -> str:
    starts = [f"{STRATEGIES[k].Options.generate[name]} for --cache {k}" for k in kinds
              if name in STRATEGIES[k].Options.generate]
    return f"{spec.help}{f' (kvexplore generate: {starts[0]})' if starts else ''}"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Add every strategy's options to ``parser`` (generate's), each defaulting to None ("not given")."""
    for name, (spec, kinds) in _declared().items():
        help = f"--cache {'/'.join(kinds)}: {_help(name, spec, kinds)}"
        if spec.flag.switch:
            parser.add_argument(flag_of(name, spec), dest=name, action="store_const", const=True, default=None,
                                help=help)
        else:
            parser.add_argument(flag_of(name, spec), dest=name, type=_parsed(name, spec), choices=spec.flag.choices,
                                default=None, help=help)


def given(args: argparse.Namespace) -> dict[str, Any]:
    """The options of ``args.cache`` the command line gave, over what the strategy's ``generate`` starts with; one
    of another strategy is refused, naming it."""
    declared = _declared()
    chosen = getattr(STRATEGIES[args.cache], "Options", None)
    takes = chosen.names() if chosen is not None else []
    options = {name: getattr(args, name) for name in declared if getattr(args, name, None) is not None}
    for name in options:
        if name not in takes:
            spec, kinds = declared[name]
            raise SettingsError(f"{flag_of(name, spec)} is an option of --cache {'/'.join(kinds)}, not of --cache "
                                f"{args.cache}")
    return {**(chosen.generate if chosen is not None else {}), **options}


def table() -> str:
    """The options as docs/cli.md lists them (a test holds the page to it): cache, flag, values, what."""
    rows = ["| `--cache` | flag | values | what it sets |", "|---|---|---|---|"]
    for name, (spec, kinds) in _declared().items():
        values = ("none (a switch)" if spec.flag.switch else ", ".join(map(str, spec.flag.choices))
                  if spec.flag.choices else f"{spec.flag.parse.__name__}")
        rows.append(f"| {', '.join(kinds)} | `{flag_of(name, spec)}` | {values} | `{name}`: "
                    f"{_help(name, spec, kinds)} |")
    return "\n".join(rows)
