"""Shard and replicate groups: how far each unit is sharded (paper: sharding factor F).

A unit shards its parameters over a *shard group* of F ranks and replicates them across a
*replicate group* of W / F ranks. Gradient reduction is a reduce-scatter inside the shard
group, then an all-reduce of the shard inside the replicate group.
- FULL_SHARD / SHARD_GRAD_OP: F = W (no replicate group).
- NO_SHARD: F = 1 (no shard group; gradients all-reduced like DDP).
- HYBRID_SHARD / HYBRID_SHARD_ZERO2: 1 <= F <= W, by default the ranks of one host.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from enum import Enum

import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh


class ShardingStrategy(Enum):
    """How far a unit's parameters are sharded and when they are freed."""

    FULL_SHARD = "full_shard"  # F = W; reshard after forward and after backward (ZeRO-3)
    SHARD_GRAD_OP = "shard_grad_op"  # F = W; keep unsharded from forward to backward (ZeRO-2)
    NO_SHARD = "no_shard"  # F = 1; replicate, gradients all-reduced (DDP)
    HYBRID_SHARD = "hybrid_shard"  # shard in groups of F, replicate across W / F groups
    HYBRID_SHARD_ZERO2 = "hybrid_shard_zero2"  # hybrid, kept unsharded until backward

    @property
    def reshard_after_forward(self) -> bool:
        return self in (ShardingStrategy.FULL_SHARD, ShardingStrategy.HYBRID_SHARD)

    @property
    def is_hybrid(self) -> bool:
        return self in (ShardingStrategy.HYBRID_SHARD, ShardingStrategy.HYBRID_SHARD_ZERO2)


@dataclass(frozen=True)
class ShardGroups:
    """Where a unit's FlatParameters live: sharded over ``shard``, replicated over ``replicate``.

    None stands for a group of one rank (nothing to communicate).
    """

    shard: dist.ProcessGroup | None
    replicate: dist.ProcessGroup | None

    @property
    def shard_size(self) -> int:
        """F: ranks a FlatParameter is cut across."""
        return 1 if self.shard is None else dist.get_world_size(self.shard)

    @property
    def shard_rank(self) -> int:
        return 0 if self.shard is None else dist.get_rank(self.shard)

    @property
    def replicate_size(self) -> int:
        return 1 if self.replicate is None else dist.get_world_size(self.replicate)

    @property
    def world_size(self) -> int:
        """W = F * replicas: the ranks a gradient is averaged over."""
        return self.shard_size * self.replicate_size


def resolve_groups(
    strategy: ShardingStrategy,
    process_group: dist.ProcessGroup,
    sharding_factor: int | None,
    hybrid_groups: tuple[dist.ProcessGroup, dist.ProcessGroup] | None,
    device_mesh: DeviceMesh | None,
) -> ShardGroups:
    """The shard and replicate groups that ``strategy`` and the options ask for."""
    hybrid_options = [
        name
        for name, value in [
            ("sharding_factor", sharding_factor),
            ("hybrid_groups", hybrid_groups),
            ("device_mesh", device_mesh),
        ]
        if value is not None
    ]
    if not strategy.is_hybrid:
        if hybrid_options:
            raise ValueError(
                f"flatshard.fully_shard: {hybrid_options[0]} only applies to HYBRID_SHARD "
                f"and HYBRID_SHARD_ZERO2, not {strategy.name}; drop it or choose a hybrid "
                "strategy."
            )
        if strategy is ShardingStrategy.NO_SHARD:
            return _groups(None, process_group)
        return _groups(process_group, None)
    if len(hybrid_options) > 1:
        raise ValueError(
            f"flatshard.fully_shard: give one of sharding_factor, hybrid_groups or "
            f"device_mesh, not {' and '.join(hybrid_options)}."
        )
    if hybrid_groups is not None:
        return _explicit_groups(process_group, *hybrid_groups)
    if device_mesh is not None:
        return _mesh_groups(process_group, device_mesh)
    world = dist.get_world_size(process_group)
    factor = sharding_factor if sharding_factor is not None else _ranks_per_host(world)
    return _factor_groups(process_group, factor)


