"""The collectives flatshard issues, as free functions with explicit groups.

Every all-gather and gradient reduction of the runtime goes through here, so that counting,
tagging and choosing an implementation per backend have one home.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import torch.distributed as dist

from flatshard._mesh import ShardGroups

# torch 2.13 renamed the tensor collectives; older releases only have the old names.
_ALL_GATHER = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_REDUCE_SCATTER = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


class PendingReduction(NamedTuple):
    """A gradient reduction in flight.

    ``input`` is held so that its memory stays alive until the collective has read it.
    """

    work: dist.Work | None
    input: torch.Tensor  # (C * F,) the unsharded gradient
    output: torch.Tensor  # (C,) this rank's averaged shard once ``work`` is done


def all_gather_into(unsharded: torch.Tensor, shard: torch.Tensor, group: dist.ProcessGroup) -> None:
    """Fill ``unsharded`` (C * F,) with every rank's ``shard`` (C,), in rank order."""
    _ALL_GATHER(unsharded, shard, group=group)


def start_reduction(grad: torch.Tensor, groups: ShardGroups) -> PendingReduction:
    """Average ``grad`` (C * F,) over all W ranks; this rank keeps its chunk (C,).

    Reduce-scatter inside the shard group, then all-reduce of the chunk inside the
    replicate group. Divides before summing so that low-precision sums do not overflow.
    """
    if groups.world_size > 1:
        grad.div_(groups.world_size)
    work: dist.Work | None = None
    output = grad
    if groups.shard is not None:
        output = grad.new_empty(grad.numel() // groups.shard_size)
        async_op = groups.replicate is None  # else the all-reduce needs its result now
        work = _REDUCE_SCATTER(output, grad, group=groups.shard, async_op=async_op)
    if groups.replicate is not None:
        work = dist.all_reduce(output, group=groups.replicate, async_op=True)
    return PendingReduction(work=work, input=grad, output=output)


def wait_reduction(pending: PendingReduction) -> torch.Tensor:
    """Block until the reduction is done; returns this rank's averaged shard."""
    if pending.work is not None:
        pending.work.wait()
    return pending.output


def sum_reduce(grad: torch.Tensor, groups: ShardGroups) -> torch.Tensor:
    """Sum ``grad`` (C * F,) over all W ranks and return this rank's chunk (C,); blocking."""
    output = grad
    if groups.shard is not None:
        output = grad.new_empty(grad.numel() // groups.shard_size)
        _REDUCE_SCATTER(output, grad, group=groups.shard)
    if groups.replicate is not None:
        dist.all_reduce(output, group=groups.replicate)
    return output
