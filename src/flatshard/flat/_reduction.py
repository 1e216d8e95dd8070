"""The gradient path of one flat parameter group: reduce, then write the shard to ``.grad``.

After backward, autograd has accumulated one flat gradient (C * F,) for the group. It is
reduced (``_collectives.reduce_gradient``: reduce-scatter in the shard group, all-reduce
across replicas, averaged over W; or a user's communication hook), and this rank's (C,)
chunk is added to the original parameters' ``.grad`` as views of their rows.
"""

from __future__ import annotations

from collections.abc import Callable
from enum import Enum, auto
from typing import Protocol

import torch

from flatshard.comm._collectives import (
    PendingReduction,
    all_reduce,
    gradient_division,
    sum_reduce,
    wait_reduction,
)
from flatshard.comm._mesh import ShardGroups
from flatshard.comm._watchdog import Tag, current_tag, tagged
from flatshard.flat._transport import Transport

CommHook = Callable[[torch.Tensor, ShardGroups], torch.Tensor]
"""Replaces a group's gradient reduction: ``hook(grad, groups) -> shard``.

``grad`` is the unsharded flat gradient (C * F,) summed over this rank's backward passes;
the hook returns this rank's chunk (C,), averaged over all ``groups.world_size`` (W) ranks,
in ``grad``'s dtype. It must issue the same collectives on every rank.
"""


class Owed(Enum):
    """What a group's gradient still owes before the optimizer may step on ``.grad``."""

    NOTHING = auto()  # every backward's gradient reached ``.grad`` (or none came)
    # Backward passes ran with gradient sync off (no_sync, set_requires_gradient_sync):
    # their sum waits, unreduced and full-size, in the flat gradient.
    REDUCTION = auto()
    # set_requires_all_reduce(False), hybrid: reduce-scattered, the replicas' sum owed.
    ALL_REDUCE = auto()


class ReducedGroup(Protocol):
    """What a reduction needs of its flat parameter group (``FlatParamGroup``)."""

    groups: ShardGroups
    reduce_dtype: torch.dtype
    # Told of each collective issued for the group: (kind, elements sent) -> its tag.
    on_collective: Callable[[str, int], Tag | None]
    transport: Transport  # how the gradient travels (the codec seam)

    def take_grad(self) -> torch.Tensor: ...

    def add_to_grads(self, reduced: torch.Tensor) -> None: ...


