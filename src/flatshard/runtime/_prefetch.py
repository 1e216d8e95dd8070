"""Prefetch: issue the next unit's all-gather before it is needed (paper mechanisms 5, 6).

This module decides what to prefetch and issues it; the hooks only say when.
Backward runs units in about the reverse of forward order, so the next unit to gather in
backward is predicted from the order recorded in this iteration's forward; forward
prefetch uses the previous iteration's order (static graphs). A wrong prediction only keeps
a unit gathered longer: it costs memory, never correctness. ``set_prefetch`` replaces the
prediction with explicit targets (``_hooks.py``).

The rate limiter (``Prefetch.limit_all_gathers``): at most ``limit`` units' all-gathers
issued ahead of their use. Nothing else stops the CPU from issuing many prefetches (each
allocating a full unit) when it runs ahead of the device; the paper limits this to two in
flight. Here a unit counts as "ahead" from its prefetch until its own hook waits for it or
it is freed. Before a prefetch would exceed the limit, the oldest is waited for: on NCCL
``wait()`` orders the compute stream after it and returns, so the host never blocks here.

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
from collections.abc import Sequence
from dataclasses import dataclass
from enum import Enum
from typing import Protocol, TypeVar, runtime_checkable

from flatshard.measure._accounting import traced

T = TypeVar("T")


# ---------------------------------------------------------------- the rate limiter
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


# ---------------------------------------------------------------- prefetch


class BackwardPrefetch(Enum):
    """When the next unit's all-gather is issued in backward."""

    # In the current unit's pre-backward, before its reduce-scatter: most overlap; two
    # units' parameters are gathered at once.
    BACKWARD_PRE = "backward_pre"
    # After the current unit's gradient reduction is issued: less memory, less overlap.
    BACKWARD_POST = "backward_post"


@dataclass(frozen=True)
class Prefetch:
    """How far ahead of use ``fully_shard``'s units are all-gathered.

    Attributes:
        backward: gather the next unit (reverse of this iteration's forward order) in the
            current unit's pre-backward (BACKWARD_PRE: more overlap, two units gathered),
            after its reduction (BACKWARD_POST), or not (None).
        forward: start gathering the next unit (previous iteration's forward order) when a
            unit's forward starts, so its all-gather overlaps this unit's compute (one unit
            more gathered in forward; a wrong guess costs memory only).
        limit_all_gathers: the rate limiter: at most two units' all-gathers issued ahead of
            their use (prefetches wait for the oldest beyond that); False: no limit.
    """

    backward: BackwardPrefetch | None = BackwardPrefetch.BACKWARD_PRE
    forward: bool = True
    limit_all_gathers: bool = True

    def __post_init__(self) -> None:
        if self.backward is not None and not isinstance(self.backward, BackwardPrefetch):
            raise TypeError(
                "flatshard.Prefetch: backward must be a flatshard.BackwardPrefetch or None, "
                f"got {self.backward!r}"
            )


@runtime_checkable
class Prefetchable(Gathering, Protocol):
    """What prefetch needs of a unit (``Unit``)."""

    @property
    def prefetch_forward(self) -> Sequence[Prefetchable] | None: ...  # set_prefetch's

    @property
    def prefetch_backward(self) -> Sequence[Prefetchable] | None: ...  # None: predicted

    @property
    def unshard_in_backward(self) -> bool: ...  # False: never gathered in backward, nor prefetched

    @property
    def label(self) -> str: ...

    @property
    def prefetch(self) -> Prefetch: ...

    @property
    def unshard_allocates(self) -> bool: ...

    def start_unshard(self) -> None: ...


class ExecutionOrder:
    """The order in which a model's units started forward: this iteration's and the last.

    A new iteration starts with the root's forward.
    """

    def __init__(self) -> None:
        self.current: list[Prefetchable] = []
        self.previous: list[Prefetchable] = []

    def record_forward(self, unit: Prefetchable, is_root: bool) -> None:
        if is_root:
            if self.current:
                self.previous = self.current
            self.current = []
        if not any(u is unit for u in self.current):
            self.current.append(unit)

    def ended_last_forward(self, unit: Prefetchable) -> bool:
        """Whether ``unit`` ran last in the previous iteration's forward.

        A guess from the last iteration; a wrong one keeps a unit gathered a little longer.
        """
        return bool(self.previous) and self.previous[-1] is unit


def forward_targets(unit: Prefetchable, order: ExecutionOrder) -> list[Prefetchable]:
    """Units to gather when ``unit``'s forward starts (forward prefetch)."""
    if unit.prefetch_forward is not None:
        return list(unit.prefetch_forward)
    if not unit.prefetch.forward:
        return []
    found = _following(order.previous, unit, +1)
    return [found] if found is not None else []


def backward_targets(unit: Prefetchable, order: ExecutionOrder) -> list[Prefetchable]:
    """Units to gather around ``unit``'s backward (backward prefetch)."""
    if unit.prefetch_backward is not None:
        return list(unit.prefetch_backward)
    if unit.prefetch.backward is None:
        return []
    found = _following(order.current, unit, -1)
    return [found] if found is not None else []


def issue(units: list[Prefetchable], limiter: RateLimiter) -> None:
    """Start gathering ``units`` ahead of use; their own hooks wait and register views."""
    for unit in units:
        if not unit.unshard_allocates:
            continue  # nothing to gather or to hold: the limiter has nothing to bound
        with traced(f"prefetch {unit.label}"):
            limiter.before_prefetch()
            unit.start_unshard()
            limiter.prefetched(unit)


def _following(order: Sequence[T], current: T, step: int) -> T | None:
    """The item ``step`` places after ``current`` in ``order`` (None at either end)."""
    for i, item in enumerate(order):
        if item is current:
            j = i + step
            return order[j] if 0 <= j < len(order) else None
    return None
