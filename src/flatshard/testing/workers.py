"""A long-lived pool of worker processes, one per rank, that runs many jobs.

Spawning processes and building gloo groups costs seconds; a test suite that did it per test
would not fit in its time budget. The pool builds them once; each job is a module-level
function ``fn(ctx, *args)`` that every rank runs. A job that fails on a rank, or does not
answer in time, raises in the caller with each rank's traceback, and the pool is rebuilt
so that ranks left waiting in a collective cannot poison the next job.
"""

from __future__ import annotations

import os
import queue
import tempfile
import traceback
from collections.abc import Callable
from dataclasses import dataclass
from datetime import timedelta
from multiprocessing.process import BaseProcess
from typing import Any

import torch
import torch.distributed as dist

from flatshard.comm._processes import fast_context

COLLECTIVE_TIMEOUT = timedelta(seconds=60)


@dataclass
class WorkerContext:
    """What a job sees on its rank."""

    rank: int
    world_size: int
    groups: dict[int, dist.ProcessGroup]  # size k -> group of ranks 0..k-1

    def group(self, size: int) -> dist.ProcessGroup | None:
        """The group of ranks 0..size-1, or None on ranks outside it."""
        return self.groups[size] if self.rank < size else None


class JobFailed(AssertionError):
    """A job raised on some rank; the message holds every rank's traceback."""


class WorkerPool:
    """``world_size`` processes joined in one gloo world, plus subgroups of every size."""

    def __init__(self, world_size: int, timeout_s: float = 240.0) -> None:
        self.world_size = world_size
        self.timeout_s = timeout_s
        self._procs: list[BaseProcess] = []
        self._tasks: list[Any] = []
        self._results: Any = None
        self._store_dir: tempfile.TemporaryDirectory[str] | None = None

    def run(self, fn: Callable[..., Any], *args: Any) -> list[Any]:
        """Run ``fn(ctx, *args)`` on every rank; return the results in rank order."""
        if not self._procs:
            self._start()
        for tasks in self._tasks:
            tasks.put((fn, args))
        results: dict[int, Any] = {}
        failures: dict[int, str] = {}
        deadline = self.timeout_s
        while len(results) + len(failures) < self.world_size:
            try:
                rank, ok, payload = self._results.get(timeout=deadline)
            except queue.Empty:
                missing = sorted(set(range(self.world_size)) - results.keys() - failures.keys())
                self.close()
                failures.update({r: f"no answer within {self.timeout_s:.0f}s" for r in missing})
                break
            (results if ok else failures)[rank] = payload
            if failures:
                deadline = min(deadline, 30.0)  # the others may wait on the failed rank
        if failures:
            self.close()
            report = "\n".join(f"--- rank {r} ---\n{failures[r]}" for r in sorted(failures))
            raise JobFailed(f"{fn.__name__} failed on ranks {sorted(failures)}:\n{report}")
        return [results[r] for r in range(self.world_size)]

    def _start(self) -> None:
        ctx = fast_context()
        self._store_dir = tempfile.TemporaryDirectory(prefix="flatshard-pool-")
        store = os.path.join(self._store_dir.name, "store")
        self._results = ctx.Queue()
        self._tasks = [ctx.Queue() for _ in range(self.world_size)]
        self._procs = [
            ctx.Process(
                target=_worker_main,
                args=(rank, self.world_size, store, self._tasks[rank], self._results),
                daemon=True,
            )
            for rank in range(self.world_size)
        ]
        for proc in self._procs:
            proc.start()

    def close(self) -> None:
        """Stop the workers (politely, then by force)."""
        for tasks in self._tasks:
            tasks.put(None)
        for proc in self._procs:
            proc.join(timeout=5)
            if proc.is_alive():
                proc.kill()
                proc.join()
        self._procs, self._tasks = [], []
        if self._store_dir is not None:
            self._store_dir.cleanup()
            self._store_dir = None


def join_gloo_world(rank: int, world_size: int, store: str) -> None:
    """Make this process rank ``rank`` of a gloo world met through the file ``store``."""
    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo",
        init_method=f"file://{store}",
        rank=rank,
        world_size=world_size,
        timeout=COLLECTIVE_TIMEOUT,
    )


def _worker_main(rank: int, world_size: int, store: str, tasks: Any, results: Any) -> None:
    join_gloo_world(rank, world_size, store)
    try:
        groups = {k: dist.new_group(list(range(k))) for k in range(1, world_size + 1)}
        ctx = WorkerContext(rank=rank, world_size=world_size, groups=groups)
        while (task := tasks.get()) is not None:
            fn, args = task
            try:
                results.put((rank, True, fn(ctx, *args)))
            except BaseException:
                results.put((rank, False, traceback.format_exc()))
    finally:
        dist.destroy_process_group()
