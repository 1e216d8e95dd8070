"""``flatshard``: the command-line entry point."""

from __future__ import annotations

import sys
from typing import NoReturn

from flatshard.cli import ckpt
from flatshard.cli.bench import command as bench
from flatshard.cli.config import ConfigError, OneLineParser
from flatshard.cli.internals import exit_without_teardown
from flatshard.cli.plan import command as plan
from flatshard.cli.train import command as train


def build_parser() -> OneLineParser:
    parser = OneLineParser(
        prog="flatshard", description="Fully sharded data parallel training for PyTorch."
    )
    commands = parser.add_subparsers(dest="command", required=True)
    train.add_parser(commands)
    bench.add_parser(commands)
    ckpt.add_parser(commands)
    plan.add_parser(commands)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    args.argv = list(sys.argv[1:] if argv is None else argv)  # what a restart runs again
    try:
        return int(args.run(args))
    except ConfigError as error:
        print(f"flatshard {args.command}: error: {error}", file=sys.stderr)
        return 2


def entry() -> NoReturn:
    """The ``flatshard`` command: ``main``, then an exit without interpreter teardown."""
    exit_without_teardown(main())


if __name__ == "__main__":
    entry()
