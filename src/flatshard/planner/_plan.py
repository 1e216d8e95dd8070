"""``flatshard.plan``: per-rank peak memory, collectives and step time, before launch.

See _recorder.py ([Note: simulated step]) for how the memory is known and _timing.py for
the step-time model.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass, field, replace
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from flatshard.comm._mesh import ShardingStrategy
from flatshard.comm._processes import fast_context
from flatshard.flat._partition import AutoWrapPolicy
from flatshard.flat._placement import Rows, ShardPlacement
from flatshard.planner._cluster import PRESETS, Cluster
from flatshard.planner._pipeline import (
    Pipeline,
    PipelineCost,
    StagePlan,
    first_microbatch,
    input_bytes,
    kind_of,
    price,
    stage_inputs,
    stage_kinds,
    stage_parts,
    stage_setup,
)
from flatshard.planner._recorder import ACTIVATIONS, Op
from flatshard.planner._simulate import Inputs, Loss, Setup, simulate
from flatshard.planner._timing import StepTime, collective_time, step_time
from flatshard.runtime._prefetch import Prefetch

# Device memory a plan keeps free of tensors: the CUDA context and the caching
# allocator's rounding and fragmentation, which live-tensor accounting does not see.
CONTEXT_BYTES = 1 << 30
ALLOCATOR_SLACK = 0.05


@dataclass(frozen=True)
class CollectiveTotal:
    kind: str
    count: int
    bytes: int  # the ring's buffer sizes summed (gathered output, reduced input)
    seconds: float  # alone on its link
    links: str  # "intra-host", "inter-host" or both


@dataclass(frozen=True)
class Plan:
    """What one rank of the planned run needs and does per optimizer step."""

    setup: Setup
    cluster: Cluster
    params: int
    trainable: int
    units: int
    peak_memory_bytes: int  # live tensor storage at the steady-state step's peak
    memory: dict[str, int]  # the same bytes by what they hold
    at_rest_bytes: int  # alive between steps: the state sharding divides
    collectives: list[CollectiveTotal]
    step: StepTime
    timeline: list[int] = field(repr=False)  # live bytes after each op of the step
    ops: list[Op] = field(repr=False)
    # CPU offload: the peak of what lives in host memory (shards, gradients, optimizer
    # state); the fields above are then the device's alone.
    host_memory_bytes: int = 0
    total_peak_bytes: int = 0  # the peak of both memories together (a CPU's one memory)
    # Pipeline stages: the schedule's share, and every pipeline rank's figures; the fields
    # above are then those of the rank with the most memory ([Note: planning pipeline
    # stages]).
    pipeline: PipelineCost | None = None
    timeline_ops: list[int] = field(default_factory=list, repr=False)  # ops before each entry

    @property
    def device_memory_needed(self) -> int:
        """The peak plus the context and allocator slack (``CONTEXT_BYTES``, 5%)."""
        slack = int(self.peak_memory_bytes * ALLOCATOR_SLACK)
        context = CONTEXT_BYTES if self.cluster.device != "cpu" else 0
        return self.peak_memory_bytes + slack + context

    @property
    def fits(self) -> bool:
        return self.fits_within(self.cluster.memory_bytes)

    @property
    def memory_needed(self) -> int:
        """What a memory budget holds: the device's memory needed, and on a CPU, whose one
        memory holds what is offloaded too, that as well."""
        if self.cluster.host_memory_bytes:
            return self.device_memory_needed
        return self.device_memory_needed + self.total_peak_bytes - self.peak_memory_bytes

    def fits_within(self, budget: int) -> bool:
        """``memory_needed`` within ``budget``, and its host's memory (CPU offload) within
        the host's."""
        host = self.cluster.host_memory_bytes
        return self.memory_needed <= budget and (not host or self.host_memory_bytes <= host)

    @property
    def tflops_per_device(self) -> float:
        return self.step.flops / self.step.seconds / 1e12 if self.step.seconds else 0.0

    @property
    def mfu(self) -> float:
        """Executed FLOP/s over the device's peak in the compute dtype (recomputation
        counts: hardware, not model, utilization)."""
        peak = self.cluster.peak_flops(self.setup.param_dtype or torch.float32)
        return self.tflops_per_device * 1e12 / peak

    def to_json(self) -> dict[str, Any]:
        step = self.step
        return {
            "peak_memory_bytes": self.peak_memory_bytes,
            "memory_bytes": dict(self.memory),
            "at_rest_bytes": self.at_rest_bytes,
            "device_memory_needed_bytes": self.device_memory_needed,
            "device_memory_bytes": self.cluster.memory_bytes,
            "host_memory_bytes": self.host_memory_bytes,
            "total_peak_bytes": self.total_peak_bytes,
            "fits": self.fits,
            "step_time_s": step.seconds,
            "compute_s": step.compute_s,
            "communication_s": step.communication_s,
            "exposed_communication_s": step.exposed_communication_s,
            "flops_per_step": step.flops,
            "tflops_per_device": self.tflops_per_device,
            "mfu": self.mfu,
            "collectives": [vars(c) for c in self.collectives],
            "params": self.params,
            "trainable_params": self.trainable,
            "units": self.units,
            "world_size": self.setup.world_size,
            "strategy": self.setup.strategy.name,
            "kept_gathered": self.setup.kept_gathered,
            "cpu_offload": self.setup.cpu_offload,
            "placement": repr(self.setup.placement or Rows()),
            "reshard_after_forward": self.setup.reshard_after_forward,
            "no_unshard_in_backward": list(self.setup.no_unshard_in_backward),
            "separate_reduce_scatter_group": self.setup.separate_reduce_scatter_group,
            "cluster": self.cluster.name,
            "pipeline": None if self.pipeline is None else self.pipeline.to_json(),
        }


