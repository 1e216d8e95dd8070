"""The rate limiter: at most ``limit`` units' all-gathers issued ahead of their use.

Prefetching issues a unit's all-gather before the unit runs. Nothing else stops the CPU
from issuing many of them (each allocating a full unit) when it runs ahead of the device;
the paper limits this to two in flight. Here a unit counts as "ahead" from its prefetch
until its own hook waits for it or it is freed, and, on an accelerator, until the device
has actually freed it (an event recorded when it is resharded in forward, as PyTorch FSDP
does). Before a prefetch would exceed the limit, the oldest is waited for.
"""

from __future__ import annotations

from collections import deque
from typing import Protocol

import torch

DEFAULT_LIMIT = 2


class Gathering(Protocol):
    """What the limiter needs of a unit it tracks (``Unit``)."""

    @property
    def gather_in_flight(self) -> bool: ...

    def finish_unshard(self) -> None: ...


class RateLimiter:
    """Bounds the units gathered ahead of use."""

    def __init__(self, limit: int | None = DEFAULT_LIMIT) -> None:
        self.limit = limit  # None: no limit
        self._ahead: deque[Gathering] = deque()
        self._frees: deque[torch.Event] = deque()  # accelerators only
        # For tests and reports (flatshard.testing.internals.rate_limiter_of):
        self.max_ahead = 0  # the most units ever gathered ahead at once
        self.prefetches = 0  # calls of before_prefetch
        self.frees = 0  # calls of resharded

    def before_prefetch(self) -> None:
        """Make room for one more all-gather issued ahead of use."""
        self.prefetches += 1
        self._ahead = deque(unit for unit in self._ahead if unit.gather_in_flight)
        if self.limit is None:
            return
        while len(self._ahead) >= self.limit:
            self._ahead.popleft().finish_unshard()
        while len(self._frees) >= self.limit:
            self._frees.popleft().synchronize()  # the device has freed that unit

    def prefetched(self, unit: Gathering) -> None:
        if unit.gather_in_flight:
            self._ahead.append(unit)
        self.max_ahead = max(self.max_ahead, len(self._ahead))

    def resharded(self, device: torch.device) -> None:
        """A unit was freed in forward: on an accelerator, note when the device gets there."""
        self.frees += 1
        if self.limit is not None and device.type not in ("cpu", "meta"):  # meta: a plan
            event = torch.Event(device=device)
            event.record()
            self._frees.append(event)
            # Events of one stream complete in order: the newest ``limit`` say it all (and
            # without prefetches nothing else would ever drain the queue).
            while len(self._frees) > self.limit:
                self._frees.popleft()
