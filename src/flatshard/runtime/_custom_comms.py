"""A user's own all-gather and reduce-scatter for a unit: FSDP2's ``set_custom_all_gather``
and ``set_custom_reduce_scatter`` as free functions.

The objects FSDP2 takes work here unchanged (``__call__`` with FSDP2's arguments); their
``allocate`` is not called, because the buffers are the FlatParameter's own (the
unsharded buffer, and the gradient autograd made). flatshard issues them with
``async_op=True`` and waits for the returned work where it waits for its own (None: done
on return); the watchdog tracks them like its own. They travel the groups' ``Transport``,
so everything above it is unchanged: the hybrid all-reduce across replicas stays torch's,
and the division by W is done apart, as always (the reduce-scatter gets ``SUM``).
"""

from __future__ import annotations

from torch import nn

from flatshard.comm._agreement import global_rank
from flatshard.comm._collectives import AllGatherComm, ReduceScatterComm
from flatshard.runtime._switches import change_units
from flatshard.runtime._unit import Unit, unit_or_error


def set_custom_all_gather(module: nn.Module, comm: AllGatherComm | None) -> None:
    """All-gather the unit ``module``'s parameters with ``comm`` (called as
    ``comm(output_tensor, input_tensor, group, async_op=True)``, returning a ``Work`` or
    None once done) instead of torch's; None: torch's again. One unit (not the units inside
    it), as FSDP2's ``module.set_custom_all_gather(comm)``; every rank alike."""
    unit = _unit(module, "set_custom_all_gather", comm)
    _check_gathered_groups(unit, "set_custom_all_gather")
    change_units(module, [unit], "set_custom_all_gather", comm, custom_all_gather=comm)


def set_custom_reduce_scatter(module: nn.Module, comm: ReduceScatterComm | None) -> None:
    """Reduce-scatter the unit ``module``'s gradients inside its shard group with ``comm``
    (called as ``comm(output_tensor, input_tensor, group, op=SUM, async_op=True)``)
    instead of torch's (gloo's: an all-to-all and a sum); None: torch's again. Not with a
    communication hook, which does the whole reduction. FSDP2's
    ``module.set_custom_reduce_scatter(comm)``."""
    unit = _unit(module, "set_custom_reduce_scatter", comm)
    _check_gathered_groups(unit, "set_custom_reduce_scatter")
    if comm is not None and unit.trainable and unit.config.comm_hook is not None:
        raise ValueError(
            f"flatshard.set_custom_reduce_scatter: unit '{unit.label}' reduces through a "
            f"communication hook, which does the whole reduction (rank {global_rank()}); "
            "reduce-scatter in the hook, or register no hook first "
            "(flatshard.comm_hooks.register_comm_hook(model, None))."
        )
    change_units(module, [unit], "set_custom_reduce_scatter", comm, custom_reduce_scatter=comm)


def _unit(module: nn.Module, caller: str, comm: object) -> Unit:
    if comm is not None and not callable(comm):
        raise TypeError(
            f"flatshard.{caller}: comm must be callable (FSDP2's AllGather / ReduceScatter "
            f"objects are) or None, got {type(comm).__name__}"
        )
    unit = unit_or_error(module, caller)
    unit.require_idle(caller, "call it between steps.")
    return unit


def _check_gathered_groups(unit: Unit, caller: str) -> None:
    """An error for a unit holding a row-sparse table, whose rows travel by all-to-all."""
    tables = [t for f in unit.flat_params if (t := f.placement.custom_collective_conflict())]
    if tables:
        raise ValueError(
            f"flatshard.{caller}: unit '{unit.label}' holds the row-sparse table "
            f"'{tables[0]}', whose rows travel by all-to-all, not by all-gather and "
            f"reduce-scatter (rank {global_rank()}); give it placement flatshard.Rows(), or "
            "put the table in a unit of its own and set the collective on the other units."
        )
