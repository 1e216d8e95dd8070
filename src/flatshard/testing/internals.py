"""The one documented place where tests and benchmarks reach into flatshard's internals.

Tests otherwise drive the public API. What is here answers questions the public API does
not (how often the rate limiter ran, which profiler ranges were opened) or makes a fault or
an alternative happen on purpose (a save that dies midway, another reduce-scatter form, no
"keep the last unit" rule). Nothing here is for training code, and names may change.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from contextlib import AbstractContextManager, contextmanager, nullcontext
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from flatshard.comm import _agreement as comm_agreement
from flatshard.comm import _collectives, _mesh
from flatshard.comm import _collectives as comm_collectives
from flatshard.comm._collectives import ReduceScatter
from flatshard.comm._mesh import ranks_per_host
from flatshard.comm._processes import fast_context
from flatshard.comm._watchdog import TORCH_COLLECTIVES, Tag, watchdog
from flatshard.flat._flat_param import FlatParamGroup, Storage, storage_move
from flatshard.flat._layout import ViewSplits, row_layout
from flatshard.flat._partition import UnitMembers, partition, select_unit_roots
from flatshard.flat._reduction import GradientReduction
from flatshard.flat._transport import GatherCodec, quantize_rows
from flatshard.measure._accounting import Ranges
from flatshard.planner._calibrate import _achieved as fitted_achieved
from flatshard.planner._calibrate import _predicted as calibrated_seconds
from flatshard.planner._calibrate import _Speeds as CalibratedSpeeds
from flatshard.planner._meta_ops import MetaOps
from flatshard.planner._meta_ops import not_remembered as meta_ops_not_remembered
from flatshard.planner._recorder import Op as RecordedOp
from flatshard.planner._simulate import measure as measured_step_peak
from flatshard.planner._simulate import measure_step_seconds as measured_step_seconds
from flatshard.runtime._configuration import Switches, UnitConfig, config_lines
from flatshard.runtime._prefetch import ExecutionOrder, RateLimiter
from flatshard.runtime._step import StepContext, context_of, contexts_under
from flatshard.runtime._torch_utilities import TorchReach
from flatshard.runtime._unit import Unit, units_of
from flatshard.sharding._init import with_index as device_with_index
from flatshard.state import _async_save, _checkpoint, _dcp
from flatshard.state._load import file_line as checkpoint_file_line


def owners_of_state() -> dict[str, type]:
    """The classes whose fields docs/design.md's "Unit state" table names."""
    return {
        "Unit": Unit,
        "StepContext": StepContext,
        "FlatParamGroup": FlatParamGroup,
        "GradientReduction": GradientReduction,
    }


__all__ = [
    "TORCH_COLLECTIVES",
    "CalibratedSpeeds",
    "GatherCodec",
    "MetaOps",
    "RateLimiter",
    "RecordedOp",
    "ReduceScatter",
    "Storage",
    "Switches",
    "TorchReach",
    "UnitConfig",
    "UnitMembers",
    "ViewSplits",
    "calibrated_seconds",
    "checkpoint_file_line",
    "checkpoint_file_reads_fail",
    "checkpoint_save_fails",
    "checkpoint_saves_pause",
    "checkpoint_writes_start_after",
    "collective_tag",
    "comm_agreement",
    "comm_collectives",
    "config_lines",
    "context_of",
    "contexts_under",
    "device_with_index",
    "fast_context",
    "fitted_achieved",
    "forced_reduce_scatter",
    "forget_hybrid_groups",
    "gather_now",
    "gathered_units",
    "measured_step_peak",
    "measured_step_seconds",
    "meta_ops_not_remembered",
    "no_keep_last_unit",
    "owners_of_state",
    "partition",
    "profiler_ranges_entered",
    "quantize_rows",
    "ranks_per_host",
    "rate_limiter_of",
    "replica_steps_pause",
    "row_layout",
    "select_unit_roots",
    "staging_buffers",
    "storage_move",
    "units_of",
    "watchdog",
]


def forget_hybrid_groups() -> None:
    """The next hybrid ``fully_shard`` of this process makes its groups anew (to count the
    groups it creates)."""
    _mesh._HYBRID_GROUPS.clear()


def gathered_units(model: nn.Module) -> list[str]:
    """The units inside ``model`` whose unsharded buffers are allocated right now (a
    buffer that is the shard itself, F = 1 in the master dtype, does not count)."""
    return [
        unit.label
        for unit in units_of(model, "gathered_units")
        if any(f.is_unsharded and not f.aliases_shard for f in unit.flat_params)
    ]


def rate_limiter_of(model: nn.Module) -> RateLimiter:
    """The rate limiter of the ``fully_shard`` call on ``model``: its counters say how
    often it ran (``prefetches``, ``frees``) and the most units it saw ahead
    (``max_ahead``)."""
    context = context_of(model)
    if context is None:
        raise ValueError(f"fully_shard was not called on {type(model).__name__}")
    return context.rate_limiter


