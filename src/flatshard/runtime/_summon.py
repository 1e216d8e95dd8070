"""``summon_full_params``: every original parameter full-size on every rank, for a while."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import ExitStack, contextmanager

from torch import nn

from flatshard.flat._full_params import full_params
from flatshard.runtime._step import collective_call
from flatshard.runtime._unit import Hold, units_of


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
