"""Shard and replicate groups: how far each unit is sharded (paper: sharding factor F).

A unit shards its parameters over a *shard group* of F ranks and replicates them across a
*replicate group* of W / F ranks. Gradient reduction is a reduce-scatter inside the shard
group, then an all-reduce of the shard inside the replicate group.
- FULL_SHARD / SHARD_GRAD_OP: F = W (no replicate group).
- NO_SHARD: F = 1 (no shard group; gradients all-reduced like DDP).
- HYBRID_SHARD / HYBRID_SHARD_ZERO2: 1 <= F <= W, by default the ranks of one host; or
  given as ``sharding_factor=F`` or a 2-D (replicate, shard) ``DeviceMesh``.
- HYBRID_SHARD_OPTIM: the parameters as HYBRID_SHARD's, the gradients and the optimizer
  state sharded across all W ranks: the reduction is a reduce-scatter in both groups, and
  the replicas all-gather their updated rows before the next gather (see [Note: optimizer
  state sharded across the replicas] in flat/_flat_param.py).
"""

from __future__ import annotations

import atexit
import difflib
import os
from dataclasses import dataclass, replace
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
    HYBRID_SHARD_OPTIM = "hybrid_shard_optim"  # hybrid; gradients and optimizer over all W

    @property
    def reshard_after_forward(self) -> bool:
        return self in (
            ShardingStrategy.FULL_SHARD,
            ShardingStrategy.HYBRID_SHARD,
            ShardingStrategy.HYBRID_SHARD_OPTIM,
        )

    @property
    def is_hybrid(self) -> bool:
        return self in (
            ShardingStrategy.HYBRID_SHARD,
            ShardingStrategy.HYBRID_SHARD_ZERO2,
            ShardingStrategy.HYBRID_SHARD_OPTIM,
        )

    @property
    def shards_optimizer_across_replicas(self) -> bool:
        return self is ShardingStrategy.HYBRID_SHARD_OPTIM

    @classmethod
    def parse(cls, value: object, caller: str = "fully_shard") -> ShardingStrategy:
        """``value`` as a strategy: one of ours, its name in any case (``"shard_grad_op"``),
        an enum member of that name, such as PyTorch FSDP1's
        ``torch.distributed.fsdp.ShardingStrategy.SHARD_GRAD_OP``, or another library's
        name for it (``"zero3"``, ``"ddp"``: ``ALIASES``)."""
        if isinstance(value, cls):
            return value
        name = value.name if isinstance(value, Enum) else value
        if isinstance(name, str):
            key = name.strip().lstrip("_").upper().replace("-", "_")
            if key in cls.__members__:
                return cls[key]
            alias = ALIASES.get(key.replace("_", "").lower())
            if alias is not None:
                return alias
        raise TypeError(f"flatshard.{caller}: strategy {not_a_strategy(value)}")

    @property
    def kept_gathered(self) -> ShardingStrategy | None:
        """The same sharding, kept unsharded from forward to backward (None: already is,
        or not sharded)."""
        return _KEPT_GATHERED.get(self)


# Other libraries' names for the same sharding (lower case, no separators).
ALIASES: dict[str, ShardingStrategy] = {
    "zero3": ShardingStrategy.FULL_SHARD,
    "fsdp": ShardingStrategy.FULL_SHARD,
    "zero2": ShardingStrategy.SHARD_GRAD_OP,
    "ddp": ShardingStrategy.NO_SHARD,
    "hsdp": ShardingStrategy.HYBRID_SHARD,
}

# What each strategy does, in the words of ZeRO and PyTorch (every listing reads this).
_WHAT: dict[ShardingStrategy, str] = {
    ShardingStrategy.FULL_SHARD: "ZeRO-3: parameters, gradients and optimizer state sharded "
    "over all ranks; parameters gathered for forward and again for backward",
    ShardingStrategy.SHARD_GRAD_OP: "ZeRO-2 as PyTorch names it: sharded as FULL_SHARD, "
    "parameters kept gathered from forward to backward (one all-gather per step)",
    ShardingStrategy.NO_SHARD: "DDP: every rank holds everything, gradients all-reduced",
    ShardingStrategy.HYBRID_SHARD: "HSDP: FULL_SHARD within groups of sharding_factor "
    "ranks (a host by default), replicated across the groups",
    ShardingStrategy.HYBRID_SHARD_ZERO2: "SHARD_GRAD_OP within groups, replicated across them",
    ShardingStrategy.HYBRID_SHARD_OPTIM: "HYBRID_SHARD's parameters; gradients and "
    "optimizer state sharded over all ranks (sharding_factor=1: DeepSpeed's ZeRO-2, "
    "parameters replicated)",
}


