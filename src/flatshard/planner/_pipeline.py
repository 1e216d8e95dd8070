"""A pipelined layout's plan: each distinct stage simulated, the schedule priced around them.

[Note: planning pipeline stages]
torch's schedules cannot run in a simulated world (their stages exchange shapes and
activations point to point), so a pipelined plan is built from its stages: each kind of
stage (the first, one of the middle ones, the last: the middle ones are cut alike) is
planned as a model of its own, sharded over the stage's W / P ranks, for two
micro-batches under ``no_sync`` (as the pipeline runs them: each micro-batch's gradient
kept unreduced, the last reduces) and with its units kept gathered through the step
(``reshard_after_forward=False`` where the strategy reshards: flatshard's pipeline keeps
units gathered after backward, so the step's peak holds every unit of the stage; the
re-gathers of the warm-up forwards are not priced). A pipeline rank holds one stage, or
two under the interleaved schedule (stages r and r + P). Around them:

- memory: the rank's stages' simulated peaks, plus the activations of the micro-batches
  in flight beyond one per stage (what a micro-batch's forward adds, but the units it
  gathers): GPipe holds all M; 1F1B and zero-bubble P - r on rank r (at most M; the
  weight passes of zero-bubble keep more until they run, not modelled: measured 1.7x
  1F1B's peak on docs/performance.md's byte-gpt);
  interleaved (v = 2 stages a rank) the (v - 1) P + 2 (P - 1 - r) + 1 chunks of torch's
  warm-up (at most v M); plus torch's receive buffers, one per micro-batch for the
  activations a stage takes and one for the gradient it gets back;
- time: the busiest rank's work (its stages' simulated steps, extended from 2 to M
  micro-batches by the first micro-batch's time), plus the bubble: P - 1 slots of one
  stage's micro-batch (GPipe, 1F1B, interleaved: there a slot is one of v chunks, so the
  bubble shrinks by v), a third of that under zero-bubble (the ZB-H1 estimate, for
  forward, input-gradient and weight-gradient passes of equal time), plus the sends that
  fill and drain the pipeline (2 (P - 1) hops of one micro-batch's activations);
- sends per step: each micro-batch's activations forward and their gradient back, per
  stage boundary.
These are estimates of a schedule the plan does not run; ``flatshard bench --pp``
measures the same layout.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Any

import torch
from torch import nn

from flatshard.planner._cluster import Cluster
from flatshard.planner._timing import StepTime, step_time

Cut = Callable[[nn.Module, int, int], None]
"""(whole model, stage, stages) -> None: keeps ``stage``'s part of the model in place."""
StageLoss = Callable[[torch.Tensor, tuple[torch.Tensor, ...]], torch.Tensor]
"""(the last stage's output, the micro-batch the first stage took) -> the scalar loss, as
torch's schedules call their ``loss_fn`` (the target drawn from the micro-batch)."""

SCHEDULES = ("gpipe", "1f1b", "interleaved", "zero-bubble")


@dataclass(frozen=True)
class Pipeline:
    """A pipelined layout to plan: the world as (``ranks``, W / ``ranks``), pipeline-major,
    as torchtitan lays it out; each stage sharded over its W / ``ranks`` ranks."""

    ranks: int  # P: the pipeline's ranks
    microbatches: int  # M: each a rank's micro-batch (``inputs``) per data-parallel replica
    cut: Cut
    loss_fn: StageLoss
    schedule: str = "1f1b"  # gpipe | 1f1b | interleaved | zero-bubble

    def __post_init__(self) -> None:
        if self.schedule not in SCHEDULES:
            raise ValueError(
                f"flatshard.plan: pipeline schedule must be one of {', '.join(SCHEDULES)}, "
                f"got {self.schedule!r}"
            )
        if self.ranks < 2 or self.microbatches < self.ranks:
            raise ValueError(
                f"flatshard.plan: a pipeline of {self.ranks} ranks takes at least 2 ranks and "
                f"as many micro-batches (got {self.microbatches})"
            )

    @property
    def stages_per_rank(self) -> int:
        return 2 if self.schedule == "interleaved" else 1

    @property
    def stages(self) -> int:
        return self.ranks * self.stages_per_rank

    def in_flight(self, rank: int) -> int:
        """Micro-batches (interleaved: stage chunks) whose activations ``rank`` holds at
        once (see the note)."""
        p, m, v = self.ranks, self.microbatches, self.stages_per_rank
        if self.schedule == "gpipe":
            return m
        if self.schedule == "interleaved":
            return min(v * m, (v - 1) * p + 2 * (p - 1 - rank) + 1)
        return min(m, p - rank)

    @property
    def bubble_slots(self) -> float:
        """Idle slots of one stage's micro-batch on the busiest rank per step."""
        return (self.ranks - 1) / (3 if self.schedule == "zero-bubble" else 1)


