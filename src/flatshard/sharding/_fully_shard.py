"""The public entry point: ``fully_shard``."""

from __future__ import annotations

import warnings
from dataclasses import dataclass
from typing import TypeVar

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh

from flatshard.comm._agreement import (
    check_same_on_all_ranks,
    join_name,
    lines_if_different,
    raise_differences,
)
from flatshard.comm._collectives import has_cpu_backend
from flatshard.comm._mesh import ShardGroups, ShardingStrategy, model_group, resolve_groups
from flatshard.comm._watchdog import Tag, tagged, watchdog
from flatshard.flat._flat_param import FlatParamGroup, GroupSpec
from flatshard.flat._lookup_options import LOOKUPS
from flatshard.flat._mixed_precision import CPUOffload, MixedPrecision, host_of
from flatshard.flat._partition import (
    AutoWrapPolicy,
    OriginalParam,
    UnitMembers,
    is_within,
    partition,
    select_unit_roots,
)
from flatshard.flat._placement import (
    ROWS,
    PlacementRule,
    Rows,
    ShardPlacement,
    kept_in_part,
    left_alone,
    placement_rule,
    split_by_placement,
)
from flatshard.flat._tensor_parallel import global_shapes, localize
from flatshard.flat._transport import SCALED
from flatshard.placements._row_sparse import RowSparse
from flatshard.runtime._by_hand import LOCKSTEP_MARK
from flatshard.runtime._changes import DIFFERED, awaits_load, mark_awaiting
from flatshard.runtime._configuration import (
    UnitConfig,
    config_lines,
    describe,
    structure_lines,
    value_lines,
)
from flatshard.runtime._hooks import install, install_output_cast, register_entry_point
from flatshard.runtime._prefetch import DEFAULT_LIMIT, Prefetch, RateLimiter
from flatshard.runtime._step import CONTEXT_ATTR, StepContext, context_of
from flatshard.runtime._torch_utilities import watch_torch_utilities
from flatshard.runtime._unit import Unit, owner_of, unit_of
from flatshard.sharding._init import (
    InitOptions,
    ParamInitFn,
    broadcast_unit,
    default_device,
    init_module,
    materialize_unit,
    with_index,
)
from flatshard.sharding._skip_init import skip_init

M = TypeVar("M", bound=nn.Module)
_CPU = torch.device("cpu")


