"""The collectives flatshard issues, as free functions with explicit groups.

Every all-gather and reduce-scatter of the runtime goes through here, so that counting,
tagging and choosing an implementation per backend have one home.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import torch.distributed as dist

# torch 2.13 renamed the tensor collectives; older releases only have the old names.
_ALL_GATHER = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_REDUCE_SCATTER = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


class PendingReduction(NamedTuple):
    """An asynchronous reduce-scatter in flight.

    ``input`` is held so that its memory stays alive until the collective has read it.
    """

    work: dist.Work | None
    input: torch.Tensor  # (C * W,) the unsharded gradient
    output: torch.Tensor  # (C,) this rank's reduced shard


def all_gather_into(unsharded: torch.Tensor, shard: torch.Tensor, group: dist.ProcessGroup) -> None:
    """Fill ``unsharded`` (C * W,) with every rank's ``shard`` (C,), in rank order."""
    _ALL_GATHER(unsharded, shard, group=group)


def start_reduce_scatter(grad: torch.Tensor, group: dist.ProcessGroup) -> PendingReduction:
    """Average ``grad`` (C * W,) over the group; this rank keeps its chunk (C,).

    Divides before the sum (not after) so that low-precision gradients do not overflow.
    """
    world_size = dist.get_world_size(group)
    if world_size > 1:
        grad.div_(world_size)
    output = grad.new_empty(grad.numel() // world_size)
    work = _REDUCE_SCATTER(output, grad, group=group, async_op=True)
    return PendingReduction(work=work, input=grad, output=output)


def wait_reduction(pending: PendingReduction) -> torch.Tensor:
    """Block until the reduce-scatter is done; returns this rank's reduced shard."""
    if pending.work is not None:
        pending.work.wait()
    return pending.output
