"""Given a memory budget, the fastest setup that fits, and why the others do not.

The candidates are what an FSDP user would try by hand: each sharding strategy (the
hybrid ones only across hosts, sharded over one host, two, four... : every F =
ranks_per_host x 2^k below the world size), with and without activation checkpointing. Each is
planned (simulated) in full; the fastest whose device memory fits the budget wins. If it
reshards after forward, as many of its last units as still fit are then kept gathered
until backward (``keep_gathered_where_it_fits``): less communication than resharding
every unit, a choice no peer makes for you. Before that, the unit policy: where a
candidate that gathers parameters is faster than the best that fits but does not fit
itself, it is planned again with its blocks split into sublayers
(``finer_units_where_they_help``, ``SublayerPolicy``): fewer parameters gathered at once,
for more collectives. Across hosts, the model cut into pipeline stages too
(``pipelines_across_hosts``, where the problem knows how to cut it). Where nothing fits,
FULL_SHARD with CPU offload is planned too (``offload_where_nothing_fits``): the slowest
way, and the last.
"""

from __future__ import annotations

import multiprocessing as mp
import os
from collections.abc import Callable
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass, replace

import torch.distributed as dist
from torch import nn

from flatshard.comm._mesh import ShardingStrategy
from flatshard.flat._partition import SublayerPolicy
from flatshard.planner._cluster import Cluster
from flatshard.planner._pipeline import Pipeline
from flatshard.planner._plan import Plan, plan_setup
from flatshard.planner._simulate import Inputs, Loss, Setup

Builder = Callable[[bool], Callable[[], nn.Module]]
"""checkpoint_activations -> the model's build function."""


@dataclass(frozen=True)
class Problem:
    """What every candidate plans: the model, one rank's micro-batch, the loss, the cluster;
    ``pipelines(P)``: the model cut into P pipeline stages (None where it cannot be), for
    ``pipelines_across_hosts``."""

    builder: Builder
    inputs: Inputs
    loss: Loss
    cluster: Cluster
    pipelines: Callable[[int], Pipeline | None] | None = None

    def plan(self, setup: Setup, checkpointing: bool) -> Plan:
        return plan_setup(self.builder(checkpointing), self.inputs, self.loss, setup, self.cluster)


def recommend(problem: Problem, setup: Setup, budget: int) -> list[Candidate]:
    """Every candidate of the module docstring planned, fastest first (``best_fit`` picks)."""
    found = candidates(problem, setup)
    found = finer_units_where_they_help(found, budget, problem)
    found = keep_gathered_where_it_fits(found, budget, problem)
    found = pipelines_across_hosts(found, problem)
    return offload_where_nothing_fits(found, budget, problem)


@dataclass(frozen=True)
class Candidate:
    strategy: ShardingStrategy
    checkpoint_activations: bool
    plan: Plan
    kept_gathered: int = 0  # the last N units in the strategy's ZeRO-2 form

    @property
    def sharding_factor(self) -> int | None:
        return self.plan.setup.sharding_factor if self.strategy.is_hybrid else None

    @property
    def sublayers(self) -> bool:
        return isinstance(self.plan.setup.auto_wrap_policy, SublayerPolicy)

    @property
    def pipeline(self) -> Pipeline | None:
        return self.plan.setup.pipeline

    @property
    def label(self) -> str:
        factor = f" (F={self.sharding_factor})" if self.sharding_factor else ""
        units = ", sublayer units" if self.sublayers else ""
        checkpointing = ", activation checkpointing" if self.checkpoint_activations else ""
        offload = ", CPU offload" if self.plan.setup.cpu_offload else ""
        kept = kept_phrase(self.kept_gathered)
        pipe = self.pipeline
        stages = (
            ""
            if pipe is None
            else f", {pipe.ranks} pipeline stages ({pipe.schedule}, {pipe.microbatches} "
            "micro-batches)"
        )
        return f"{self.strategy.name}{factor}{units}{kept}{stages}{checkpointing}{offload}"


def kept_phrase(count: int) -> str:
    """How a setup's label says that its last ``count`` units are kept gathered."""
    if not count:
        return ""
    return f", last {count} unit{'s' if count > 1 else ''} kept gathered"


def candidates(problem: Problem, setup: Setup) -> list[Candidate]:
    """Every strategy with and without checkpointing, planned, fastest first."""
    cluster = problem.cluster
    strategies = [
        ShardingStrategy.NO_SHARD,
        ShardingStrategy.SHARD_GRAD_OP,
        ShardingStrategy.FULL_SHARD,
    ]
    if cluster.hosts > 1:
        strategies += [ShardingStrategy.HYBRID_SHARD_ZERO2, ShardingStrategy.HYBRID_SHARD]
    wanted = [
        (replace(setup, strategy=strategy, sharding_factor=factor), checkpointing)
        for strategy in strategies
        for factor in _factors(strategy, cluster)
        for checkpointing in (False, True)
    ]
    found = [
        Candidate(chosen.strategy, checkpointing, plan)
        for (chosen, checkpointing), plan in zip(wanted, plan_each(problem, wanted), strict=True)
    ]
    return sorted(found, key=lambda c: c.plan.step.seconds)