def plan(
    build: Callable[..., nn.Module],
    inputs: Inputs,
    *,
    loss: Loss | None = None,
    auto_wrap_policy: AutoWrapPolicy = None,
    cluster: Cluster | str = "a100-80gb",
    hosts: int = 1,
    ranks_per_host: int | None = None,
    strategy: ShardingStrategy = ShardingStrategy.FULL_SHARD,
    sharding_factor: int | None = None,
    mixed_precision: torch.dtype | None = None,
    gather_dtype: torch.dtype | None = None,
    prefetch: Prefetch | None = None,
    grad_accum: int = 1,
    accumulation: str = "no_sync",
    optimizer: str = "adamw",
    clip: bool = True,
    keep_gathered: int = 0,
    cpu_offload: bool = False,
    tensor_parallel: int = 1,
    placement: ShardPlacement | None = None,
    reshard_after_forward: bool | int | None = None,
    no_unshard_in_backward: tuple[str, ...] = (),
    separate_reduce_scatter_group: bool = False,
    pipeline: Pipeline | None = None,
) -> Plan:
    """Predict one rank's memory and step time for a training run, without running it.

    ``build()`` makes the model; it is called under ``torch.device("meta")``, so nothing
    is allocated, and ``fully_shard`` with these options runs on it in a simulated world
    of ``hosts * ranks_per_host`` ranks (torch's fake process group: nothing is sent) for
    two training steps. ``inputs()`` makes one rank's micro-batch (a tuple of tensors,
    also on meta), and ``loss(model, batch)`` runs the forward and returns the scalar to
    backpropagate (default: ``model(*batch)``'s ``.loss``, or its output's mean). Called
    where a process group already exists, the simulation runs in a spawned process, and
    these three must then be picklable (module-level functions).

    Args:
        cluster: a preset name ("a100-80gb", "h100-80gb", "h200", "cpu-dev"; "cpu": this
            machine, measured once per process: ``cpu_cluster``) or a ``Cluster``.
        sharding_factor: F for the hybrid strategies (default: ``ranks_per_host``, as
            ``fully_shard`` defaults to under torchrun).
        mixed_precision: the compute and all-gather dtype (gradients reduced in fp32).
        gather_dtype: ``MixedPrecision(gather_dtype=...)``: the dtype parameters travel in
            when all-gathered (int8 / float8 with a scale per row, or a cast); the plan
            prices the bytes sent and the encoding's buffers.
        accumulation: how ``grad_accum`` micro-batches but the last run: "no_sync" (no
            reduction, the unsharded gradients kept) or "reduce" (a reduction each, sharded
            gradients; hybrid: the reduce-scatter alone, the replicas' all-reduce once, as
            ``flatshard.set_requires_all_reduce``).
        optimizer: "adamw", "adam", "sgd-momentum", "sgd" or "muon" (Muon on the blocks'
            2-D weights, kept whole (``Whole()``), AdamW on the rest, as
            ``flatshard train --optimizer muon``). Adafactor cannot be planned: its step
            reads values (``.item()``) that a simulated step does not have.
        keep_gathered: the last N units (FULL_SHARD, HYBRID_SHARD) keep their parameters
            gathered from forward to backward, in the strategy's ZeRO-2 form: backward
            gathers them no more, for their memory.
        tensor_parallel: T > 1 plans 2-D parallelism: the W ranks form a (W / T, T) mesh
            named ("dp", "tp"), ``build(mesh["tp"])`` makes the model and applies its
            tensor-parallel plan (``parallelize_module``), and flatshard shards over "dp"
            (FULL_SHARD, SHARD_GRAD_OP, NO_SHARD). TP's own collectives are in the step.
        cpu_offload: ``CPUOffload()``: shards, gradients and the optimizer on the host.
            The peak is then the device's, ``host_memory_bytes`` the host's; the step
            adds the copies over PCIe and the optimizer's step at the host's speed.
        placement: ``fully_shard``'s placement for every parameter it serves (a value,
            not a rule: it travels to the simulation). ``flatshard.RowSparse()``: each
            lookup fetches its tokens' rows and sends their gradients back as rows. A
            simulated batch has no token values, so the plan takes every token id distinct
            (at most the vocabulary): the most bytes a batch of that many tokens can move;
            real text, whose frequent tokens repeat, moves fewer. ``Experts`` is refused
            (a simulated router has no choices to route by).
        reshard_after_forward: ``flatshard.set_reshard_after_forward(model, value)`` on the
            sharded model: False keeps every unit gathered from forward to backward
            (backward gathers nothing, for the memory); None: as the strategy says. An
            int N: backward gathers inside groups of N ranks (e.g. ``ranks_per_host``),
            from the 1/N of each unit kept after forward.
        no_unshard_in_backward: the units (module names, e.g. ``("tok_embeddings",)``)
            ``flatshard.set_unshard_in_backward(unit, False)`` is called on: backward
            gathers them no more.
        separate_reduce_scatter_group: ``flatshard.set_separate_reduce_scatter_group``:
            the reductions on a communication stream of their own in the step's timing.
        pipeline: ``flatshard.planner.Pipeline(ranks=P, microbatches=M, cut, loss_fn,
            schedule)``: the model cut into stages by ``cut(model, stage, stages)`` (in
            place, as torchtitan cuts its models), each sharded over W / P ranks, run by
            torch's ``schedule`` over M micro-batches of ``inputs()`` per replica,
            ``loss_fn(output, micro_batch)`` on the last stage. Each kind of stage is
            simulated; the schedule's bubble, its activations in flight and its sends
            are priced around them (``Plan.pipeline``: every pipeline rank's memory and
            work; the plan's own figures are those of the rank with the most memory).

    The peak is the steady-state step's most live tensor bytes on the rank, the
    quantity ``flatshard bench`` and the tests measure at the dispatcher; on the rank the
    planner runs (rank 0) it is exact for the ops the run will dispatch.
    """
    machines = _cluster(cluster, hosts, ranks_per_host)
    _check_optimizer(optimizer)
    if accumulation not in ("no_sync", "reduce"):
        raise ValueError(
            f"flatshard.plan: accumulation must be 'no_sync' or 'reduce', got {accumulation!r}"
        )
    _check_tensor_parallel(tensor_parallel, machines.world_size, strategy)
    refusal = None if placement is None else placement.plan_refusal()
    if refusal is not None:
        raise ValueError(f"flatshard.plan: placement {placement!r} is not planned: {refusal}")
    if strategy.is_hybrid and sharding_factor is None:  # shard inside a host, as torchrun
        sharding_factor = machines.ranks_per_host  # would make fully_shard's default
    setup = Setup(
        world_size=machines.world_size,
        auto_wrap_policy=auto_wrap_policy,
        strategy=strategy,
        sharding_factor=sharding_factor,
        param_dtype=mixed_precision,
        gather_dtype=gather_dtype,
        prefetch=prefetch,
        grad_accum=grad_accum,
        accumulation=accumulation,
        optimizer=optimizer,
        clip=clip,
        backend=machines.backend,
        foreach=machines.device != "cpu" and not cpu_offload,  # the optimizer's device
        kept_gathered=keep_gathered,
        cpu_offload=cpu_offload,
        tensor_parallel=tensor_parallel,
        placement=placement,
        reshard_after_forward=reshard_after_forward,
        no_unshard_in_backward=tuple(no_unshard_in_backward),
        separate_reduce_scatter_group=separate_reduce_scatter_group,
        pipeline=pipeline,
    )
    return plan_setup(build, inputs, loss or _default_loss, setup, machines)


