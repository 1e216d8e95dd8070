"""Auto-wrap policies: which submodules become units (paper mechanism 14)."""

from __future__ import annotations

from collections.abc import Callable, Collection
from dataclasses import dataclass

from torch import nn

from flatshard._ranks import join_name


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


ModulePredicate = Callable[[nn.Module, str], bool]
AutoWrapPolicy = Collection[type[nn.Module]] | type[nn.Module] | ModulePredicate | SizePolicy | None


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
    if callable(policy) and not isinstance(policy, type):
        return [name for name, module in candidates if policy(module, name)]
    classes = _as_class_set(policy)
    return [name for name, module in candidates if isinstance(module, classes)]


def last_units(root: nn.Module, policy: AutoWrapPolicy, count: int) -> list[nn.Module]:
    """The last ``count`` submodules (in module order) that the policy makes units."""
    if count <= 0:
        return []
    names = select_unit_roots(root, policy, skip=())
    if count > len(names):
        raise ValueError(
            f"keep_gathered ({count}) exceeds the {len(names)} units the auto_wrap_policy "
            "makes (the root is never one of them)"
        )
    return [root.get_submodule(name) for name in names[-count:]]


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