@dataclass(frozen=True)
class PipelineRank:
    """One pipeline rank of a pipelined plan (every data-parallel rank of it alike)."""

    rank: int
    stages: tuple[int, ...]
    peak_memory_bytes: int  # the stages' simulated peaks, plus the micro-batches in flight
    at_rest_bytes: int
    in_flight: int
    activation_bytes: int  # one micro-batch's activations through its stages
    busy_s: float  # its work per step, every micro-batch


@dataclass(frozen=True)
class PipelineCost:
    """What the schedule adds to its stages' plans."""

    layout: Pipeline
    ranks: list[PipelineRank]
    bubble_s: float
    bubble_fraction: float  # of the step
    send_bytes: int  # one rank's point-to-point sends per step (activations, gradients)
    send_s: float  # the sends that fill and drain the pipeline
    links: str  # where the sends go: "intra-host" or "inter-host"

    def to_json(self) -> dict[str, Any]:
        return {
            "pipeline_ranks": self.layout.ranks,
            "schedule": self.layout.schedule,
            "microbatches": self.layout.microbatches,
            "stages": self.layout.stages,
            "bubble_s": self.bubble_s,
            "bubble_fraction": self.bubble_fraction,
            "send_bytes": self.send_bytes,
            "per_rank": [vars(r) | {"stages": list(r.stages)} for r in self.ranks],
        }


@dataclass(frozen=True)
class StagePlan:
    """One stage's simulated plan and its first micro-batch's share of the step."""

    plan: Any  # _plan.Plan (imported there: it builds these)
    microbatch: StepTime
    input_bytes: int  # the activations it receives per micro-batch (0: the first stage)
    output_bytes: int  # the activations it sends per micro-batch (0: the last stage)

    @property
    def activation_bytes(self) -> int:
        """What one micro-batch's forward leaves alive until its backward: the bytes its
        first forward adds, but the units it gathers (kept for every micro-batch)."""
        ops, timeline = self.plan.ops, self.plan.timeline
        end = next((i for i, op in enumerate(ops) if op.backward), len(ops))
        forward = [b for b, n in zip(timeline, self.plan.timeline_ops, strict=True) if n <= end]
        gathered = sum(op.io_bytes for op in ops[:end] if op.collective == "all_gather")
        return int(max(max(forward) - timeline[0] - gathered, 0))

    def busy_s(self, microbatches: int) -> float:
        return float(self.plan.step.seconds + (microbatches - 2) * self.microbatch.seconds)

    def flops(self, microbatches: int) -> float:
        return float(self.plan.step.flops + (microbatches - 2) * self.microbatch.flops)


def stage_setup(setup: Any) -> Any:
    """The setup each stage is simulated with (see the note)."""
    assert setup.pipeline is not None
    keep = setup.strategy.kept_gathered is not None and setup.reshard_after_forward is None
    return replace(
        setup,
        world_size=setup.world_size // setup.pipeline.ranks,
        grad_accum=2,
        accumulation="no_sync",
        reshard_after_forward=False if keep else setup.reshard_after_forward,
        pipeline=None,
    )


def stage_kinds(stages: int) -> list[int]:
    """The stages simulated: the first, one middle one (cut alike), the last."""
    return sorted({0, min(1, stages - 1), stages - 1})


def kind_of(stage: int, stages: int) -> int:
    return stage if stage in (0, stages - 1) else 1


def stage_inputs(
    build: Callable[[], nn.Module],
    inputs: Callable[[], tuple[torch.Tensor, ...]],
    pipeline: Pipeline,
    dtype: torch.dtype | None,
) -> list[tuple[tuple[tuple[int, ...], torch.dtype], ...]]:
    """Each stage's inputs (shapes and dtypes): the micro-batch, then what the stage before
    returns (run on the meta device; floats travel in ``dtype``, the compute dtype)."""
    specs = []
    with torch.device("meta"):
        batch = inputs()
        for stage in range(pipeline.stages):
            specs.append(tuple((tuple(t.shape), t.dtype) for t in batch))
            if stage == pipeline.stages - 1:
                break
            model = build()
            pipeline.cut(model, stage, pipeline.stages)
            with torch.no_grad():
                out = model(*batch)
            outs = out if isinstance(out, tuple) else (out,)
            batch = tuple(
                t.to(dtype) if dtype is not None and t.is_floating_point() else t for t in outs
            )
    return specs


