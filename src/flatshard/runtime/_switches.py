"""Switches of a sharded model's step: ``no_sync`` (accumulate gradients locally, reduce
once: paper mechanism 7), and the ones named after FSDP2's methods so that migrating is a
rename: ``set_requires_gradient_sync``, ``set_reshard_after_backward``,
``set_reshard_after_forward`` and ``set_requires_all_reduce``; and
``set_gradient_divide_factor``, ``set_unshard_in_backward`` and
``set_separate_reduce_scatter_group``.

Each applies to a whole model (every unit of the ``fully_shard`` call on it, bottom-up
calls included), until set again. Ranks that set different values would issue different
collectives (gloo can abort a process on the sizes), so the ranks first agree on the call
and its value through the c10d store: a rank that differs raises
``CollectiveMismatchError`` on every rank before anything is sent.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import replace
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from flatshard.comm._agreement import global_rank
from flatshard.comm._mesh import post_forward_groups, reduction_groups
from flatshard.runtime._configuration import describe
from flatshard.runtime._join import note_span
from flatshard.runtime._pipeline import refuse_inside_schedule
from flatshard.runtime._step import StepContext, agree, collective_call, contexts_under
from flatshard.runtime._unit import Unit, unit_or_error, units_of


def set_requires_gradient_sync(model: nn.Module, requires_gradient_sync: bool) -> None:
    """False: backward passes keep their gradients unsharded and unreduced, as inside
    ``flatshard.no_sync(model)``, until it is set True again; the first backward after
    that reduces the sum once. FSDP2's ``model.set_requires_gradient_sync(False)``."""
    value = bool(requires_gradient_sync)
    change_switches(model, "set_requires_gradient_sync", value, requires_gradient_sync=value)


def set_reshard_after_backward(model: nn.Module, reshard_after_backward: bool) -> None:
    """False: units stay gathered after backward, so the next micro-batch's forward
    gathers nothing (between micro-batches of one optimizer step the shards do not change).
    A unit whose shard was written since is gathered again: after a step of an optimizer
    that holds the model's parameters, and, for a model no torch optimizer steps (an update
    written by hand), after each synchronized backward. It holds the unsharded model between
    steps. FSDP2's ``model.set_reshard_after_backward(False)``."""
    value = bool(reshard_after_backward)
    change_switches(model, "set_reshard_after_backward", value, reshard_after_backward=value)


def set_reshard_after_forward(model: nn.Module, reshard_after_forward: bool | int) -> None:
    """False: units keep their gathered parameters from forward to backward (backward
    gathers nothing; ZeRO-2's memory for ZeRO-3's strategy); True: every unit frees them
    after forward, also under SHARD_GRAD_OP. With ``set_reshard_after_backward(False)``
    too, each unit is gathered once per optimizer step across all its micro-batches.
    The root and the last unit of the forward order keep theirs either way (backward
    starts with them). An int N (FSDP2's): forward keeps 1/N of each unit, this rank's
    part in its group of N consecutive shard ranks (e.g. one host), and backward gathers
    inside that group ([Note: resharding to a smaller group after forward]); N divides
    every shard group's size, and the model spans the world (every rank makes the groups).
    FSDP2's ``model.set_reshard_after_forward``."""
    value = reshard_after_forward
    if not isinstance(value, int) or (not isinstance(value, bool) and value < 2):
        raise TypeError(
            "flatshard.set_reshard_after_forward: pass True, False or a number of ranks "
            f">= 2 to reshard to, got {value!r} (rank {global_rank()})"
        )
    contexts = change_switches(
        model, "set_reshard_after_forward", value, reshard_after_forward=value
    )
    flats = [f for c in contexts for u in c.units for f in u.flat_params]
    groups: dict[int, dist.ProcessGroup] = {}
    if not isinstance(value, bool):
        shards = list({id(s): s for f in flats if (s := f.groups.shard) is not None}.values())
        model_group = contexts[0].process_group
        if not shards or model_group is None:
            raise ValueError(
                f"flatshard.set_reshard_after_forward: no unit of {type(model).__name__} is "
                f"sharded across more than one rank (rank {global_rank()}), so there are no "
                f"{value} ranks to reshard to; pass True or False."
            )
        made = post_forward_groups(shards, value, model_group)
        groups = {id(s): g for s, g in zip(shards, made, strict=True)}
    for flat in flats:
        flat.post_forward_group = flat.placement.post_forward_group(
            groups.get(id(flat.groups.shard))
        )


def set_requires_all_reduce(model: nn.Module, requires_all_reduce: bool) -> None:
    """Hybrid sharding with accumulation: False makes each micro-batch's reduction a
    reduce-scatter inside the shard group only (sharded gradient memory, no traffic across
    replicas); the sum is kept, and the first reduction after it is set True again
    all-reduces the total across the replicas once. Set it True before the last
    micro-batch: an ``optimizer.step()`` while a sum is still owed is an error (as is one
    while gradient sync is off for every backward since the last step). Nothing
    changes for non-hybrid units. FSDP2's ``model.set_requires_all_reduce(False)``."""
    value = bool(requires_all_reduce)
    change_switches(model, "set_requires_all_reduce", value, requires_all_reduce=value)


