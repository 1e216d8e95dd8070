"""The gradient path of one flat parameter group: reduce, then write the shard to ``.grad``.

After backward, autograd has accumulated one flat gradient (C * F,) for the group. It is
reduced (``_collectives.reduce_gradient``: reduce-scatter in the shard group, all-reduce
across replicas, averaged over W; or a user's communication hook), and this rank's (C,)
chunk is added to the original parameters' ``.grad`` as views of their rows.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

import torch

from flatshard._checks import current_tag, tagged
from flatshard._collectives import PendingReduction, reduce_gradient, wait_reduction
from flatshard._mesh import ShardGroups

if TYPE_CHECKING:
    from flatshard._flat_param import FlatParamGroup

CommHook = Callable[[torch.Tensor, ShardGroups], torch.Tensor]
"""Replaces a group's gradient reduction: ``hook(grad, groups) -> shard``.

``grad`` is the unsharded flat gradient (C * F,) summed over this rank's backward passes;
the hook returns this rank's chunk (C,), averaged over all ``groups.world_size`` (W) ranks,
in ``grad``'s dtype. It must issue the same collectives on every rank.
"""


class GradientReduction:
    """The reduction of one group's gradient: in flight at most once, per backward pass."""

    def __init__(self, flat: FlatParamGroup) -> None:
        self.flat = flat
        self.comm_hook: CommHook | None = None  # None: the built-in reduction
        self.pending: PendingReduction | None = None  # started, not waited
        # Whether this backward pass's gradient was dealt with (reduced, or kept for
        # later under no_sync); reset by the end of the pass.
        self.done_in_backward = False

    def start(self) -> None:
        """Reduce the accumulated flat gradient (zeros if none arrived), without waiting."""
        grad = self.flat.take_grad()
        if self.pending is not None:
            self.finish()
        grad = grad.to(self.flat.reduce_dtype).contiguous()
        groups = self.flat.groups
        tag = None
        if groups.world_size > 1:
            tag = self.flat.on_collective("reduce", grad.numel())
        if self.comm_hook is not None:
            with tagged(tag or current_tag()):
                reduced = self.comm_hook(grad, groups)
            self.pending = PendingReduction(work=None, input=grad, output=reduced)
        else:
            self.pending = reduce_gradient(grad, groups, tag)
        self.done_in_backward = True

    def keep_unreduced(self) -> None:
        """no_sync: leave the flat gradient to accumulate until a synchronized backward."""
        self.done_in_backward = True

    def finish(self) -> None:
        """Wait for the reduction and add the result to the originals' ``.grad``."""
        if self.pending is None:
            return
        reduced = wait_reduction(self.pending)  # (C,)
        self.pending = None
        flat = self.flat
        # The optimizer steps on the master shard: its dtype and device.
        # Blocking: the optimizer may read it on the CPU right after (offload).
        reduced = reduced.to(flat.shard.device, flat.shard.dtype, copy=flat.offloaded)
        for orig, view in zip(flat.originals, flat.views.shard_views(reduced), strict=True):
            if orig.param.grad is None:
                orig.param.grad = view
            else:
                orig.param.grad.add_(view)
