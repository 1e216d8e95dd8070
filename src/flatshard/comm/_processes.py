"""Local processes that start in milliseconds: forked from a server that imported torch.

[Note: fast ranks] A spawned process spends seconds importing torch before it runs a
line, and the bench, the planner's calibration and the tests start many of them on a
few cores. Python's forkserver start method forks each new process from a server that
did the imports once (and nothing else: no thread pool, no process group, no device),
with the same isolation as a spawned one. Two differences matter here:
- the server's environment is the one it had when it started, so a caller whose
  environment may have changed since passes ``os.environ`` along and the child adopts
  it (``adopt_environment``);
- a child's parent is the server, not the caller: ``flatshard train``'s ranks, which die
  with their launcher, watch the launcher itself (``cli/train/launch.py``);
- a child's output goes where the server's went when it started, so a caller whose output
  may have been redirected since passes its own along (``CallerOutput``).
"""

from __future__ import annotations

import atexit
import multiprocessing as mp
import os
import sys
from multiprocessing import reduction
from multiprocessing.context import ForkServerContext, SpawnContext
from typing import Any, NoReturn

PRELOAD = ["torch", "torch._dynamo", "flatshard"]


def fast_context() -> ForkServerContext | SpawnContext:
    """The forkserver context, its server importing ``PRELOAD`` once (spawn where the
    platform has no forkserver: Windows)."""
    if "forkserver" not in mp.get_all_start_methods():
        return mp.get_context("spawn")
    context = mp.get_context("forkserver")
    context.set_forkserver_preload(PRELOAD)
    return context


def adopt_environment(env: dict[str, str]) -> None:
    """Make this (forked) process's environment the caller's."""
    os.environ.clear()
    os.environ.update(env)


class CallerOutput:
    """The caller's stdout and stderr (descriptors 1 and 2), for a child to write to.

    The server lives as long as the process that started it, and its children inherit its
    descriptors: where that process's output went when the server started. A process that
    redirects its output later (a test capturing it, a program running a command in
    process and keeping its output apart) would lose its children's lines. Given as an
    argument of the process being started, this pickles the caller's descriptors as they
    are at that moment, passed to the child with it (``multiprocessing.reduction.DupFd``);
    the child calls ``adopt`` before it writes anything.
    """

    def __init__(self, out: Any = None, err: Any = None) -> None:
        self._out, self._err = out, err

    def __reduce__(self) -> tuple[Any, ...]:
        return (CallerOutput, tuple(_passed(fd) for fd in (1, 2)))

    def adopt(self) -> None:
        """Make the caller's descriptors this (started) process's stdout and stderr."""
        for stream, passed, fd in ((sys.stdout, self._out, 1), (sys.stderr, self._err, 2)):
            if passed is None:  # not pickled (the caller itself), or nothing to pass
                continue
            if stream is not None:
                stream.flush()
            received = passed.detach()
            os.dup2(received, fd)
            os.close(received)


def _passed(fd: int) -> Any:
    """``fd`` passed to the child being started, or None where it is closed (a caller
    started with its output closed: the child keeps the server's)."""
    try:
        os.fstat(fd)
    except OSError:
        return None
    return reduction.DupFd(fd)


def exit_without_teardown(code: int) -> NoReturn:
    """End this process now: exit handlers run and output is flushed, the rest is skipped.

    [Note: exiting without teardown] Python's own exit then garbage-collects every module
    object one by one: 0.7 s after importing torch on the development machine, 1.5 s once
    torch._dynamo is in (``fully_shard`` imports it), in every rank and every CLI
    command. Work that must outlive the process is done by then (files are closed as they
    are written, process groups destroyed), and what registered for the exit (``atexit``:
    flatshard's own release of process groups, logging) still runs. Processes forked by
    multiprocessing end this way already.
    """
    atexit._run_exitfuncs()
    for stream in (sys.stdout, sys.stderr):
        if stream is not None:  # (None: the process was started with it closed)
            stream.flush()
    os._exit(code)
