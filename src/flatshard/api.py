"""The public entry point: ``fully_shard``."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TypeVar

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh

from flatshard._consistency import check_same_on_all_ranks, structure_lines, value_lines
from flatshard._flat_param import FlatParameter, OriginalParam
from flatshard._init import (
    ParamInitFn,
    broadcast_unit,
    default_device,
    init_module,
    materialize_unit,
)
from flatshard._mesh import ShardGroups, ShardingStrategy, resolve_groups
from flatshard._mixed_precision import CPUOffload, MixedPrecision
from flatshard._partition import UnitPlan, partition
from flatshard._policy import AutoWrapPolicy, is_within, select_unit_roots
from flatshard._prefetch import BackwardPrefetch
from flatshard._rate_limiter import DEFAULT_LIMIT, RateLimiter
from flatshard._runtime import TREE_ATTR, ShardTree, install, shard_tree, unit_runtime
from flatshard._unit import Unit

M = TypeVar("M", bound=nn.Module)
_CPU = torch.device("cpu")


def fully_shard(
    module: M,
    *,
    auto_wrap_policy: AutoWrapPolicy = None,
    process_group: dist.ProcessGroup | None = None,
    strategy: ShardingStrategy = ShardingStrategy.FULL_SHARD,
    sharding_factor: int | None = None,
    hybrid_groups: tuple[dist.ProcessGroup, dist.ProcessGroup] | None = None,
    device_mesh: DeviceMesh | None = None,
    device: torch.device | str | None = None,
    param_init_fn: ParamInitFn | None = None,
    init_seed: int | None = None,
    sync_module_states: bool = False,
    check_consistency: bool = True,
    check_weights: bool = False,
    mixed_precision: MixedPrecision | None = None,
    cpu_offload: CPUOffload | None = None,
    backward_prefetch: BackwardPrefetch | None = BackwardPrefetch.BACKWARD_PRE,
    forward_prefetch: bool = True,
    limit_all_gathers: bool = True,
) -> M:
    """Shard ``module``'s parameters over ``process_group`` in place and return it.

    Each submodule chosen by ``auto_wrap_policy`` becomes a unit; ``module`` itself holds
    the parameters left over. ``fully_shard`` may be called on submodules first and then on
    the root, also with different strategies per call (e.g. blocks FULL_SHARD, root
    NO_SHARD). Parameter names stay exactly as written. Build the optimizer afterwards: the
    parameters it must see are the sharded ones.

    A model built under ``torch.device("meta")`` is materialized on ``device``, initialized
    and sharded one unit at a time, so the whole model never exists on one rank.

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
        device: where meta parameters are materialized (default: the current accelerator,
            else the CPU); parameters on another device are moved there unit by unit.
        param_init_fn: initializes one module's own meta parameters and buffers
            (default: the module's ``reset_parameters()``); see ``flatshard.init_weights``.
        init_seed: base seed of that initialization (default ``torch.initial_seed()``).
        sync_module_states: broadcast rank 0's parameters and buffers, unit by unit, before
            sharding: other ranks may build the model on meta, and only rank 0 needs to
            load weights.
        check_consistency: compare model structure, strategy and buffer values across
            ranks at startup and raise, on every rank, if they differ (one small
            all-gather per unit).
        check_weights: also compare parameter values across ranks before sharding.
        mixed_precision: dtypes of all-gather/compute, reduction and buffers
            (``flatshard.MixedPrecision``); the sharded master parameters keep theirs.
        cpu_offload: ``flatshard.CPUOffload(params=True)`` keeps the sharded parameters and
            their gradients on the CPU (the optimizer steps there); compute runs on
            ``device``.
        backward_prefetch: gather the next unit (reverse of this iteration's forward
            order) in the current unit's pre-backward (BACKWARD_PRE: more overlap, two
            units gathered), after its reduction (BACKWARD_POST), or not (None).
        forward_prefetch: start gathering the next unit (previous iteration's forward
            order) when a unit's forward starts, so its all-gather overlaps this unit's
            compute (one unit more gathered in forward; a wrong guess costs memory only).
        limit_all_gathers: the rate limiter: at most two units' all-gathers issued ahead of
            their use (prefetches wait for the oldest beyond that); False: no limit.
    """
    _check_distributed()
    group = process_group if process_group is not None else dist.group.WORLD
    if not isinstance(group, dist.ProcessGroup):
        raise TypeError(f"process_group must be a torch.distributed ProcessGroup, got {group!r}")
    if not isinstance(strategy, ShardingStrategy):
        raise TypeError(f"strategy must be a flatshard.ShardingStrategy, got {strategy!r}")
    rank = dist.get_rank()
    _check_not_sharded(module, rank)
    target = _target_device(module, device, rank)
    earlier = _earlier_trees(module)
    _check_inherited_precision(earlier, mixed_precision, rank)
    unit_names = select_unit_roots(module, auto_wrap_policy, skip=earlier.keys())
    managed = {name: _managed_param_ids(tree) for name, tree in earlier.items()}
    plans = partition(module, unit_names, managed, rank)
    if check_consistency:
        strategy_line = _strategy_line(strategy, group, sharding_factor, hybrid_groups)
        check_same_on_all_ranks(
            structure_lines(plans, strategy_line),
            group,
            target or _CPU,
            "built different models or sharding options",
            "Build the same model (same code, config and dtypes) and pass the same "
            "fully_shard options on every rank.",
        )
    build = _UnitBuild(
        groups=resolve_groups(strategy, group, sharding_factor, hybrid_groups, device_mesh),
        process_group=group,
        strategy=strategy,
        mixed_precision=mixed_precision,
        device=target,
        offload=cpu_offload is not None and cpu_offload.params,
        param_init_fn=param_init_fn,
        seed=torch.initial_seed() if init_seed is None else init_seed,
        sync_module_states=sync_module_states,
        check_consistency=check_consistency,
        check_weights=check_weights,
        backward_prefetch=backward_prefetch,
        forward_prefetch=forward_prefetch,
    )
    tree = ShardTree(module, group)
    tree.rate_limiter = RateLimiter(DEFAULT_LIMIT if limit_all_gathers else None)
    for name, sub_tree in earlier.items():
        tree.adopt(sub_tree, prefix=name, mixed_precision=mixed_precision)
    for plan in plans:
        unit = _build_unit(plan, build, rank)
        if unit is not None:
            install(unit, tree)
    module.__dict__[TREE_ATTR] = tree
    return module


@dataclass(frozen=True)
class _UnitBuild:
    """How every unit of one ``fully_shard`` call is built (its options, resolved)."""

    groups: ShardGroups
    process_group: dist.ProcessGroup
    strategy: ShardingStrategy
    mixed_precision: MixedPrecision | None
    device: torch.device | None  # where full tensors are materialized and computed on
    offload: bool  # shards live on the CPU
    param_init_fn: ParamInitFn | None
    seed: int
    sync_module_states: bool
    check_consistency: bool
    check_weights: bool
    backward_prefetch: BackwardPrefetch | None
    forward_prefetch: bool

    @property
    def compute_device(self) -> torch.device:
        return self.device or _CPU

    @property
    def master_device(self) -> torch.device:
        return _CPU if self.offload else self.compute_device


def _build_unit(plan: UnitPlan, build: _UnitBuild, rank: int) -> Unit | None:
    """Materialize (or receive) one unit's values, check them, and shard them."""
    policy = build.mixed_precision or MixedPrecision()
    # Allocate the shards first: the unit's full tensors then meet nothing else large.
    flat_params = [
        FlatParameter(
            params,
            build.groups,
            build.master_device,
            compute_dtype=dtype,
            reduce_dtype=policy.gradient_reduce_dtype(dtype),
            compute_device=build.compute_device,
        )
        for params, dtype in _split_by_compute_dtype(plan.groups, policy)
    ]
    _prepare(plan, build, rank)
    _cast_buffers(plan, policy.buffer_dtype)
    if build.check_consistency:
        check_same_on_all_ranks(
            value_lines(plan, with_params=build.check_weights),
            build.process_group,
            build.compute_device,
            "hold different values",
            "Start every rank from the same weights: seed identically before building "
            "the model, load the same checkpoint, or pass sync_module_states=True.",
        )
    for flat in flat_params:
        flat.load_shard()
    if not flat_params:
        return None
    return Unit(
        plan.module,
        plan.fqn,
        flat_params,
        build.strategy,
        plan.modules,
        build.mixed_precision,
        build.backward_prefetch,
        build.forward_prefetch,
    )


