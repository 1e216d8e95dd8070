"""Tensor-parallel (DTensor) parameters in flatshard units: 2-D, TP x sharded data parallel.

[Note: DTensor parameters]
A model parallelized with ``torch.distributed.tensor.parallel`` holds DTensor parameters
over a TP mesh: each rank's local tensor is its TP shard. ``fully_shard(model,
process_group=mesh["dp"])`` shards those local tensors over the data-parallel ranks, which
hold the same TP shard (``localize`` refuses a group that overlaps the TP mesh: it would
flatten different shards together). ``localize`` replaces each DTensor parameter with a
plain parameter holding its local tensor and remembers the DTensor's mesh, placements and
global shape (``TensorParallel``); from then on flatshard treats it as any parameter of
that local shape (row-aligned layout, views, reduction over dp, optimizer state). Inside a
unit's forward the registered views are wrapped back into DTensors
(``DTensor.from_local``, differentiable), so the TP layers compute as before; their
gradients come back as local tensors (a replicated parameter's already summed over TP by
DTensor's backward) and are reduced over dp. Between steps a parameter is this rank's rows
of its local TP shard, as a plain tensor (the optimizer steps it like any other).
What depends on TP: the gradient norm (TP-sharded parameters' partial sums are also summed
over the TP ranks), full state dicts (each local shard gathered over dp, then over TP with
``full_tensor``), and checkpoint chunks (offset by the local shard's place in the global
tensor), so a checkpoint loads at any dp degree, and at another TP degree (DCP reads
each rank's rows from the global tensors' chunks).
"""

from __future__ import annotations

import sys
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import TYPE_CHECKING, ClassVar, cast

import torch
import torch.distributed as dist
from torch import nn

if TYPE_CHECKING:  # torch.distributed.tensor takes ~1 s to import: only with TP models
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.tensor import DTensor
    from torch.distributed.tensor.placement_types import Placement

_ATTR = "_flatshard_tensor_parallel"


@dataclass(frozen=True)
class SplitParam:
    """A parameter whose local tensor is this rank's part of a global tensor that other
    ranks hold other parts of: tensor parallelism (``TensorParallel``) or expert
    parallelism (``placements/_experts.py``). Norms, full state dicts and checkpoint chunks ask
    it, not which it is."""

    # Whether the parts are held by ranks beside the model's own (tensor parallelism), not
    # by the model's ranks themselves (experts); read by this module's spanning_group only,
    # everyone else asks the verbs below
    _parts_beside_model: ClassVar[bool] = True

    shape: torch.Size  # the global tensor's
    stride: tuple[int, ...]
    offset: tuple[int, ...]  # where this rank's local tensor starts in the global tensor

    @property
    def sharded(self) -> bool:
        """Whether the ranks of ``group`` hold different parts (else each holds all of it)."""
        raise NotImplementedError

    @property
    def group(self) -> dist.ProcessGroup:
        """The ranks that hold the parts."""
        raise NotImplementedError

    @property
    def local_shape(self) -> torch.Size:
        raise NotImplementedError

    @property
    def holds_first(self) -> bool:
        """Whether this rank holds the part at offset 0 (the one that writes files)."""
        return not any(self.offset)

    @property
    def how(self) -> str:
        """How it is split, in the user's words."""
        raise NotImplementedError

    def wrap(self, local: torch.Tensor) -> torch.Tensor:
        """``local`` as the model's forward reads it."""
        return local

    def full(self, local: torch.Tensor) -> torch.Tensor:
        """The global tensor from every rank's ``local`` (a collective over ``group``)."""
        raise NotImplementedError

    def full_where_kept(self, local: torch.Tensor, keep: bool) -> torch.Tensor | None:
        """``full(local)`` on a rank that keeps it (a full state dict's keeper); elsewhere
        None, with no collective: the TP ranks beside are rank ``r`` of their own data
        groups, so they keep or not alike."""
        return self.full(local) if keep else None

    def summoned(self, local: torch.Tensor) -> torch.Tensor:
        """What the parameter is inside ``summon_full_params`` (and in a full gather): this
        rank's part, which its layers compute on as a DTensor and the TP ranks beside hold
        alike."""
        return local

    def summon_refusal(self) -> str | None:
        """Why a plain state dict or a forward inside ``summon_full_params`` cannot use the
        summoned parameter (None: they can)."""
        return "this rank's tensor-parallel part, which its layers read as a DTensor"

    def startup_value(self, local: torch.Tensor) -> torch.Tensor | None:
        """What ``fully_shard``'s startup check compares across the model's ranks (None:
        nothing): the part, which the model's ranks at one TP place hold alike."""
        return local

    def local_part(self, full: torch.Tensor) -> torch.Tensor:
        """This rank's part of the global tensor ``full`` (a view)."""
        part = full
        for dim, (start, size) in enumerate(zip(self.offset, self.local_shape, strict=True)):
            part = part.narrow(dim, start, size)
        return part


