"""Units: which modules become units, which unit owns each of the user's parameters, and
how a unit's parameters are grouped.

Auto-wrap policies (``SizePolicy``, ``SublayerPolicy``, a callable) choose which
submodules become units (paper mechanism 14).

An ``OriginalParam`` is one of the user's parameters as a flat group and its placement see
it: the parameter, its first name, and every place a module registers it. A parameter
belongs to the deepest unit whose module contains every module that registers it, so tied
parameters (an embedding shared with the LM head) land in their lowest common ancestor unit
and are flattened once (paper mechanism 15). Inside a unit, parameters are grouped by
(requires_grad, dtype), one flat parameter group per group, in first-seen order.
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Mapping
from dataclasses import dataclass, field

import torch
from torch import nn

from flatshard.comm._agreement import join_name
from flatshard.flat._tensor_parallel import SplitParam, tensor_parallel


@dataclass(frozen=True)
class SizePolicy:
    """Make a unit of every module holding at least ``min_params`` parameter elements.

    Counted bottom-up: elements already owned by an inner unit do not count again, so a
    large block becomes a unit and its parent only counts what is left.
    """

    min_params: int

    def __post_init__(self) -> None:
        if not isinstance(self.min_params, int) or self.min_params < 1:
            raise ValueError(
                f"SizePolicy(min_params=...) must be a positive int, got {self.min_params!r}"
            )


@dataclass(frozen=True)
class SublayerPolicy:
    """Finer units than ``blocks`` makes: its units, each of their children that holds at
    least ``min_share`` of its unit's parameters (the attention and the MLP of a
    transformer block; the block keeps the rest, its norms), and each module outside them
    that holds no unit and at least ``min_share`` of an average unit's parameters, tied to
    nothing (an untied input embedding, an output head).

    Fewer parameters are gathered at once, for more and smaller collectives: ``flatshard
    plan --memory-budget`` weighs the two and recommends it (``--units sublayers``) where
    it makes a faster setup fit.
    """

    blocks: AutoWrapPolicy
    min_share: float = 0.1

    def __post_init__(self) -> None:
        if self.blocks is None or isinstance(self.blocks, SublayerPolicy):
            raise ValueError(
                "SublayerPolicy(blocks=...) takes the policy that chooses the blocks to "
                f"split (e.g. {{Block}}), got {self.blocks!r}"
            )
        if not 0 < self.min_share <= 1:
            raise ValueError(
                f"SublayerPolicy(min_share=...) must be in (0, 1], got {self.min_share!r}"
            )


ModulePredicate = Callable[[nn.Module, str], bool]
AutoWrapPolicy = (
    Collection[type[nn.Module]]
    | type[nn.Module]
    | ModulePredicate
    | SizePolicy
    | SublayerPolicy
    | None
)


def select_unit_roots(root: nn.Module, policy: AutoWrapPolicy, skip: Collection[str]) -> list[str]:
    """Names of the submodules (never the root) that the policy makes units.

    ``skip`` holds names of submodules that are units already; nothing inside them is chosen.
    """
    candidates = [
        (name, module)
        for name, module in root.named_modules()
        if name and not is_within(name, skip)
    ]
    if policy is None:
        return []
    if isinstance(policy, SizePolicy):
        return _select_by_size(root, policy.min_params, skip)
    if isinstance(policy, SublayerPolicy):
        return _select_sublayers(root, policy, skip)
    if callable(policy) and not isinstance(policy, type):
        return [name for name, module in candidates if policy(module, name)]
    classes = _as_class_set(policy)
    return [name for name, module in candidates if isinstance(module, classes)]


def last_units(root: nn.Module, policy: AutoWrapPolicy, count: int) -> list[nn.Module]:
    """The last ``count`` submodules (in module order) that the policy makes units, each
    after the units inside it (``SublayerPolicy`` nests them): the order to shard them in."""
    if count <= 0:
        return []
    names = select_unit_roots(root, policy, skip=())
    if count > len(names):
        raise ValueError(
            f"keep_gathered ({count}) exceeds the {len(names)} units the auto_wrap_policy "
            "makes (the root is never one of them)"
        )
    position = {name: i for i, name in enumerate(_post_order(root))}
    return [root.get_submodule(name) for name in sorted(names[-count:], key=position.__getitem__)]


def _post_order(root: nn.Module, name: str = "") -> list[str]:
    """Module names, each after its submodules'."""
    inner = [
        found
        for child, module in root.named_children()
        for found in _post_order(module, join_name(name, child))
    ]
    return [*inner, name]