class GradientReduction:
    """The reduction of one group's gradient: in flight at most once, per backward pass."""

    def __init__(self, flat: ReducedGroup) -> None:
        self.flat = flat
        self.comm_hook: CommHook | None = None  # None: the built-in reduction
        # set_all_reduce_hook: runs on the reduced shard before it reaches ``.grad``
        self.all_reduce_hook: Callable[[torch.Tensor], None] | None = None
        self.pending: PendingReduction | None = None  # started, not waited
        # Whether this backward pass's gradient was dealt with (reduced, or kept for
        # later under no_sync); reset by the end of the pass.
        self.done_in_backward = False
        # set_requires_all_reduce(False), hybrid: the sum of this rank's reduce-scattered
        # chunks (C,), averaged over W but not yet summed across the replicas; it reaches
        # ``.grad`` at the first reduction with the all-reduce on.
        self.owed: torch.Tensor | None = None
        self.owes = Owed.NOTHING  # what the optimizer must not step before
        self._across_now = True  # the pending reduction ends with the replicas' sum
        # A row-sparse table's exchanged lookup gradient (C,), divided by the first part
        # of W, not yet summed across the replicas ([Note: row-sparse embedding tables])
        self.sparse_sum: torch.Tensor | None = None
        self._sparse_across = True
        # set_gradient_divide_factor: what the summed gradient is divided by (None: W)
        self.divide_factor: float | None = None

    @property
    def division(self) -> tuple[float, float]:
        """(before, after) the sum: the gradient is divided by W (the average), or by the
        factor ``flatshard.set_gradient_divide_factor`` set."""
        return gradient_division(self.flat.groups.world_size, self.divide_factor)

    def start(self, all_reduce: bool = True) -> None:
        """Reduce the accumulated flat gradient (zeros if none arrived), without waiting.

        ``all_reduce=False`` (``set_requires_all_reduce``; hybrid only): reduce-scatter
        inside the shard group and keep the chunk, owed to the replicas' all-reduce.
        """
        grad = self.flat.take_grad()
        if self.owes is Owed.REDUCTION:  # the kept sum is in ``grad``: reduced now
            self.owes = Owed.NOTHING
        if self.pending is not None:
            self.finish()
        grad = grad.to(self.flat.reduce_dtype).contiguous()
        groups = self.flat.groups
        tag = None
        if groups.communicates:
            tag = self.flat.on_collective("reduce", grad.numel())
        hybrid = groups.replicate is not None
        if self.comm_hook is not None:
            if groups.split_across_replicas:
                raise RuntimeError(
                    "flatshard: a communication hook does the whole reduction, which under "
                    "HYBRID_SHARD_OPTIM must also cut the gradient across the replicas; "
                    "use HYBRID_SHARD with the hook, or register no hook"
                )
            if self.divide_factor is not None:
                raise RuntimeError(
                    "flatshard: a communication hook does the whole reduction, its "
                    "division too: flatshard.set_gradient_divide_factor does not apply to "
                    "its unit; divide in the hook, or register no hook"
                )
            if hybrid and (not all_reduce or self.owed is not None):
                raise RuntimeError(
                    "flatshard.set_requires_all_reduce(False) does not apply to a unit with "
                    "a communication hook (the hook does the whole reduction): set it True, "
                    "or register no hook"
                )
            with tagged(tag or current_tag()):
                reduced = self.comm_hook(grad, groups)
            self.pending = PendingReduction(work=None, input=grad, output=reduced)
        else:
            # The replicas' sum of a chunk owed from earlier micro-batches comes at finish,
            # over the total: this reduction scatters only.
            across = not hybrid or (all_reduce and self.owed is None)
            self.pending = self.flat.transport.reduce(grad, groups, tag, across, self.division)
        self._across_now = all_reduce
        self.done_in_backward = True

    def add_sparse(self, shard_sum: torch.Tensor, all_reduce: bool = True) -> None:
        """A row-sparse table's exchanged gradient (C,): it joins the originals' ``.grad``
        at ``finish``, summed across the replicas (unless owed, as ``start`` says)."""
        if self.comm_hook is not None:
            raise RuntimeError(
                "flatshard: a communication hook does the whole reduction, but a row-sparse "
                "embedding table's lookup gradient is exchanged as rows; register no hook "
                "on its unit, or give the table placement Rows()"
            )
        if self.owes is Owed.REDUCTION:  # the rows kept under no_sync are in ``shard_sum``
            self.owes = Owed.NOTHING
        self.sparse_sum = shard_sum
        self._sparse_across = all_reduce
        self.done_in_backward = True

    @property
    def keeps_gradients(self) -> bool:
        """Whether gradients of earlier backward passes wait here instead of in ``.grad``."""
        return self.owes is not Owed.NOTHING or self.owed is not None

    def drop_kept(self) -> None:
        """``zero_grad`` of the whole group: the kept gradients go (the flat one is
        dropped by the group)."""
        self.owed = None
        self.owes = Owed.NOTHING

    def keep_unreduced(self) -> None:
        """no_sync: leave the flat gradient to accumulate until a synchronized backward."""
        self.done_in_backward = True
        self.owes = Owed.REDUCTION

    def pass_ended(self) -> None:
        """The backward pass is over (or a pipeline step's weight pass, or its
        reduction): the next one deals with the group afresh."""
        self.done_in_backward = False

    def finish(self) -> None:
        """Wait for the reduction and add the result to the originals' ``.grad``."""
        self._finish_dense()
        self._finish_sparse()

    def _finish_sparse(self) -> None:
        part = self.sparse_sum
        if part is None:
            return
        self.sparse_sum = None
        groups = self.flat.groups
        _, post = self.division
        if post != 1:
            part.div_(post)
        if groups.replicate is not None:
            if self.owed is not None or not self._sparse_across:
                self.owed = part if self.owed is None else self.owed.add_(part)
                if not self._sparse_across:
                    self.owes = Owed.ALL_REDUCE
                    return  # owed to a later micro-batch's all-reduce
                part, self.owed = self.owed, None
                self.owes = Owed.NOTHING
            tag = self.flat.on_collective("all_reduce", part.numel())
            all_reduce(part, groups.replicate, tag)
        self._run_hook(part)
        self.flat.add_to_grads(part)

    def _run_hook(self, reduced: torch.Tensor) -> None:
        """``set_all_reduce_hook``'s hook on this rank's reduced shard, in place (FSDP2's
        all-reduce hook: after the reduce-scatter, and under hybrid sharding after the
        replicas' all-reduce)."""
        if self.all_reduce_hook is not None:
            self.all_reduce_hook(reduced)

    def _finish_dense(self) -> None:
        if self.pending is None:
            return
        reduced = wait_reduction(self.pending)  # (C,)
        self.pending = None
        groups = self.flat.groups
        owing = self.owed is not None or not self._across_now
        if groups.replicate is not None and self.comm_hook is None and owing:
            self.owed = reduced if self.owed is None else self.owed.add_(reduced)
            if not self._across_now:
                self.owes = Owed.ALL_REDUCE
                return  # owed to a later micro-batch's all-reduce
            reduced, self.owed = self.owed, None
            self.owes = Owed.NOTHING
            if groups.split_across_replicas:  # the total, cut across the replicas
                tag = self.flat.on_collective("reduce", reduced.numel())
                reduced = sum_reduce(reduced, ShardGroups(groups.replicate, None), tag)
            else:
                tag = self.flat.on_collective("all_reduce", reduced.numel())
                all_reduce(reduced, groups.replicate, tag)
        self._run_hook(reduced)
        self.flat.add_to_grads(reduced)
