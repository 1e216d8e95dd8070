"""Prefetch: issue the next unit's all-gather before it is needed (paper mechanisms 5, 6).

This module decides what to prefetch and issues it; the hooks only say when.
Backward runs units in about the reverse of forward order, so the next unit to gather in
backward is predicted from the order recorded in this iteration's forward; forward
prefetch uses the previous iteration's order (static graphs). A wrong prediction only keeps
a unit gathered longer: it costs memory, never correctness. ``set_prefetch`` replaces the
prediction with explicit targets (``_hooks.py``).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from enum import Enum
from typing import Protocol, TypeVar, runtime_checkable

from flatshard.runtime._profiling import traced
from flatshard.runtime._rate_limiter import Gathering, RateLimiter

T = TypeVar("T")


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
