"""Gathering units by hand: ``unshard`` / ``reshard`` (one unit gathered on request, until
asked to free it) and ``summon_full_params`` (every original parameter full-size on every
rank, for a while).

FSDP2's ``module.unshard()`` / ``module.reshard()`` as free functions, for generation in a
training loop (every unit gathered once, no all-gather per token) and for hand-made
prefetch. Like FSDP2's, they act on one unit, not the units inside it. Forward and backward
leave a held unit gathered; between them its modules hold the original parameters, so
everything else sees the shards ([Note: held units]); after the model's
``optimizer.step()`` its next use gathers it again.

Full-size parameters (and tensors laid out like them) are gathered outside forward/backward
by ``summon_full_params`` here and by full state dicts and full optimizer state dicts: a
blocking all-gather over the group's shard group, on the compute device (NCCL cannot gather
CPU shards when offloading).
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from typing import cast

import torch
import torch.distributed as dist
from torch import nn

from flatshard.comm._agreement import global_rank
from flatshard.comm._collectives import all_gather_into, all_gather_object
from flatshard.flat._flat_param import FlatParamGroup
from flatshard.flat._tensor_parallel import SplitParam
from flatshard.runtime._changes import refuse_differed
from flatshard.runtime._configuration import checksum
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


# transformers keeps ranks decoding in step (generate's synced_gpus: one all-reduce per
# token, a finished rank running forwards until the last is done) for modules marked so, as
# FSDP2 marks them; ``fully_shard`` marks the model it shards, since each forward gathers,
# and the transformers models inside it (a wrapper such as peft's hands ``generate`` to the
# model inside, and transformers looks at that one: [Note: a wrapper's generate]).
# Inside ``summon_full_params`` a forward gathers nothing, so the mark is off there: a
# generation on one rank only (the decode-in-summon pattern) must not wait in an
# all-reduce its peers never join.
LOCKSTEP_MARK = "_is_fsdp_managed_module"


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
    refuse_differed(model, "summon_full_params")
    with ExitStack() as stack:
        # Its gathers, not the body's; ``writeback`` is agreed, as it decides the exit's check.
        with collective_call(model, f"summon_full_params(writeback={bool(writeback)})"):
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
        marked = [m for m in model.modules() if m.__dict__.get(LOCKSTEP_MARK)]
        for module in marked:  # see LOCKSTEP_MARK
            module.__dict__[LOCKSTEP_MARK] = False
        try:
            yield
            if writeback:
                _written_alike(model, units, summoned)
        finally:
            for module in marked:
                module.__dict__[LOCKSTEP_MARK] = True
            for unit, hold in zip(units, holds, strict=True):
                unit.hold = hold
    for unit in units:  # (the write-backs are done: a pending backward is refused)
        if any(s.changed for s in summoned if any(s.flat is f for f in unit.flat_params)):
            unit.user_wrote("summon_full_params's write-back")


def _written_alike(model: nn.Module, units: list[Unit], summoned: list[Summoned]) -> None:
    """[Note: a write-back every rank makes alike]
    Each rank writes back only its own rows of what it holds at exit. So a change made on
    some ranks only (``if rank == 0: model.load_state_dict(...)`` inside the summon) would
    land in those ranks' rows alone: a silent mix. At exit the ranks compare a digest of
    every parameter they must hold alike (all but tensor-parallel parts, each rank's own),
    and where any differs, every rank raises naming them and nothing is written back.
    One O(parameters) pass and one small all-gather per write-back summon.
    """
    exits = [s.digests() for s in summoned]
    for s, at_exit in zip(summoned, exits, strict=True):
        s.changed = at_exit != s.entered
    mine = [digest for at_exit in exits for digest in at_exit]
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


# ---------------------------------------- full-size gathers, here and for full state dicts
def gather_full(
    flat: FlatParamGroup, region: torch.Tensor
) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """All-gather a tensor laid out like ``flat.param_region``; return it and full-shape views.

    A collective over the shard group (and first across the replicas under
    HYBRID_SHARD_OPTIM: [Note: optimizer state sharded across the replicas]). Used for
    parameters (the region itself) and for anything shaped like them, such as optimizer
    moments packed by ``pack_rows``.
    """
    flat_shard = flat.gather_region(region)  # laid out like the shard (C,)
    full = torch.empty(
        flat.layout.unsharded_numel, dtype=flat_shard.dtype, device=flat.compute_device
    )  # (C * F,)
    source = flat_shard.to(flat.compute_device)
    if flat.groups.shard is None:
        full.copy_(source)
    else:
        all_gather_into(full, source, flat.groups.shard)
    return full, flat.views.full_views(full)


def gather_copies(
    flat: FlatParamGroup, region: torch.Tensor, keep: bool, cpu_offload: bool
) -> list[torch.Tensor]:
    """Gather ``region`` (laid out like ``param_region``); copy out each original's part.

    Returns nothing when not ``keep``. A function of its own so that the gathered buffer
    (which every view keeps alive) is freed on return, before the next gather.
    """
    views = gather_full(flat, region)[1]
    if not keep and not flat.has_tp:
        return []
    # A split parameter's part -> the global tensor, a collective over its group on the
    # ranks that must join it even without keeping it (SplitParam.full_where_kept).
    copies = [copy_out(view, cpu_offload) if keep else view for view in views]
    if flat.has_tp:
        copies = [
            _global(orig.tp, c, flat, keep) for orig, c in zip(flat.originals, copies, strict=True)
        ]
    return copies if keep else []


def _global(
    tp: SplitParam | None, local: torch.Tensor, flat: FlatParamGroup, keep: bool
) -> torch.Tensor:
    """The global tensor of a split parameter from every rank's ``local`` of its group
    (``local`` itself where this rank does not keep it)."""
    if tp is None:
        return local
    full = tp.full_where_kept(local.to(flat.compute_device), keep)
    return local if full is None else full.to(local.device)


def copy_out(tensor: torch.Tensor, cpu_offload: bool) -> torch.Tensor:
    """A fresh copy (on the CPU with ``cpu_offload``): a view would keep a whole buffer."""
    device = torch.device("cpu") if cpu_offload else tensor.device
    return tensor.detach().to(device, copy=True)


def pack_rows(flat: FlatParamGroup, local_rows: list[torch.Tensor]) -> torch.Tensor:
    """Lay tensors shaped like each original's held rows out like ``flat.param_region``."""
    packed = torch.zeros(
        flat.param_layout.shard_numel, dtype=local_rows[0].dtype, device=flat.shard.device
    )
    for view, rows in zip(flat.param_views.shard_views(packed), local_rows, strict=True):
        view.copy_(rows)
    return packed


class Summoned:
    """A group's parameters, full-size for a while (``full_params``)."""

    def __init__(
        self,
        flat: FlatParamGroup,
        views: list[torch.Tensor],
        given: list[torch.Tensor],
        writeback: bool,
    ):
        self.writeback = True  # False: what was written is dropped (``discard``)
        self.flat = flat
        # The originals every rank holds alike: all but a tensor-parallel part (this rank's)
        self._alike = [
            orig
            for orig, view, tensor in zip(flat.originals, views, given, strict=True)
            if orig.tp is None or tensor is not view
        ]
        # What they held at entry, and whether that changed by the exit: decided alike on
        # every rank, as every rank holds them alike (the exit compares them)
        self.entered = self.digests() if writeback else []
        self.changed = False

    def digests(self) -> list[tuple[str, str]]:
        """(name, checksum) of each parameter every rank must hold alike, as it is now."""
        return [(orig.fqn, checksum(orig.param.data)) for orig in self._alike]

    def discard(self) -> None:
        self.writeback = False


@contextmanager
def full_params(flat: FlatParamGroup, writeback: bool) -> Iterator[Summoned]:
    """Give every original parameter of ``flat`` its full shape and value (master dtype).

    A split parameter becomes what ``SplitParam.summoned`` says: expert slices the whole
    global tensor (joined over their group, as in a full state dict), tensor-parallel parts
    this rank's part. With ``writeback`` what they hold at exit is written to the shards,
    unless ``discard`` was called.
    """
    full, views = gather_full(flat, flat.param_region)
    joined = [
        view if orig.tp is None else orig.tp.summoned(view)
        for orig, view in zip(flat.originals, views, strict=True)
    ]
    for orig, tensor in zip(flat.originals, joined, strict=True):
        orig.param.data = tensor
    summoned = Summoned(flat, views, joined, writeback)
    try:
        yield summoned
    finally:
        if writeback and summoned.writeback:
            flat.shards_written()
            _write_back(flat, full, views, joined)
        flat.use_sharded_data()


def _write_back(
    flat: FlatParamGroup,
    full: torch.Tensor,
    views: list[torch.Tensor],
    given: list[torch.Tensor],
) -> None:
    for orig, view, tensor in zip(flat.originals, views, given, strict=True):
        data = orig.param.data
        if data.data_ptr() == view.data_ptr():
            continue  # edited in place: already in ``full``
        if tensor is not view and orig.tp is not None:  # a whole global tensor: our part
            data = orig.tp.local_part(data)
        view.copy_(data)
    chunk = flat.layout.shard_numel
    flat.shard.copy_(full[flat.rank * chunk : (flat.rank + 1) * chunk])