def set_all_reduce_hook(model: nn.Module, hook: Callable[[torch.Tensor], None] | None) -> None:
    """Call ``hook(shard)`` on each unit's reduced gradient shard inside ``model``, in
    place, before it reaches the parameters' ``.grad``: once per reduction (per step under
    ``no_sync`` accumulation), after the reduce-scatter (averaged over the unit's ranks,
    or as ``set_gradient_divide_factor`` says) and, under the hybrid strategies, after the
    replicas' all-reduce. The place to sum gradients across replicas flatshard does not
    know of, e.g. torchft's fault-tolerant replica groups
    (``flatshard.integrations.torchft``). None removes it. FSDP2's
    ``module.set_all_reduce_hook(hook)``, for every unit inside ``model``. Every rank
    makes the same call (agreed: a hook of another function or class on one rank is a
    ``CollectiveMismatchError`` on every rank). The hook that averages torchft's replica
    groups is not replaced by another (the replicas would drift apart), unless that one
    averages them too and says so: a class attribute ``averages_replicas = True`` (a
    hook wrapping ``ManagerAllReduce``)."""
    if hook is not None and not callable(hook):
        raise TypeError(
            f"flatshard.set_all_reduce_hook: hook must be callable or None, got {hook!r} "
            f"(rank {global_rank()})"
        )
    units = units_of(model, "set_all_reduce_hook")
    held = {id(h): h for u in units if (h := u.config.all_reduce_hook) is not None}
    replicas = [h for h in held.values() if getattr(h, "averages_replicas", False)]
    averaging = hook is None or getattr(hook, "averages_replicas", False)  # (None: undone)
    if replicas and not averaging:
        raise ValueError(
            f"flatshard.set_all_reduce_hook (rank {global_rank()}): the units of this model "
            f"average their gradients across replica groups through "
            f"{type(replicas[0]).__qualname__} (set by flatshard.integrations.torchft's "
            "replicate_with); this hook would replace it and leave the groups' "
            "replicas apart, silently. Change the gradients after the step's reduction "
            "instead (before optimizer.step()); a hook of your own that averages the "
            "groups too (wrapping ManagerAllReduce) says so with a class attribute "
            "averages_replicas = True."
        )
    change_units(model, units, "set_all_reduce_hook", hook, all_reduce_hook=hook)


def set_gradient_divide_factor(model: nn.Module, factor: float | None) -> None:
    """Divide the summed gradients of every unit inside ``model`` by ``factor`` instead of
    W, the number of ranks (None: W again, the average). E.g. ``factor=1`` sums them, for
    losses already normalized over the global batch. A whole factor is divided partly
    before and partly after the sum, as W is (``flatshard.comm_hooks.split_division``);
    another after it. Row-sparse tables' gradients are divided alike. Not with a
    communication hook (it does the whole reduction). FSDP2's
    ``module.set_gradient_divide_factor(factor)``, for every unit inside ``model``."""
    if factor is not None and (
        isinstance(factor, bool)
        or not isinstance(factor, int | float)
        or not math.isfinite(factor)
        or factor <= 0
    ):
        raise ValueError(
            f"flatshard.set_gradient_divide_factor: factor must be a positive number or "
            f"None (divide by the world size), got {factor!r} (rank {global_rank()})"
        )
    units = units_of(model, "set_gradient_divide_factor")
    for unit in units:
        if factor is not None and unit.trainable and unit.config.comm_hook is not None:
            raise ValueError(
                f"flatshard.set_gradient_divide_factor: unit '{unit.label}' reduces "
                f"through a communication hook, which does the whole reduction, its "
                f"division too (rank {global_rank()}); divide in the hook, or register "
                "no hook (flatshard.comm_hooks.register_comm_hook(model, None))."
            )
    value = None if factor is None else float(factor)
    change_units(
        model,
        units,
        "set_gradient_divide_factor",
        value,
        over_stages=True,  # one scale for the gradients of every stage
        gradient_divide_factor=value,
    )


def set_unshard_in_backward(module: nn.Module, unshard_in_backward: bool) -> None:
    """False: backward does not gather the unit ``module`` (one ``fully_shard`` made a
    unit: not the units inside it, as FSDP2's), for a unit no backward op reads the
    parameters of, e.g. an embedding table's: one all-gather less per step, and forward
    frees the buffer at once. Its gradient is reduced as always. If a backward op does
    read them, it fails in torch (out of bounds for storage of size 0) ([Note: a unit
    backward does not read]). FSDP2's ``module.set_unshard_in_backward(False)``."""
    if not isinstance(unshard_in_backward, bool):
        raise TypeError(
            f"flatshard.set_unshard_in_backward: pass True or False, got {unshard_in_backward!r}"
        )
    unit = unit_or_error(module, "set_unshard_in_backward")
    unit.require_idle("set_unshard_in_backward", "call it between steps.")
    change_units(
        module,
        [unit],
        "set_unshard_in_backward",
        unshard_in_backward,
        unshard_in_backward=unshard_in_backward,
    )


