"""A pipeline schedule running a sharded model's step: what a stage of
``torch.distributed.pipelining`` needs of the runtime (``flatshard.integrations.pipelining``).

[Note: a schedule runs the step]
A schedule (GPipe, 1F1B, interleaved, zero-bubble) runs several micro-batches' forward
and backward passes through a stage before the optimizer steps, in an order of its own,
and may split a backward in two: the gradients of the stage's inputs first (sent on to
the stage before), the weights' gradients later. For the step it runs, the schedule owns
the switches FSDP2's pipelining integration flips (``ScheduledStep`` in the
``StepContext``):

- every backward pass keeps its gradient unreduced (sync off), and the units stay gathered
  after backward (``reshard_after_backward`` off), so that a weight-gradient pass finds
  what its graph saved;
- the last full backward of the step reduces as a backward always does (the reductions
  overlap its compute); where the weights' gradients come in a pass of their own, the
  reduction waits for the last of them (``end_step``): nothing reads a gradient that is
  not complete;
- at the end of the step the user's switches come back: a user's ``no_sync`` around the
  whole ``schedule.step()`` keeps the sum for a later step (accumulation across steps),
  a user's ``set_reshard_after_backward(False)`` keeps the units gathered.

Gathers then come from the switches as outside a pipeline: under FULL_SHARD each forward
gathers and frees again; with ``set_reshard_after_forward(model, False)`` each unit is
gathered once per step. Every rank of the stage's data-parallel group runs the same
schedule, so these switches are agreed by construction; the ranks compare what the
schedule ran (``ScheduledStep.actions``) before reducing, so a rank that skipped a
micro-batch is named instead of pairing its reductions with another rank's. Inside the
step, the sync switches by hand (``no_sync``, ``set_requires_gradient_sync``, ...) are
refused: the schedule would undo them.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import replace

import torch
import torch.distributed as dist
from torch import nn

from flatshard.comm._agreement import check_same_on_all_ranks, global_rank
from flatshard.comm._collectives import all_gather_into
from flatshard.comm._watchdog import NO_STEP, Tag, watchdog
from flatshard.flat._flat_param import FlatParamGroup
from flatshard.flat._reduction import Owed
from flatshard.runtime._configuration import describe
from flatshard.runtime._step import (
    PipelineSeat,
    ScheduledStep,
    StepContext,
    agree,
    agreed_in_this_call,
    contexts_under,
)
from flatshard.runtime._unit import Hold


def join_pipeline(
    model: nn.Module, group: dist.ProcessGroup, stage: int, stages: int, owner: str
) -> None:
    """``model`` is stage ``stage`` of ``stages`` of the pipeline over ``group``: its
    gradient norms add up over the stages ([Note: a norm over every stage]). A model
    sharded whole and cut afterwards is refused: its step (gathers, reductions, the
    end-of-step check) would span stages that torch's schedule runs apart."""
    contexts = contexts_under(model, owner)
    device = contexts[0].units[0].compute_device
    check_same_on_all_ranks(  # before any step: a wrong count hangs in torch's first sends
        [f"num_stages={stages}"],
        group,
        device,
        what="build pipeline stages with different numbers of stages",
        fix="Pass every rank's PipelineStage the same num_stages: the whole pipeline's.",
        caller="integrations.pipelining.PipelineStage",
    )
    factors = sorted({describe(u.config.gradient_divide_factor) for c in contexts for u in c.units})
    check_same_on_all_ranks(  # a norm over every stage adds gradients of one scale
        [f"set_gradient_divide_factor: {', '.join(factors)}"],
        group,
        device,
        what="divide their stages' gradients by other factors",
        fix="Give every stage the same set_gradient_divide_factor (or none): each stage's "
        "gradients would be scaled otherwise, the model's updates skewed.",
        caller="integrations.pipelining.PipelineStage",
    )
    inside = {id(m) for m in model.modules()}
    outside = [u.fqn or "<root>" for c in contexts for u in c.units if id(u.module) not in inside]
    if outside:
        raise ValueError(
            f"{owner}: stage {stage}'s module is part of a model sharded as one "
            f"(units outside it: {', '.join(outside[:4])}{', ...' if len(outside) > 4 else ''}"
            "): a sharded model's step cannot span pipeline stages. Cut the model into "
            "stages first, then call flatshard.fully_shard on each stage's module."
        )
    for context in contexts:
        context.pipeline = PipelineSeat(group, stage, stages)