def not_a_strategy(value: object, listing: bool = True) -> str:
    """Why ``value`` names no strategy (after "strategy "), with what each one does unless
    ``listing`` is False (a one-line error)."""
    what = ". The strategies:\n" + strategy_table() if listing else ""
    name = value.name if isinstance(value, Enum) else value
    if isinstance(name, str) and name.strip().upper().replace("-", "").replace("_", "") in (
        "ZERO1",
        "ZERO",
    ):
        return (
            f"{value!r}: ZeRO-1 (only the optimizer state sharded) has no strategy of its "
            "own. Closest: HYBRID_SHARD_OPTIM with sharding_factor=1 (parameters replicated "
            "as in ZeRO-1; gradients sharded too, for the same bytes per step); "
            "SHARD_GRAD_OP ('zero2') also shards the parameters between steps" + what
        )
    by_upper = {n.upper(): n for n in [*ShardingStrategy.__members__, *ALIASES]}
    close = difflib.get_close_matches(str(name).upper(), list(by_upper), n=1)
    hint = f" (did you mean {by_upper[close[0]]}?)" if close else ""
    return (
        f"must be one of {', '.join(ShardingStrategy.__members__)} (any case) or another "
        f"library's name for one, got {value!r}{hint}" + what
    )


def strategy_names() -> str:
    """``"FULL_SHARD (zero3) | SHARD_GRAD_OP (zero2) | ..."``: for help texts."""
    return " | ".join(
        s.name + (f" ({', '.join(a)})" if (a := _aliases_of(s)) else "") for s in ShardingStrategy
    )


def strategy_table() -> str:
    """One line per strategy: its name, other names, and what it shards."""
    lines = []
    for s in ShardingStrategy:
        aliases = _aliases_of(s)
        also = f" (also {', '.join(repr(a) for a in aliases)})" if aliases else ""
        lines.append(f"  {s.name}{also}: {_WHAT[s]}")
    return "\n".join(lines)


def _aliases_of(strategy: ShardingStrategy) -> list[str]:
    return [alias for alias, s in ALIASES.items() if s is strategy]


_KEPT_GATHERED = {
    ShardingStrategy.FULL_SHARD: ShardingStrategy.SHARD_GRAD_OP,
    ShardingStrategy.HYBRID_SHARD: ShardingStrategy.HYBRID_SHARD_ZERO2,
}


@dataclass(frozen=True)
class ShardGroups:
    """Where a unit's flat parameter groups live: sharded over ``shard``, replicated over
    ``replicate``.

    None stands for a group of one rank (nothing to communicate).
    """

    shard: dist.ProcessGroup | None
    replicate: dist.ProcessGroup | None
    # HYBRID_SHARD_OPTIM: gradients and optimizer state are cut across the replicas too
    split_across_replicas: bool = False
    # Experts: the ranks a gradient is averaged over when more ranks than the shard and
    # replicate groups feed it (the other expert-parallel ranks' tokens, through the
    # all-to-all): the model's W ([Note: expert parallelism])
    averaged_over: int | None = None

    @property
    def factor(self) -> int:
        """F: ranks a flat parameter group is cut across."""
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
        if self.averaged_over is not None:
            return self.averaged_over
        return self.factor * self.replicate_size

    @property
    def communicates(self) -> bool:
        """Whether a gradient is summed over other ranks (else only divided)."""
        return self.shard is not None or self.replicate is not None

    @property
    def replicate_rank(self) -> int:
        return 0 if self.replicate is None else dist.get_rank(self.replicate)

    @property
    def splits(self) -> int:
        """How many parts of its shard each rank's optimizer steps (R where the optimizer
        is sharded across the replicas, else 1)."""
        return self.replicate_size if self.split_across_replicas else 1

    @property
    def grad_groups(self) -> tuple[dist.ProcessGroup, ...]:
        """The groups over which ranks hold disjoint gradient rows (a norm adds up there)."""
        groups = (self.shard, self.replicate if self.split_across_replicas else None)
        return tuple(g for g in groups if g is not None)


