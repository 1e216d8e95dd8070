"""The collectives flatshard issues, as free functions with explicit groups.

Every all-gather and gradient reduction of the runtime goes through here, so that counting,
tagging and choosing an implementation per backend have one home.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import NamedTuple

import torch
import torch.distributed as dist

from flatshard._mesh import ShardGroups

# torch 2.13 renamed the tensor collectives; older releases only have the old names.
# Module attributes looked up at call time, so that tests can delay them
# (flatshard.testing.delays).
_ALL_GATHER = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_REDUCE_SCATTER = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
_ALL_REDUCE = dist.all_reduce


class WaitClock:
    """Seconds the calling thread spent blocked on flatshard's collectives.

    On CPU backends (gloo) this is communication the compute waited for: the exposed
    communication time. On CUDA, ``Work.wait()`` only makes the compute stream wait and
    returns at once, so there it measures nothing; use a profiler trace instead.
    """

    seconds = 0.0

    @classmethod
    @contextmanager
    def measure(cls) -> Iterator[None]:
        start = time.perf_counter()
        try:
            yield
        finally:
            cls.seconds += time.perf_counter() - start


class PendingReduction(NamedTuple):
    """A gradient reduction in flight.

    ``input`` is held so that its memory stays alive until the collective has read it.
    When the shard-group step ran as an all-reduce, ``chunk`` is this rank's part of
    ``input`` still to copy into ``output`` once ``work`` is done.
    """

    work: dist.Work | None
    input: torch.Tensor  # (C * F,) the unsharded gradient
    output: torch.Tensor  # (C,) this rank's averaged shard once ``work`` is done
    chunk: slice | None = None


def all_gather_into(unsharded: torch.Tensor, shard: torch.Tensor, group: dist.ProcessGroup) -> None:
    """Fill ``unsharded`` (C * F,) with every rank's ``shard`` (C,), in rank order; blocking."""
    with WaitClock.measure():
        _ALL_GATHER(unsharded, shard, group=group)


def start_all_gather(
    unsharded: torch.Tensor, shard: torch.Tensor, group: dist.ProcessGroup
) -> dist.Work:
    """``all_gather_into`` without waiting: ``wait_work`` before reading ``unsharded``.

    ``shard`` must stay alive until then (the collective reads it in the background).
    """
    work: dist.Work = _ALL_GATHER(unsharded, shard, group=group, async_op=True)
    return work


def wait_work(work: dist.Work | None) -> None:
    """Block until ``work`` is done (on CUDA: make the current stream wait for it)."""
    if work is not None:
        with WaitClock.measure():
            work.wait()


def describe(group: dist.ProcessGroup) -> str:
    """Which implementation each collective uses on ``group``'s backend (for reports)."""
    backend = dist.get_backend(group)
    reduce = (
        "all_reduce in place + copy of own chunk"
        if reduces_by_all_reduce(group)
        else "reduce_scatter_tensor"
    )
    return f"{backend}: all-gather all_gather_into_tensor (async); gradient reduce {reduce}"


def reduces_by_all_reduce(group: dist.ProcessGroup) -> bool:
    """Whether a reduce-scatter over ``group`` runs as an in-place all-reduce.

    gloo implements reduce_scatter_tensor as a full-size clone, an all-reduce and a copy;
    an in-place all-reduce of the gradient (which we own) plus a copy of this rank's chunk
    skips the clone: 1.29-1.48x faster for 1-16 MiB shards at 2 ranks on the development
    machine (``benchmarks/gloo_collectives.py``), and no full-size temporary. Same sums.
    """
    return dist.get_backend(group) == dist.Backend.GLOO


def start_reduction(grad: torch.Tensor, groups: ShardGroups) -> PendingReduction:
    """Average ``grad`` (C * F,) over all W ranks; this rank keeps its chunk (C,).

    Reduce-scatter inside the shard group, then all-reduce of the chunk inside the
    replicate group. Divides before summing so that low-precision sums do not overflow.
    """
    if groups.world_size > 1:
        grad.div_(groups.world_size)
    if groups.shard is None:
        work = None
        if groups.replicate is not None:
            work = _ALL_REDUCE(grad, group=groups.replicate, async_op=True)
        return PendingReduction(work=work, input=grad, output=grad)
    size = grad.numel() // groups.shard_size
    output = grad.new_empty(size)  # (C,)
    chunk = slice(groups.shard_rank * size, (groups.shard_rank + 1) * size)
    if groups.replicate is not None:  # the all-reduce across replicas needs the chunk now
        _scatter_sum(output, grad, groups.shard, chunk)
        work = _ALL_REDUCE(output, group=groups.replicate, async_op=True)
        return PendingReduction(work=work, input=grad, output=output)
    if reduces_by_all_reduce(groups.shard):
        work = _ALL_REDUCE(grad, group=groups.shard, async_op=True)
        return PendingReduction(work=work, input=grad, output=output, chunk=chunk)
    work = _REDUCE_SCATTER(output, grad, group=groups.shard, async_op=True)
    return PendingReduction(work=work, input=grad, output=output)


def wait_reduction(pending: PendingReduction) -> torch.Tensor:
    """Block until the reduction is done; returns this rank's averaged shard."""
    wait_work(pending.work)
    if pending.chunk is not None:
        pending.output.copy_(pending.input[pending.chunk])
    return pending.output


def sum_reduce(grad: torch.Tensor, groups: ShardGroups) -> torch.Tensor:
    """Sum ``grad`` (C * F,) over all W ranks and return this rank's chunk (C,); blocking."""
    output = grad
    if groups.shard is not None:
        size = grad.numel() // groups.shard_size
        output = grad.new_empty(size)
        chunk = slice(groups.shard_rank * size, (groups.shard_rank + 1) * size)
        _scatter_sum(output, grad, groups.shard, chunk)
    if groups.replicate is not None:
        with WaitClock.measure():
            _ALL_REDUCE(output, group=groups.replicate)
    return output


def _scatter_sum(
    output: torch.Tensor, grad: torch.Tensor, group: dist.ProcessGroup, chunk: slice
) -> None:
    """Blocking reduce-scatter of ``grad`` into ``output`` (this rank's ``chunk``)."""
    with WaitClock.measure():
        if reduces_by_all_reduce(group):
            _ALL_REDUCE(grad, group=group)
            output.copy_(grad[chunk])
        else:
            _REDUCE_SCATTER(output, grad, group=group)
