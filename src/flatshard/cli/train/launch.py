"""``flatshard train``'s own launcher: one process per local rank, stopped together.

Without torchrun, ``flatshard train --nproc N`` starts its ranks here. A rank that fails
stops the others (they would wait in a collective forever) and is named with its exit
code or signal; SIGTERM / SIGINT to the launcher stop every rank; a launcher killed with
SIGKILL takes its ranks with it.
"""

from __future__ import annotations

import ctypes
import multiprocessing as mp
import os
import signal
import sys
import threading
import time
from collections.abc import Callable
from typing import Any

STOP_GRACE_S = 5.0  # how long stopped ranks may take before SIGKILL
PREEMPT_GRACE_S = 300.0  # ... when they finish a step and save first (--ckpt-on-preempt)


def run_local_ranks(
    nproc: int, worker: Callable[..., None], args: tuple[Any, ...], grace_s: float = STOP_GRACE_S
) -> int:
    """Run ``worker(rank, *args, launcher_pid)`` in one process per local rank; stop them
    all at the first failure or signal; the exit code for the command.

    SIGTERM / SIGINT to the launcher are passed to every rank, which then have ``grace_s``
    seconds before SIGKILL; a launcher killed outright takes its ranks with it
    (``stop_with_parent``). The rank that failed first is named, with its exit code or
    the signal that killed it.
    """
    ctx = mp.get_context("spawn")
    launcher = os.getpid()
    procs = [ctx.Process(target=worker, args=(r, *args, launcher)) for r in range(nproc)]
    for proc in procs:
        proc.start()
    received: list[int] = []
    previous = {sig: signal.signal(sig, lambda s, _: received.append(s)) for sig in _STOP}
    try:
        first = _supervise(procs, received, grace_s)
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
    if received:
        print(f"flatshard train: stopped all ranks on {signal.Signals(received[0]).name}")
        return 128 + received[0]
    if first is not None and first[1] == 128 + signal.SIGTERM:  # stopped itself on SIGTERM
        print(f"flatshard train: rank {first[0]} stopped on SIGTERM; stopped the other ranks")
        return first[1]
    if first is not None:
        rank, code = first
        print(
            f"flatshard train: rank {rank} {_how(code)}; stopped the other ranks", file=sys.stderr
        )
        return 1
    return 0


_STOP = (signal.SIGTERM, signal.SIGINT)


def _supervise(procs: list[Any], received: list[int], grace_s: float) -> tuple[int, int] | None:
    """Wait for the ranks; at a failure or a signal, stop the rest. The first failure."""
    while True:
        # Checked once more after the last rank ended: ranks that all fail at once (a bad
        # option every rank finds) must not look like a success.
        failed = [(r, p.exitcode) for r, p in enumerate(procs) if p.exitcode]
        if failed or received:
            _stop(procs, grace_s)  # a rank failed: the others would wait forever
            return failed[0] if failed else None
        if not any(p.is_alive() for p in procs):
            return None
        procs[0].join(timeout=0.2)


def _stop(procs: list[Any], grace_s: float) -> None:
    """SIGTERM every live rank, then SIGKILL whatever is left after ``grace_s``."""
    for proc in procs:
        if proc.is_alive():
            proc.terminate()
    deadline = time.monotonic() + grace_s
    for proc in procs:
        proc.join(timeout=max(0.0, deadline - time.monotonic()))
        if proc.is_alive():
            proc.kill()
            proc.join()


def _how(exitcode: int) -> str:
    if exitcode < 0:
        return f"was killed by {signal.Signals(-exitcode).name}"
    return f"exited with code {exitcode}"


def stop_with_parent(parent: int) -> None:
    """Have this process receive SIGTERM when ``parent`` dies (Linux), so that ranks never
    outlive a launcher killed with SIGKILL; elsewhere a thread watches the parent."""
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(_PR_SET_PDEATHSIG, signal.SIGTERM)
    except (OSError, AttributeError):
        threading.Thread(target=_watch_parent, args=(parent,), daemon=True).start()
    if os.getppid() != parent:  # it died before prctl took effect
        os.kill(os.getpid(), signal.SIGTERM)


_PR_SET_PDEATHSIG = 1  # linux/prctl.h


def _watch_parent(parent: int) -> None:
    while os.getppid() == parent:
        time.sleep(1.0)
    os.kill(os.getpid(), signal.SIGTERM)