def _as_class_set(policy: object) -> tuple[type[nn.Module], ...]:
    if isinstance(policy, type) and issubclass(policy, nn.Module):
        return (policy,)
    if isinstance(policy, Collection) and not isinstance(policy, str):
        classes = tuple(policy)
        if all(isinstance(c, type) and issubclass(c, nn.Module) for c in classes):
            return classes
    raise TypeError(
        "auto_wrap_policy must be a set of nn.Module classes (e.g. {Block}), a callable "
        "(module, name) -> bool, flatshard.SizePolicy(min_params=N) or None; "
        f"got {policy!r}"
    )


def _select_by_size(root: nn.Module, min_params: int, skip: Collection[str]) -> list[str]:
    chosen: list[str] = []
    seen: set[int] = set()  # parameters already counted (ties count once)

    def visit(module: nn.Module, name: str) -> int:
        if is_within(name, skip):
            return 0
        remaining = sum(visit(child, join_name(name, c)) for c, child in module.named_children())
        for param in module.parameters(recurse=False):
            if id(param) not in seen:
                seen.add(id(param))
                remaining += param.numel()
        if name and remaining >= min_params:
            chosen.append(name)
            return 0
        return remaining

    visit(root, "")
    return chosen


def is_within(name: str, prefixes: Collection[str]) -> bool:
    return any(name == p or name.startswith(p + ".") for p in prefixes)


def _select_sublayers(root: nn.Module, policy: SublayerPolicy, skip: Collection[str]) -> list[str]:
    blocks = select_unit_roots(root, policy.blocks, skip)
    if not blocks:
        return []
    sizes = {name: _numel(root.get_submodule(name)) for name in blocks}
    chosen = set(blocks)
    for name in blocks:
        for child, module in root.get_submodule(name).named_children():
            if _numel(module) >= policy.min_share * sizes[name]:
                chosen.add(join_name(name, child))
    average = sum(sizes.values()) / len(sizes)
    chosen |= _large_leftovers(root, blocks, policy.min_share * average, skip)
    return [name for name, _ in root.named_modules() if name in chosen]


def _large_leftovers(
    root: nn.Module, blocks: Collection[str], threshold: float, skip: Collection[str]
) -> set[str]:
    """The outermost modules that hold no block, at least ``threshold`` parameters and
    no tied one (a tied one lands in the common ancestor's unit: the unit would be empty)."""
    tied = _tied_params(root)
    found: set[str] = set()

    def visit(name: str, module: nn.Module) -> None:
        if name in blocks or is_within(name, skip):
            return
        if not name or any(b.startswith(name + ".") for b in blocks):
            for child, inner in module.named_children():
                visit(join_name(name, child), inner)
        elif _numel(module) >= threshold and not any(id(p) in tied for p in module.parameters()):
            found.add(name)

    visit("", root)
    return found


def _numel(module: nn.Module) -> int:
    return sum(p.numel() for p in module.parameters())


def _tied_params(root: nn.Module) -> set[int]:
    """Ids of the parameters that more than one module registers."""
    seen: dict[int, int] = {}
    for _, module in root.named_modules(remove_duplicate=False):
        for param in module._parameters.values():
            if param is not None:
                seen[id(param)] = seen.get(id(param), 0) + 1
    return {key for key, count in seen.items() if count > 1}


@dataclass
class OriginalParam:
    """One of the user's parameters, with every place a module registers it (ties)."""

    param: nn.Parameter
    fqn: str  # its first name in the model
    usages: list[tuple[nn.Module, str]] = field(default_factory=list)

    @property
    def tp(self) -> SplitParam | None:
        """Set when its local tensor is a part of a global one: a DTensor parameter ([Note:
        DTensor parameters]) or experts ([Note: expert parallelism])."""
        return tensor_parallel(self.param)


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