def stage_parts(
    build: Callable[[], nn.Module],
    inputs: Callable[[], tuple[torch.Tensor, ...]],
    pipeline: Pipeline,
    stage: int,
    specs: tuple[tuple[tuple[int, ...], torch.dtype], ...],
) -> tuple[Callable[[], nn.Module], Callable[[], tuple[torch.Tensor, ...]], Any]:
    """The build, inputs and loss of ``stage`` as a model of its own (picklable where
    ``build``, ``inputs`` and the pipeline's functions are)."""
    last = stage == pipeline.stages - 1
    return (
        functools.partial(_stage_build, build, pipeline.cut, stage, pipeline.stages),
        inputs if stage == 0 else functools.partial(_stage_batch, specs),
        functools.partial(_stage_loss, pipeline.loss_fn if last else None, inputs),
    )


def input_bytes(specs: tuple[tuple[tuple[int, ...], torch.dtype], ...]) -> int:
    return sum(
        torch.Size(shape).numel() * torch.empty((), dtype=dtype).element_size()
        for shape, dtype in specs
    )


def _stage_build(build: Callable[[], nn.Module], cut: Cut, stage: int, stages: int) -> nn.Module:
    model = build()
    cut(model, stage, stages)
    return model


def _stage_batch(
    specs: tuple[tuple[tuple[int, ...], torch.dtype], ...],
) -> tuple[torch.Tensor, ...]:
    return tuple(torch.empty(shape, dtype=dtype) for shape, dtype in specs)


def _stage_loss(
    loss_fn: StageLoss | None,
    inputs: Callable[[], tuple[torch.Tensor, ...]],
    model: nn.Module,
    batch: tuple[torch.Tensor, ...],
) -> torch.Tensor:
    """The last stage: ``loss_fn`` of its output; the others: a scalar whose gradient is
    the one the next stage sends back (its values do not matter to a plan)."""
    out = model(*batch)
    outs = out if isinstance(out, tuple) else (out,)
    device = outs[0].device
    if loss_fn is not None:
        with device:  # the micro-batch the first stage took, for the target
            first = inputs()
        return loss_fn(out, first)
    zero = torch.zeros((), device=device)
    return sum((t.float().sum() for t in outs if t.is_floating_point()), zero)


def first_microbatch(ops: list[Any], cluster: Cluster, host: frozenset[int]) -> StepTime:
    """The time of the simulated step's first micro-batch (its ops up to the second's
    forward)."""
    for index in range(1, len(ops)):
        if ops[index - 1].backward and not ops[index].backward:
            return step_time(ops[:index], cluster, host)
    return step_time(ops, cluster, host)


def price(
    pipeline: Pipeline, kinds: dict[int, StagePlan], cluster: Cluster, world: int
) -> tuple[PipelineCost, int, float]:
    """The schedule around the stages' plans: the cost, the rank with the most memory and
    the step's seconds."""
    p, m, v, stages = (
        pipeline.ranks,
        pipeline.microbatches,
        pipeline.stages_per_rank,
        pipeline.stages,
    )
    ranks = []
    for rank in range(p):
        own = [kinds[kind_of(stage, stages)] for stage in range(rank, stages, p)]
        activations = sum(s.activation_bytes for s in own)
        in_flight = pipeline.in_flight(rank)
        extra = (in_flight - v) * activations // v
        # torch's stage keeps a receive buffer per micro-batch: activations coming in,
        # gradients coming back.
        extra += m * sum(s.input_bytes + s.output_bytes for s in own)
        ranks.append(
            PipelineRank(
                rank=rank,
                stages=tuple(range(rank, stages, p)),
                peak_memory_bytes=sum(s.plan.peak_memory_bytes for s in own) + extra,
                at_rest_bytes=sum(s.plan.at_rest_bytes for s in own),
                in_flight=in_flight,
                activation_bytes=activations,
                busy_s=sum(s.busy_s(m) for s in own),
            )
        )
    chunk = max(s.microbatch.seconds for s in kinds.values())
    sent = max(s.input_bytes for s in kinds.values())
    across = cluster.hosts > 1 and world // p >= cluster.ranks_per_host
    bandwidth = cluster.inter_bandwidth if across else cluster.intra_bandwidth
    latency = cluster.inter_latency if across else cluster.intra_latency
    hop = cluster.collective_latency + latency + sent / bandwidth
    send_s = 2 * (p - 1) * hop
    bubble = pipeline.bubble_slots * chunk
    seconds = max(r.busy_s for r in ranks) + bubble + send_s
    cost = PipelineCost(
        layout=pipeline,
        ranks=ranks,
        bubble_s=bubble,
        bubble_fraction=bubble / seconds if seconds else 0.0,
        send_bytes=2 * v * m * sent,
        send_s=send_s,
        links="inter-host" if across else "intra-host",
    )
    heaviest = max(ranks, key=lambda r: r.peak_memory_bytes).rank
    return cost, heaviest, seconds
