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
from typing import cast

import torch.distributed as dist
from torch import nn

from flatshard.comm._agreement import global_rank
from flatshard.comm._collectives import all_gather_object
from flatshard.flat._full_params import Summoned, full_params
from flatshard.runtime._step import agree, collective_call, distinct_contexts
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
            summoned = [
                stack.enter_context(full_params(flat, writeback))
                for unit in units
                for flat in unit.flat_params
            ]
        holds = [unit.hold for unit in units]
        for unit in units:
            unit.hold = Hold.SUMMONED
        try:
            yield
            if writeback:
                _written_alike(model, units, summoned)
        finally:
            for unit, hold in zip(units, holds, strict=True):
                unit.hold = hold


def _written_alike(model: nn.Module, units: list[Unit], summoned: list[Summoned]) -> None:
    """[Note: a write-back every rank makes alike]
    Each rank writes back only its own rows of what it holds at exit. So a change made on
    some ranks only (``if rank == 0: model.load_state_dict(...)`` inside the summon) would
    land in those ranks' rows alone: a silent mix. At exit the ranks compare a digest of
    every parameter they must hold alike (all but tensor-parallel parts, each rank's own),
    and where any differs, every rank raises naming them and nothing is written back.
    One O(parameters) pass and one small all-gather per write-back summon.
    """
    mine = [digest for s in summoned for digest in s.digests()]
    contexts = distinct_contexts(units)
    groups = {id(c.process_group): c.process_group for c in contexts if c.process_group}
    ranks: list[int] = []
    every: list[list[tuple[str, int]]] = []
    with collective_call(model, "summon_full_params(writeback=True) exit"):
        for group in groups.values():
            if dist.get_world_size(group) > 1:
                ranks += dist.get_process_group_ranks(group)
                every += [cast(list[tuple[str, int]], d) for d in all_gather_object(mine, group)]
    differ = [i for i in range(len(mine)) if len({digests[i][1] for digests in every}) > 1]
    if not differ:
        return
    for s in summoned:
        s.discard()
    holders: dict[int, list[str]] = {}  # the first differing parameter's values: ranks
    for rank, digests in zip(ranks, every, strict=True):
        holders.setdefault(digests[differ[0]][1], []).append(str(rank))
    values = [f"rank(s) {', '.join(sorted(set(r), key=int))}" for r in holders.values()]
    sides = f"one value on {values[0]}" + "".join(f", another on {v}" for v in values[1:])
    names = [mine[i][0] for i in differ]
    named = ", ".join(f"'{n}'" for n in names[:3]) + (", ..." if len(names) > 3 else "")
    raise RuntimeError(
        f"flatshard: summon_full_params(writeback=True) ended with {len(names)} full "
        f"parameter(s) that differ between the ranks (seen on rank {global_rank()}): "
        f"{named} ('{names[0]}': {sides}). Each rank writes back only its own rows, so "
        "the model would become a mix of them: nothing was written back. Make the same "
        "change on every rank inside the summon (e.g. load the same state dict on every "
        "rank), or load rank 0's values into every rank with flatshard.load_state_dict("
        "model, state_dict, from_rank0=True)."
    )