def fully_shard(
    module: M,
    *,
    auto_wrap_policy: AutoWrapPolicy = None,
    strategy: ShardingStrategy | str = ShardingStrategy.FULL_SHARD,
    process_group: dist.ProcessGroup | DeviceMesh | None = None,
    sharding_factor: int | None = None,
    mixed_precision: MixedPrecision | None = None,
    cpu_offload: CPUOffload | None = None,
    device: torch.device | str | None = None,
    param_init_fn: ParamInitFn | None = None,
    init: InitOptions | None = None,
    prefetch: Prefetch | None = None,
    placement: PlacementRule = None,
    **renamed: object,
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
        strategy: FULL_SHARD (ZeRO-3), SHARD_GRAD_OP (ZeRO-2: no second all-gather in
            backward), NO_SHARD (DDP), HYBRID_SHARD / HYBRID_SHARD_ZERO2 (shard inside
            groups of F ranks, replicate across the W / F groups), HYBRID_SHARD_OPTIM
            (HYBRID_SHARD's parameters, the gradients and optimizer state cut across all
            W ranks: hybrid's traffic with full sharding's optimizer memory). A
            ``flatshard.ShardingStrategy``, its name in any case, or "zero3", "fsdp",
            "zero2", "ddp", "hsdp".
        process_group: where to shard: the W ranks that train together as a process group
            or a 1-D ``DeviceMesh`` (default: the world), or, for the hybrid strategies, a
            2-D ``DeviceMesh`` of (replicate, shard) dims over the world.
        sharding_factor: F for the hybrid strategies, instead of a 2-D mesh; by default
            torchrun's LOCAL_WORLD_SIZE (shard inside a host), else W.
        mixed_precision: dtypes of all-gather/compute, reduction and buffers
            (``flatshard.MixedPrecision``); the sharded master parameters keep theirs.
        cpu_offload: ``flatshard.CPUOffload(params=True)`` keeps the sharded parameters and
            their gradients on the CPU (the optimizer steps there); compute runs on
            ``device``.
        device: where meta parameters are materialized (default: the current accelerator,
            else the CPU); parameters on another device are moved there unit by unit.
        param_init_fn: initializes one module's own meta parameters and buffers
            (default: the module's ``reset_parameters()``); see ``flatshard.init_weights``.
        init: seed, rank-0 broadcast and startup checks (``flatshard.InitOptions``).
        prefetch: how far ahead units are all-gathered, and the rate limiter
            (``flatshard.Prefetch``; default: backward BACKWARD_PRE, forward on, limited).
        placement: how each parameter lies across the shard group: one placement for
            every parameter it serves, or a rule ``(name, parameter) -> placement`` (None:
            ``Rows()``; ``name`` relative to ``module``). ``flatshard.Rows()`` (default):
            each rank a slice of whole rows. ``flatshard.Whole()``: each parameter whole
            in one rank's shard, for optimizers that update a matrix as a whole (Muon,
            Adafactor, Shampoo); ``lambda name, p: flatshard.Whole() if p.ndim == 2 else
            None`` keeps only the matrices whole. ``flatshard.RowSparse()``: an
            ``nn.Embedding`` weight looked up row-sparse (each forward fetches its tokens'
            rows, not the whole table); given for the whole model it serves every embedding
            weight. Not with ``max_norm``, tensor-parallel tables, HYBRID_SHARD_OPTIM or a
            communication hook.
    """
    _check_distributed()
    placement = _renamed_options(module, placement, renamed)
    strategy = ShardingStrategy.parse(strategy)
    group = model_group(process_group)
    with tagged(Tag("fully_shard")):
        init = init or InitOptions()
        prefetch = prefetch or Prefetch()
        rank = dist.get_rank()
        _check_not_sharded(module, rank)
        target = _target_device(module, device, rank)
        _check_backend_reaches(target, group, rank)
        earlier = _earlier_contexts(module)
        _check_inherited_precision(earlier, mixed_precision, rank)
        unit_names = select_unit_roots(module, auto_wrap_policy, skip=earlier.keys())
        managed = {name: _managed_param_ids(context) for name, context in earlier.items()}
        localize(module, group, rank)  # DTensor (TP) parameters: their local tensors
        units = partition(module, unit_names, managed, rank)
        placements = _placements(units, placement, strategy, rank)
        placements = _tables_exact(units, placements, mixed_precision)
        config = UnitConfig(strategy, mixed_precision, prefetch)
        _agree_on_checks(group, init)
        if init.check_consistency:
            check_same_on_all_ranks(
                structure_lines(
                    units,
                    _option_lines(
                        config, group, sharding_factor, cpu_offload, init, units, param_init_fn
                    ),
                    placements,
                ),
                group,
                target or _CPU,
                "built different models or sharding options",
                "Build the same model (same code, config and dtypes) and pass the same "
                "fully_shard options on every rank.",
            )
        _check_split_options(strategy, cpu_offload, rank)
        groups = resolve_groups(strategy, process_group, sharding_factor)
        _take_parts(units, placements, group, groups, init, rank)
        build = _UnitBuild(
            groups=groups,
            process_group=group,
            config=config,
            device=target,
            offload=cpu_offload is not None and cpu_offload.params,
            placements=placements,
            param_init_fn=param_init_fn,
            init=init,
        )
        _refuse_lookup_options(units, build)
        limiter = RateLimiter(DEFAULT_LIMIT if prefetch.limit_all_gathers else None)
        context = StepContext(module, group, limiter)
        watch_torch_utilities(context)
        for name, sub_context in earlier.items():
            context.adopt(sub_context, prefix=name, mixed_precision=mixed_precision)
        context.left_alone += [o.param for m in units for o in left_alone(m.originals, placements)]
        for members in units:
            unit = _build_unit(members, build, rank)
            if unit is not None:
                context.add(unit)
                install(unit)
        if mixed_precision is not None and mixed_precision.output_dtype is not None:
            install_output_cast(module, mixed_precision.output_dtype)
        module.__dict__[CONTEXT_ATTR] = context
        for generating in [module, *_generation_models(module)]:  # see LOCKSTEP_MARK
            generating.__dict__[LOCKSTEP_MARK] = True
        _generate_gathers_the_root(module)
        return module


def _generation_models(module: nn.Module) -> list[nn.Module]:
    """The transformers models (``GenerationMixin``) inside ``module``, itself included."""
    return [
        m
        for m in module.modules()
        if any(cls.__name__ == "GenerationMixin" for cls in type(m).__mro__)
    ]


def _generate_gathers_the_root(module: nn.Module) -> None:
    """[Note: a wrapper's generate]
    A transformers model's ``generate`` calls the model itself for each token, so the
    root unit's hooks gather it. A wrapper's need not: peft's ``PeftModel`` hands
    ``generate`` to the transformers model it wraps, whose forward the root's hooks never
    see, and the root's own parameters (the embeddings, the head) would be read sharded.
    So the ``generate`` of a root that wraps a transformers model without being one is
    made an entry point of the root (``register_entry_point``), as a user would; the
    ranks stay in step per token because the wrapped model carries ``LOCKSTEP_MARK`` too
    (transformers looks at it, not at the wrapper). Only those modules: torch.compile
    takes a module so marked for one of FSDP1's and breaks its graph there."""
    generate = getattr(type(module), "generate", None)
    if not callable(generate) or unit_of(module) is None:
        return
    inner = _generation_models(module)
    if inner and inner[0] is not module:
        register_entry_point(module, "generate")


def _agree_on_checks(group: dist.ProcessGroup, init: InitOptions) -> None:
    """The startup check's own switches, agreed through the store before it runs: a rank
    that skips the check (``check_consistency=False``) would send its first collective
    where the others send the check's digest (gloo aborts on the sizes), and a rank that
    alone compares weights would report "different values" that are not."""
    dog = watchdog()
    if dog is None or group.size() == 1:
        return
    switches = ", ".join(
        f"{name}={getattr(init, name)!r}"
        for name in ("check_consistency", "check_weights", "sync_module_states")
    )
    dog.entry(group, Tag(f"fully_shard(InitOptions: {switches})"))


def _check_split_options(strategy: ShardingStrategy, offload: CPUOffload | None, rank: int) -> None:
    """HYBRID_SHARD_OPTIM gathers the replicas' rows into the shard after each step: not
    with offloaded shards (host memory, the optimizer steps there)."""
    if not strategy.shards_optimizer_across_replicas:
        return
    if offload is not None and offload.params:
        raise ValueError(
            f"flatshard.fully_shard: HYBRID_SHARD_OPTIM does not combine with CPUOffload "
            f"(rank {rank}): its shards are refreshed across the replicas on the device. "
            "Use HYBRID_SHARD with CPUOffload, or HYBRID_SHARD_OPTIM without it."
        )


@dataclass(frozen=True)
class _UnitBuild:
    """How every unit of one ``fully_shard`` call is built (its options, resolved)."""

    groups: ShardGroups
    process_group: dist.ProcessGroup
    config: UnitConfig
    device: torch.device | None  # where full tensors are materialized and computed on
    offload: bool  # shards live on the CPU
    placements: dict[str, ShardPlacement]  # each parameter's, by name
    param_init_fn: ParamInitFn | None
    init: InitOptions

    @property
    def compute_device(self) -> torch.device:
        return self.device or _CPU

    @property
    def master_device(self) -> torch.device:
        return host_of(self.compute_device) if self.offload else self.compute_device


def _build_unit(members: UnitMembers, build: _UnitBuild, rank: int) -> Unit | None:
    """Materialize (or receive) one unit's values, check them, and shard them."""
    policy = build.config.mixed_precision or MixedPrecision()
    # Allocate the shards first: the unit's full tensors then meet nothing else large.
    flat_params = [
        FlatParamGroup(
            group,
            placement.shard_groups(build.groups, group),
            GroupSpec(
                master_device=build.master_device,
                compute_device=build.compute_device,
                compute_dtype=dtype,
                reduce_dtype=policy.gradient_reduce_dtype(dtype),
                offload=build.offload,
                gather_dtype=gather,
            ),
            placement,
        )
        for params, dtype, gather in _split_by_compute_dtype(members.groups, policy)
        for placement, group in split_by_placement(params, build.placements)
    ]
    built_here = frozenset(o.fqn for o in members.originals if o.param.is_meta)
    _prepare(members, build, rank)
    _cast_buffers(members, policy.buffer_dtype)
    if build.init.check_consistency:
        _check_values(members, build, built_here)
    for flat in flat_params:
        flat.load_shard()
    if not flat_params:
        return None
    unit = Unit(members.module, members.fqn, flat_params, members.modules, build.config)
    unit.awaiting_load = _awaiting_load(members)
    return unit


def _check_values(members: UnitMembers, build: _UnitBuild, built_here: frozenset[str]) -> None:
    """The unit's buffers and parameters compared across ranks: a difference raises on
    every rank, but parameters that only need a load to be one model again are marked as
    awaiting one ([Note: weights that differ across ranks]). There, the parameters
    ``fully_shard`` built on meta are not read (equal by construction: an agreed seed);
    where a difference raises at once (replicas, ``check_weights=True``) they are, as a
    ``param_init_fn`` may still load on one rank only."""
    now = build.init.refuses_weights_now(build.groups)
    # an Unmanaged parameter's value is each rank's own (it is never sharded)
    own = frozenset(o.fqn for o in left_alone(members.originals, build.placements))
    lines = value_lines(
        members, build.init.compares_weights(), skip=own if now else own | built_here
    )
    fix = (
        "Start every rank from the same weights: seed identically before building the "
        "model, load the same checkpoint, or pass "
        "init=flatshard.InitOptions(sync_module_states=True)."
    )
    group, device = build.process_group, build.compute_device
    every = lines_if_different(lines, group, device)
    if every is None:
        return
    shared = set(every[0]).intersection(*every[1:])
    differing = {line for theirs in every for line in theirs} - shared
    names = {line.split("'")[1] for line in differing if line.startswith("parameter '")}
    only_params = all(line.startswith("parameter '") for line in differing)
    if only_params and not now:
        for o in members.originals:
            if o.fqn in names:
                mark_awaiting(o.param, DIFFERED)
        return
    if any(line.startswith("buffer '") for line in differing):
        fix += (
            " A buffer whose value is each rank's own by design (a per-rank offset or "
            "seed): pass init=flatshard.InitOptions(check_consistency=False), which leaves "
            "the values unchecked (sync_module_states would overwrite it with rank 0's)."
        )
    raise_differences(every, "hold different values", fix, "fully_shard")


def _take_parts(
    units: list[UnitMembers],
    placements: dict[str, ShardPlacement],
    group: dist.ProcessGroup,
    groups: ShardGroups,
    init: InitOptions,
    rank: int,
) -> None:
    """Parameters whose placement keeps a part on each rank (experts) become that part."""
    kept = [o for m in units for o in kept_in_part(m.originals, placements)]
    if kept and init.sync_module_states:
        raise ValueError(
            f"flatshard.fully_shard: '{kept[0].fqn}' is placed {placements[kept[0].fqn]!r}, "
            f"each rank keeping its own experts (rank {rank}), and sync_module_states "
            "would give every rank rank 0's; build the model with the same seed on every "
            "rank, or on the meta device (each rank initializes the whole weight and keeps "
            "its part)."
        )
    by_id = {id(o.param): o for m in units for o in m.originals}
    for orig in kept:
        siblings = [
            (by_id[id(p)], placements[by_id[id(p)].fqn])
            for module, _ in orig.usages
            for p in module._parameters.values()
            if p is not None and id(p) in by_id and p is not orig.param
        ]
        refusal = placements[orig.fqn].part_refusal(orig, siblings)
        if refusal is not None:
            raise ValueError(f"flatshard.fully_shard: '{orig.fqn}' (rank {rank}): {refusal}.")
    for orig in kept:
        placements[orig.fqn].take_part(orig, group, groups, rank)


def _awaiting_load(members: UnitMembers) -> list[tuple[str, torch.Tensor]]:
    """The unit's tensors ``skip_init`` left for ``load_safetensors`` (runtime/_changes.py)."""
    named: list[tuple[str, torch.Tensor | None]] = [(o.fqn, o.param) for o in members.originals]
    named += [
        (join_name(m, b), t) for m, module in members.modules for b, t in module._buffers.items()
    ]
    return [(name, t) for name, t in named if t is not None and awaits_load(t)]


def _split_by_compute_dtype(
    groups: list[list[OriginalParam]], policy: MixedPrecision
) -> list[tuple[list[OriginalParam], torch.dtype, torch.dtype | None]]:
    """Parameters of ``keep_full_precision`` modules compute apart, in their own dtype, and
    are gathered unencoded: (members, compute dtype, the policy's gather dtype for them)."""
    keep = tuple(policy.keep_full_precision)
    split: list[tuple[list[OriginalParam], torch.dtype, torch.dtype | None]] = []
    for params in groups:
        by_dtype: dict[tuple[torch.dtype, torch.dtype | None], list[OriginalParam]] = {}
        for orig in params:
            full = any(isinstance(m, keep) for m, _ in orig.usages) if keep else False
            dtype = policy.compute_dtype(orig.param.dtype, full)
            gather = None if full or not orig.param.is_floating_point() else policy.gather_dtype
            by_dtype.setdefault((dtype, gather), []).append(orig)
        split += [(same, dtype, gather) for (dtype, gather), same in by_dtype.items()]
    return split


def _cast_buffers(members: UnitMembers, dtype: torch.dtype | None) -> None:
    if dtype is None:
        return
    for _, module in members.modules:
        for name, buf in module._buffers.items():
            if buf is not None and buf.is_floating_point():
                module._buffers[name] = cast = buf.to(dtype)
                if awaits_load(buf):
                    mark_awaiting(cast)


def _prepare(members: UnitMembers, build: _UnitBuild, rank: int) -> None:
    """Materialize, initialize or receive the unit's full values, just before sharding."""

    seed = torch.initial_seed() if build.init.seed is None else build.init.seed

    def init(name: str, module: nn.Module) -> None:
        with global_shapes(module):  # [Note: initializing TP parameters]
            init_module(module, name, build.param_init_fn, seed)

    if not build.init.sync_module_states:
        materialize_unit(members, build.device, init, rank)
        return
    source = dist.get_rank(build.process_group) == 0
    # Rank 0 must end with real values (its own init if it built on meta); the others
    # only need storage for what rank 0 sends.
    materialize_unit(members, build.device, init if source else None, rank)
    broadcast_unit(members, build.process_group)


def _target_device(
    module: nn.Module, device: torch.device | str | None, rank: int
) -> torch.device | None:
    """Where the units' tensors must end: ``device``, else where the real ones are."""
    if device is not None:
        try:
            wanted = torch.device(device)
        except RuntimeError as error:
            raise ValueError(
                f"flatshard.fully_shard: device={device!r} is not a device name torch knows "
                f"(rank {rank}): {str(error).splitlines()[0]} (e.g. 'cpu', 'cuda', 'cuda:1')"
            ) from None
        if wanted.type not in ("cpu", "meta") and not _device_exists(wanted):
            here = (
                torch.accelerator.current_accelerator()
                if torch.accelerator.is_available()
                else None
            )
            raise ValueError(
                f"flatshard.fully_shard: device={device!r} (rank {rank}), but this process has "
                f"no such device (its accelerator: {here.type if here else 'none'}, "
                f"{torch.accelerator.device_count()} device(s)). Pass a device it has "
                f"(device='{here.type if here else 'cpu'}'), or leave device out: the "
                "model's own device, else the current accelerator, else the CPU."
            )
        return with_index(wanted)
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


def _device_exists(device: torch.device) -> bool:
    """Whether this process can allocate on ``device`` (its type, and its index if given)."""
    accelerator = (
        torch.accelerator.current_accelerator() if torch.accelerator.is_available() else None
    )
    if accelerator is None or accelerator.type != device.type:
        return False
    return device.index is None or device.index < torch.accelerator.device_count()


def _check_backend_reaches(
    target: torch.device | None, group: dist.ProcessGroup, rank: int
) -> None:
    """A model that stays on the CPU over a group with no CPU backend (NCCL) is an error."""
    if target is None or target.type != "cpu" or group.size() == 1:
        return  # at one rank nothing is communicated
    if not has_cpu_backend(group):
        raise ValueError(
            f"flatshard.fully_shard: the model is on the CPU (rank {rank}) but the process "
            f"group's backend ({dist.get_backend(group)}) cannot communicate CPU tensors. "
            "Pass device='cuda' (each unit is moved there as it is sharded), move the model "
            "to the GPU first, or init_process_group('cpu:gloo,cuda:nccl') to keep it on "
            "the CPU."
        )


def _option_lines(
    config: UnitConfig,
    group: dist.ProcessGroup,
    sharding_factor: int | None,
    offload: CPUOffload | None,
    init: InitOptions,
    units: list[UnitMembers],
    param_init_fn: ParamInitFn | None,
) -> list[str]:
    """The options every rank must pass alike: the units' agreed configuration
    ([Note: the agreed configuration]) and what else decides collectives or values. Dtypes
    matter beyond the numbers: ranks gathering in different dtypes send payloads of
    different sizes, which the backend aborts on rather than naming."""
    root = next((m.module for m in units if not m.fqn), None)  # the call's module
    lines = [f"fully_shard of a {type(root).__qualname__} with {len(units)} unit(s)"]
    lines += [f"world of {dist.get_world_size(group)} ranks, sharding_factor={sharding_factor}"]
    lines += [f"cpu_offload={describe(offload)}", *config_lines(config)]
    on_meta = any(o.param.is_meta and not awaits_load(o.param) for m in units for o in m.originals)
    initialized = not init.sync_module_states and param_init_fn is not skip_init
    if on_meta and initialized:  # every rank initializes the whole weights from the seed
        seed = torch.initial_seed() if init.seed is None else init.seed
        lines.append(
            f"meta parameters initialized from seed {seed} (InitOptions(seed=...), else "
            "torch.initial_seed(): seed every rank alike before building the model)"
        )
    return lines


def _placements(
    units: list[UnitMembers], rule: PlacementRule, strategy: ShardingStrategy, rank: int
) -> dict[str, ShardPlacement]:
    """Each parameter's placement by name, as ``rule`` chooses; an error for a parameter
    its placement cannot serve."""
    chosen: dict[str, ShardPlacement] = {}
    for members in units:
        for orig in members.originals:
            if rule is None:
                placement: ShardPlacement | None = ROWS
            elif isinstance(rule, ShardPlacement):
                placement = rule if rule.serves(orig) else ROWS
            elif callable(rule):
                placement = rule(orig.fqn, orig.param)
            else:
                raise TypeError(
                    "flatshard.fully_shard: placement must be a placement (flatshard.Rows(), "
                    "flatshard.Whole(), flatshard.RowSparse()) or a callable (name, "
                    f"parameter) -> placement, got {rule!r}"
                )
            placement = ROWS if placement is None else placement
            if not isinstance(placement, ShardPlacement):
                raise TypeError(
                    f"flatshard.fully_shard: the placement rule returned {placement!r} for "
                    f"'{orig.fqn}' (rank {rank}); return flatshard.Rows(), flatshard.Whole(), "
                    "flatshard.RowSparse() or None (Rows)."
                )
            refusal = placement.refusal(orig, strategy)
            if refusal is not None:
                raise ValueError(
                    f"flatshard.fully_shard: placement {placement!r} cannot serve "
                    f"'{orig.fqn}' (rank {rank}): {refusal}."
                )
            chosen[orig.fqn] = placement
    return chosen


def _tables_exact(
    units: list[UnitMembers],
    placements: dict[str, ShardPlacement],
    policy: MixedPrecision | None,
) -> dict[str, ShardPlacement]:
    """[Note: embedding tables gathered exact]
    Under a one-byte gather dtype (int8, fp8), the embedding tables (and a head tied to
    one) travel in the compute dtype, unless their placement names a gather dtype of its
    own (``Rows(gather_dtype=torch.int8)`` quantizes them too). A table's rows are looked
    up one token at a time and a tied head's logits read every row: on the byte GPT,
    quantizing them cost more held-out loss than all the blocks' matrices together
    (docs/performance.md, "Quantized all-gather"). The API, the CLI, the planner and the
    Lightning strategy all build through here, so the option means the same everywhere."""
    if policy is None or policy.gather_dtype not in SCALED:
        return placements
    exact = dict(placements)
    for members in units:
        for orig in members.originals:
            table = any(isinstance(m, nn.Embedding) and key == "weight" for m, key in orig.usages)
            if table and placements[orig.fqn] == ROWS:
                exact[orig.fqn] = Rows(gather_dtype=policy.param_dtype or orig.param.dtype)
    return exact


def _renamed_options(
    module: nn.Module, placement: PlacementRule, renamed: dict[str, object]
) -> PlacementRule:
    """``whole_params`` and ``sparse_embeddings``, the two options ``placement`` replaced,
    still work for a while (with a warning giving the new spelling); any other unknown
    keyword is the TypeError Python gives."""
    unknown = sorted(set(renamed) - {"whole_params", "sparse_embeddings"})
    if unknown:
        raise TypeError(f"fully_shard() got an unexpected keyword argument '{unknown[0]}'")
    whole, sparse = renamed.get("whole_params", False), renamed.get("sparse_embeddings", False)
    if not whole and not sparse:
        return placement
    if placement is not None:
        raise TypeError(
            "flatshard.fully_shard: pass placement= alone; whole_params and "
            "sparse_embeddings are its old spellings."
        )
    if not callable(whole) and not isinstance(whole, bool):
        raise TypeError(
            "flatshard.fully_shard: whole_params must be True, False or a callable "
            f"(name, parameter) -> bool, got {whole!r}"
        )
    warnings.warn(
        "flatshard.fully_shard: whole_params= and sparse_embeddings= became one option, "
        "placement=: whole_params=True -> placement=flatshard.Whole(); whole_params=rule -> "
        "placement=lambda name, p: flatshard.Whole() if rule(name, p) else None; "
        "sparse_embeddings=True -> placement=flatshard.RowSparse().",
        FutureWarning,
        stacklevel=3,
    )
    return placement_rule(module, whole, RowSparse() if sparse else None)


def _refuse_lookup_options(units: list[UnitMembers], build: _UnitBuild) -> None:
    """Every embedding's options, before any unit is built (flat/_lookup_options.py)."""
    sharded = build.groups.shard is not None
    for members in units:
        for orig in members.originals:
            for module, _ in orig.usages:
                if isinstance(module, LOOKUPS):
                    trainable = orig.param.requires_grad
                    placement = build.placements[orig.fqn]
                    placement.check_lookup_options(orig.fqn, module, trainable, sharded)


def _check_distributed() -> None:
    if not dist.is_available() or not dist.is_initialized():
        raise RuntimeError(
            "flatshard.fully_shard needs torch.distributed: call "
            "torch.distributed.init_process_group(backend=...) first (torchrun sets the "
            "environment it needs; for one process use world_size=1)."
        )


def _check_not_sharded(module: nn.Module, rank: int) -> None:
    if context_of(module) is not None or unit_of(module) is not None:
        raise ValueError(
            f"flatshard.fully_shard: {type(module).__name__} is already sharded (rank "
            f"{rank}); call fully_shard once per module."
        )
    owner = owner_of(module)
    if owner is not None:
        unit, name = owner
        raise ValueError(
            f"flatshard.fully_shard: {type(module).__name__} ('{name}') is inside the unit "
            f"'{unit.fqn or type(unit.module).__name__}' that an earlier fully_shard call "
            f"sharded (rank {rank}), and its parameters are that unit's. Call fully_shard "
            "on inner modules before the modules around them, or let one call's "
            "auto_wrap_policy choose both (e.g. flatshard.SublayerPolicy({Block}))."
        )


def _check_inherited_precision(
    earlier: dict[str, StepContext], policy: MixedPrecision | None, rank: int
) -> None:
    """Units of earlier calls without a policy inherit this one, except keep_full_precision.

    Modules kept in full precision need flat parameter groups of their own, and a unit's
    flat parameter groups were made by the earlier call: silently computing them in low
    precision would ignore what the user asked for.
    """
    lowered = policy is not None and (policy.param_dtype or policy.gather_dtype) is not None
    if policy is None or not lowered or not policy.keep_full_precision:
        return
    keep = tuple(policy.keep_full_precision)
    for prefix, context in earlier.items():
        for unit in context.units:
            if unit.config.mixed_precision is not None:
                continue
            modules = [unit.module, *(m for _, m in unit.inner_modules)]
            kept = sorted({type(m).__name__ for m in modules if isinstance(m, keep)})
            if kept:
                label = join_name(prefix, unit.fqn)
                raise ValueError(
                    f"flatshard.fully_shard (rank {rank}): unit '{label}' was sharded by an "
                    "earlier fully_shard call without mixed_precision, so it would compute or "
                    f"gather its {', '.join(kept)} parameters in "
                    f"{policy.param_dtype or policy.gather_dtype} although "
                    "keep_full_precision names them. Pass the same mixed_precision to the "
                    f"earlier call on '{prefix}'."
                )


def _earlier_contexts(module: nn.Module) -> dict[str, StepContext]:
    """Step contexts of earlier fully_shard calls on submodules, outermost only."""
    found = {
        name: context
        for name, sub in module.named_modules()
        if name and (context := context_of(sub)) is not None
    }
    return {n: c for n, c in found.items() if not is_within(n, [o for o in found if o != n])}


def _managed_param_ids(context: StepContext) -> set[int]:
    """The parameters an earlier call took: its flat groups' and those it left alone."""
    return {
        id(orig.param)
        for unit in context.units
        for flat in unit.flat_params
        for orig in flat.originals
    } | {id(p) for p in context.left_alone}
