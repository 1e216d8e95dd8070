"""Given a memory budget, the fastest setup that fits, and why the others do not.

The candidates are what an FSDP user would try by hand: each sharding strategy (the
hybrid ones only across hosts), with and without activation checkpointing. Each is
planned (simulated) in full; the fastest whose device memory fits the budget wins.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, replace

from torch import nn

from flatshard._mesh import ShardingStrategy
from flatshard._planner.cluster import Cluster
from flatshard._planner.plan import Plan, plan_setup
from flatshard._planner.simulate import Inputs, Loss, Setup

Builder = Callable[[bool], Callable[[], nn.Module]]
"""checkpoint_activations -> the model's build function."""


@dataclass(frozen=True)
class Candidate:
    strategy: ShardingStrategy
    checkpoint_activations: bool
    plan: Plan

    @property
    def label(self) -> str:
        checkpointing = ", activation checkpointing" if self.checkpoint_activations else ""
        return f"{self.strategy.name}{checkpointing}"


def candidates(
    builder: Builder, inputs: Inputs, loss: Loss, setup: Setup, cluster: Cluster
) -> list[Candidate]:
    """Every candidate planned, fastest first."""
    strategies = [
        ShardingStrategy.NO_SHARD,
        ShardingStrategy.SHARD_GRAD_OP,
        ShardingStrategy.FULL_SHARD,
    ]
    if cluster.hosts > 1:
        strategies += [ShardingStrategy.HYBRID_SHARD_ZERO2, ShardingStrategy.HYBRID_SHARD]
    found = []
    for strategy in strategies:
        factor = cluster.ranks_per_host if strategy.is_hybrid else None
        for checkpointing in (False, True):
            chosen = replace(setup, strategy=strategy, sharding_factor=factor)
            result = plan_setup(builder(checkpointing), inputs, loss, chosen, cluster)
            found.append(Candidate(strategy, checkpointing, result))
    return sorted(found, key=lambda c: c.plan.step.seconds)


def best_fit(found: list[Candidate], budget: int) -> Candidate | None:
    return next((c for c in found if c.plan.device_memory_needed <= budget), None)