def pipeline_total(
    contexts: list[StepContext], partial: torch.Tensor, inf: bool, caller: str
) -> torch.Tensor:
    """[Note: a norm over every stage]
    A gradient norm of pipeline stages: this rank's sum of |g|^p (or max) over
    ``contexts`` is added over the pipeline group, so every stage gets the norm of the
    whole model, as torchtitan's pipelined clipping does. The ranks send each other their
    share and the stages it covers (one all-gather): where one call does not cover every
    stage exactly once (interleaved schedules put several stages on a rank, and two calls
    would each add only their stage's share), every rank raises instead of clipping by a
    wrong norm."""
    seats = [c.pipeline for c in contexts if c.pipeline is not None]
    if not seats:
        return partial
    if len(seats) != len(contexts) or len({id(s.group) for s in seats}) > 1:
        raise ValueError(
            f"flatshard.{caller}: the gradients belong to models that are not stages of one "
            "pipeline; take the norm of one pipeline's stages at a time."
        )
    group, stages = seats[0].group, seats[0].stages
    mine = partial.new_zeros(1 + stages)
    mine[0] = partial
    for seat in seats:
        mine[1 + seat.stage] += 1
    dog = watchdog()
    # Every stage's ranks make the call ([Note: a pipeline step starts on every rank]):
    # agreed here unless the call's own entry took the pipeline group already.
    if dog is not None and not agreed_in_this_call(group):
        dog.entry(group, Tag(f"{caller} over every stage"))
    every = mine.new_empty(dist.get_world_size(group) * (1 + stages))
    all_gather_into(every, mine, group)
    every = every.view(-1, 1 + stages)
    covered = every[:, 1:].sum(0)
    if not bool((covered == 1).all()):
        missing = [i for i, n in enumerate(covered.tolist()) if n == 0]
        twice = [i for i, n in enumerate(covered.tolist()) if n > 1]
        found = [f"left out stages {missing}"] if missing else []
        found += [f"took stages {twice} more than once"] if twice else []
        raise ValueError(
            f"flatshard.{caller}: a norm over a pipeline's stages takes every stage once in "
            f"one call on each rank; this call {' and '.join(found)} (rank "
            f"{global_rank()}). Pass all of a rank's stage modules in "
            "one call: flatshard.clip_grad_norm_(nn.ModuleList(stage_modules), ...) or "
            "torch.nn.utils.clip_grad_norm_ over all their parameters."
        )
    return every[:, 0].max() if inf else every[:, 0].sum()


def stages_spanning(group: dist.ProcessGroup, seat: PipelineSeat) -> dist.ProcessGroup:
    """[Note: checkpoints of pipeline stages]
    A checkpoint of a pipelined model is one directory that every stage writes its part of
    under the original names (stages split as torchtitan splits them keep those): one DCP
    save over the ranks of every stage, so that it loads at any other layout, a pipeline of
    other stages, or the model without a pipeline. ``group``: the ranks a stage writes with
    (data-parallel, x tensor-parallel); with the pipeline's they must span the world (or a
    stage has one rank: the pipeline group itself). A rank holding several stages
    (interleaved schedules) would write one of them per call, each call a whole save of
    the directory: refused."""
    stages_here = seat.stages // dist.get_world_size(seat.group)
    if stages_here != 1:
        raise ValueError(
            f"flatshard: a checkpoint or an export of a pipeline whose ranks hold "
            f"{stages_here} stages each is not supported; each call would write the "
            "directory with one stage. "
            "Save from a layout with one stage per rank, or save each stage's "
            "full_state_dict (original names) and merge them."
        )
    if dist.get_world_size(group) == 1:
        return seat.group
    if dist.get_world_size(group) * dist.get_world_size(seat.group) == dist.get_world_size():
        world = dist.group.WORLD
        assert world is not None
        return world
    raise ValueError(
        "flatshard: a checkpoint of pipeline stages is written by the ranks of every stage "
        f"together, and the stage's {dist.get_world_size(group)} ranks x the pipeline's "
        f"{dist.get_world_size(seat.group)} do not span the world "
        f"({dist.get_world_size()} ranks)."
    )


