"""The transport of a flat group's payloads: the codec seam of gather and reduction.

A flat group issues its all-gather (``FlatParamGroup.start_unshard``) and its gradient
reduction (``GradientReduction.start``) through its ``Transport``. The one here sends the
tensors as they are: the shard in the compute dtype, the gradient in the reduce dtype. A
codec (e.g. one byte per weight with row-wise scales) subclasses it: ``gather`` may send
an encoded payload and decode into ``unsharded`` when its work is waited for, ``reduce`` the
same for gradients, so the unit, the runtime and the state layers never see the encoding.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from flatshard.comm._checks import Tag
from flatshard.comm._collectives import PendingReduction, reduce_gradient, start_all_gather
from flatshard.comm._mesh import ShardGroups


class Transport:
    """Sends a group's payloads unchanged (the identity codec)."""

    def gather(
        self,
        unsharded: torch.Tensor,
        source: torch.Tensor,
        group: dist.ProcessGroup,
        tag: Tag | None,
    ) -> dist.Work:
        """All-gather ``source`` (C,) of every rank into ``unsharded`` (C * F,), without
        waiting; ``unsharded`` is complete once the work is waited for."""
        return start_all_gather(unsharded, source, group, tag)

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
        return reduce_gradient(grad, groups, tag, across_replicas, division)


IDENTITY = Transport()
