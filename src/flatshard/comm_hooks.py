"""Communication hooks: replace how a unit's gradient is reduced (paper mechanism 13).

A hook is any callable ``hook(grad, groups) -> shard`` (see ``CommHook``);
``register_comm_hook(model, hook)`` installs it on every unit inside ``model`` (call it on a
submodule afterwards to override those units).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from flatshard.comm import ShardGroups
from flatshard.comm._agreement import global_rank
from flatshard.comm._collectives import split_division, sum_reduce
from flatshard.flat import CommHook
from flatshard.runtime._switches import change_units
from flatshard.runtime._unit import units_of

__all__ = ["CommHook", "LowPrecisionHook", "register_comm_hook", "split_division"]

LOW_PRECISION = (torch.bfloat16, torch.float16)


def register_comm_hook(model: nn.Module, hook: CommHook | None) -> None:
    """Reduce the gradients of every unit inside ``model`` with ``hook`` (None: built-in)."""
    if hook is not None and not callable(hook):
        raise TypeError(
            f"flatshard.comm_hooks.register_comm_hook: hook must be callable, got {hook!r}"
        )
    units = units_of(model, "register_comm_hook")
    tables = [
        name for u in units for f in u.trainable if (name := f.placement.comm_hook_conflict())
    ]
    if hook is not None and tables:
        raise ValueError(
            f"flatshard.comm_hooks.register_comm_hook: the units inside this module hold "
            f"row-sparse embedding tables ({', '.join(repr(t) for t in tables)}; "
            f"placement flatshard.RowSparse()), whose lookup gradients are sent as "
            f"rows, not through a hook (rank {global_rank()}). Register the hook on the units "
            "without tables (for block in model.blocks: register_comm_hook(block, hook)), "
            "or give the tables the placement flatshard.Rows()."
        )
    custom = [u.label for u in units if u.trainable and u.config.custom_reduce_scatter]
    if hook is not None and custom:
        raise ValueError(
            f"flatshard.comm_hooks.register_comm_hook: unit '{custom[0]}' reduce-scatters "
            f"with a custom collective (flatshard.set_custom_reduce_scatter), and a hook does "
            f"the whole reduction (rank {global_rank()}); reduce-scatter in the hook, or "
            "set_custom_reduce_scatter(unit, None) first."
        )
    change_units(model, units, "register_comm_hook", hook, comm_hook=hook)


@dataclass(frozen=True)
class LowPrecisionHook:
    """Communicate gradients in ``dtype`` (bf16/fp16) and give them back in their own dtype.

    Halves the bytes of every reduction at the cost of low-precision summation.
    ``predivide`` is the factor divided before the sum (the rest after); None chooses
    ``split_division(W)``.
    """

    dtype: torch.dtype = torch.bfloat16
    predivide: int | None = None

    def __post_init__(self) -> None:
        if self.dtype not in LOW_PRECISION:
            raise ValueError(
                f"LowPrecisionHook(dtype=...) must be torch.bfloat16 or torch.float16, "
                f"got {self.dtype}"
            )
        if self.predivide is not None and (
            not isinstance(self.predivide, int) or self.predivide < 1
        ):
            raise ValueError(
                f"LowPrecisionHook(predivide=...) must be a positive int or None, "
                f"got {self.predivide!r}"
            )

    def __call__(self, grad: torch.Tensor, groups: ShardGroups) -> torch.Tensor:
        world = groups.world_size
        pre = split_division(world)[0] if self.predivide is None else self.predivide
        low = grad.to(self.dtype)  # (C * F,)
        if pre != 1:
            low.div_(pre)
        shard = sum_reduce(low, groups)  # (C,)
        return shard.to(grad.dtype).div_(world / pre)