def step_starts(group: dist.ProcessGroup) -> None:
    """[Note: a pipeline step starts on every rank]
    A rank of the pipeline that is still in a call every stage must make (a norm over
    every stage) while another has gone on to the next ``schedule.step()`` would wait for
    it for the process group's timeout: the other sits in torch's sends and receives,
    which flatshard does not see. So each schedule step (and evaluation) begins, on each
    stage, before any activation moves, with an entry every rank of the pipeline agrees on
    through the store, as those calls do: a rank at another call makes it a
    ``CollectiveMismatchError`` on every rank, within seconds. One store round trip a
    stage and step."""
    dog = watchdog()
    if dog is not None and group.size() > 1:  # (the phase says what; no count to drift)
        dog.entry(group, Tag("pipeline schedule step", step=NO_STEP))


def begin_step(model: nn.Module, owner: str) -> None:
    """The schedule starts a step of ``model`` (at its first forward): sync off, units
    kept gathered after backward; the user's switches saved."""
    for context in contexts_under(model, owner):
        if context.schedule is not None:
            continue
        context.schedule = ScheduledStep(owner, context.switches)
        context.switches = replace(
            context.switches, requires_gradient_sync=False, reshard_after_backward=False
        )


def note(model: nn.Module, action: str, agree_now: bool) -> None:
    """What the schedule runs next on this rank ("F0", "B", "I", "W"): compared at the end
    of the step, or (``agree_now``: a schedule's first step) before it runs, through the
    store: ranks of one stage that run different schedules (GPipe on one, 1F1B on another)
    would otherwise pair one's all-gather with the other's reduction, which gloo answers
    with an abort. A schedule runs the same actions every step, so its first step is
    where they can first differ; later steps are compared once, at their end."""
    for context in contexts_under(model, "PipelineStage"):
        if context.schedule is not None:
            context.schedule.actions.append(action)
            if agree_now:
                agree(model, f"{context.schedule.owner} runs {action}")


@contextmanager
def last_backward(model: nn.Module) -> Iterator[None]:
    """The step's last full backward pass reduces as it goes (where the user syncs)."""
    contexts = contexts_under(model, "PipelineStage")
    scheduled = [c for c in contexts if c.schedule is not None]
    for context in scheduled:
        assert context.schedule is not None
        _compare_actions(model, context)
        sync = context.schedule.user.requires_gradient_sync
        context.switches = replace(context.switches, requires_gradient_sync=sync)
    try:
        yield
    finally:
        for context in scheduled:
            context.switches = replace(context.switches, requires_gradient_sync=False)


def end_step(model: nn.Module) -> None:
    """The schedule is done with the step: reduce what backward passes kept (unless the
    user keeps it: ``no_sync`` around the step), then the user's switches come back and
    the units are freed as they say."""
    for context in contexts_under(model, "PipelineStage"):
        schedule = context.schedule
        if schedule is None:
            continue
        if schedule.actions:  # (not compared yet: no last full backward ran)
            _compare_actions(model, context)
        if schedule.user.requires_gradient_sync:
            _reduce_kept(context)
        context.switches = schedule.user
        context.schedule = None
        if context.reshard_after_backward:
            for unit in context.units:  # (a unit flatshard.unshard holds stays gathered)
                if unit.hold is Hold.NONE and unit.reshard():
                    context.rate_limiter.resharded()


def _compare_actions(model: nn.Module, context: StepContext) -> None:
    """Every rank of the stage ran the same micro-batches (before any reduction pairs)."""
    assert context.schedule is not None
    actions = " ".join(context.schedule.actions)
    context.schedule.actions = []
    agree(model, f"{context.schedule.owner} step [{actions}]")


def _reduce_kept(context: StepContext) -> None:
    """Reduce every gradient the step's backward passes kept, as a synchronized backward
    would at its end: one reduction per group, each waited for by the next."""
    in_flight = context.in_flight
    reduced = []
    for unit in reversed(context.units):  # the same order on every rank
        for flat in unit.trainable:
            if flat.reduction.owes is Owed.REDUCTION:
                in_flight = flat.placement.start_reduction(context.all_reduce_replicas, in_flight)
                reduced.append(flat)
    for flat in reduced:  # what the placement reduces at a backward's end (a table's rows)
        flat.placement.finish_reduction(context.all_reduce_replicas)
    for flat in reduced:
        flat.reduction.finish()
        flat.reduction.pass_ended()
    context.in_flight = None
    if reduced:
        if not context.stepped_by_optimizer:
            context.gradients_delivered()
        context.wait_host_copies()
        context.check_ledger("pipeline step", "end-of-step check")


