"""The rate limiter: at most ``limit`` units' all-gathers issued ahead of their use.

Prefetching issues a unit's all-gather before the unit runs. Nothing else stops the CPU
from issuing many of them (each allocating a full unit) when it runs ahead of the device;
the paper limits this to two in flight. Here a unit counts as "ahead" from its prefetch
until its own hook waits for it or it is freed. Before a prefetch would exceed the limit,
the oldest is waited for: on NCCL ``wait()`` orders the compute stream after it and
returns, so the host never blocks here.

[Note: no host sync in the rate limiter]
PyTorch FSDP1 also waits, on the host, for an event recorded where a unit was freed in
forward: its all-gathers allocate on a stream of their own, and memory freed on the compute
stream comes back to that stream only once the host knows the device got past the free.
flatshard allocates the unsharded buffer on the compute stream (NCCL writes it from its
own stream, and the buffer is waited for before it is freed: [Note: asynchronous
all-gather]). The caching allocator hands a block freed on a stream to the next allocation
on that same stream at once, and stream order makes the reuse safe. So the memory a rank
uses is bounded by what the host keeps alive (at most ``limit`` units gathered ahead, plus
the one running), however far the host runs ahead, and an event wait would add a host sync
per unit and no bound. ``resharded`` only counts the frees.
"""

from __future__ import annotations

from collections import deque
from typing import Protocol

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

    def prefetched(self, unit: Gathering) -> None:
        if unit.gather_in_flight:
            self._ahead.append(unit)
        self.max_ahead = max(self.max_ahead, len(self._ahead))

    def resharded(self) -> None:
        """A unit was freed in forward (counted; see [Note: no host sync in the rate
        limiter] for why the device is not waited for)."""
        self.frees += 1
