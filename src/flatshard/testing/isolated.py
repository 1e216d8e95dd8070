"""Ranks in fresh processes, for faults that leave a process group unusable.

A job that hangs, aborts or kills a rank cannot run on the shared ``WorkerPool``: its
collectives stay in flight and would pair with the next job's. ``run_isolated`` starts
``world_size`` new processes, runs ``fn(rank)`` in each after ``init_process_group``, and
reports what became of every rank: its return value, ``Died(exit code)`` or ``Hung``.
"""

from __future__ import annotations

import os
import queue
import subprocess
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch.distributed as dist

from flatshard.comm import _watchdog
from flatshard.comm._processes import adopt_environment, fast_context
from flatshard.testing.workers import join_gloo_world


@dataclass(frozen=True)
class Died:
    """The rank's process ended without a result (negative: killed by that signal)."""

    exitcode: int | None


@dataclass(frozen=True)
class Hung:
    """The rank gave no result within the deadline and was killed."""


def run_isolated(
    fn: Callable[..., Any], *args: Any, world_size: int = 2, deadline_s: float = 60.0
) -> list[Any]:
    """Run ``fn(rank, *args)`` on ``world_size`` fresh ranks (gloo); each rank's outcome."""
    ctx = fast_context()
    env = dict(os.environ)  # [Note: fast ranks]
    results: Any = ctx.Queue()
    with tempfile.TemporaryDirectory(prefix="flatshard-isolated-") as tmp:
        store = os.path.join(tmp, "store")
        procs = [
            ctx.Process(target=_main, args=(fn, args, rank, world_size, store, results, env))
            for rank in range(world_size)
        ]
        for proc in procs:
            proc.start()
        outcomes: dict[int, Any] = {}
        end = time.monotonic() + deadline_s
        while len(outcomes) < world_size and time.monotonic() < end:
            try:
                rank, value = results.get(timeout=0.2)
                outcomes[rank] = value
            except queue.Empty:
                for rank, proc in enumerate(procs):
                    if rank not in outcomes and proc.exitcode is not None:
                        outcomes[rank] = Died(proc.exitcode)
        for proc in procs:
            proc.join(timeout=max(0.0, end - time.monotonic()))
            if proc.is_alive():
                proc.kill()
                proc.join()
    return [outcomes.get(rank, Hung()) for rank in range(world_size)]


def alive(pid: int) -> bool:
    """Whether process ``pid`` still runs (a zombie has exited; its parent did not reap it)."""
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (FileNotFoundError, IndexError):
        return False
    return state != "Z"


def _main(
    fn: Callable[..., Any],
    args: tuple[Any, ...],
    rank: int,
    world: int,
    store: str,
    out: Any,
    env: dict[str, str],
) -> None:
    adopt_environment(env)
    join_gloo_world(rank, world, store)
    out.put((rank, fn(rank, *args)))
    out.close()
    out.join_thread()
    dog = _watchdog._WATCHDOG
    left_in_flight = dog is not None and dog.failed  # then leave it: see _at_exit
    if dist.is_initialized() and not left_in_flight:  # (unless ``fn`` destroyed it)
        dist.destroy_process_group()


def descendants(pid: int) -> list[int]:
    """Every process below ``pid`` (children first)."""
    found = subprocess.run(["pgrep", "-P", str(pid)], capture_output=True, text=True).stdout
    children = [int(p) for p in found.split()]
    return children + [d for c in children for d in descendants(c)]


def rank_pid(root: int, rank: int) -> int | None:
    """The process of ``flatshard train``'s rank ``rank`` under ``root``, where its launcher
    (torch's elastic agent, torchrun) gave it RANK in its environment."""
    for pid in descendants(root):
        try:
            environ = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
            cmdline = Path(f"/proc/{pid}/cmdline").read_bytes()
        except (FileNotFoundError, ProcessLookupError, PermissionError):
            continue
        if b"flatshard.cli.main" in cmdline and f"RANK={rank}".encode() in environ:
            return pid
    return None


def wait_until(condition: Callable[[], object], seconds: float = 120.0) -> None:
    """Poll ``condition`` until it holds; an AssertionError after ``seconds``."""
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        if condition():
            return
        time.sleep(0.005)
    raise AssertionError("timed out waiting")