# [Note: candidates planned side by side]
# Each candidate is a whole simulation, seconds each on a large model, and the candidates
# of a round do not depend on each other: they are planned in processes of their own, as
# many at once as this process may use cores. The processes are forked, and the problem
# and the candidates reach them as the pool's initializer arguments, which a forked
# process inherits rather than unpickles (a build function is often a closure); only each
# plan comes back, pickled, without its setup (which may hold closures too: the caller
# has it). Where fork is not offered, or a process group exists (``plan_setup`` then plans
# in a process of its own anyway), or pipelines are planned (their plans hold the
# pipeline's functions), the candidates are planned one after another.
_INHERITED: tuple[Problem, list[tuple[Setup, bool]]] | None = None  # in a forked worker


def plan_each(problem: Problem, wanted: list[tuple[Setup, bool]]) -> list[Plan]:
    """``problem.plan(setup, checkpointing)`` of each of ``wanted``, side by side."""
    workers = min(len(wanted), _usable_cores())
    if (
        workers < 2
        or "fork" not in mp.get_all_start_methods()
        or dist.is_initialized()
        or any(setup.pipeline is not None for setup, _ in wanted)
    ):
        return [problem.plan(setup, checkpointing) for setup, checkpointing in wanted]
    with ProcessPoolExecutor(
        workers, mp.get_context("fork"), initializer=_inherit, initargs=(problem, wanted)
    ) as pool:
        plans = list(pool.map(_plan_one, range(len(wanted))))
    return [replace(plan, setup=setup) for plan, (setup, _) in zip(plans, wanted, strict=True)]


def _inherit(problem: Problem, wanted: list[tuple[Setup, bool]]) -> None:
    global _INHERITED
    _INHERITED = (problem, wanted)


def _plan_one(index: int) -> Plan:
    """In a forked worker: the plan of candidate ``index``, its setup left out (the caller
    puts it back)."""
    assert _INHERITED is not None
    problem, wanted = _INHERITED
    setup, checkpointing = wanted[index]
    return replace(problem.plan(setup, checkpointing), setup=Setup())


def _usable_cores() -> int:
    affinity = getattr(os, "sched_getaffinity", None)
    return len(affinity(0)) if affinity is not None else os.cpu_count() or 1


def _factors(strategy: ShardingStrategy, cluster: Cluster) -> list[int | None]:
    """The sharding factors F to try: one host's ranks, then two hosts', four... below the
    world (F = W is FULL_SHARD itself); None for the other strategies."""
    if not strategy.is_hybrid:
        return [None]
    factors: list[int | None] = []
    factor = cluster.ranks_per_host
    while factor < cluster.world_size and cluster.world_size % factor == 0:
        factors.append(factor)
        factor *= 2
    return factors


# Each try is a whole plan; the fastest few that miss the budget are the ones worth it.
MOST_SPLIT = 3


def finer_units_where_they_help(
    found: list[Candidate], budget: int, problem: Problem
) -> list[Candidate]:
    """``found`` and, planned with their blocks split into sublayers, the best that fits
    and the ``MOST_SPLIT`` fastest of those faster than it that do not fit, of those that
    can be split (``_splittable``); fastest first."""
    best = best_fit(found, budget)
    splittable = [c for c in found if _splittable(c)]
    faster = [
        c
        for c in splittable
        if not c.plan.fits_within(budget)
        and (best is None or c.plan.step.seconds < best.plan.step.seconds)
    ][:MOST_SPLIT]
    chosen = [*faster, *([best] if best is not None and _splittable(best) else [])]
    wanted = [
        (
            replace(c.plan.setup, auto_wrap_policy=SublayerPolicy(c.plan.setup.auto_wrap_policy)),
            c.checkpoint_activations,
        )
        for c in chosen
    ]
    added = [
        Candidate(c.strategy, c.checkpoint_activations, plan)
        for c, plan in zip(chosen, plan_each(problem, wanted), strict=True)
    ]
    return sorted(found + added, key=lambda c: c.plan.step.seconds)


def _splittable(c: Candidate) -> bool:
    """Gathers parameters (not NO_SHARD) and has blocks to split (not split already)."""
    policy = c.plan.setup.auto_wrap_policy
    return c.strategy != ShardingStrategy.NO_SHARD and policy is not None and not c.sublayers


def best_fit(found: list[Candidate], budget: int) -> Candidate | None:
    return next((c for c in found if c.plan.fits_within(budget)), None)