def model_group(where: dist.ProcessGroup | DeviceMesh | None) -> dist.ProcessGroup:
    """The ranks that train the model together (W), from ``fully_shard(process_group=)``.

    A process group or a 1-D mesh names them; a 2-D mesh spans the world.
    """
    if where is None:
        return _world()
    if isinstance(where, dist.ProcessGroup):
        return where
    if isinstance(where, DeviceMesh):
        if where.ndim == 1:
            return where.get_group()
        if where.ndim == 2 and where.size() == dist.get_world_size():
            return _world()
        if where.ndim == 2 and where.mesh_dim_names:
            return _ranks_of(where)
        raise ValueError(
            "flatshard.fully_shard: process_group may be a 1-D DeviceMesh, or a 2-D "
            f"(replicate, shard) DeviceMesh for hybrid sharding (over all "
            f"{dist.get_world_size()} ranks, or a named part of a larger mesh); got the "
            f"{where.ndim}-D mesh {where}."
        )
    raise TypeError(
        "flatshard.fully_shard: process_group must be a torch.distributed ProcessGroup or "
        f"a DeviceMesh, got {where!r}"
    )


def _ranks_of(mesh: DeviceMesh) -> dist.ProcessGroup:
    """The group of a 2-D part of a larger mesh (torchtitan's ("dp_replicate", "dp_shard")
    inside ("pp", "dp_replicate", "dp_shard", "tp")): the ranks that train the model
    together where pipeline stages or tensor parallelism take the other dimensions.

    torch makes such a group only through the mesh (``DeviceMesh._flatten``, which
    torchtitan's parallel dimensions use as well): ``new_group`` would need every rank of
    the world to create every such group, and the ranks of one stage cannot know the
    others' calls. Every rank calls ``fully_shard`` for its own part, and ``_flatten``
    creates the groups of all parts alike on each."""
    flat = mesh._flatten()
    return flat.get_group()


def resolve_groups(
    strategy: ShardingStrategy,
    where: dist.ProcessGroup | DeviceMesh | None,
    sharding_factor: int | None,
) -> ShardGroups:
    """The shard and replicate groups that ``strategy`` and the options ask for.

    Hybrid strategies take F from a 2-D mesh, or from ``sharding_factor``, or by default
    from the ranks per host; the others shard over (FULL_SHARD, SHARD_GRAD_OP) or
    replicate across (NO_SHARD) all W ranks.
    """
    group = model_group(where)
    mesh_2d = where if isinstance(where, DeviceMesh) and where.ndim == 2 else None
    given = [
        name
        for name, v in [("sharding_factor", sharding_factor), ("a 2-D mesh", mesh_2d)]
        if v is not None
    ]
    if not strategy.is_hybrid:
        if given:
            raise ValueError(
                f"flatshard.fully_shard: {given[0]} only applies to the hybrid strategies "
                f"(HYBRID_SHARD, HYBRID_SHARD_ZERO2, HYBRID_SHARD_OPTIM), not "
                f"{strategy.name}; drop it or choose a hybrid strategy."
            )
        if strategy is ShardingStrategy.NO_SHARD:
            return _groups(None, group)
        return _groups(group, None)
    if len(given) > 1:
        raise ValueError(
            "flatshard.fully_shard: give F as sharding_factor or as a 2-D (replicate, shard) "
            "mesh in process_group, not both."
        )
    if mesh_2d is not None:
        groups = _explicit_groups(group, mesh_2d.get_group(1), mesh_2d.get_group(0))
    else:
        world = dist.get_world_size(group)
        factor = sharding_factor if sharding_factor is not None else ranks_per_host(world)
        groups = _factor_groups(group, factor)
    if strategy.shards_optimizer_across_replicas and groups.replicate is not None:
        groups = replace(groups, split_across_replicas=True)
    return groups


