"""`hf-megatron <verb>`: the command-line entry point.

Each verb lives in its own module exposing ``add_parser(subparsers)``; the
parser it registers carries ``func=<callable(args) -> int>``.  Verbs are
imported lazily so that `hf-megatron --help` stays fast and a broken optional
dependency of one verb never breaks the others.

Errors: a `hf_megatron.errors.HFMegatronError` (bad user input) is printed as one line
`hf-megatron <verb>: error: ...` with exit status 2; every other exception is a bug and keeps
its traceback.
"""
from __future__ import annotations

import argparse
import importlib
import sys

from .errors import HFMegatronError

# verb module paths, in the order they appear in --help
VERB_MODULES = [
    "hf_megatron.commands.train",
    "hf_megatron.commands.evaluate",
    "hf_megatron.commands.preprocess",
    "hf_megatron.commands.convert",
    "hf_megatron.commands.reshard",
    "hf_megatron.commands.push",
]


class Parser(argparse.ArgumentParser):
    """argparse without prefix matching, as Megatron-LM's parser (allow_abbrev=False): a flag is
    taken only as spelled, so `--num-layers` is never read as the start of a longer flag and a
    misspelt or truncated flag is an error, not silently another one.  Sub-parsers inherit it."""

    def __init__(self, *args, **kwargs):
        kwargs.setdefault("allow_abbrev", False)
        super().__init__(*args, **kwargs)


def build_parser() -> argparse.ArgumentParser:
    parser = Parser(
        prog="hf-megatron",
        description="Megatron-style training and checkpoint tools for Hugging Face models.",
    )
    subparsers = parser.add_subparsers(dest="verb", metavar="<verb>", parser_class=Parser)
    for name in VERB_MODULES:
        try:
            module = importlib.import_module(name)
        except ModuleNotFoundError as exc:
            if exc.name == name:  # verb not written yet
                continue
            raise
        module.add_parser(subparsers)
    return parser


def _parse(parser: argparse.ArgumentParser, argv: list[str]) -> argparse.Namespace:
    """parse_args, except that a flag no verb takes is reported by that verb's parser (its usage,
    `hf-megatron <verb>: error: unrecognized arguments: ...`, naming Megatron-LM's flags as such),
    not by the top-level one."""
    from .commands.flags import unknown_megatron_lm_flags, unrecognized
    verb, rest = parser, argv  # the innermost (sub)command named, e.g. `convert megatron-to-hf`
    while rest:
        nested = [a for a in verb._actions if isinstance(a, argparse._SubParsersAction)]
        if not nested or rest[0] not in nested[0].choices:
            break
        verb, rest = nested[0].choices[rest[0]], rest[1:]
    if verb is not parser and (megatron := unknown_megatron_lm_flags(verb, rest)):
        verb.error(unrecognized(megatron))
    args, extras = parser.parse_known_args(argv)
    if extras:
        verb.error(unrecognized(extras))
    return args


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = _parse(parser, sys.argv[1:] if argv is None else list(argv))
    if not getattr(args, "func", None):
        parser.print_help()
        return 2
    try:
        return int(args.func(args) or 0)
    except HFMegatronError as exc:  # bad user input: one line; anything else is a bug and keeps its traceback
        print(f"hf-megatron {args.verb}: error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