def pipelines_across_hosts(found: list[Candidate], problem: Problem) -> list[Candidate]:
    """``found`` and, across hosts, the model cut into P = 2, 4... pipeline stages (P
    dividing the hosts: each stage sharded inside W / P ranks, FULL_SHARD; 1F1B with P x
    the micro-batches, so that the global batch stays; with and without activation
    checkpointing): between hosts only the activations travel, point to point, instead of
    every unit's all-gathers and reductions."""
    hosts = problem.cluster.hosts
    if problem.pipelines is None or hosts < 2 or not found:
        return found
    added = []
    ranks = 2
    while ranks <= hosts and hosts % ranks == 0:
        pipeline = problem.pipelines(ranks)
        if pipeline is not None:
            setup = replace(
                found[0].plan.setup,
                strategy=ShardingStrategy.FULL_SHARD,
                sharding_factor=None,
                kept_gathered=0,
                pipeline=pipeline,
            )
            for checkpointing in (False, True):
                planned = problem.plan(setup, checkpointing)
                added.append(Candidate(ShardingStrategy.FULL_SHARD, checkpointing, planned))
        ranks *= 2
    return sorted(found + added, key=lambda c: c.plan.step.seconds)


def offload_where_nothing_fits(
    found: list[Candidate], budget: int, problem: Problem
) -> list[Candidate]:
    """``found`` and, if none of it fits, FULL_SHARD with CPU offload (with and without
    activation checkpointing): the device then holds no sharded state at all."""
    if best_fit(found, budget) is not None or not found:
        return found
    unpipelined = next((c for c in found if c.pipeline is None), found[0])
    setup = replace(
        unpipelined.plan.setup,
        strategy=ShardingStrategy.FULL_SHARD,
        sharding_factor=None,
        kept_gathered=0,
        cpu_offload=True,
        foreach=False,  # the optimizer steps on the CPU
        pipeline=None,
    )
    wanted = [(setup, False), (setup, True)]
    added = [
        Candidate(ShardingStrategy.FULL_SHARD, checkpointing, plan)
        for (_, checkpointing), plan in zip(wanted, plan_each(problem, wanted), strict=True)
    ]
    return sorted(found + added, key=lambda c: c.plan.step.seconds)


# Kept units cost memory; below this share of the step saved, the headroom is worth more
# (where prefetch already hides backward's all-gathers, keeping units saves next to nothing).
MIN_GAIN = 0.005


def keep_gathered_where_it_fits(
    found: list[Candidate], budget: int, problem: Problem
) -> list[Candidate]:
    """``found`` and, for each candidate that reshards after forward (FULL_SHARD,
    HYBRID_SHARD) and fits while its ZeRO-2 form does not, the same with as many of its
    last units kept gathered until backward as still fit, if that saves at least
    ``MIN_GAIN`` of the step; fastest first. Each kept unit saves the all-gather backward
    would make for it. Skipped where it cannot win: the ZeRO-2 form (every unit kept)
    bounds how fast it gets."""
    added: list[Candidate] = []
    for reshards in found:
        form = reshards.strategy.kept_gathered
        zero2 = next(
            (
                c
                for c in found
                if c.strategy == form
                and c.sharding_factor == reshards.sharding_factor
                and c.checkpoint_activations == reshards.checkpoint_activations
            ),
            None,
        )
        best = best_fit(found + added, budget)
        if (
            form is None
            or reshards.pipeline is not None
            or zero2 is None
            or not reshards.plan.fits_within(budget)
            or zero2.plan.fits_within(budget)
            or (best is not None and best.plan.step.seconds <= zero2.plan.step.seconds)
        ):
            continue
        kept = _most_kept(reshards, zero2, budget, problem)
        if kept.plan.step.seconds < reshards.plan.step.seconds * (1 - MIN_GAIN):
            added.append(kept)
    return sorted(found + added, key=lambda c: c.plan.step.seconds)


def _most_kept(reshards: Candidate, zero2: Candidate, budget: int, problem: Problem) -> Candidate:
    """``reshards`` with its most last units kept gathered that fit.

    Memory grows with their number, from ``reshards`` (none kept, fits) to its ZeRO-2
    form (every unit kept, does not fit): a search between the most known to fit and the
    fewest known not to. Each kept unit adds about the same bytes, so each round plans the
    count where the line between those two plans' memory meets the budget, and the next
    (as many counts as there are cores: on two, a line that holds ends the search in one
    round); where a round did not halve the range, the next one bisects it instead."""
    fit, over = (0, reshards), (reshards.plan.units, zero2)  # the root is never one
    interpolate = True
    while over[0] - fit[0] > 1:
        low, high = fit[0], over[0]
        if interpolate:
            need, fit_need = budget - fit[1].plan.memory_needed, fit[1].plan.memory_needed
            slope = max(over[1].plan.memory_needed - fit_need, 1) / (high - low)
            start = low + int(need // slope)
        else:
            start = (low + high) // 2
        start = min(max(start, low + 1), high - 1)
        counts = list(range(start, min(start + _usable_cores(), high)))
        wanted = [
            (replace(reshards.plan.setup, kept_gathered=count), reshards.checkpoint_activations)
            for count in counts
        ]
        for count, planned in zip(counts, plan_each(problem, wanted), strict=True):
            probed = Candidate(reshards.strategy, reshards.checkpoint_activations, planned, count)
            if planned.fits_within(budget):
                fit = max(fit, (count, probed), key=lambda known: known[0])
            else:
                over = min(over, (count, probed), key=lambda known: known[0])
        interpolate = 2 * (over[0] - fit[0]) <= high - low
    return fit[1]
