"""The public entry point: ``fully_shard``."""

from __future__ import annotations

from typing import TypeVar

import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh

from flatshard._flat_param import FlatParameter
from flatshard._mesh import ShardingStrategy, resolve_groups
from flatshard._partition import partition
from flatshard._policy import AutoWrapPolicy, is_within, select_unit_roots
from flatshard._runtime import TREE_ATTR, ShardTree, install, shard_tree, unit_runtime
from flatshard._unit import Unit

M = TypeVar("M", bound=nn.Module)


def fully_shard(
    module: M,
    *,
    auto_wrap_policy: AutoWrapPolicy = None,
    process_group: dist.ProcessGroup | None = None,
    strategy: ShardingStrategy = ShardingStrategy.FULL_SHARD,
    sharding_factor: int | None = None,
    hybrid_groups: tuple[dist.ProcessGroup, dist.ProcessGroup] | None = None,
    device_mesh: DeviceMesh | None = None,
) -> M:
    """Shard ``module``'s parameters over ``process_group`` in place and return it.

    Each submodule chosen by ``auto_wrap_policy`` becomes a unit; ``module`` itself holds
    the parameters left over. ``fully_shard`` may be called on submodules first and then on
    the root, also with different strategies per call (e.g. blocks FULL_SHARD, root
    NO_SHARD). Parameter names stay exactly as written. Build the optimizer afterwards: the
    parameters it must see are the sharded ones.

    Args:
        module: the model (or a submodule) to shard; every rank of the group must pass a
            model of the same structure.
        auto_wrap_policy: a set of module classes (e.g. ``{Block}``), a callable
            ``(module, name) -> bool``, ``flatshard.SizePolicy(min_params=N)``, or None
            (``module`` is the only unit).
        process_group: the W ranks that train together; default the world.
        strategy: FULL_SHARD (ZeRO-3), SHARD_GRAD_OP (ZeRO-2: no second all-gather in
            backward), NO_SHARD (DDP), HYBRID_SHARD / HYBRID_SHARD_ZERO2 (shard inside
            groups of F ranks, replicate across the W / F groups).
        sharding_factor: F for the hybrid strategies; by default torchrun's
            LOCAL_WORLD_SIZE (shard inside a host), else W.
        hybrid_groups: for the hybrid strategies, an explicit (shard_group,
            replicate_group) pair instead of ``sharding_factor``.
        device_mesh: for the hybrid strategies, a 2-D mesh of (replicate, shard) dims.
    """
    _check_distributed()
    group = process_group if process_group is not None else dist.group.WORLD
    if not isinstance(group, dist.ProcessGroup):
        raise TypeError(f"process_group must be a torch.distributed ProcessGroup, got {group!r}")
    if not isinstance(strategy, ShardingStrategy):
        raise TypeError(f"strategy must be a flatshard.ShardingStrategy, got {strategy!r}")
    rank = dist.get_rank()
    _check_not_sharded(module, rank)
    _check_one_device(module, rank)
    groups = resolve_groups(strategy, group, sharding_factor, hybrid_groups, device_mesh)
    earlier = _earlier_trees(module)
    unit_names = select_unit_roots(module, auto_wrap_policy, skip=earlier.keys())
    managed = {name: _managed_param_ids(tree) for name, tree in earlier.items()}
    plans = partition(module, unit_names, managed, rank)
    tree = ShardTree(module)
    for name, sub_tree in earlier.items():
        tree.adopt(sub_tree, prefix=name)
    for plan in plans:
        flat_params = [FlatParameter(group_params, groups) for group_params in plan.groups]
        install(Unit(plan.module, plan.fqn, flat_params, strategy), tree)
    module.__dict__[TREE_ATTR] = tree
    return module


def _check_distributed() -> None:
    if not dist.is_available() or not dist.is_initialized():
        raise RuntimeError(
            "flatshard.fully_shard needs torch.distributed: call "
            "torch.distributed.init_process_group(backend=...) first (torchrun sets the "
            "environment it needs; for one process use world_size=1)."
        )


def _check_not_sharded(module: nn.Module, rank: int) -> None:
    if shard_tree(module) is not None or unit_runtime(module) is not None:
        raise ValueError(
            f"flatshard.fully_shard: {type(module).__name__} is already sharded (rank "
            f"{rank}); call fully_shard once per module."
        )


def _check_one_device(module: nn.Module, rank: int) -> None:
    devices = {(n, p.device) for n, p in module.named_parameters()}
    if len({d for _, d in devices}) > 1:
        first = sorted(devices, key=lambda x: str(x[1]))
        raise ValueError(
            f"flatshard.fully_shard: parameters are on several devices (rank {rank}), e.g. "
            f"'{first[0][0]}' on {first[0][1]} and '{first[-1][0]}' on {first[-1][1]}; "
            "move the model to one device (module.to(device)) before sharding."
        )


def _earlier_trees(module: nn.Module) -> dict[str, ShardTree]:
    """Trees of earlier fully_shard calls on submodules, outermost only."""
    found = {
        name: tree
        for name, sub in module.named_modules()
        if name and (tree := shard_tree(sub)) is not None
    }
    return {n: t for n, t in found.items() if not is_within(n, [o for o in found if o != n])}


def _managed_param_ids(tree: ShardTree) -> set[int]:
    return {
        id(orig.param)
        for runtime in tree.units
        for flat in runtime.unit.flat_params
        for orig in flat.originals
    }
