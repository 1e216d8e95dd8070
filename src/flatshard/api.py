"""The public entry point: ``fully_shard``."""

from __future__ import annotations

from enum import Enum
from typing import TypeVar

import torch.distributed as dist
from torch import nn

from flatshard._flat_param import FlatParameter
from flatshard._partition import partition
from flatshard._policy import AutoWrapPolicy, is_within, select_unit_roots
from flatshard._runtime import TREE_ATTR, ShardTree, install, shard_tree, unit_runtime
from flatshard._unit import Unit

M = TypeVar("M", bound=nn.Module)


class ShardingStrategy(Enum):
    """How far a unit's parameters are sharded (paper: sharding factor F)."""

    FULL_SHARD = "full_shard"  # F = W; reshard after forward and after backward (ZeRO-3)
    SHARD_GRAD_OP = "shard_grad_op"  # F = W; keep unsharded from forward to backward
    NO_SHARD = "no_shard"  # F = 1; gradients all-reduced (DDP)
    HYBRID_SHARD = "hybrid_shard"  # 1 < F < W; shard in groups of F, replicate across
    HYBRID_SHARD_ZERO2 = "hybrid_shard_zero2"  # hybrid, kept unsharded until backward


SUPPORTED_STRATEGIES = (ShardingStrategy.FULL_SHARD,)


def fully_shard(
    module: M,
    *,
    auto_wrap_policy: AutoWrapPolicy = None,
    process_group: dist.ProcessGroup | None = None,
    strategy: ShardingStrategy = ShardingStrategy.FULL_SHARD,
) -> M:
    """Shard ``module``'s parameters over ``process_group`` in place and return it.

    Each submodule chosen by ``auto_wrap_policy`` becomes a unit; ``module`` itself holds
    the parameters left over. ``fully_shard`` may be called on submodules first and then on
    the root. Parameter names stay exactly as written. Build the optimizer afterwards: the
    parameters it must see are the sharded ones.

    Args:
        module: the model (or a submodule) to shard; every rank of the group must pass a
            model of the same structure.
        auto_wrap_policy: a set of module classes (e.g. ``{Block}``), a callable
            ``(module, name) -> bool``, ``flatshard.SizePolicy(min_params=N)``, or None
            (``module`` is the only unit).
        process_group: the ranks to shard over; default the world.
        strategy: ``ShardingStrategy.FULL_SHARD`` (the only one implemented so far).
    """
    _check_distributed()
    if strategy not in SUPPORTED_STRATEGIES:
        raise NotImplementedError(
            f"flatshard.fully_shard: strategy={strategy} is not implemented yet; use "
            "ShardingStrategy.FULL_SHARD."
        )
    group = process_group if process_group is not None else dist.group.WORLD
    if not isinstance(group, dist.ProcessGroup):
        raise TypeError(f"process_group must be a torch.distributed ProcessGroup, got {group!r}")
    rank = dist.get_rank()
    _check_not_sharded(module, rank)
    _check_one_device(module, rank)
    earlier = _earlier_trees(module)
    unit_names = select_unit_roots(module, auto_wrap_policy, skip=earlier.keys())
    managed = {name: _managed_param_ids(tree) for name, tree in earlier.items()}
    plans = partition(module, unit_names, managed, rank)
    tree = ShardTree(module)
    for name, sub_tree in earlier.items():
        tree.adopt(sub_tree, prefix=name)
    for plan in plans:
        flat_params = [FlatParameter(group_params, group) for group_params in plan.groups]
        install(Unit(plan.module, plan.fqn, flat_params), tree)
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
