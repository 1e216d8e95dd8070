"""``ShardedGradScaler``: loss scaling for fp16 whose overflow check all ranks agree on."""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

from flatshard.comm._collectives import all_reduce
from flatshard.comm._watchdog import Tag, watchdog
from flatshard.runtime._join import note_unreplayable


class ShardedGradScaler(torch.amp.GradScaler):
    """``torch.amp.GradScaler`` for sharded gradients.

    Each rank sees only its shard of the gradients, so an inf/NaN on one rank must skip the
    step on every rank, or the replicas of the model would diverge. After unscaling, the
    found-inf flags are max-reduced over ``process_group`` (default: the world). Use it as
    the plain scaler: ``scale(loss).backward()``, optionally ``unscale_`` and
    ``flatshard.clip_grad_norm_``, then ``step`` and ``update`` on every rank.
    """

    def __init__(
        self,
        device: str = "cpu",
        *,
        process_group: dist.ProcessGroup | None = None,
        **kwargs: Any,
    ) -> None:
        super().__init__(device, **kwargs)
        self.process_group = process_group

    def unscale_(self, optimizer: torch.optim.Optimizer) -> None:
        super().unscale_(optimizer)
        if not self.is_enabled():
            return
        state = self._per_optimizer_states[id(optimizer)]
        group = self.process_group or dist.group.WORLD
        assert group is not None
        tag = Tag("ShardedGradScaler.unscale_")
        note_unreplayable("ShardedGradScaler", "flatshard.join does not take a grad scaler")
        dog = watchdog()
        if dog is not None:  # a rank that unscales alone waits in the store, not in gloo
            dog.entry(group, tag)
        for found_inf in state["found_inf_per_device"].values():
            all_reduce(found_inf, group, tag, dist.ReduceOp.MAX)
