"""What the commands share: one-line option errors, and flags made from a config dataclass.

A command's options are a frozen dataclass; each field's docstring (the string literal
under it) is its ``--help`` text (``{strategies}`` in it lists the sharding strategies).
Values come from the field defaults, then an optional TOML file (``--config run.toml``,
keys are field names), then the command line.
"""

from __future__ import annotations

import argparse
import ast
import difflib
import inspect
import itertools
import sys
import textwrap
from collections.abc import Callable, Sequence
from dataclasses import MISSING, fields
from pathlib import Path
from typing import Any, NoReturn, TypeVar, cast

from flatshard.cli.internals import not_a_strategy, strategy_names
from flatshard.comm import ShardingStrategy

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover - Python 3.10
    import tomli as tomllib

C = TypeVar("C")

# Options whose name changed -> the new name, so that an old command line or TOML file gets
# the new spelling in its error (the CLI takes the API's words: placement=RowSparse()).
RENAMED = {"sparse_embeddings": "row_sparse_tables"}


class ConfigError(ValueError):
    """A bad option: reported as one line naming the option, not a traceback."""


class OneLineParser(argparse.ArgumentParser):
    """argparse, but a usage error is one line (the usage is one ``--help`` away), and a
    mistyped flag of a subcommand is reported by that subcommand with the closest flag."""

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"{self.prog}: error: {message} (see {self.prog} --help)\n")

    def parse_args(  # type: ignore[override]
        self, args: Sequence[str] | None = None, namespace: None = None
    ) -> argparse.Namespace:
        parsed, unknown = self.parse_known_args(args)
        if unknown:
            command: argparse.ArgumentParser = getattr(parsed, "command_parser", self)
            flags: tuple[str, ...] = getattr(parsed, "known_flags", ())
            hints = [_hint(word, flags) for word in unknown]
            command.error(f"unrecognized arguments: {' '.join(hints)}")
        return parsed


def _hint(word: str, flags: tuple[str, ...]) -> str:
    """An unknown flag with its new name (renamed) or the closest known one."""
    name = word.split("=")[0]
    negated = name.startswith("--no-")
    old = name.removeprefix("--no-").removeprefix("--").replace("-", "_")
    if old in RENAMED:
        new = flag(RENAMED[old])
        return f"{word} (renamed {'--no-' + new[2:] if negated else new})"
    close = difflib.get_close_matches(name, flags, n=1)
    return f"{word} (did you mean {close[0]}?)" if close else word


def field_docs(config: type[Any]) -> dict[str, str]:
    """Each field's docstring, read from the class source."""
    tree = ast.parse(textwrap.dedent(inspect.getsource(config)))
    body = cast(ast.ClassDef, tree.body[0]).body
    docs: dict[str, str] = {}
    for node, following in itertools.pairwise(body):
        if (
            isinstance(node, ast.AnnAssign)
            and isinstance(node.target, ast.Name)
            and isinstance(following, ast.Expr)
            and isinstance(following.value, ast.Constant)
            and isinstance(following.value.value, str)
        ):
            docs[node.target.id] = " ".join(following.value.value.split())
    return docs


def flag(name: str) -> str:
    return f"--{name.replace('_', '-')}"


def add_config_parser(
    commands: Any,
    name: str,
    *,
    help: str,
    description: str | None,
    config: type[Any],
    run: Callable[[argparse.Namespace], int],
    config_file: bool = False,
) -> None:
    """A subcommand with one ``--flag`` per field of the ``config`` dataclass."""
    parser = commands.add_parser(
        name,
        help=help,
        description=description,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    known = ["--help", *(["--config"] if config_file else [])]
    for field in fields(config):
        known += [flag(field.name)]
        if isinstance(field.default, bool):
            known += [f"--no-{flag(field.name)[2:]}"]
    docs = field_docs(config)
    if config_file:
        parser.add_argument(
            "--config",
            type=Path,
            default=None,
            help="a TOML file of options (keys are the option names); flags override it",
        )
    for field in fields(config):
        default = field.default
        doc = docs.get(field.name, "").replace("{strategies}", strategy_names())
        text = f"{doc} (default: {default!r})"
        if isinstance(default, bool):
            parser.add_argument(
                flag(field.name),
                action=argparse.BooleanOptionalAction,
                default=argparse.SUPPRESS,
                help=text,
            )
        else:
            parser.add_argument(
                flag(field.name), type=type(default), default=argparse.SUPPRESS, help=text
            )
    parser.set_defaults(run=run, command_parser=parser, known_flags=tuple(known))


def config_from_args(config: Callable[..., C], args: argparse.Namespace) -> C:
    """The ``config`` dataclass from defaults, the TOML file, then flags (and validated)."""
    values: dict[str, Any] = {}
    path = getattr(args, "config", None)
    if path is not None:
        values.update(_from_toml(cast(type[Any], config), path))
    names = [f.name for f in fields(cast(Any, config))]
    values.update({name: getattr(args, name) for name in names if hasattr(args, name)})
    return config(**values)


def _from_toml(config: type[Any], path: Path) -> dict[str, Any]:
    try:
        raw = tomllib.loads(path.read_text())
    except OSError as error:
        raise ConfigError(f"--config: cannot read {path}: {error.strerror}") from None
    except tomllib.TOMLDecodeError as error:
        raise ConfigError(f"--config: {path} is not valid TOML: {error}") from None
    known = {f.name: f for f in fields(config)}
    values: dict[str, Any] = {}
    for key, value in raw.items():
        name = key.replace("-", "_")
        if name in RENAMED:
            raise ConfigError(f"--config: '{key}' in {path} was renamed '{RENAMED[name]}'")
        if name not in known:
            raise ConfigError(f"--config: unknown option '{key}' in {path} (see --help)")
        default = known[name].default
        expected = type(default) if default is not MISSING else object
        if expected is float and isinstance(value, int) and not isinstance(value, bool):
            value = float(value)
        if not isinstance(value, expected) or isinstance(value, bool) != (expected is bool):
            raise ConfigError(
                f"--config: '{key}' in {path} must be {expected.__name__}, got {value!r}"
            )
        values[name] = value
    return values


def fail(option: str, message: str) -> NoReturn:
    """Raise the one-line error for ``option`` (a field name or flag)."""
    raise ConfigError(f"{flag(option) if not option.startswith('--') else option} {message}")


def strategy_option(value: str, option: str = "strategy") -> ShardingStrategy:
    """``--strategy``: a strategy's name in any case, or another library's (``zero3``)."""
    try:
        return ShardingStrategy.parse(value)
    except TypeError:
        fail(option, not_a_strategy(value, listing=False) + " (--help says what each does)")
