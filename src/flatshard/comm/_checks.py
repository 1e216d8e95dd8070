"""``flatshard.Checks``: how long a collective may wait, and whether to check each one first.

[Note: what the checks cost]
Always on: every flatshard collective is recorded (a few hundred nanoseconds), waited for
in slices of ``SLICE_S`` on backends whose wait blocks the host (gloo), and compared across
ranks by one 8-byte digest per step (``_ledger.py``). Calls that a program may make on some
ranks only (``summon_full_params``, state dicts, ``clip_grad_norm_``, checkpoints) first
agree through the c10d store, so a rank that calls one alone waits there instead of
sending mismatched buffers to the backend (gloo aborts the process on a size mismatch).
Debug mode agrees through the store before every collective: a few store round trips
each, which a training step notices (``benchmarks/watchdog_overhead.py``).
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from contextlib import contextmanager
from contextvars import ContextVar
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist

TIMEOUT_ENV = "FLATSHARD_TIMEOUT"  # seconds
DEBUG_ENV = "FLATSHARD_DEBUG"  # "1": check every collective's descriptor first
_DEFAULT_TIMEOUT_S = 1800.0  # torch's own default for gloo and NCCL groups
# A wait this many times the slowest step (and at least this long) gets a warning first.
WARN_AFTER_STEPS = 10
MIN_WARN_AFTER_S = 60.0


@dataclass(frozen=True)
class Checks:
    """How flatshard watches its collectives, in this process (``flatshard.set_checks``).

    Args:
        timeout: seconds a flatshard collective may wait before every rank raises
            ``flatshard.CollectiveTimeoutError`` with what each rank was doing. None: the
            ``FLATSHARD_TIMEOUT`` environment variable, else the process group's own
            timeout (``init_process_group(timeout=...)``, 30 minutes by default).
        debug: agree on every collective's descriptor (op, unit, sizes, dtype, sequence
            number) through the c10d store before issuing it, so the first mismatch is
            reported before it reaches the backend. Slower; for finding a desync. None:
            the ``FLATSHARD_DEBUG`` environment variable ("1" turns it on).
        warn_after: seconds a flatshard collective may wait before every waiting rank
            prints, as a ``flatshard.SlowCollectiveWarning``, the diagnosis the timeout
            would raise, and waits on. None: 10 times the slowest step so far, and at
            least a minute. No warning where it would come at or after the timeout.
    """

    timeout: float | None = None
    debug: bool | None = None
    warn_after: float | None = None

    def __post_init__(self) -> None:
        if self.timeout is not None and not self.timeout > 0:
            raise ValueError(f"flatshard.Checks: timeout must be > 0 seconds, got {self.timeout}")
        if self.warn_after is not None and not self.warn_after > 0:
            raise ValueError(
                f"flatshard.Checks: warn_after must be > 0 seconds, got {self.warn_after}"
            )

    def warn_after_s(self, slowest_step_s: float) -> float:
        """When a wait is worth a warning, given the slowest step seen so far."""
        if self.warn_after is not None:
            return self.warn_after
        return max(MIN_WARN_AFTER_S, WARN_AFTER_STEPS * slowest_step_s)

    def timeout_s(self, group: dist.ProcessGroup) -> float:
        """The timeout in force for a collective over ``group``."""
        if self.timeout is not None:
            return self.timeout
        if (env := os.environ.get(TIMEOUT_ENV)) is not None:
            try:
                return float(env)
            except ValueError:
                raise ValueError(
                    f"{TIMEOUT_ENV} must be a number of seconds, got {env!r}"
                ) from None
        return _group_timeout(group)

    @property
    def debug_on(self) -> bool:
        if self.debug is not None:
            return self.debug
        return os.environ.get(DEBUG_ENV, "") not in ("", "0")


Checks.__module__ = "flatshard"


@dataclass(frozen=True)
class Tag:
    """What a collective is for, in the user's terms: the ledger's and the reports' words."""

    phase: str  # "forward", "backward", "clip_grad_norm_", "summon_full_params", ...
    unit: str = ""  # the unit's name, "" when the collective is not for one unit
    step: int = 0  # backward passes completed by the model's root


_SETTINGS = [Checks()]  # this process's, set by set_checks


def set_checks(checks: Checks) -> None:
    """Use ``checks`` for every flatshard collective of this process from now on.

    One setting per process, like ``init_process_group``'s timeout: the watchdog that
    applies it serves every model of the process.
    """
    if not isinstance(checks, Checks):
        raise TypeError(f"flatshard.set_checks: expected a flatshard.Checks, got {checks!r}")
    _SETTINGS[0] = checks
    _DEBUG.clear()


def current_checks() -> Checks:
    """The ``Checks`` in force (``set_checks``; by default the environment's and the group's)."""
    return _SETTINGS[0]


_DEBUG: list[bool] = []  # debug_on of the Checks in force, once read (set_checks resets it)


def debug_enabled() -> bool:
    """Whether debug mode is on: asked before every collective, so read once."""
    if not _DEBUG:
        _DEBUG.append(current_checks().debug_on)
    return _DEBUG[0]


_CURRENT: ContextVar[Tag | None] = ContextVar("flatshard_tag", default=None)
_UNTAGGED = Tag("flatshard")


def current_tag() -> Tag:
    """The tag of the flatshard call running now (for collectives not issued by a unit)."""
    return _CURRENT.get() or _UNTAGGED


@contextmanager
def tagged(tag: Tag) -> Iterator[None]:
    """Tag the collectives issued inside (that do not name a tag of their own)."""
    token = _CURRENT.set(tag)
    try:
        yield
    finally:
        _CURRENT.reset(token)


def _group_timeout(group: dist.ProcessGroup) -> float:
    """The timeout ``group`` was created with (torch's default if it cannot be read)."""
    for device in (torch.device("cpu"), torch.device("cuda")):
        try:
            backend = group._get_backend(device)
            timeout = backend.options._timeout
        except (RuntimeError, AttributeError):
            continue
        if isinstance(timeout, timedelta):
            return timeout.total_seconds()
    return _DEFAULT_TIMEOUT_S
