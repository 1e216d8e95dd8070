"""The transport of a flat group's payloads: the codec seam of gather and reduction.

A flat group issues its all-gather (``FlatParamGroup.start_unshard``) and its gradient
reduction (``GradientReduction.start``) through its ``Transport``. The one here sends the
tensors as they are: the shard in the compute dtype, the gradient in the reduce dtype. A
codec (e.g. one byte per weight with row-wise scales) subclasses it: ``gather`` may send
an encoded payload and decode into ``unsharded`` when its work is waited for, ``reduce`` the
same for gradients, so the unit, the runtime and the state layers never see the encoding.
The collectives themselves are torch's, or a user's (FSDP2's ``set_custom_all_gather`` /
``set_custom_reduce_scatter``): ``all_gather`` and ``reduce_scatter``; reductions inside the
shard group may take a group of their own (``reduce_group``, [Note: reductions on their
own group] in ``comm/_mesh.py``).
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch
import torch.distributed as dist

from flatshard.comm._checks import Tag
from flatshard.comm._collectives import (
    AllGatherComm,
    PendingReduction,
    ReduceScatterComm,
    reduce_gradient,
    start_all_gather,
)
from flatshard.comm._mesh import ShardGroups


@dataclass(frozen=True)
class Transport:
    """Sends a group's payloads unchanged (the identity codec), by torch's collectives or
    the user's given here (None: torch's)."""

    all_gather: AllGatherComm | None = None
    reduce_scatter: ReduceScatterComm | None = None  # the one inside the shard group
    reduce_group: dist.ProcessGroup | None = None  # the shard group's twin for reductions

    def gather(
        self,
        unsharded: torch.Tensor,
        source: torch.Tensor,
        group: dist.ProcessGroup,
        tag: Tag | None,
    ) -> dist.Work:
        """All-gather ``source`` (C,) of every rank into ``unsharded`` (C * F,), without
        waiting; ``unsharded`` is complete once the work is waited for."""
        return start_all_gather(unsharded, source, group, tag, self.all_gather)

    def reduce(
        self,
        grad: torch.Tensor,
        groups: ShardGroups,
        tag: Tag | None,
        across_replicas: bool,
        division: tuple[float, float],
    ) -> PendingReduction:
        """Sum ``grad`` (C * F,) over the W ranks divided as ``division`` says (before,
        after the sum; W by default: the average); this rank keeps its chunk (C,)."""
        if self.reduce_group is not None and groups.shard is not None:
            groups = replace(groups, shard=self.reduce_group)
        return reduce_gradient(grad, groups, tag, across_replicas, division, self.reduce_scatter)


IDENTITY = Transport()