def plan_setup(
    build: Callable[..., nn.Module], inputs: Inputs, loss: Loss, setup: Setup, cluster: Cluster
) -> Plan:
    """``plan`` of an explicit ``Setup``. In a process that already joined a process group
    the simulation runs in a fresh one (its world would clash), so ``build``, ``inputs``
    and ``loss`` must then be picklable (module-level functions)."""
    if dist.is_initialized():
        context = fast_context()
        with ProcessPoolExecutor(1, mp_context=context) as child:
            return child.submit(plan_setup, build, inputs, loss, setup, cluster).result()
    if setup.pipeline is not None:
        return _pipelined(build, inputs, setup, cluster)
    simulated = simulate(build, inputs, loss, setup, cluster.ranks_per_host)
    recorder = simulated.recorder
    ops = list(recorder.ops)
    device, host = recorder.split(simulated.host.__contains__)
    return Plan(
        setup=setup,
        cluster=cluster,
        params=simulated.params,
        trainable=simulated.trainable,
        units=simulated.units,
        peak_memory_bytes=device.peak,
        memory=recorder.breakdown(device.at_peak),
        at_rest_bytes=device.timeline[0] if device.timeline else device.peak,
        collectives=_collectives(ops, cluster),
        step=step_time(ops, cluster, simulated.host),
        timeline=device.timeline,
        ops=ops,
        host_memory_bytes=host.peak,
        total_peak_bytes=recorder.peak,
        timeline_ops=recorder.ops_at,
    )


