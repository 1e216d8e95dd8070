"""``flatshard <command>`` run in the test's own process, its ranks' output included.

A command run as ``python -m flatshard.cli.main`` imports torch in its own process and
starts a fork server that imports it again: about 5 s of CPU before its ranks run a line,
tens of times in the suite. Run here, the command reuses this process's imports and its
fork server (started once per pytest worker). Its ranks write to the descriptors the
launcher has when it starts them (``CallerOutput``), which this redirects to files.
Commands whose process is the subject (a launcher killed, restarts under the elastic
agent, torchrun) still run as their own process.
"""

from __future__ import annotations

import contextlib
import os
import sys
import tempfile
from collections.abc import Iterator
from typing import IO

from flatshard.cli.main import main


def run_command(argv: list[str]) -> tuple[int, str, str]:
    """``flatshard <argv>`` here: its exit code, stdout and stderr."""
    with tempfile.TemporaryFile() as out, tempfile.TemporaryFile() as err:
        with _descriptors_to(out, err):
            try:
                code = main(argv)
            except SystemExit as exit:  # a usage error: argparse exits
                code = exit.code if isinstance(exit.code, int) else 1
        return code, _text(out), _text(err)


def train(*argv: str) -> str:
    """``flatshard train <argv>`` here, which must succeed: its output."""
    code, out, err = run_command(["train", *argv])
    assert code == 0, out + err
    return out


@contextlib.contextmanager
def _descriptors_to(out: IO[bytes], err: IO[bytes]) -> Iterator[None]:
    """Descriptors 1 and 2, and ``sys.stdout`` / ``sys.stderr`` over them, to the files."""
    sys.stdout.flush()
    sys.stderr.flush()
    saved = os.dup(1), os.dup(2)
    os.dup2(out.fileno(), 1)
    os.dup2(err.fileno(), 2)
    stdout = open(1, "w", buffering=1, closefd=False)  # noqa: SIM115 (closed below)
    stderr = open(2, "w", buffering=1, closefd=False)  # noqa: SIM115
    try:
        with contextlib.redirect_stdout(stdout), contextlib.redirect_stderr(stderr):
            yield
    finally:
        stdout.close()
        stderr.close()
        os.dup2(saved[0], 1)
        os.dup2(saved[1], 2)
        os.close(saved[0])
        os.close(saved[1])


def _text(file: IO[bytes]) -> str:
    file.seek(0)
    return file.read().decode("utf-8", errors="replace")
