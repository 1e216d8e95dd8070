"""Collectives that finish late: results land only when ``wait()`` is called.

``delayed_collectives(seconds)`` replaces the collectives flatshard's runtime issues with
versions that compute the real result into a private buffer and copy it into the caller's
tensor only inside ``wait()``, after sleeping. Code that reads a gathered buffer, or a
gradient being reduced, before waiting for it then reads stale data instead of getting
lucky with a fast loopback transport: parity fails. Blocking calls just sleep first.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import torch

from flatshard.comm import _collectives


class LateWork:
    """A finished collective whose result is copied in at ``wait()``."""

    def __init__(self, seconds: float, result: torch.Tensor, target: torch.Tensor) -> None:
        self.seconds, self.result, self.target = seconds, result, target
        self.done = False

    def wait(self, timeout: Any = None) -> bool:
        if not self.done:
            time.sleep(self.seconds)
            self.target.copy_(self.result)
            self.done = True
        return True


def _late(real: Callable[..., Any], seconds: float, output_arg: int) -> Callable[..., Any]:
    def late(*args: Any, async_op: bool = False, **kwargs: Any) -> Any:
        if not async_op:
            time.sleep(seconds)
            return real(*args, **kwargs)
        target: torch.Tensor = args[output_arg]
        private = target.clone()  # in-place collectives read their input from it
        real(*(private if i == output_arg else a for i, a in enumerate(args)), **kwargs)
        return LateWork(seconds, private, target)

    return late


@contextmanager
def delayed_collectives(seconds: float = 0.01) -> Iterator[None]:
    """Inside: every flatshard collective is late by ``seconds`` (see the module note)."""
    names = ("_ALL_GATHER", "_REDUCE_SCATTER", "_ALL_REDUCE", "_ALL_TO_ALL")
    saved = {name: getattr(_collectives, name) for name in names}
    for name, real in saved.items():
        setattr(_collectives, name, _late(real, seconds, 0))  # the output comes first in all
    try:
        yield
    finally:
        for name, real in saved.items():
            setattr(_collectives, name, real)


class _LaggedWork:
    """A collective's work whose ``wait`` queues a device sleep after it."""

    def __init__(self, work: Any, lag: Callable[[], None]) -> None:
        self.work, self.lag = work, lag

    def wait(self, timeout: Any = None) -> bool:
        done = bool(self.work.wait()) if timeout is None else bool(self.work.wait(timeout))
        self.lag()
        return done

    def is_completed(self) -> bool:
        return bool(self.work.is_completed())


def _lagged(real: Callable[..., Any], lag: Callable[[], None]) -> Callable[..., Any]:
    def lagged(*args: Any, **kwargs: Any) -> Any:
        lag()  # the collective starts late on the device: its inputs are read late
        work = real(*args, **kwargs)
        return _LaggedWork(work, lag) if work is not None else None

    return lagged


@contextmanager
def gpu_lag(cycles: int = 2_000_000) -> Iterator[None]:
    """Inside: the device sleeps ``cycles`` before each collective flatshard launches and
    after each wait (``torch.cuda._sleep`` on the current stream), while the host runs on.

    A buffer freed, reused or overwritten before its collective was waited for is then
    still in use on the device when the host moves on: results differ from a run without
    the lag, where a fast GPU hides the race. For CUDA only; nothing on a CPU run.
    """
    if not torch.cuda.is_available():
        yield
        return

    def lag() -> None:
        torch.cuda._sleep(cycles)  # type: ignore[no-untyped-call]

    names = ("_ALL_GATHER", "_REDUCE_SCATTER", "_ALL_REDUCE", "_ALL_TO_ALL")
    saved = {name: getattr(_collectives, name) for name in names}
    for name, real in saved.items():
        setattr(_collectives, name, _lagged(real, lag))
    try:
        yield
    finally:
        for name, real in saved.items():
            setattr(_collectives, name, real)