def _split_by_compute_dtype(
    groups: list[list[OriginalParam]], policy: MixedPrecision
) -> list[tuple[list[OriginalParam], torch.dtype]]:
    """Parameters of ``keep_full_precision`` modules compute apart, in their own dtype."""
    keep = tuple(policy.keep_full_precision)
    split: list[tuple[list[OriginalParam], torch.dtype]] = []
    for params in groups:
        by_dtype: dict[torch.dtype, list[OriginalParam]] = {}
        for orig in params:
            full = any(isinstance(m, keep) for m, _ in orig.usages) if keep else False
            dtype = policy.compute_dtype(orig.param.dtype, full)
            by_dtype.setdefault(dtype, []).append(orig)
        split += [(members, dtype) for dtype, members in by_dtype.items()]
    return split


def _cast_buffers(plan: UnitPlan, dtype: torch.dtype | None) -> None:
    if dtype is None:
        return
    for _, module in plan.modules:
        for name, buf in module._buffers.items():
            if buf is not None and buf.is_floating_point():
                module._buffers[name] = buf.to(dtype)


def _prepare(plan: UnitPlan, build: _UnitBuild, rank: int) -> None:
    """Materialize, initialize or receive the unit's full values, just before sharding."""

    def init(name: str, module: nn.Module) -> None:
        init_module(module, name, build.param_init_fn, build.seed)

    if not build.sync_module_states:
        materialize_unit(plan, build.device, init, rank)
        return
    source = dist.get_rank(build.process_group) == 0
    # Rank 0 must end with real values (its own init if it built on meta); the others
    # only need storage for what rank 0 sends.
    materialize_unit(plan, build.device, init if source else None, rank)
    broadcast_unit(plan, build.process_group)