def _ranks_per_host(world: int) -> int:
    """Topology-aware default: torchrun's LOCAL_WORLD_SIZE, else every rank on one host."""
    local = os.environ.get("LOCAL_WORLD_SIZE")
    if local is not None and local.isdigit() and int(local) > 0 and world % int(local) == 0:
        return int(local)
    return world


def _factor_groups(process_group: dist.ProcessGroup, factor: int) -> ShardGroups:
    ranks = dist.get_process_group_ranks(process_group)
    world = len(ranks)
    if not isinstance(factor, int) or factor < 1 or world % factor:
        raise ValueError(
            f"flatshard.fully_shard: sharding_factor F={factor!r} must be a positive divisor "
            f"of the world size W={world} (rank {dist.get_rank()}); e.g. F = ranks per host."
        )
    if factor == world:
        return _groups(process_group, None)
    if factor == 1:
        return _groups(None, process_group)
    if world != dist.get_world_size():
        # new_group must be called by every rank of the world, and only the ranks of
        # process_group are here.
        raise ValueError(
            f"flatshard.fully_shard: hybrid sharding with F={factor} over a process group of "
            f"{world} of the {dist.get_world_size()} ranks cannot create its groups (rank "
            f"{dist.get_rank()}); create them on every rank and pass "
            "hybrid_groups=(shard_group, replicate_group)."
        )
    return _world_factor_groups(ranks, factor)


def _world_factor_groups(ranks: list[int], factor: int) -> ShardGroups:
    """Create every shard and replicate group (all ranks, same order); keep this rank's."""
    me = dist.get_rank()
    # Shard groups are consecutive ranks (one host under torchrun); replicas are strided.
    shard_blocks = [ranks[i : i + factor] for i in range(0, len(ranks), factor)]
    replicate_blocks = [ranks[i::factor] for i in range(factor)]
    shard = replicate = None
    for block in shard_blocks:
        group = dist.new_group(block)
        shard = group if me in block else shard
    for block in replicate_blocks:
        group = dist.new_group(block)
        replicate = group if me in block else replicate
    return _groups(shard, replicate)


def _explicit_groups(
    process_group: dist.ProcessGroup, shard: dist.ProcessGroup, replicate: dist.ProcessGroup
) -> ShardGroups:
    world = dist.get_world_size(process_group)
    shard_ranks = set(dist.get_process_group_ranks(shard))
    replicate_ranks = set(dist.get_process_group_ranks(replicate))
    me = dist.get_rank()
    if (
        len(shard_ranks) * len(replicate_ranks) != world
        or shard_ranks & replicate_ranks != {me}
        or not (shard_ranks | replicate_ranks) <= set(dist.get_process_group_ranks(process_group))
    ):
        raise ValueError(
            "flatshard.fully_shard: hybrid_groups=(shard_group, replicate_group) must cut the "
            f"W={world} ranks into a grid: F x (W / F) ranks meeting only at this rank; got "
            f"shard group {sorted(shard_ranks)} and replicate group {sorted(replicate_ranks)} "
            f"on rank {me}."
        )
    return _groups(shard, replicate)


def _mesh_groups(process_group: dist.ProcessGroup, mesh: DeviceMesh) -> ShardGroups:
    if mesh.ndim != 2:
        raise ValueError(
            "flatshard.fully_shard: device_mesh must be 2-D (replicate, shard) for hybrid "
            f"sharding; got {mesh.ndim}-D mesh {mesh}."
        )
    return _explicit_groups(process_group, mesh.get_group(1), mesh.get_group(0))


def _groups(shard: dist.ProcessGroup | None, replicate: dist.ProcessGroup | None) -> ShardGroups:
    """Groups of one rank become None: there is nothing to communicate in them."""

    def real(group: dist.ProcessGroup | None) -> dist.ProcessGroup | None:
        return group if group is not None and dist.get_world_size(group) > 1 else None

    return ShardGroups(shard=real(shard), replicate=real(replicate))