@dataclass(frozen=True)
class TensorParallel(SplitParam):
    """How a parameter was a DTensor: its TP mesh, placements and global shape."""

    mesh: DeviceMesh
    placements: tuple[Placement, ...]

    @property
    def sharded(self) -> bool:
        """Whether TP ranks hold different parts (else each holds all of it)."""
        return any(p.is_shard() for p in self.placements)

    @property
    def group(self) -> dist.ProcessGroup:
        return self.mesh.get_group()

    @property
    def holds_first(self) -> bool:
        return bool(self.mesh.get_local_rank() == 0)

    @property
    def how(self) -> str:
        return "by tensor parallelism"

    def wrap(self, local: torch.Tensor) -> DTensor:
        """``local`` (this rank's TP shard) as the DTensor the TP layers expect."""
        from torch.distributed.tensor import DTensor

        return DTensor.from_local(
            local, self.mesh, self.placements, run_check=False, shape=self.shape, stride=self.stride
        )

    def full(self, local: torch.Tensor) -> torch.Tensor:
        """The global tensor from every TP rank's ``local`` (a collective over TP)."""
        if not self.sharded:
            return local
        full: torch.Tensor = self.wrap(local).full_tensor()
        return full

    @property
    def local_shape(self) -> torch.Size:
        from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

        shape, _ = compute_local_shape_and_global_offset(self.shape, self.mesh, self.placements)
        return torch.Size(shape)


def tensor_parallel(param: torch.Tensor) -> SplitParam | None:
    """How a parameter is split across other ranks: what ``localize`` found of a DTensor,
    or what ``Experts`` cut (None for others)."""
    found = getattr(param, _ATTR, None)
    return found if isinstance(found, SplitParam) else None


def mark_split(param: torch.Tensor, split: SplitParam) -> None:
    """Record how ``param`` (a local tensor) is split across ranks."""
    setattr(param, _ATTR, split)


def carry(old: torch.Tensor, new: torch.Tensor) -> None:
    """``new`` replaces parameter ``old`` (materialized, moved, re-assigned by an init
    function): it keeps what ``old`` was as a DTensor."""
    found = tensor_parallel(old)
    if found is not None and tensor_parallel(new) is None:
        setattr(new, _ATTR, found)


@contextmanager
def global_shapes(module: nn.Module) -> Iterator[None]:
    """Inside, ``module``'s TP-sharded parameters are their whole (global) tensors; on
    exit each keeps this rank's part of what was written to it.

    [Note: initializing TP parameters] A model built on the meta device and parallelized
    there is initialized one module at a time by ``fully_shard``. On the local shards, an
    initializer would draw the same numbers on every TP rank (each module's seed is its
    name's, [Note: deterministic initialization]), so the shards of one weight would be
    copies and their units would stay symmetric through training; and it would take its
    fan-in from the local shape. On the global tensor it draws what the model without
    TP draws, and each rank keeps its part: one module's global weights at a time.
    """
    swapped: list[tuple[str, nn.Parameter, nn.Parameter, int, SplitParam]] = []
    for name, local in list(module._parameters.items()):
        tp = tensor_parallel(local) if local is not None else None
        if local is None or tp is None or not tp.sharded:
            continue
        empty = torch.empty(tp.shape, dtype=local.dtype, device=local.device)
        whole = nn.Parameter(empty, requires_grad=local.requires_grad)
        module._parameters[name] = whole
        swapped.append((name, local, whole, whole._version, tp))
    try:
        yield
    finally:
        for name, local, whole, version, tp in swapped:
            written = module._parameters[name]  # an initializer may assign a new one
            if written is not None and (written is not whole or whole._version != version):
                with torch.no_grad():
                    local.copy_(tp.local_part(written))
            module._parameters[name] = local  # unwritten: left as it was (reported later)