def _target_device(
    module: nn.Module, device: torch.device | str | None, rank: int
) -> torch.device | None:
    """Where the units' tensors must end: ``device``, else where the real ones are."""
    if device is not None:
        return torch.device(device)
    tensors = [*module.parameters(), *module.buffers()]
    real = {t.device for t in tensors if not t.is_meta}
    if len(real) > 1:
        named: dict[torch.device, str] = {}
        for name, t in [*module.named_parameters(), *module.named_buffers()]:
            named.setdefault(t.device, name)
        found = ", ".join(f"'{n}' on {d}" for d, n in sorted(named.items(), key=str))
        raise ValueError(
            f"flatshard.fully_shard: parameters and buffers are on several devices (rank "
            f"{rank}), e.g. {found}; move the model to one device (module.to(device)) or "
            "pass device=... to move each unit there as it is sharded."
        )
    if real:
        return next(iter(real))
    return default_device() if tensors else None


def _strategy_line(
    strategy: ShardingStrategy,
    group: dist.ProcessGroup,
    sharding_factor: int | None,
    hybrid_groups: tuple[dist.ProcessGroup, dist.ProcessGroup] | None,
) -> str:
    line = f"strategy {strategy.name} over {dist.get_world_size(group)} ranks"
    if sharding_factor is not None:
        line += f", sharding_factor {sharding_factor}"
    if hybrid_groups is not None:
        sizes = [dist.get_world_size(g) for g in hybrid_groups]
        line += f", hybrid groups of {sizes[0]} x {sizes[1]}"
    return line


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


def _check_inherited_precision(
    earlier: dict[str, ShardTree], policy: MixedPrecision | None, rank: int
) -> None:
    """Units of earlier calls without a policy inherit this one, except keep_full_precision.

    Modules kept in full precision need FlatParameters of their own, and a unit's
    FlatParameters were made by the earlier call: silently computing them in low
    precision would ignore what the user asked for.
    """
    if policy is None or policy.param_dtype is None or not policy.keep_full_precision:
        return
    keep = tuple(policy.keep_full_precision)
    for prefix, tree in earlier.items():
        for runtime in tree.units:
            unit = runtime.unit
            if unit.mixed_precision is not None:
                continue
            modules = [unit.module, *(m for _, m in unit.inner_modules)]
            kept = sorted({type(m).__name__ for m in modules if isinstance(m, keep)})
            if kept:
                label = f"{prefix}.{unit.fqn}" if unit.fqn else prefix
                raise ValueError(
                    f"flatshard.fully_shard (rank {rank}): unit '{label}' was sharded by an "
                    "earlier fully_shard call without mixed_precision, so it would compute its "
                    f"{', '.join(kept)} parameters in {policy.param_dtype} although "
                    "keep_full_precision names them. Pass the same mixed_precision to the "
                    f"earlier call on '{prefix}'."
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