def refuse_inside_schedule(contexts: list[StepContext], caller: str) -> None:
    """``no_sync`` and the switches by hand inside a schedule's step: the schedule turns
    them itself, and would undo them."""
    for context in contexts:
        if context.schedule is not None:
            raise RuntimeError(
                f"flatshard.{caller}: called inside a step that "
                f"{context.schedule.owner} runs (rank {global_rank()}); the pipeline "
                "schedule turns gradient sync and resharding on and off itself. Call it "
                "between schedule.step() calls: no_sync around a whole schedule.step() "
                "accumulates over steps."
            )


# ---------------------------------------------------------------------- weight gradients
def weight_leaves(model: nn.Module) -> list[torch.Tensor]:
    """The autograd leaves the model's weights are views of: one flat tensor per trainable
    group, where its gradient accumulates (``FlatParamGroup.unsharded``)."""
    return [flat.unsharded for flat in _trainable_groups(model)]


@contextmanager
def weights_gathered(model: nn.Module) -> Iterator[None]:
    """Around a weight-gradient pass: what its graph saved of the parameters is readable
    again, and the modules hold views of the gathered buffers (activation checkpointing
    recomputes forwards inside the pass). A forward since (FULL_SHARD) freed the buffers;
    gathering into the same storage makes the saved views valid again (see [Note: flat
    tensors and their lifetimes])."""
    units = [
        unit
        for context in contexts_under(model, "PipelineStage")
        for unit in context.units
        if unit.trainable
    ]
    for unit in units:
        unit.start_unshard()  # every gather in flight before the first wait
    with torch.enable_grad():  # views that a recomputed forward's graph can record
        for unit in units:
            unit.unshard()
    try:
        yield
    finally:
        for unit in units:
            unit.hide_views()


def add_weight_grads(model: nn.Module, grads: list[torch.Tensor | None]) -> None:
    """A weight-gradient pass's results (aligned with ``weight_leaves``), kept unreduced
    like any gradient of the step until ``end_step``."""
    for flat, grad in zip(_trainable_groups(model), grads, strict=True):
        if grad is None:
            continue
        flat.accumulate_grad(grad)
        flat.reduction.keep_unreduced()
        flat.reduction.pass_ended()


def _trainable_groups(model: nn.Module) -> list[FlatParamGroup]:
    """The model's trainable flat groups, in the same order on every call."""
    return [
        flat
        for context in contexts_under(model, "PipelineStage")
        for unit in context.units
        for flat in unit.trainable
    ]


_PREPARING: set[int] = set()  # pipeline groups whose schedule this rank is preparing


def schedule_runs(group: dist.ProcessGroup) -> None:
    """The schedule over ``group`` prepared its stages and runs: the next preparation (a
    new schedule) checks the micro-batch count again."""
    _PREPARING.discard(id(group))


def keeps_gradients(model: nn.Module) -> bool:
    """Whether gradients of the model wait unreduced (``no_sync`` around the step)."""
    return any(flat.reduction.keeps_gradients for flat in _trainable_groups(model))


def agree_microbatches(group: dist.ProcessGroup, device: torch.device, count: int) -> None:
    """The pipeline's ranks agree on the micro-batch count before any activation is
    sent: a mismatch would leave a stage waiting for a micro-batch that never comes.

    Once per schedule, by the first stage it prepares on each rank, before any of its
    activations moves; the rank's later stages (interleaved schedules) skip it until the
    schedule runs (``schedule_runs``): their checks would pair with another rank's sends."""
    if id(group) in _PREPARING:
        return
    _PREPARING.add(id(group))
    try:
        check_same_on_all_ranks(
            [f"n_microbatches={count}"],
            group,
            device,
            what="run pipeline schedules with different micro-batch counts",
            fix="Build the schedule with the same n_microbatches on every rank.",
            caller="integrations.pipelining.PipelineStage",
        )
    except ValueError:
        _PREPARING.discard(id(group))  # the next schedule is checked again
        raise
