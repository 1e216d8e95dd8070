"""Profiler ranges ``flatshard::<phase> <unit>`` around the runtime's work."""

from __future__ import annotations

from collections.abc import Callable
from contextlib import AbstractContextManager, nullcontext

import torch
from torch.profiler import record_function

# Whether a profiler is recording (torch exposes no public query; without this private
# one, ranges are always entered).
_profiling: Callable[[], bool] = getattr(torch._C._autograd, "_profiler_enabled", lambda: True)


class Ranges:
    """Where ranges are opened; ``flatshard.testing.internals`` swaps ``open`` to count."""

    open: Callable[[str], AbstractContextManager[object]] = record_function


def traced(what: str) -> AbstractContextManager[object]:
    """A profiler range ``flatshard::<what>`` while a profiler records, else nothing.

    Entering a range costs CPU time even when nothing records, and a step enters several
    per unit: on a GPU, launch time the device may wait for.
    """
    return Ranges.open(f"flatshard::{what}") if _profiling() else nullcontext()