@contextmanager
def profiler_ranges_entered() -> Iterator[list[str]]:
    """Inside: every profiler range flatshard opens is appended to the yielded list
    instead of being opened."""
    entered: list[str] = []

    def record(name: str) -> AbstractContextManager[object]:
        entered.append(name)
        return nullcontext()

    real = Ranges.open
    Ranges.open = record
    try:
        yield entered
    finally:
        Ranges.open = real


@contextmanager
def forced_reduce_scatter(impl: ReduceScatter) -> Iterator[None]:
    """Inside: every gradient reduce-scatter uses ``impl`` whatever the backend."""
    chosen = _collectives.reduce_scatter_impl
    _collectives.reduce_scatter_impl = lambda group: impl
    try:
        yield
    finally:
        _collectives.reduce_scatter_impl = chosen


def no_keep_last_unit() -> None:
    """From now on in this process, the last unit of forward is resharded like the others
    (for A/B benchmarks of that rule)."""

    def never(self: ExecutionOrder, unit: Any) -> bool:
        return False

    ExecutionOrder.ended_last_forward = never  # type: ignore[method-assign]


@contextmanager
def checkpoint_save_fails(error: BaseException) -> Iterator[None]:
    """Inside: ``save_checkpoint`` raises ``error`` after writing its data, before its
    manifest (``KeyboardInterrupt``: a process killed mid-save; ``OSError(ENOSPC)``: a
    full disk)."""

    def fail(*args: Any) -> None:
        raise error

    real = _checkpoint._share_of_checksums
    _checkpoint._share_of_checksums = fail  # type: ignore[assignment]
    try:
        yield
    finally:
        _checkpoint._share_of_checksums = real


def checkpoint_saves_pause(seconds: float) -> None:
    """From now on in this process, each ``save_checkpoint`` pauses ``seconds`` after
    writing its data, while the checkpoint is still ``.partial``: a kill during a save
    then cannot miss the window (``tests/test_restarts.py`` loads it into every rank)."""
    real = _checkpoint._share_of_checksums

    def paused(*args: Any) -> Any:
        time.sleep(seconds)
        return real(*args)

    _checkpoint._share_of_checksums = paused  # type: ignore[assignment]


def replica_steps_pause(alone: float, together: float = 0.0) -> None:
    """From now on in this process, each step ``flatshard train --ft-replicas`` commits
    pauses ``alone`` seconds after it where fewer replica groups than it was told of took
    part, ``together`` where all did: a group that goes on without a dead one takes few
    steps while the dead one restarts (``tests/test_torchft.py`` loads it into the
    groups' ranks)."""
    from flatshard.cli.train.fault_tolerant import FaultTolerance

    real = FaultTolerance.take

    def paused(self: FaultTolerance, attempt: Any) -> float:
        loss = real(self, attempt)
        time.sleep(alone if len(self.group.quorum) < self.group.groups.count else together)
        return loss

    FaultTolerance.take = paused  # type: ignore[method-assign]


@contextmanager
def checkpoint_writes_start_after(seconds: float) -> Iterator[None]:
    """Inside: each save's DCP write starts ``seconds`` late, so that an asynchronous
    save's writer runs while training changes the live state."""
    real = _dcp.write

    def late(*args: Any) -> None:
        time.sleep(seconds)
        real(*args)

    _dcp.write = late  # type: ignore[assignment]
    try:
        yield
    finally:
        _dcp.write = real


@contextmanager
def checkpoint_file_reads_fail(error: OSError) -> Iterator[None]:
    """Inside: this process cannot read back the files it wrote (its share of the
    checksums fails with ``error``; the other ranks read theirs)."""

    def fail(*args: Any) -> None:
        raise error

    real = _checkpoint._file_facts
    _checkpoint._file_facts = fail  # type: ignore[assignment]
    try:
        yield
    finally:
        _checkpoint._file_facts = real


def staging_buffers() -> dict[str, torch.Tensor]:
    """The host buffers this process's asynchronous saves copy the state into."""
    return _async_save._STAGING.buffers


def collective_tag() -> Tag:
    """A tag as a unit's forward gives its collectives (benchmarks/watchdog_overhead.py)."""
    return Tag("forward", "bench", 0)


def gather_now(out: torch.Tensor, shard: torch.Tensor, group: dist.ProcessGroup, tag: Tag) -> None:
    """One all-gather the way flatshard issues and waits for it (recorded, watched)."""
    _collectives.all_gather_into(out, shard, group, tag)


def agreements_on(group: dist.ProcessGroup) -> int:
    """How many times the ranks of ``group`` have agreed on a call through the store (each
    one a round trip to it), since the watchdog started."""
    dog = watchdog()
    assert dog is not None, "the watchdog runs once a model is sharded"
    return dog._agreements.get(group.group_name, 0)