def set_separate_reduce_scatter_group(model: nn.Module, enable: bool = True) -> None:
    """True: every unit inside ``model`` reduces its gradients inside its shard group on a
    process group of its own over the same ranks (made once per shard group), so that an
    all-gather never waits behind a reduce-scatter issued before it; False: on the shard
    group again. The replicas' all-reduce (hybrid) and a communication hook's collectives
    are unchanged. FSDP2's ``model.set_separate_reduce_scatter_group(enable)``."""
    if not isinstance(enable, bool):
        raise TypeError(
            f"flatshard.set_separate_reduce_scatter_group: pass True or False, got {enable!r}"
        )
    contexts = change_switches(
        model, "set_separate_reduce_scatter_group", enable, separate_reduce_scatter_group=enable
    )
    flats = [f for c in contexts for u in c.units for f in u.flat_params]
    twins: dict[int, dist.ProcessGroup] = {}
    if enable:
        shards = list({id(s): s for f in flats if (s := f.groups.shard) is not None}.values())
        model_group = contexts[0].process_group
        if shards and model_group is not None:
            made = reduction_groups(shards, model_group)
            twins = {id(s): t for s, t in zip(shards, made, strict=True)}
    for flat in flats:
        twin = twins.get(id(flat.groups.shard)) if flat.groups.shard is not None else None
        flat.transport = replace(flat.transport, reduce_group=twin)


def set_prefetch(
    module: nn.Module,
    *,
    forward: list[nn.Module] | None = None,
    backward: list[nn.Module] | None = None,
) -> None:
    """Name the units to gather when ``module``'s unit starts forward / backward.

    Overrides the prediction from recorded order (``[]`` turns prefetch off for the unit;
    None keeps the prediction). All modules must be units of the same model; every rank
    alike (the order of the all-gathers changes).
    """
    owner = unit_or_error(module, "set_prefetch")
    targets: dict[str, Any] = {
        f"prefetch_{name}": tuple(unit_or_error(m, "set_prefetch") for m in modules)
        for name, modules in (("forward", forward), ("backward", backward))
        if modules is not None
    }
    labels = {name: tuple(u.label for u in units) for name, units in targets.items()}
    change_units(module, [owner], "set_prefetch", labels, **targets)


def change_switches(
    model: nn.Module, caller: str, value: object, **changes: Any
) -> list[StepContext]:
    """Set the model's ``Switches`` fields ``changes``, once every rank made the same call
    with ``value`` ([Note: the agreed configuration]); the model's step contexts."""
    contexts = contexts_under(model, caller)
    refuse_inside_schedule(contexts, caller)
    outer = [c for c in contexts if c.root is not model]
    if outer:
        raise ValueError(
            f"flatshard.{caller}: {type(model).__name__} is part of the model that "
            f"fully_shard was last called on ({type(outer[0].root).__name__}); the switch "
            "applies to a whole model's step: call it on that model."
        )
    with collective_call(model, f"{caller}({describe(value)})"):
        switch(contexts, **changes)
    return contexts


def switch(contexts: list[StepContext], **changes: Any) -> None:
    """Set ``Switches`` fields without agreeing: for ``change_switches`` once agreed, and
    for a call every rank agreed on as a whole (``train_step``)."""
    for context in contexts:
        context.switches = replace(context.switches, **changes)


def change_units(
    model: nn.Module,
    units: list[Unit],
    caller: str,
    value: object,
    *,
    over_stages: bool = False,
    **changes: Any,
) -> None:
    """Set the ``UnitConfig`` fields ``changes`` of ``units`` (inside ``model``), once every
    rank made the same call with ``value`` ([Note: the agreed configuration]); with
    ``over_stages``, every rank of a pipeline too ([Note: calls over every stage])."""
    with collective_call(model, f"{caller}({describe(value)})", over_stages):
        for unit in units:
            unit.configure(**changes)


@contextmanager
def no_sync(model: nn.Module) -> Iterator[None]:
    """Backward passes inside keep their gradients unsharded and unreduced.

    The first backward outside the context adds its gradient to the kept ones and reduces
    the sum once per flat parameter group. It costs a full-size (unsharded) gradient per
    flat parameter group between those backward passes, and saves all their communication.
    Enter it on every rank alike.
    """
    contexts = contexts_under(model, "no_sync")
    refuse_inside_schedule(contexts, "no_sync")
    note_span(lambda: no_sync(model))  # (inside join: first, as its replay enters it)
    agree(model, "no_sync")
    try:
        with sync_off(contexts):
            yield
    finally:
        note_span(None)


@contextmanager
def sync_off(contexts: list[StepContext]) -> Iterator[None]:
    """Gradient sync off for the body, without agreeing: for a caller every rank agreed
    on already (``no_sync`` itself, ``train_step``)."""
    previous = [context.sync_gradients for context in contexts]
    for context in contexts:
        context.switches = replace(context.switches, requires_gradient_sync=False)
    try:
        yield
    finally:
        for context, value in zip(contexts, previous, strict=True):
            context.switches = replace(context.switches, requires_gradient_sync=value)
