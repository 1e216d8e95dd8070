"""What the commands share: option errors, and flags made from a config dataclass."""

from __future__ import annotations

import argparse
from collections.abc import Callable
from dataclasses import asdict, fields
from typing import Any, TypeVar, cast

C = TypeVar("C")


class ConfigError(ValueError):
    """A bad option: reported as one line naming the option, not a traceback."""


def add_config_parser(
    commands: Any,
    name: str,
    *,
    help: str,
    description: str | None,
    config: type[Any],
    run: Callable[[argparse.Namespace], int],
) -> None:
    """A subcommand with one ``--flag`` per field of the ``config`` dataclass."""
    parser = commands.add_parser(
        name,
        help=help,
        description=description,
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    for field, value in asdict(config()).items():
        parser.add_argument(f"--{field.replace('_', '-')}", type=type(value), default=value)
    parser.set_defaults(run=run)


def config_from_args(config: Callable[..., C], args: argparse.Namespace) -> C:
    """The ``config`` dataclass built (and so validated) from parsed flags."""
    names = [f.name for f in fields(cast(Any, config))]
    return config(**{name: getattr(args, name) for name in names})
