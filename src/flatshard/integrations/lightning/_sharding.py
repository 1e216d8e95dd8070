"""How both Lightning strategies (the ``Trainer``'s and Fabric's) shard a module.

One set of options, checked once, and one ``shard`` call: activation checkpointing, the
move to the device for a module that is not on meta, ``fully_shard``.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from dataclasses import dataclass, field
from functools import partial
from typing import Any

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint as recompute

import flatshard

STATE_DICT_TYPES = ("sharded", "full")
# fully_shard's keywords the strategies set themselves (the rest pass through)
_OWN_KEYWORDS = {"auto_wrap_policy", "strategy", "mixed_precision", "cpu_offload", "device"}


@dataclass
class ShardOptions:
    """The strategies' sharding options (their arguments, documented there)."""

    auto_wrap_policy: Any = None
    sharding_strategy: flatshard.ShardingStrategy | str = "FULL_SHARD"
    mixed_precision: flatshard.MixedPrecision | None = None
    cpu_offload: flatshard.CPUOffload | None = None
    activation_checkpointing_policy: set[type[nn.Module]] | None = None
    state_dict_type: str = "sharded"
    fully_shard_options: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.state_dict_type not in STATE_DICT_TYPES:
            raise ValueError(
                f"flatshard.integrations.lightning: state_dict_type={self.state_dict_type!r}; "
                f"choose one of {STATE_DICT_TYPES}."
            )
        _check_options(self.fully_shard_options)

    def policy(self, precision: str, from_precision: flatshard.MixedPrecision | None) -> Any:
        """The ``MixedPrecision`` to shard with: the strategy's, or the precision's."""
        if self.mixed_precision is not None and precision != "32-true":
            raise ValueError(
                "flatshard.integrations.lightning: both mixed_precision=... and "
                f"precision={precision!r} were given; give one (the precision setting "
                "stands for a flatshard MixedPrecision policy)."
            )
        return self.mixed_precision if self.mixed_precision is not None else from_precision

    def shard(
        self, module: nn.Module, device: torch.device, mixed: flatshard.MixedPrecision | None
    ) -> None:
        """``fully_shard`` the module in place on ``device``."""
        if self.activation_checkpointing_policy:
            _checkpoint_forwards(module, tuple(self.activation_checkpointing_policy))
        if not _on_meta(module):
            module.to(device)  # the full module: build on meta to never hold it
        flatshard.fully_shard(
            module,
            auto_wrap_policy=self.auto_wrap_policy,
            strategy=self.sharding_strategy,
            mixed_precision=mixed,
            cpu_offload=self.cpu_offload,
            device=device,
            **self.fully_shard_options,
        )


def is_sharded(module: nn.Module) -> bool:
    return bool(flatshard.unit_modules(module))


def holds_parameters_itself(module: nn.Module) -> bool:
    """Whether ``module`` is a unit of its own (parameters outside the policy's units)."""
    return any(name == "" for name, _ in flatshard.unit_modules(module))


def _check_options(options: dict[str, Any]) -> None:
    known = set(inspect.signature(flatshard.fully_shard).parameters) - {"module"}
    own = sorted(set(options) & _OWN_KEYWORDS)
    if own:
        raise TypeError(
            f"flatshard.integrations.lightning: the strategy sets {own} itself; pass "
            "auto_wrap_policy, sharding_strategy, mixed_precision and cpu_offload by name "
            "(the device is Lightning's)."
        )
    unknown = sorted(set(options) - known)
    if unknown:
        raise TypeError(
            f"flatshard.integrations.lightning: the strategy got {unknown}, which "
            f"flatshard.fully_shard does not take (it takes {sorted(known - _OWN_KEYWORDS)})."
        )


def _checkpoint_forwards(module: nn.Module, classes: tuple[type[nn.Module], ...]) -> None:
    """Recompute each ``classes`` module's forward in backward (non-reentrant); the unit's
    hooks stay outside the recomputed region, so it reads the gathered parameters."""
    for inner in module.modules():
        if isinstance(inner, classes):
            forward: Callable[..., Any] = inner.forward
            inner.forward = partial(recompute, forward, use_reentrant=False)


def _on_meta(module: nn.Module) -> bool:
    return any(t.is_meta for t in [*module.parameters(), *module.buffers()])