def _pipelined(
    build: Callable[..., nn.Module], inputs: Inputs, setup: Setup, cluster: Cluster
) -> Plan:
    """A pipelined layout: each kind of stage planned as a model of its own, the schedule
    priced around them ([Note: planning pipeline stages])."""
    pipeline = setup.pipeline
    assert pipeline is not None
    _check_pipeline(setup, pipeline)
    specs = stage_inputs(build, inputs, pipeline, setup.param_dtype)
    inner = stage_setup(setup)
    kinds = {}
    for kind in stage_kinds(pipeline.stages):
        stage_build, stage_batch, stage_loss = stage_parts(
            build, inputs, pipeline, kind, specs[kind]
        )
        planned = plan_setup(stage_build, stage_batch, stage_loss, inner, cluster)
        received = input_bytes(specs[kind]) if kind else 0
        sent = input_bytes(specs[kind + 1]) if kind < pipeline.stages - 1 else 0
        microbatch = first_microbatch(planned.ops, cluster, frozenset())
        kinds[kind] = StagePlan(planned, microbatch, received, sent)
    cost, heaviest, seconds = price(pipeline, kinds, cluster, setup.world_size)
    own = [
        kinds[kind_of(s, pipeline.stages)] for s in range(heaviest, pipeline.stages, pipeline.ranks)
    ]
    every = [kinds[kind_of(s, pipeline.stages)].plan for s in range(pipeline.stages)]
    rank = cost.ranks[heaviest]
    memory: dict[str, int] = {}
    for part in own:
        for what, nbytes in part.plan.memory.items():
            memory[what] = memory.get(what, 0) + nbytes
    memory[ACTIVATIONS] = memory.get(ACTIVATIONS, 0) + (
        rank.peak_memory_bytes - sum(s.plan.peak_memory_bytes for s in own)
    )
    m = pipeline.microbatches
    compute = sum(s.plan.step.compute_s + (m - 2) * s.microbatch.compute_s for s in own)
    communication = (
        sum(s.plan.step.communication_s + (m - 2) * s.microbatch.communication_s for s in own)
        + cost.send_s
    )
    sends = CollectiveTotal(
        "send/recv", 2 * pipeline.stages_per_rank * m, cost.send_bytes, cost.send_s, cost.links
    )
    first = own[0].plan
    return Plan(
        setup=replace(setup, grad_accum=m),
        cluster=cluster,
        params=sum(p.params for p in every),
        trainable=sum(p.trainable for p in every),
        units=sum(p.units for p in every),
        peak_memory_bytes=rank.peak_memory_bytes,
        memory=memory,
        at_rest_bytes=rank.at_rest_bytes,
        collectives=[*_merged(s.plan.collectives for s in own), sends],
        step=StepTime(
            seconds,
            compute,
            communication,
            max(seconds - compute, 0.0),
            sum(s.flops(m) for s in own),
        ),
        timeline=first.timeline,
        ops=first.ops,
        timeline_ops=first.timeline_ops,
        total_peak_bytes=rank.peak_memory_bytes,
        pipeline=cost,
    )


