"""Which unit owns each original parameter, and how a unit's parameters are grouped.

A parameter belongs to the deepest unit whose module contains every module that registers
it, so tied parameters (an embedding shared with the LM head) land in their lowest common
ancestor unit and are flattened once (paper mechanism 15). Inside a unit, parameters are
grouped by (requires_grad, dtype), one flat parameter group per group, in first-seen order.
"""

from __future__ import annotations

from collections.abc import Collection, Mapping
from dataclasses import dataclass, field

import torch
from torch import nn

from flatshard.comm._ranks import join_name
from flatshard.flat._original_param import OriginalParam
from flatshard.flat._policy import is_within


@dataclass
class UnitMembers:
    """One unit to build: its module and its parameter groups."""

    fqn: str
    module: nn.Module
    groups: list[list[OriginalParam]] = field(default_factory=list)
    # The modules this unit owns (its subtree minus inner units), in pre-order: their
    # buffers and initialization belong to this unit.
    modules: list[tuple[str, nn.Module]] = field(default_factory=list)

    @property
    def originals(self) -> list[OriginalParam]:
        return [orig for group in self.groups for orig in group]


def partition(
    root: nn.Module,
    unit_names: Collection[str],
    sharded_elsewhere: Mapping[str, Collection[int]],
    rank: int,
) -> list[UnitMembers]:
    """Assign the root's parameters to ``unit_names`` plus the root ("").

    ``sharded_elsewhere`` maps each submodule already sharded by an earlier call to the ids
    of the parameters it manages; those are skipped, and a tie reaching outside such a
    submodule is an error.
    """
    originals, owners = _collect(root, sharded_elsewhere, rank)
    modules = dict(root.named_modules())
    # Pre-order of the module tree: the same on every rank (a set's order is not), and
    # reversed it puts every inner unit before the units around it.
    position = {name: i for i, name in enumerate(modules)}
    names = sorted({"", *unit_names}, key=position.__getitem__)
    units = {name: UnitMembers(fqn=name, module=modules[name]) for name in names}
    members: dict[str, list[OriginalParam]] = {name: [] for name in names}
    for key, orig in originals.items():
        home = max((n for n in names if all(_inside_or_root(o, n) for o in owners[key])), key=len)
        members[home].append(orig)
    for name in names:
        units[name].groups = _group(members[name])
    for mname, module in modules.items():
        if not is_within(mname, sharded_elsewhere):
            home = max((n for n in names if _inside_or_root(mname, n)), key=len)
            units[home].modules.append((mname, module))
    # Inner units first: their hooks must exist before an outer unit adopts them. Units
    # without parameters are returned too (they may own buffers to initialize).
    return [units[n] for n in reversed(names)]


def _collect(
    root: nn.Module, sharded_elsewhere: Mapping[str, Collection[int]], rank: int
) -> tuple[dict[int, OriginalParam], dict[int, list[str]]]:
    originals: dict[int, OriginalParam] = {}
    owners: dict[int, list[str]] = {}
    for mname, module in root.named_modules(remove_duplicate=False):
        if is_within(mname, sharded_elsewhere):
            continue
        for pname, param in module._parameters.items():
            if param is None:
                continue
            fqn = join_name(mname, pname)
            _check_param(param, fqn, rank)
            _check_not_tied_into(param, fqn, sharded_elsewhere, rank)
            orig = originals.setdefault(id(param), OriginalParam(param=param, fqn=fqn))
            if not any(m is module and n == pname for m, n in orig.usages):
                orig.usages.append((module, pname))
            owners.setdefault(id(param), []).append(mname)
    return originals, owners


def _group(params: list[OriginalParam]) -> list[list[OriginalParam]]:
    groups: dict[tuple[bool, torch.dtype], list[OriginalParam]] = {}
    for orig in params:
        groups.setdefault((orig.param.requires_grad, orig.param.dtype), []).append(orig)
    return list(groups.values())


def _check_param(param: nn.Parameter, fqn: str, rank: int) -> None:
    if type(param.data) is not torch.Tensor:
        raise TypeError(
            f"flatshard.fully_shard: parameter '{fqn}' is a {type(param.data).__name__}, "
            f"not a plain tensor (rank {rank}); flatshard cannot shard a model another "
            "data parallelism (FSDP2) already manages. (DTensor parameters of tensor "
            "parallelism are supported: see [Note: DTensor parameters].)"
        )


def _check_not_tied_into(
    param: nn.Parameter, fqn: str, sharded_elsewhere: Mapping[str, Collection[int]], rank: int
) -> None:
    for unit_name, ids in sharded_elsewhere.items():
        if id(param) in ids:
            raise ValueError(
                f"flatshard.fully_shard: parameter '{fqn}' is tied to a parameter of "
                f"'{unit_name}', which an earlier fully_shard call already sharded (rank "
                f"{rank}). A tied parameter must live in a unit that contains every module "
                "using it: shard the common ancestor instead, e.g. pass the parent to "
                "fully_shard with auto_wrap_policy and no separate call on "
                f"'{unit_name}'."
            )


def _inside_or_root(name: str, unit: str) -> bool:
    return unit == "" or is_within(name, [unit])
