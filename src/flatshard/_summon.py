"""``summon_full_params``: every original parameter full-size on every rank, for a while."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import ExitStack, contextmanager

import torch.distributed as dist
from torch import nn

from flatshard._runtime import units_of
from flatshard._unit import TrainingState


@contextmanager
def summon_full_params(model: nn.Module, writeback: bool = True) -> Iterator[None]:
    """Give every original parameter its full shape and value on every rank.

    A collective: every rank of the model's process group must enter it. With
    ``writeback=True`` in-place edits of the full parameters (or new ``.data``) are written
    back to the shards on exit; with False they are discarded. Gradients are not gathered.
    Do not run forward or backward inside it.
    """
    runtimes = units_of(model, "summon_full_params")
    for runtime in runtimes:
        unit = runtime.unit
        if unit.state is not TrainingState.IDLE:
            raise RuntimeError(
                f"flatshard.summon_full_params: unit '{unit.label}' is in its "
                f"{unit.state.name.lower()} pass (rank {dist.get_rank()}); enter "
                "summon_full_params between steps, not inside forward or backward."
            )
        unit.reshard()  # a root kept unsharded must not go stale under writeback
    with ExitStack() as stack:
        for runtime in runtimes:
            for flat in runtime.unit.flat_params:
                stack.enter_context(flat.full_params(writeback))
        for runtime in runtimes:
            runtime.unit.params_are_full = True
        try:
            yield
        finally:
            for runtime in runtimes:
                runtime.unit.params_are_full = False