def _check_pipeline(setup: Setup, pipeline: Pipeline) -> None:
    refused = {
        "tensor_parallel": setup.tensor_parallel > 1,
        "cpu_offload": setup.cpu_offload,
        "keep_gathered": setup.kept_gathered > 0,
    }
    for name, value in refused.items():
        if value:
            raise ValueError(f"flatshard.plan: {name} is not planned with pipeline stages yet")
    if setup.world_size % pipeline.ranks:
        raise ValueError(
            f"flatshard.plan: the pipeline's {pipeline.ranks} ranks must divide the world "
            f"({setup.world_size} ranks)"
        )


def _merged(parts: Iterable[list[CollectiveTotal]]) -> list[CollectiveTotal]:
    """The collectives of a rank's stages, summed by kind."""
    merged: dict[str, CollectiveTotal] = {}
    for collectives in parts:
        for c in collectives:
            had = merged.get(c.kind)
            merged[c.kind] = c if had is None else replace(
                had, count=had.count + c.count, bytes=had.bytes + c.bytes,
                seconds=had.seconds + c.seconds,
            )  # fmt: skip
    return list(merged.values())


OPTIMIZERS = ("adamw", "adam", "sgd-momentum", "sgd", "muon")


def _check_optimizer(optimizer: str) -> None:
    if optimizer == "adafactor":
        raise ValueError(
            "flatshard.plan: optimizer 'adafactor' cannot be planned: torch.optim.Adafactor's "
            "step reads a value (param.norm().item()) that a simulated step does not have. "
            "Plan with 'muon' for a whole-parameter layout, or measure with flatshard bench "
            "--optimizer adafactor."
        )
    if optimizer not in OPTIMIZERS:
        raise ValueError(
            f"flatshard.plan: optimizer must be one of {', '.join(OPTIMIZERS)}, got {optimizer!r}"
        )


def _check_tensor_parallel(degree: int, world: int, strategy: ShardingStrategy) -> None:
    if degree < 1 or world % degree:
        raise ValueError(
            f"flatshard.plan: tensor_parallel={degree} must be >= 1 and divide the "
            f"{world} ranks (hosts x ranks_per_host)"
        )
    if degree > 1 and strategy.is_hybrid:
        raise ValueError(
            f"flatshard.plan: tensor_parallel with {strategy.name} is not planned yet; "
            "plan FULL_SHARD or SHARD_GRAD_OP over the dp ranks"
        )


def _cluster(cluster: Cluster | str, hosts: int, ranks_per_host: int | None) -> Cluster:
    if isinstance(cluster, Cluster):
        return cluster.sized(hosts, ranks_per_host or cluster.ranks_per_host)
    if cluster == "cpu":
        from flatshard.planner._calibrate import cpu_cluster

        return cpu_cluster(ranks_per_host or 1).sized(hosts, ranks_per_host or 1)
    if cluster not in PRESETS:
        raise ValueError(
            f"flatshard.plan: unknown cluster {cluster!r}; expected one of "
            f"{', '.join([*PRESETS, 'cpu'])} or a flatshard.Cluster"
        )
    preset = PRESETS[cluster]
    return preset.sized(hosts, ranks_per_host or preset.ranks_per_host)


def _collectives(ops: list[Op], cluster: Cluster) -> list[CollectiveTotal]:
    totals: dict[str, CollectiveTotal] = {}
    for op in ops:
        if op.collective is None or op.group_size <= 1:
            continue
        link = "inter-host" if op.hosts > 1 else "intra-host"
        old = totals.get(op.collective)
        if old is None:
            old = CollectiveTotal(op.collective, 0, 0, 0.0, link)
        links = old.links if link in old.links else f"{old.links}, {link}"
        totals[op.collective] = replace(
            old,
            count=old.count + 1,
            bytes=old.bytes + op.io_bytes,
            seconds=old.seconds + collective_time(op, cluster),
            links=links,
        )
    return list(totals.values())


def _default_loss(model: nn.Module, batch: tuple[torch.Tensor, ...]) -> torch.Tensor:
    output = model(*batch)
    value = getattr(output, "loss", None)
    if isinstance(value, torch.Tensor):
        return value
    tensor = output if isinstance(output, torch.Tensor) else output[0]
    mean: torch.Tensor = tensor.float().mean()
    return mean
