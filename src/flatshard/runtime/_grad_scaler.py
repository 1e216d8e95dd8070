"""``ShardedGradScaler``: loss scaling for fp16 whose overflow check all ranks agree on."""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from torch.amp.grad_scaler import OptState

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
        assert self._scale is not None  # set by scale(), which unscale_ follows
        for found_inf in state["found_inf_per_device"].values():
            # [Note: one scale on every rank]
            # Each rank scaled its loss by its own scale, and the reduced gradients are the
            # sum of every rank's: with scales that differ (another init_scale, a scaler
            # state loaded on one rank) each rank unscales the sum by its own factor, and
            # the shards of one model are updated by different amounts, silently. So the
            # found-inf flag travels with the scale and its negation in one max-reduce:
            # their sum is the spread of the ranks' scales, checked where ``step`` reads
            # the flag on the host anyway (torch's scaler syncs there).
            scale = self._scale.to(device=found_inf.device, dtype=torch.float32).reshape(1)
            both = torch.cat([found_inf.reshape(1).float(), scale, -scale])
            all_reduce(both, group, tag, dist.ReduceOp.MAX)
            found_inf.copy_(both[0].reshape(found_inf.shape))
            state["scale_spread"] = both[1:].sum()

    def step(self, optimizer: torch.optim.Optimizer, *args: Any, **kwargs: Any) -> Any:
        if not self.is_enabled():
            return super().step(optimizer, *args, **kwargs)
        state = self._per_optimizer_states[id(optimizer)]
        if state["stage"] is OptState.READY:
            self.unscale_(optimizer)
        spread = state.get("scale_spread")
        if spread is not None and float(spread) != 0.0:  # the host waits here, as torch's next
            raise RuntimeError(
                f"flatshard.ShardedGradScaler: the ranks scaled their losses by different "
                f"scales (rank {dist.get_rank()}: {float(self.get_scale()):g}; the ranks' "
                f"largest and smallest differ by {float(spread):g}), so the summed gradients "
                "cannot be unscaled: the step would update each rank's shard by its own "
                "factor. Build the scaler with the same init_scale, growth and backoff "
                "settings on every rank, and load its state_dict on every rank."
            )
        return super().step(optimizer, *args, **kwargs)