def ranks_per_host(world: int) -> int:
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
            f"{dist.get_rank()}); build a 2-D (replicate, shard) DeviceMesh over the world "
            "and pass it as process_group."
        )
    return _world_factor_groups(ranks, factor)


def _world_factor_groups(ranks: list[int], factor: int) -> ShardGroups:
    """This rank's shard and replicate groups for ``factor``: made once per world and F.

    Every hybrid ``fully_shard`` call (per-block calls, kept units, the bench) asks for
    them. Made anew each time, they would cost on NCCL two more communicators per call on
    every rank (GPU memory, threads, start-up time); made once, every unit shares them.
    Every rank makes the same calls, so every rank finds the same groups cached.
    """
    world = _world()
    key = (id(world), tuple(ranks), factor)
    cached = _HYBRID_GROUPS.get(key)
    if cached is not None and cached[0] is world:  # not a world that died at the same id
        return cached[1]
    if not _HYBRID_GROUPS:
        atexit.register(_HYBRID_GROUPS.clear)  # see _release_at_exit in runtime/_step.py
    groups = _new_world_factor_groups(ranks, factor)
    _HYBRID_GROUPS[key] = (world, groups)
    return groups


# (id of the world group, its ranks, F) -> (that world group, this rank's groups).
_HYBRID_GROUPS: dict[tuple[int, tuple[int, ...], int], tuple[dist.ProcessGroup, ShardGroups]] = {}


def _new_world_factor_groups(ranks: list[int], factor: int) -> ShardGroups:
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
            "flatshard.fully_shard: a 2-D (replicate, shard) mesh must cut the W="
            f"{world} ranks into a grid: F x (W / F) ranks meeting only at this rank; got "
            f"shard group {sorted(shard_ranks)} and replicate group {sorted(replicate_ranks)} "
            f"on rank {me}."
        )
    return _groups(shard, replicate)


def _world() -> dist.ProcessGroup:
    world = dist.group.WORLD
    if world is None:  # only before init_process_group, which fully_shard checks first
        raise RuntimeError("flatshard.fully_shard needs torch.distributed to be initialized")
    return world


def _groups(shard: dist.ProcessGroup | None, replicate: dist.ProcessGroup | None) -> ShardGroups:
    """Groups of one rank become None: there is nothing to communicate in them."""

    def real(group: dist.ProcessGroup | None) -> dist.ProcessGroup | None:
        return group if group is not None and dist.get_world_size(group) > 1 else None

    return ShardGroups(shard=real(shard), replicate=real(replicate))


def reduction_groups(
    shards: list[dist.ProcessGroup], model: dist.ProcessGroup
) -> list[dist.ProcessGroup]:
    """For each of ``shards`` (a model's distinct shard groups, in the same order on every
    rank), a process group of its own over the same ranks in the same order, for gradient
    reductions (``set_separate_reduce_scatter_group``).

    [Note: reductions on their own group]
    Collectives on one process group are started in the order they were issued, so an
    all-gather issued after a large reduce-scatter waits for it: on gloo a 2 MB all-gather
    behind a 50 MB all-to-all finished with it in a third of the tries, on a group of its
    own in none (docs/performance.md). NCCL runs one collective at a time per communicator
    the same way. On a twin group the two progress together.
    """
    wanted = [tuple(dist.get_process_group_ranks(s)) for s in shards]
    return _groups_over(wanted, model, "set_separate_reduce_scatter_group", _REDUCTIONS)


def post_forward_groups(
    shards: list[dist.ProcessGroup], size: int, model: dist.ProcessGroup
) -> list[dist.ProcessGroup]:
    """For each of ``shards``, the group of ``size`` consecutive ranks of it this rank is
    in (``set_reshard_after_forward(model, size)``: backward gathers inside it); an error
    naming the group if ``size`` does not divide its size."""
    wanted = []
    for shard in shards:
        ranks = dist.get_process_group_ranks(shard)
        if len(ranks) % size:
            raise ValueError(
                f"flatshard.set_reshard_after_forward: {size} ranks do not divide the "
                f"{len(ranks)} ranks of a shard group {ranks} (rank {dist.get_rank()}); "
                f"give a divisor of {len(ranks)} (e.g. the ranks per host), or True/False."
            )
        start = ranks.index(dist.get_rank()) // size * size
        wanted.append(tuple(ranks[start : start + size]))
    return _groups_over(wanted, model, "set_reshard_after_forward", f"post-forward {size}")