def localize(root: nn.Module, group: dist.ProcessGroup, rank: int) -> None:
    """Replace every DTensor parameter of ``root`` by a plain one holding its local tensor.

    Ties stay ties (one DTensor registered twice becomes one plain parameter registered
    twice). See [Note: DTensor parameters].
    """
    if "torch.distributed.tensor" not in sys.modules:
        return  # never imported: no DTensor exists
    from torch.distributed.tensor import DTensor

    replaced: dict[int, nn.Parameter] = {}
    for mname, module in root.named_modules(remove_duplicate=False):
        for pname, param in list(module._parameters.items()):
            if not isinstance(param, DTensor):
                continue
            fqn = f"{mname}.{pname}" if mname else pname
            plain = replaced.get(id(param))
            if plain is None:
                plain = nn.Parameter(param.to_local().detach(), requires_grad=param.requires_grad)
                setattr(plain, _ATTR, _describe(param, fqn, group, rank))
                replaced[id(param)] = plain
            module._parameters[pname] = plain


def _describe(param: DTensor, fqn: str, group: dist.ProcessGroup, rank: int) -> TensorParallel:
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    mesh, placements = param.device_mesh, tuple(param.placements)
    problem = ""
    if mesh.ndim != 1:
        problem = f"a DTensor over a {mesh.ndim}-D mesh (flatshard takes 1-D TP meshes)"
    elif not all(isinstance(p, Replicate) or type(p) is Shard for p in placements):
        problem = f"a DTensor placed {placements} (flatshard takes Shard and Replicate)"
    else:
        shared = set(mesh.mesh.flatten().tolist()) & set(dist.get_process_group_ranks(group))
        if shared != {rank}:
            problem = (
                f"a DTensor over TP ranks {mesh.mesh.flatten().tolist()}, and flatshard's "
                f"group holds {sorted(shared)} of them: ranks of one TP group hold different "
                "shards and must not be sharded together. Pass the data-parallel dimension, "
                'e.g. process_group=mesh["dp"]'
            )
    if problem:
        raise ValueError(f"flatshard.fully_shard: parameter '{fqn}' is {problem} (rank {rank}).")
    _, offset = compute_local_shape_and_global_offset(param.shape, mesh, placements)
    return TensorParallel(
        shape=param.shape,
        stride=param.stride(),
        offset=tuple(offset),
        mesh=mesh,
        placements=placements,
    )


def spanning_group(dp: dist.ProcessGroup, tps: list[SplitParam]) -> dist.ProcessGroup:
    """A group holding every rank of dp x tp: what a checkpoint's ranks write together.

    The data-parallel group alone would leave each TP shard's writers unaware of the others
    (one directory, several DCP coordinators). Found among the groups that exist: the TP
    group (at dp 1) or the world (dp x tp spans it). Parts held inside the model's own
    group (experts) need nothing more than that group.
    """
    tps = [t for t in tps if t._parts_beside_model]
    if not tps:
        return dp
    tp = tps[0].group
    if any(
        set(dist.get_process_group_ranks(t.group)) != set(dist.get_process_group_ranks(tp))
        for t in tps
    ):
        raise ValueError(
            "flatshard: the model's DTensor parameters live on different TP meshes; "
            "checkpoints need one TP mesh per model."
        )
    dp_size, tp_size = dist.get_world_size(dp), dist.get_world_size(tp)
    if dp_size == 1:
        return tp
    if dp_size * tp_size == dist.get_world_size():
        return cast(dist.ProcessGroup, dist.group.WORLD)
    raise ValueError(
        f"flatshard: checkpoints of a tensor-parallel model need dp x tp ({dp_size} x "
        f"{tp_size}) to span the world ({dist.get_world_size()} ranks) or dp = 1."
    )
