"""Gathering units by hand: ``unshard`` / ``reshard`` (one unit gathered on request, until
asked to free it) and ``summon_full_params`` (every original parameter full-size on every
rank, for a while).

FSDP2's ``module.unshard()`` / ``module.reshard()`` as free functions, for generation in a
training loop (every unit gathered once, no all-gather per token) and for hand-made
prefetch. Like FSDP2's, they act on one unit, not the units inside it. Forward and backward
leave a held unit gathered; between them its modules hold the original parameters, so
everything else sees the shards ([Note: held units]); after the model's
``optimizer.step()`` its next use gathers it again.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import ExitStack, contextmanager

from torch import nn

from flatshard.flat._full_params import full_params
from flatshard.runtime._step import agree, collective_call
from flatshard.runtime._unit import Hold, Unit, unit_or_error, units_of


class UnshardHandle:
    """An all-gather ``unshard(..., async_op=True)`` started: ``wait()`` finishes it and
    gives the unit's modules their full parameters."""

    def __init__(self, unit: Unit) -> None:
        self._unit = unit

    def wait(self) -> None:
        self._unit.hold_gathered()


def unshard(module: nn.Module, *, async_op: bool = False) -> UnshardHandle | None:
    """Gather the unit ``module`` (one the ``fully_shard`` call made a unit) and keep it
    gathered until ``flatshard.reshard(module)``. A collective: every rank alike. With
    ``async_op`` the all-gather is started and a handle returned; the unit's forward (or
    ``handle.wait()``) waits for it."""
    unit = unit_or_error(module, "unshard")
    agree(module, "unshard")  # the gather after it is the unit's own, as in a step
    if async_op:
        unit.hold = Hold.USER
        unit.start_unshard()
        return UnshardHandle(unit)
    unit.hold_gathered()
    return None


def reshard(module: nn.Module) -> None:
    """Free the unit ``module``'s gathered parameters (the modules get the sharded ones
    back), whether ``unshard`` or a forward left it gathered. Between steps only."""
    unit = unit_or_error(module, "reshard")
    unit.require_idle("reshard", "call it between steps, not inside forward or backward.")
    with collective_call(module, "reshard"):  # the next use gathers: on every rank alike
        if unit.release():
            unit.context.rate_limiter.resharded()


@contextmanager
def summon_full_params(model: nn.Module, writeback: bool = True) -> Iterator[None]:
    """Give every original parameter its full shape and value on every rank.

    A collective: every rank of the model's process group must enter it. With
    ``writeback=True`` in-place edits of the full parameters (or new ``.data``) are written
    back to the shards on exit; with False they are discarded. Gradients are not gathered.
    A forward under ``torch.no_grad()`` inside it runs on the full parameters without any
    all-gather (e.g. ``generate``: the whole model on every rank, no collective per
    token); a forward with gradients inside it is an error.
    """
    units = units_of(model, "summon_full_params")
    with ExitStack() as stack:
        with collective_call(model, "summon_full_params"):  # its gathers, not the body's
            for unit in units:
                unit.require_idle(
                    "summon_full_params",
                    "enter summon_full_params between steps, not inside forward or backward.",
                )
                unit.reshard()  # a root kept unsharded must not go stale under writeback
            for unit in units:
                for flat in unit.flat_params:
                    stack.enter_context(full_params(flat, writeback))
        holds = [unit.hold for unit in units]
        for unit in units:
            unit.hold = Hold.SUMMONED
        try:
            yield
        finally:
            for unit, hold in zip(units, holds, strict=True):
                unit.hold = hold