def _groups_over(
    wanted: list[tuple[int, ...]], model: dist.ProcessGroup, caller: str, kind: str
) -> list[dist.ProcessGroup]:
    """A process group over each of ``wanted`` (this rank's rank lists; every rank asks
    for as many, in the same order), each in the order given. Made once per world, rank
    list and ``kind`` (a twin is another group than the post-forward group it equals).

    Every rank of the world makes every group (``new_group`` without local
    synchronization: with it, torch hangs where the ranks made different groups before,
    as every hybrid world's ranks have; pytorch/pytorch#173608). So ``model`` must be the
    whole world, and the ranks first exchange what they want, to make the same groups in
    one order.
    """
    world = _world()
    if dist.get_world_size(model) != dist.get_world_size():
        raise ValueError(
            f"flatshard.{caller}: the model is sharded over {dist.get_world_size(model)} of "
            f"the {dist.get_world_size()} ranks (rank {dist.get_rank()}), and every rank of "
            "the world must make the groups it needs; shard it over the whole world."
        )
    if not _MADE:
        atexit.register(_MADE.clear)  # see _release_at_exit in runtime/_step.py
    everyone: list[list[tuple[int, ...]] | None] = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, wanted, group=model)
    backend = str(dist.get_backend(model))
    for ranks in sorted({ranks for lists in everyone for ranks in lists or []}):
        cached = _MADE.get((id(world), ranks, kind))
        if cached is None or cached[0] is not world:
            group: dist.ProcessGroup | None = dist.new_group(list(ranks), backend=backend)
            _MADE[(id(world), ranks, kind)] = (world, group)
    made = []
    for ranks in wanted:
        group = _MADE[(id(world), ranks, kind)][1]
        if group is None or tuple(dist.get_process_group_ranks(group)) != ranks:
            raise ValueError(
                f"flatshard.{caller}: the shard group's ranks {list(ranks)} are not in "
                f"ascending order (rank {dist.get_rank()}), so no group over them keeps "
                "each rank's chunk; build the group (or mesh) with its ranks in ascending "
                "order."
            )
        made.append(group)
    return made


def expert_groups(
    model: dist.ProcessGroup, degree: int
) -> tuple[dist.ProcessGroup | None, dist.ProcessGroup | None]:
    """This rank's (expert-parallel group, expert data-parallel group) for ``degree``
    (None: a group of one rank): the model's ranks, in its order, cut into EP groups of
    ``degree`` consecutive ranks; the ranks at the same place in every EP group hold the
    same experts and form the expert data-parallel group ([Note: expert parallelism]).

    A degree of 1 or of the model's size needs no new group; any other is made by every
    rank of the world (``_groups_over``).
    """
    ranks = dist.get_process_group_ranks(model)
    size, me = len(ranks), ranks.index(dist.get_rank())
    if degree == 1:
        return None, model if size > 1 else None
    if degree == size:
        return model, None
    start = me // degree * degree
    ep = tuple(ranks[start : start + degree])
    dp = tuple(ranks[me % degree :: degree])
    made = _groups_over([ep, dp], model, "Experts", f"experts {degree}")
    return made[0], made[1]


def is_reduction_group(group: dist.ProcessGroup) -> bool:
    """Whether ``group`` is a twin made for reductions (the planner gives them a timeline
    of their own)."""
    return any(made[1] is group for (_, _, kind), made in _MADE.items() if kind == _REDUCTIONS)


_REDUCTIONS = "twins"
# (id of the world group, ranks, kind) -> (that world group, this rank's group, or None)
_MADE: dict[
    tuple[int, tuple[int, ...], str], tuple[dist.ProcessGroup, dist.ProcessGroup | None]
] = {}
