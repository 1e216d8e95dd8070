"""Pipeline parallelism: flatshard-sharded stages in torch.distributed.pipelining's schedules.

A stack of residual MLP blocks is cut into stages (one block each), each stage sharded with
flatshard over its data-parallel group and run by torch's own schedules through
``flatshard.integrations.pipelining.PipelineStage``: GPipe, 1F1B, Interleaved1F1B and the
two zero-bubble schedules (backward split into input and weight passes). Against DDP's
semantics (the unsharded model, each data-parallel rank's batch cut into the same
micro-batches, the schedule's mean loss, gradients averaged over the ranks), parameters
after three SGD steps agree to fp32 noise at PP2 x DP2 and PP4 (4 ranks) and PP2 (2
ranks), under FULL_SHARD and SHARD_GRAD_OP, with flatshard's and torch's clipping over all
stages. Collectives per step by formula: each group gathered once and reduced once where
units stay gathered; in zero-bubble schedules the reductions come after the stage's last
weight pass; point-to-point sends and receives, one per micro-batch and neighbouring stage
on another rank. The planner's price of a pipeline against a measured run. Misuse: stages
that disagree on the micro-batch count, the sync switches inside a schedule's step, a
module flatshard did not shard, accumulation over steps with the schedule's per-step
division. See [Note: a schedule runs the step].
"""

from __future__ import annotations

import copy
import math
import re
from pathlib import Path
from typing import Any, ClassVar

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.pipelining import (
    Schedule1F1B,
    ScheduleDualPipeV,
    ScheduleGPipe,
    ScheduleInterleaved1F1B,
    ScheduleInterleavedZeroBubble,
    ScheduleLoopedBFS,
    ScheduleZBVZeroBubble,
)
from torch.utils.checkpoint import checkpoint

import flatshard
from flatshard.integrations.pipelining import PipelineStage
from flatshard.measure import ALL_GATHER, ALL_REDUCE, ALL_TO_ALL, RECV, SEND, CollectiveTracker
from flatshard.testing.internals import agreements_on
from flatshard.testing.isolated import run_isolated
from flatshard.testing.workers import WorkerContext, WorkerPool

DIM, MICRO, BATCH, STEPS, LR = 16, 4, 8, 3, 0.1
SCHEDULES: dict[str, Any] = {
    "gpipe": ScheduleGPipe,
    "1f1b": Schedule1F1B,
    "interleaved": ScheduleInterleaved1F1B,
    "zero-bubble": ScheduleInterleavedZeroBubble,
    "zbv": ScheduleZBVZeroBubble,
    "looped-bfs": ScheduleLoopedBFS,
    "dualpipev": ScheduleDualPipeV,
}
MULTI = {"interleaved", "zero-bubble", "zbv", "looped-bfs", "dualpipev"}  # 2 stages a rank
TOLERANCE = 2e-6  # relative, fp32


class Block(nn.Module):
    def __init__(self, checkpointed: bool = False) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(DIM)
        self.up = nn.Linear(DIM, 2 * DIM)
        self.down = nn.Linear(2 * DIM, DIM)
        self.checkpointed = checkpointed  # activation checkpointing of the MLP

    def mlp(self, x: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = self.down(torch.nn.functional.gelu(self.up(self.norm(x))))
        return out

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.checkpointed:
            return x + checkpoint(self.mlp, x, use_reentrant=False)
        return x + self.mlp(x)


def mse(out: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return ((out - target) ** 2).mean()


_GROUPS: dict[tuple[int, int], tuple[list[Any], list[Any]]] = {}


def _groups(pp: int, dp: int) -> tuple[list[Any], list[Any]]:
    """The data-parallel groups (one per stage position) and pipeline groups (one per
    data-parallel rank) of a pp x dp layout on ranks 0..pp*dp-1 (pp-major, as
    ``init_device_mesh(("pp", "dp"))``); every rank of the world makes them, in order."""
    if (pp, dp) not in _GROUPS:
        dps = [dist.new_group([i * dp + j for j in range(dp)]) for i in range(pp)]
        pps = [dist.new_group([i * dp + j for i in range(pp)]) for j in range(dp)]
        _GROUPS[pp, dp] = (dps, pps)
    return _GROUPS[pp, dp]


_MESHES: dict[int, Any] = {}


def _hybrid_mesh(pp: int) -> Any:
    """torchtitan's way: one mesh with named dimensions over the world, ("pp",
    "dp_replicate", "dp_shard") = (pp, 2, 1); the stage gets its (replicate, shard) sub-mesh."""
    if pp not in _MESHES:
        _MESHES[pp] = init_device_mesh(
            "cpu", (pp, 2, 1), mesh_dim_names=("pp", "dp_replicate", "dp_shard")
        )
    return _MESHES[pp]


def _stage_ids(schedule: str, pp: int, pp_rank: int) -> list[int]:
    if schedule in ("zbv", "dualpipev"):  # V-shaped: a rank's stages at both ends
        return [pp_rank, 2 * pp - 1 - pp_rank]
    if schedule in MULTI:
        return [pp_rank, pp_rank + pp]
    return [pp_rank]


def _relative(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).detach().norm() / b.detach().norm().clamp_min(1e-12))


def _moved(trained: nn.Module, initial: nn.Module) -> float:
    """How far training moved the parameters (relative): a run that did not train fails."""
    pairs = zip(trained.parameters(), initial.parameters(), strict=True)
    return max(_relative(p, q) for p, q in pairs)


def _steps_beside_reference(
    rank: int, runner: Any, optim: Any, reference: nn.Module, clip: nn.Module | None = None
) -> None:
    """STEPS steps of a PP2 x DP2 run (pp-major ranks) and of the unsharded ``reference``
    on the same data, DDP's semantics (each DP rank's micro-batches, averaged); ``clip``:
    clip both to 0.5 (flatshard's on that stage module, torch's on the reference)."""
    pp_rank, dp_rank = divmod(rank, 2)
    ref_optim = torch.optim.SGD(reference.parameters(), lr=LR)
    for step in range(STEPS):
        gen = torch.Generator().manual_seed(step)
        xs = torch.randn(2, BATCH, DIM, generator=gen)
        ys = torch.randn(2, BATCH, DIM, generator=gen)
        if pp_rank == 0:
            runner.step(xs[dp_rank])
        else:
            runner.step(target=ys[dp_rank])
        if clip is not None:
            flatshard.clip_grad_norm_(clip, 0.5)
        optim.step()
        optim.zero_grad()
        for r in range(2):
            for xm, ym in zip(xs[r].chunk(MICRO), ys[r].chunk(MICRO), strict=True):
                (mse(reference(xm), ym) / (MICRO * 2)).backward()
        if clip is not None:
            torch.nn.utils.clip_grad_norm_(reference.parameters(), 0.5)
        ref_optim.step()
        ref_optim.zero_grad()


def pipeline_job(
    ctx: WorkerContext,
    schedule: str,
    pp: int,
    dp: int,
    strategy: str = "FULL_SHARD",
    keep: bool = False,
    clip: str = "",
    variant: str = "",
) -> dict[str, Any] | None:
    """STEPS optimizer steps of a pipelined run and of the unsharded reference.
    ``variant`` "checkpointed-frozen": activation checkpointing in every block, and some
    parameters frozen (their own flat groups, gathered but never reduced)."""
    dps, pps = _groups(pp, dp)
    mesh = _hybrid_mesh(pp) if strategy == "HYBRID_SHARD" else None
    if ctx.rank >= pp * dp:
        return None
    pp_rank, dp_rank = divmod(ctx.rank, dp)
    ids = _stage_ids(schedule, pp, pp_rank)
    data_parallel = dps[pp_rank] if mesh is None else mesh["dp_replicate", "dp_shard"]
    pipeline = pps[dp_rank] if mesh is None else mesh["pp"].get_group()
    n_stages = pp * (2 if schedule in MULTI else 1)
    torch.manual_seed(0)
    reference = nn.Sequential(*[Block(checkpointed=bool(variant)) for _ in range(n_stages)])
    if variant:
        for block in reference:
            block.norm.requires_grad_(False)
            block.up.bias.requires_grad_(False)
    initial = copy.deepcopy(reference)
    modules, stages = [], []
    for index in ids:
        module = nn.Sequential(copy.deepcopy(initial[index]))
        flatshard.fully_shard(
            module,
            auto_wrap_policy={Block},
            process_group=data_parallel,
            strategy=flatshard.ShardingStrategy[strategy],
        )
        if keep:
            flatshard.set_reshard_after_forward(module, False)
        modules.append(module)
        stages.append(PipelineStage(module, index, n_stages, torch.device("cpu"), group=pipeline))
    runner = SCHEDULES[schedule](stages if schedule in MULTI else stages[0], MICRO, loss_fn=mse)
    params = [p for m in modules for p in m.parameters() if p.requires_grad]
    optim = torch.optim.SGD(params, lr=LR)
    ref_optim = torch.optim.SGD([p for p in reference.parameters() if p.requires_grad], lr=LR)
    flats = sum(f.requires_grad for m in modules for f in flatshard.sharding_summary(m).flat_params)
    gathers, reductions, norms, p2p = [], [], [], []
    clip_agreements: list[int] = []
    for step in range(STEPS):
        gen = torch.Generator().manual_seed(step)
        xs = torch.randn(dp, BATCH, DIM, generator=gen)
        ys = torch.randn(dp, BATCH, DIM, generator=gen)
        with CollectiveTracker() as tracker:
            first, last = 0 in ids, n_stages - 1 in ids
            args = (xs[dp_rank],) if first else ()
            runner.step(*args, target=ys[dp_rank] if last else None)
            before = agreements_on(pipeline)
            if clip == "flatshard":
                norms.append(float(flatshard.clip_grad_norm_(nn.ModuleList(modules), 0.5)))
            elif clip == "torch":
                norms.append(float(torch.nn.utils.clip_grad_norm_(params, 0.5)))
            clip_agreements.append(agreements_on(pipeline) - before)
            optim.step()
            optim.zero_grad()
        big = [(kind, size) for kind, size in tracker.ops if size > 64]  # not the digests
        gathers.append(sum(kind == ALL_GATHER for kind, _ in big))
        reductions.append(sum(kind in (ALL_TO_ALL, ALL_REDUCE) for kind, _ in big))
        p2p.append((tracker.counts[SEND], tracker.counts[RECV]))
        ref_optim.zero_grad()
        for r in range(dp):  # DDP's semantics: each rank's micro-batches, averaged
            for xm, ym in zip(xs[r].chunk(MICRO), ys[r].chunk(MICRO), strict=True):
                (mse(reference(xm), ym) / (MICRO * dp)).backward()
        if clip:
            norms.append(float(torch.nn.utils.clip_grad_norm_(reference.parameters(), 0.5)))
        ref_optim.step()
    moved = _moved(reference, initial)
    worst = 0.0
    for index, module in zip(ids, modules, strict=True):
        with flatshard.summon_full_params(module):
            for p, q in zip(module.parameters(), reference[index].parameters(), strict=True):
                worst = max(worst, _relative(p.detach(), q.detach()))
    sends = _point_to_point(schedule, pp, ids)
    return {
        "worst": worst,
        "moved": moved,
        "norms": norms,
        "gathers": gathers,
        "reductions": reductions,
        "flats": flats,
        "p2p": p2p,
        "p2p_formula": [(sends, sends)] * STEPS,
        "clip_agreements": clip_agreements,
        "clip": clip,
    }


def _point_to_point(schedule: str, pp: int, ids: list[int]) -> int:
    """Sends (and receives) of a rank per step, by formula: for each of its stages, one per
    micro-batch to each neighbouring stage on another rank (activations forward, their
    gradient back); the V-shaped schedules hold stages pp - 1 and pp on one rank, which
    pass each other tensors without sending."""
    n_stages = pp * (2 if schedule in MULTI else 1)
    owner = {s: r for r in range(pp) for s in _stage_ids(schedule, pp, r)}
    crossings = sum(
        owner[neighbour] != owner[stage]
        for stage in ids
        for neighbour in (stage - 1, stage + 1)
        if 0 <= neighbour < n_stages
    )
    return MICRO * crossings


def _check(results: list[dict[str, Any] | None]) -> list[dict[str, Any]]:
    found = [r for r in results if r is not None]
    for result in found:
        assert result["moved"] > 1e-3  # the reference trained
        assert result["worst"] < TOLERANCE, result
        norms = result["norms"]
        for ours, theirs in zip(norms[0::2], norms[1::2], strict=True):
            assert math.isclose(ours, theirs, rel_tol=1e-5), norms  # the global norm
        if "p2p" in result:  # the first step's also exchange the stages' shapes
            assert result["p2p"][1:] == result["p2p_formula"][1:], result
        if result.get("clip"):  # one round trip to the store per clip: the call's entry
            assert result["clip_agreements"] == [1] * STEPS, result["clip_agreements"]
    return found


@pytest.mark.parametrize(
    ("schedule", "strategy", "clip"),
    [
        ("gpipe", "FULL_SHARD", "flatshard"),
        ("1f1b", "SHARD_GRAD_OP", "torch"),
        ("interleaved", "FULL_SHARD", ""),
        ("zero-bubble", "FULL_SHARD", "flatshard"),
        ("zbv", "SHARD_GRAD_OP", "torch"),
        ("zero-bubble", "HYBRID_SHARD", "torch"),
        ("1f1b", "HYBRID_SHARD", "flatshard"),
    ],
)
def test_pp2_by_dp2_matches_ddp_semantics(
    pool: WorkerPool, schedule: str, strategy: str, clip: str
) -> None:
    """PP2 x DP2 at 4 ranks; the reductions are all-to-alls (gloo's reduce-scatter form),
    or, HYBRID_SHARD with a shard group of one, all-reduces across the 2 replicas."""
    for result in _check(pool.run(pipeline_job, schedule, 2, 2, strategy, False, clip)):
        # each group reduced once per step, whatever the schedule
        assert result["reductions"] == [result["flats"]] * STEPS


@pytest.mark.parametrize("schedule", ["zero-bubble", "1f1b"])
def test_activation_checkpointing_and_frozen_parameters_in_stages(
    pool: WorkerPool, schedule: str
) -> None:
    """Recomputation inside a split backward's weight pass finds its unit gathered; frozen
    groups are gathered for both passes and never reduced."""
    args = (schedule, 2, 2, "FULL_SHARD", False, "flatshard", "checkpointed-frozen")
    for result in _check(pool.run(pipeline_job, *args)):
        assert result["reductions"] == [result["flats"]] * STEPS  # trainable groups only


@pytest.mark.parametrize("schedule", ["interleaved", "zero-bubble", "zbv"])
def test_pp4_interleaved_matches(pool: WorkerPool, schedule: str) -> None:
    _check(pool.run(pipeline_job, schedule, 4, 1, "FULL_SHARD", False, "flatshard"))


@pytest.mark.parametrize("schedule", ["1f1b", "zero-bubble"])
def test_pp2_at_two_ranks_matches(pool: WorkerPool, schedule: str) -> None:
    _check(pool.run(pipeline_job, schedule, 2, 1, "FULL_SHARD", False, "torch"))


def debug_pipeline_job(ctx: WorkerContext, schedule: str) -> dict[str, Any] | None:
    """``pipeline_job`` at PP2 with flatshard's clip, every collective agreed first."""
    flatshard.set_checks(flatshard.Checks(debug=True))
    try:
        result = pipeline_job(ctx, schedule, 2, 1, "FULL_SHARD", False, "flatshard")
        if result is not None:  # debug mode agrees each collective too: no count to check
            result.pop("clip")
        return result
    finally:
        flatshard.set_checks(flatshard.Checks())


@pytest.mark.parametrize("schedule", ["1f1b", "zero-bubble"])
def test_debug_mode_agrees_a_pipelines_collectives_without_false_mismatches(
    pool: WorkerPool, schedule: str
) -> None:
    """Before: ``Checks(debug=True)`` (``FLATSHARD_DEBUG=1``, which diagnoses advise)
    raised a CollectiveMismatchError at the norm over every stage: the stages' records of
    one all-gather differed in their step, which each stage counts for itself."""
    _check(pool.run(debug_pipeline_job, schedule))


@pytest.mark.parametrize("schedule", list(SCHEDULES))
def test_kept_units_are_gathered_once_per_step(pool: WorkerPool, schedule: str) -> None:
    """With ``set_reshard_after_forward(False)`` each group is gathered once per optimizer
    step across all micro-batches (and again after the step: the shards changed)."""
    for result in _check(pool.run(pipeline_job, schedule, 2, 2, "FULL_SHARD", True)):
        assert result["gathers"] == [result["flats"]] * STEPS
        assert result["reductions"] == [result["flats"]] * STEPS


class RecordingStage(PipelineStage):
    """Notes where its weight passes and its end-of-step reduction fall among the
    collectives a tracker has seen so far."""

    tracker: ClassVar[CollectiveTracker | None] = None
    events: ClassVar[list[tuple[str, int, int]]] = []  # (what, stage, collectives before)

    def _note(self, what: str) -> None:
        assert self.tracker is not None
        self.events.append((what, self.stage_index, len(self.tracker.ops)))

    def backward_weight_one_chunk(self, bwd_chunk_id: int, last_backward: bool = False) -> None:
        self._note("W starts")
        super().backward_weight_one_chunk(bwd_chunk_id, last_backward=last_backward)
        self._note("W ends")

    def perform_reduce_grad(self, grad_scale_factor: int) -> None:
        self._note("reduce starts")
        super().perform_reduce_grad(grad_scale_factor)
        self._note("reduce ends")


def zero_bubble_order_job(ctx: WorkerContext) -> dict[str, Any] | None:
    dps, pps = _groups(2, 2)
    if ctx.rank >= 4:
        return None
    pp_rank, dp_rank = divmod(ctx.rank, 2)
    ids = _stage_ids("zero-bubble", 2, pp_rank)
    torch.manual_seed(0)
    stages, modules = [], []
    for index in ids:
        module = flatshard.fully_shard(
            nn.Sequential(Block()), auto_wrap_policy={Block}, process_group=dps[pp_rank]
        )
        modules.append(module)
        stages.append(RecordingStage(module, index, 4, torch.device("cpu"), group=pps[dp_rank]))
    runner = ScheduleInterleavedZeroBubble(stages, MICRO, loss_fn=mse)
    RecordingStage.events = []
    with CollectiveTracker() as tracker:
        RecordingStage.tracker = tracker
        x, y = torch.randn(BATCH, DIM), torch.randn(BATCH, DIM)
        runner.step(*((x,) if 0 in ids else ()), target=y if 3 in ids else None)
    reductions = [i for i, (kind, size) in enumerate(tracker.ops) if kind == ALL_TO_ALL]
    return {"events": RecordingStage.events, "reductions": reductions}


def test_zero_bubble_reduces_after_the_last_weight_pass(pool: WorkerPool) -> None:
    """Every reduction is issued after its stage's last weight pass began: inside the
    stage's end-of-step reduction, or, for the first stage (whose weight pass is a whole
    backward: it has no input gradient to send), inside that last pass, each group once
    its gradient is complete. A reduction issued earlier (at the last input pass, or in
    an earlier weight pass) fails this."""
    for result in pool.run(zero_bubble_order_job):
        events, reductions = result["events"], result["reductions"]
        windows = []
        for stage in {s for _, s, _ in events}:
            mine = [(what, at) for what, s, at in events if s == stage]
            starts = [at for what, at in mine if what == "W starts"]
            ends = [at for what, at in mine if what == "W ends"]
            assert len(starts) == MICRO  # the backward was split: one weight pass each
            windows.append((max(starts), max(ends)))  # the last weight pass
            (start,) = [at for what, at in mine if what == "reduce starts"]
            (end,) = [at for what, at in mine if what == "reduce ends"]
            assert max(ends) <= start
            windows.append((start, end))
        assert reductions
        for index in reductions:
            assert any(start <= index < end for start, end in windows), (index, events)


def _single_stage(group: Any, scale_grads: bool = True) -> tuple[nn.Module, Any, nn.Module]:
    torch.manual_seed(0)
    reference = nn.Sequential(Block(), Block())
    module = flatshard.fully_shard(
        copy.deepcopy(reference), auto_wrap_policy={Block}, process_group=group
    )
    stage = PipelineStage(module, 0, 1, torch.device("cpu"), group=group)
    return module, ScheduleGPipe(stage, 2, loss_fn=mse, scale_grads=scale_grads), reference


def test_sync_switches_inside_a_schedules_step_are_refused(local_group: Any) -> None:
    module, runner, _ = _single_stage(local_group)

    def meddling_loss(out: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        flatshard.set_requires_gradient_sync(module, True)
        return mse(out, target)

    runner._loss_fn = meddling_loss
    with pytest.raises(RuntimeError, match=r"inside a step that flatshard PipelineStage 0 of 1"):
        runner.step(torch.randn(BATCH, DIM), target=torch.randn(BATCH, DIM))


def test_a_module_flatshard_did_not_shard_is_refused(local_group: Any) -> None:
    with pytest.raises(ValueError, match=r"is not sharded; call flatshard.fully_shard"):
        PipelineStage(nn.Sequential(Block()), 0, 1, torch.device("cpu"), group=local_group)


def test_a_tied_embedding_and_head_cut_apart_are_refused(local_group: Any) -> None:
    """A GPT (and a Hugging Face model) that declares its embedding and head tied, cut so
    that a stage holds one of them: refused on the stage of either, with the fix; untied,
    or with both on one stage, accepted."""
    from flatshard.models import GPT, GPTBlock
    from flatshard.models.gpt import cut_to_stage

    def stage(index: int, tied: bool) -> PipelineStage:
        model = GPT(64, 16, 2, 2, 8, tied=tied)
        cut_to_stage(model, index, 2)
        sharded = flatshard.fully_shard(
            model, auto_wrap_policy={GPTBlock}, process_group=local_group
        )
        return PipelineStage(sharded, index, 2, torch.device("cpu"), group=local_group)

    for index, held in ((0, "input embedding ('tok')"), (1, "output head ('head')")):
        with pytest.raises(ValueError, match=rf"stage {index} holds the {re.escape(held)} but"):
            stage(index, tied=True)
    with pytest.raises(ValueError, match=r"Untie them before cutting .* GPT\(\.\.\., tied=False\)"):
        stage(1, tied=True)
    stage(1, tied=False)
    whole = flatshard.fully_shard(GPT(64, 16, 2, 2, 8), process_group=local_group)
    PipelineStage(whole, 0, 1, torch.device("cpu"), group=local_group)
    transformers = pytest.importorskip("transformers")
    config = transformers.LlamaConfig(
        vocab_size=64, hidden_size=16, intermediate_size=32, num_hidden_layers=2,
        num_attention_heads=2, num_key_value_heads=2, tie_word_embeddings=True,
    )  # fmt: skip
    llama = transformers.LlamaForCausalLM(config)
    llama.model.embed_tokens = None  # the last stage, cut torchtitan's way
    sharded = flatshard.fully_shard(llama, process_group=local_group)
    with pytest.raises(ValueError, match=r"holds the output head \('lm_head'\)"):
        PipelineStage(sharded, 1, 2, torch.device("cpu"), group=local_group)


def test_a_stage_cut_from_a_model_sharded_whole_is_refused(local_group: Any) -> None:
    """fully_shard on the whole model, then a block of it as a stage: the units of the
    model's one step lie in other stages; refused with the order that works."""
    whole = flatshard.fully_shard(
        nn.Sequential(Block(), Block()), auto_wrap_policy={Block}, process_group=local_group
    )
    refused = r"stage 0's module is part of a model sharded as one \(units outside it: 1\)"
    with pytest.raises(ValueError, match=refused + r".*Cut the model into stages first"):
        PipelineStage(whole[0], 0, 2, torch.device("cpu"), group=local_group)


def test_accumulating_over_steps(local_group: Any) -> None:
    """no_sync around schedule.step() keeps the sum for the next step: refused where the
    schedule divides each step by its micro-batch count, exact where the loss does."""
    x, y = torch.randn(2, BATCH, DIM), torch.randn(2, BATCH, DIM)
    module, runner, _ = _single_stage(local_group)
    with flatshard.no_sync(module), pytest.raises(RuntimeError, match=r"scale_grads=False"):
        runner.step(x[0], target=y[0])

    module, runner, reference = _single_stage(local_group, scale_grads=False)
    runner._loss_fn = lambda out, target: mse(out, target) / 4  # 2 steps x 2 micro-batches
    with flatshard.no_sync(module):
        runner.step(x[0], target=y[0])
    runner.step(x[1], target=y[1])
    for xm, ym in zip(x.reshape(4, -1, DIM), y.reshape(4, -1, DIM), strict=True):
        (mse(reference(xm), ym) / 4).backward()
    got = [p.grad for p in module.parameters()]
    want = [p.grad for p in reference.parameters()]
    for g, w in zip(got, want, strict=True):
        assert g is not None and w is not None
        torch.testing.assert_close(g, w, rtol=1e-5, atol=1e-7)


def microbatch_mismatch_job(ctx: WorkerContext) -> str | None:
    dps, pps = _groups(2, 1)
    if ctx.rank >= 2:
        return None
    module = flatshard.fully_shard(
        nn.Sequential(Block()), auto_wrap_policy={Block}, process_group=dps[ctx.rank]
    )
    stage = PipelineStage(module, ctx.rank, 2, torch.device("cpu"), group=pps[0])
    runner = ScheduleGPipe(stage, 4 if ctx.rank == 0 else 2, loss_fn=mse)
    try:
        x, y = torch.randn(BATCH, DIM), torch.randn(BATCH, DIM)
        runner.step(*((x,) if ctx.rank == 0 else ()), target=y if ctx.rank == 1 else None)
    except ValueError as error:
        return str(error)
    return "no error"


def test_stages_that_disagree_on_the_micro_batch_count_are_named(pool: WorkerPool) -> None:
    for message in pool.run(microbatch_mismatch_job)[:2]:
        assert "different micro-batch counts" in message, message
        assert "n_microbatches=4" in message and "n_microbatches=2" in message


def tensor_parallel_job(ctx: WorkerContext, schedule: str) -> dict[str, Any] | None:
    """PP2 x TP2 on one ("pp", "dp", "tp") mesh: each stage's MLP column- and row-parallel
    over "tp", flatshard over "dp" (one rank here), the stage over "pp"."""
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        RowwiseParallel,
        parallelize_module,
    )

    mesh = _MESHES.get(-1)
    if mesh is None:
        mesh = _MESHES[-1] = init_device_mesh("cpu", (2, 1, 2), mesh_dim_names=("pp", "dp", "tp"))
    pp_rank = mesh.get_local_rank("pp")
    ids = _stage_ids(schedule, 2, pp_rank)
    n_stages = 2 * (2 if schedule in MULTI else 1)
    torch.manual_seed(0)
    reference = nn.Sequential(*[Block() for _ in range(n_stages)])
    initial = copy.deepcopy(reference)
    modules, stages = [], []
    for index in ids:
        module = nn.Sequential(copy.deepcopy(initial[index]))
        parallelize_module(
            module, mesh["tp"], {"0.up": ColwiseParallel(), "0.down": RowwiseParallel()}
        )
        flatshard.fully_shard(module, auto_wrap_policy={Block}, process_group=mesh["dp"])
        modules.append(module)
        stages.append(
            PipelineStage(
                module, index, n_stages, torch.device("cpu"), group=mesh["pp"].get_group()
            )
        )
    runner = SCHEDULES[schedule](stages if schedule in MULTI else stages[0], MICRO, loss_fn=mse)
    optim = torch.optim.SGD([p for m in modules for p in m.parameters()], lr=LR)
    ref_optim = torch.optim.SGD(reference.parameters(), lr=LR)
    norms = []
    for step in range(STEPS):
        gen = torch.Generator().manual_seed(step)
        x, y = torch.randn(BATCH, DIM, generator=gen), torch.randn(BATCH, DIM, generator=gen)
        runner.step(*((x,) if 0 in ids else ()), target=y if n_stages - 1 in ids else None)
        norms.append(float(flatshard.clip_grad_norm_(nn.ModuleList(modules), 0.5)))
        optim.step()
        optim.zero_grad()
        ref_optim.zero_grad()
        for xm, ym in zip(x.chunk(MICRO), y.chunk(MICRO), strict=True):
            (mse(reference(xm), ym) / MICRO).backward()
        norms.append(float(torch.nn.utils.clip_grad_norm_(reference.parameters(), 0.5)))
        ref_optim.step()
    moved = _moved(reference, initial)
    worst = 0.0
    for index, module in zip(ids, modules, strict=True):
        full = flatshard.full_state_dict(module, rank0_only=False)
        for name, q in reference[index].state_dict().items():
            worst = max(worst, _relative(full[f"0.{name}"], q))
    return {"worst": worst, "moved": moved, "norms": norms}


@pytest.mark.parametrize("schedule", ["1f1b", "zero-bubble"])
def test_pp2_by_tp2_matches(pool: WorkerPool, schedule: str) -> None:
    _check(pool.run(tensor_parallel_job, schedule))


class Stack(nn.Module):
    """Blocks under their own names: a stage keeps the names of the whole model."""

    def __init__(self, blocks: int) -> None:
        super().__init__()
        self.blocks = nn.ModuleDict({str(i): Block() for i in range(blocks)})

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks.values():
            x = block(x)
        return x


def _cut(model: Stack, keep: list[int]) -> Stack:
    """A stage as torchtitan cuts one: the whole model, the other stages' blocks deleted."""
    stage = copy.deepcopy(model)
    for name in [n for n in stage.blocks if int(n) not in keep]:
        del stage.blocks[name]
    return stage


def _schedule(pp: int, dp: int, rank: int, stage: Stack) -> Any:
    """GPipe over the stage: a pipeline stage before its checkpoint loads, as torchtitan
    builds them."""
    pp_rank, dp_rank = divmod(rank, dp)
    group = _groups(pp, dp)[1][dp_rank]
    return ScheduleGPipe(
        PipelineStage(stage, pp_rank, pp, torch.device("cpu"), group=group), MICRO, loss_fn=mse
    )


def _pipelined_step(pp: int, dp: int, rank: int, runner: Any, x: Any, y: Any) -> None:
    pp_rank, dp_rank = divmod(rank, dp)
    first, last = pp_rank == 0, pp_rank == pp - 1
    runner.step(*((x[dp_rank],) if first else ()), target=y[dp_rank] if last else None)


def _reference_step(model: Stack, optim: Any, x: Any, y: Any) -> None:
    for r in range(x.shape[0]):
        for xm, ym in zip(x[r].chunk(MICRO), y[r].chunk(MICRO), strict=True):
            (mse(model(xm), ym) / (MICRO * x.shape[0])).backward()
    optim.step()
    optim.zero_grad()


def checkpoint_job(ctx: WorkerContext, path: str) -> dict[str, float]:
    """Train at PP2 x DP2 and save; load at DP4 without a pipeline and at PP4; one more
    step each, against the unsharded model (its Adam state too) continued alike."""
    dps, _ = _groups(2, 2)
    _groups(4, 1)
    torch.manual_seed(0)
    whole = Stack(4)
    reference = copy.deepcopy(whole)
    ref_optim = torch.optim.Adam(reference.parameters(), lr=1e-2)
    data = [
        (torch.randn(4, BATCH, DIM, generator=torch.Generator().manual_seed(s)),) * 2
        for s in range(3)
    ]
    data = [(x, torch.randn_like(x)) for (x, _) in data]
    pp_rank, _ = divmod(ctx.rank, 2)
    stage = flatshard.fully_shard(
        _cut(whole, [2 * pp_rank, 2 * pp_rank + 1]),
        auto_wrap_policy={Block},
        process_group=dps[pp_rank],
    )
    optim = torch.optim.Adam(stage.parameters(), lr=1e-2)
    runner = _schedule(2, 2, ctx.rank, stage)
    for x, y in data[:2]:  # PP2 x DP2: each DP rank's 2 of the 4 batches
        xs, ys = x.view(2, 2 * BATCH, DIM), y.view(2, 2 * BATCH, DIM)
        _pipelined_step(2, 2, ctx.rank, runner, xs, ys)
        optim.step()
        optim.zero_grad()
        _reference_step(reference, ref_optim, xs, ys)
    flatshard.save_checkpoint(path, stage, optim)
    x, y = data[2]
    errors = {}
    if ctx.rank == 0:  # the plain model, in one process: every stage's part
        plain = Stack(4)
        flatshard.load_checkpoint(path, plain)
        want = dict(reference.named_parameters())
        errors["plain"] = max(_relative(p, want[n]) for n, p in plain.named_parameters())

    # DP4, no pipeline: the whole model, every block from the two stages' writes
    model = flatshard.fully_shard(Stack(4), auto_wrap_policy={Block}, process_group=ctx.group(4))
    model_optim = torch.optim.Adam(model.parameters(), lr=1e-2)
    flatshard.load_checkpoint(path, model, model_optim)
    mse(model(x[ctx.rank]), y[ctx.rank]).backward()
    model_optim.step()
    # PP4: one block per rank
    stage4 = flatshard.fully_shard(
        _cut(Stack(4), [ctx.rank]),
        auto_wrap_policy={Block},
        process_group=_groups(4, 1)[0][ctx.rank],
    )
    stage4_optim = torch.optim.Adam(stage4.parameters(), lr=1e-2)
    runner4 = _schedule(4, 1, ctx.rank, stage4)
    flatshard.load_checkpoint(path, stage4, stage4_optim)
    _pipelined_step(4, 1, ctx.rank, runner4, x.view(1, 4 * BATCH, DIM), y.view(1, 4 * BATCH, DIM))
    stage4_optim.step()

    dp4_ref = copy.deepcopy(reference)
    dp4_optim = torch.optim.Adam(dp4_ref.parameters(), lr=1e-2)
    dp4_optim.load_state_dict(copy.deepcopy(ref_optim.state_dict()))  # (shares tensors)
    for r in range(4):
        (mse(dp4_ref(x[r]), y[r]) / 4).backward()
    dp4_optim.step()
    _reference_step(reference, ref_optim, x.view(1, 4 * BATCH, DIM), y.view(1, 4 * BATCH, DIM))
    with flatshard.summon_full_params(model):
        errors["dp4"] = max(
            _relative(p, q) for p, q in zip(model.parameters(), dp4_ref.parameters(), strict=True)
        )
    with flatshard.summon_full_params(stage4):
        mine = dict(reference.named_parameters())
        errors["pp4"] = max(_relative(p, mine[n]) for n, p in stage4.named_parameters())
    return errors


def test_checkpoints_cross_pipeline_layouts(pool: WorkerPool, tmp_path: Any) -> None:
    """A checkpoint saved by PP2 x DP2 stages (every stage's part under the original names,
    with Adam's state) loads into the plain model, at DP4 without a pipeline and at PP4,
    and continues exactly."""
    results = pool.run(checkpoint_job, str(tmp_path / "ckpt"))
    assert "plain" in results[0]
    for errors in results:
        assert all(error < TOLERANCE for error in errors.values()), errors


class Experts(nn.Module):  # the guide's: tokens sorted by expert, and the count per expert
    def __init__(self, experts: int) -> None:
        super().__init__()
        self.w1 = nn.Parameter(torch.randn(experts, DIM, 2 * DIM) / DIM**0.5)
        self.w2 = nn.Parameter(torch.randn(experts, 2 * DIM, DIM) / DIM**0.5)

    def forward(self, x: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
        rows = torch.split(x, counts.tolist())
        return torch.cat([torch.relu(r @ self.w1[i]) @ self.w2[i] for i, r in enumerate(rows)])


class MoE(nn.Module):
    def __init__(self, experts: int = 4) -> None:
        super().__init__()
        self.router = nn.Linear(DIM, experts, bias=False)
        self.experts = Experts(experts)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weights, chosen = torch.softmax(self.router(x), -1).topk(2, dim=-1)
        order = torch.argsort(chosen.reshape(-1), stable=True)
        token = order // 2
        counts = torch.bincount(chosen.reshape(-1), minlength=self.router.out_features)
        out = self.experts(x[token], counts) * weights.reshape(-1)[order, None]
        return x + torch.zeros_like(x).index_add(0, token, out)


def experts_job(ctx: WorkerContext, schedule: str) -> dict[str, Any]:
    """PP2 x EP2: each stage a mixture of experts whose experts are split over the stage's
    two data-parallel ranks (``Experts(2)``), the tokens exchanged by all-to-all."""
    dps, pps = _groups(2, 2)
    pp_rank, dp_rank = divmod(ctx.rank, 2)
    torch.manual_seed(0)
    reference = nn.Sequential(MoE(), MoE())
    module = flatshard.fully_shard(
        nn.Sequential(copy.deepcopy(reference[pp_rank])),
        auto_wrap_policy={MoE},
        process_group=dps[pp_rank],
        placement=lambda name, p: flatshard.Experts(2) if ".experts." in name else None,
    )
    stage = PipelineStage(module, pp_rank, 2, torch.device("cpu"), group=pps[dp_rank])
    runner = SCHEDULES[schedule](stage if schedule not in MULTI else [stage], MICRO, loss_fn=mse)
    optim = torch.optim.SGD(module.parameters(), lr=LR)
    # DDP's semantics: routing per rank's micro-batch
    _steps_beside_reference(ctx.rank, runner, optim, reference, clip=module)
    full = flatshard.full_state_dict(module, rank0_only=False)
    want = reference[pp_rank].state_dict()
    return {"worst": max(_relative(full[f"0.{n}"], q) for n, q in want.items())}


@pytest.mark.parametrize("schedule", ["1f1b", "zero-bubble"])
def test_experts_inside_stages_match(pool: WorkerPool, schedule: str) -> None:
    for result in pool.run(experts_job, schedule):
        assert result["worst"] < TOLERANCE, result


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.ModuleList(Block() for _ in range(4))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = layer(x)
        return x


def traced_job(ctx: WorkerContext, schedule: str) -> dict[str, Any] | None:
    """Stages cut by torch's tracer (``pipeline`` with a split point), sharded with
    flatshard, built by ``flatshard.integrations.pipelining.build_stage``: PP2 x DP2."""
    from torch.distributed.pipelining import SplitPoint, pipeline

    from flatshard.integrations.pipelining import build_stage

    dps, pps = _groups(2, 2)
    pp_rank, dp_rank = divmod(ctx.rank, 2)
    torch.manual_seed(0)
    reference = Net()
    traced = copy.deepcopy(reference)
    example = torch.randn(BATCH // MICRO, DIM)
    pipe = pipeline(traced, mb_args=(example,), split_spec={"layers.2": SplitPoint.BEGINNING})
    module = pipe.get_stage_module(pp_rank)
    flatshard.fully_shard(  # the traced blocks are InterpreterModules: units by name
        module,
        auto_wrap_policy=lambda m, name: name.count(".") == 1 and name.startswith("layers."),
        process_group=dps[pp_rank],
    )
    stage = build_stage(module, pp_rank, pipe.info(), torch.device("cpu"), group=pps[dp_rank])
    runner = SCHEDULES[schedule](stage if schedule not in MULTI else [stage], MICRO, loss_fn=mse)
    optim = torch.optim.SGD(module.parameters(), lr=LR)
    _steps_beside_reference(ctx.rank, runner, optim, reference)
    full = flatshard.full_state_dict(module, rank0_only=False)
    want = reference.state_dict()
    assert full and set(full) <= set(want), sorted(full)  # the original names
    return {"worst": max(_relative(t, want[n]) for n, t in full.items())}


@pytest.mark.parametrize("schedule", ["gpipe", "zero-bubble"])
def test_stages_of_torchs_tracer_match(pool: WorkerPool, schedule: str) -> None:
    for result in pool.run(traced_job, schedule):
        assert result["worst"] < TOLERANCE, result


def fsdp2_job(ctx: WorkerContext, schedule: str) -> dict[str, float] | None:
    """The same PP2 x DP2 run with PyTorch's ``fully_shard`` (FSDP2) stages and torch's
    ``PipelineStage``: the peer's result against the same reference."""
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.pipelining import PipelineStage as TorchStage

    dps, pps = _groups(2, 2)
    pp_rank, dp_rank = divmod(ctx.rank, 2)
    torch.manual_seed(0)
    reference = nn.Sequential(*[Block() for _ in range(2)])
    module = nn.Sequential(copy.deepcopy(reference[pp_rank]))
    mesh = DeviceMesh.from_group(dps[pp_rank], "cpu")
    fully_shard(module[0], mesh=mesh)
    fully_shard(module, mesh=mesh)
    stage = TorchStage(module, pp_rank, 2, torch.device("cpu"), group=pps[dp_rank])
    runner = SCHEDULES[schedule]([stage] if schedule in MULTI else stage, MICRO, loss_fn=mse)
    optim = torch.optim.SGD(module.parameters(), lr=LR)
    _steps_beside_reference(ctx.rank, runner, optim, reference)
    worst = 0.0
    for p, q in zip(module.parameters(), reference[pp_rank].parameters(), strict=True):
        worst = max(worst, _relative(p.full_tensor(), q))  # type: ignore[operator]
    return {"worst": worst}


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b"])
def test_fsdp2_stages_agree_with_the_same_reference(pool: WorkerPool, schedule: str) -> None:
    """PyTorch's own composition (FSDP2 stages in torch's schedules) on the run the
    flatshard tests above make: it meets the same reference within the same tolerance,
    so the reference is DDP's semantics as the peer computes them."""
    ours = _check(pool.run(pipeline_job, schedule, 2, 2))
    theirs = [r for r in pool.run(fsdp2_job, schedule) if r is not None]
    assert max(r["worst"] for r in theirs) < TOLERANCE, theirs
    assert max(r["worst"] for r in ours) < TOLERANCE


def test_evaluation_through_the_schedule_is_no_step(local_group: Any) -> None:
    """``schedule.eval()`` runs forwards only: it starts no step the schedule would own
    (the switches stay the user's), and its losses are the unsharded model's."""
    module, runner, reference = _single_stage(local_group)
    x, y = torch.randn(BATCH, DIM), torch.randn(BATCH, DIM)
    losses: list[torch.Tensor] = []
    runner.eval(x, target=y, losses=losses)
    flatshard.set_requires_gradient_sync(module, True)  # between steps: allowed
    with torch.no_grad():
        want = [mse(reference(xm), ym) for xm, ym in zip(x.chunk(2), y.chunk(2), strict=True)]
    for got, expected in zip(losses, want, strict=True):
        torch.testing.assert_close(got, expected)
    runner.step(x, target=y)  # and training afterwards works as before
    assert all(p.grad is not None for p in module.parameters())


def partial_clip_job(ctx: WorkerContext) -> str | None:
    """Interleaved, two stages a rank: clipping one stage module at a time is refused."""
    dps, pps = _groups(2, 1)
    if ctx.rank >= 2:
        return None
    modules, stages = [], []
    for index in _stage_ids("interleaved", 2, ctx.rank):
        module = flatshard.fully_shard(
            nn.Sequential(Block()), auto_wrap_policy={Block}, process_group=dps[ctx.rank]
        )
        modules.append(module)
        stages.append(PipelineStage(module, index, 4, torch.device("cpu"), group=pps[0]))
    runner = ScheduleInterleaved1F1B(stages, MICRO, loss_fn=mse)
    x, y = torch.randn(BATCH, DIM), torch.randn(BATCH, DIM)
    runner.step(*((x,) if ctx.rank == 0 else ()), target=y if ctx.rank == 1 else None)
    try:
        flatshard.clip_grad_norm_(modules[0], 0.5)
    except ValueError as error:
        return str(error)
    return "no error"


def test_a_norm_over_some_of_a_ranks_stages_is_refused(pool: WorkerPool) -> None:
    for message in pool.run(partial_clip_job)[:2]:
        assert "left out stages [2, 3]" in message, message
        assert "nn.ModuleList(stage_modules)" in message


def stages_calls_job(ctx: WorkerContext, folder: str) -> dict[str, str] | None:
    """PP2, one rank a stage: each stage makes a call that is the whole pipeline's with a
    value of its own, or alone while the other stage goes on training."""
    dps, pps = _groups(2, 1)
    if ctx.rank >= 2:
        return None
    torch.manual_seed(0)
    stage = flatshard.fully_shard(
        _cut(Stack(2), [ctx.rank]), auto_wrap_policy={Block}, process_group=dps[ctx.rank]
    )
    optim = torch.optim.SGD(stage.parameters(), lr=LR)
    pipeline = PipelineStage(stage, ctx.rank, 2, torch.device("cpu"), group=pps[0])
    runner = ScheduleGPipe(pipeline, MICRO, loss_fn=mse)
    x, y = torch.randn(BATCH, DIM), torch.randn(BATCH, DIM)

    def step() -> None:
        runner.step(*((x,) if ctx.rank == 0 else ()), target=y if ctx.rank == 1 else None)

    step()
    other = ctx.rank == 1
    calls = {
        "clip": lambda: flatshard.clip_grad_norm_(stage, 0.001 if other else 0.1),
        "torch clip": lambda: torch.nn.utils.clip_grad_norm_(
            stage.parameters(), 0.1, norm_type=math.inf if other else 2.0
        ),
        "path": lambda: flatshard.save_checkpoint(f"{folder}/stage{ctx.rank}", stage, optim),
        "dtype": lambda: flatshard.export_safetensors(
            stage, f"{folder}/export", dtype=torch.bfloat16 if other else None
        ),
        "alone": step if other else lambda: flatshard.save_checkpoint(f"{folder}/alone", stage),
        "divide": lambda: flatshard.set_gradient_divide_factor(stage, 1.0 if other else None),
    }
    found = {}
    for case, call in calls.items():
        try:
            call()
            found[case] = "no error"
        except flatshard.CollectiveMismatchError as error:
            found[case] = str(error)
    found["written"] = " ".join(sorted(p.name for p in Path(folder).iterdir()))
    built = flatshard.fully_shard(
        _cut(Stack(2), [ctx.rank]), auto_wrap_policy={Block}, process_group=dps[ctx.rank]
    )
    if other:  # before the stage is built: the stage's own ranks agree (one rank)
        flatshard.set_gradient_divide_factor(built, 1.0)
    try:
        PipelineStage(built, ctx.rank, 2, torch.device("cpu"), group=pps[0])
        found["divide, built"] = "no error"
    except ValueError as error:
        found["divide, built"] = str(error)
    return found


def test_a_call_of_the_whole_pipeline_made_by_one_stage_or_with_its_own_values_is_named(
    pool: WorkerPool, tmp_path: Path
) -> None:
    """Before: each stage clipped by its own max_norm (or norm type) the norm of every
    stage, silently; a checkpoint at a path of each stage's was committed without the
    other stage, and loaded as whole; an export wrote one stage in bfloat16; a save on
    one stage hung until the process group's timeout while the other stage trained on;
    a divide factor of one stage's scaled its gradients alone."""
    expected = {
        "clip": ("clip_grad_norm_(max_norm=0.1,", "clip_grad_norm_(max_norm=0.001,"),
        "torch clip": ("norm_type=2.0)", "norm_type=inf)"),
        "path": ("/stage0', optimizer=SGD", "/stage1', optimizer=SGD"),
        "dtype": ("dtype=None", "dtype=bfloat16"),
        "alone": ("rank 0: save_checkpoint(", "rank 1: pipeline schedule step"),
        "divide": ("set_gradient_divide_factor(None)", "set_gradient_divide_factor(1.0)"),
        "divide, built": ("divide their stages' gradients by other factors", ": 1.0"),
    }
    for found in pool.run(stages_calls_job, str(tmp_path))[:2]:
        for case, words in expected.items():
            assert all(w in found[case] for w in words), (case, found[case])
        assert found["written"] == "", found["written"]  # nothing committed, nothing begun


def switch_alone_job(rank: int) -> str:
    """PP2 x DP2: rank 0 alone turns a switch of its stage before the second step, then
    every rank steps. The name of each rank's error."""
    flatshard.set_checks(flatshard.Checks(timeout=30.0))
    dps, pps = _groups(2, 2)
    pp_rank, dp_rank = divmod(rank, 2)
    torch.manual_seed(0)
    module = flatshard.fully_shard(
        nn.Sequential(Block(), Block()), auto_wrap_policy={Block}, process_group=dps[pp_rank]
    )
    stage = PipelineStage(module, pp_rank, 2, torch.device("cpu"), group=pps[dp_rank])
    runner = Schedule1F1B(stage, MICRO, loss_fn=mse)
    x, y = torch.randn(BATCH, DIM), torch.randn(BATCH, DIM)
    try:
        for step in range(2):
            if rank == 0 and step == 1:
                flatshard.set_reshard_after_forward(module, False)
            runner.step(x) if pp_rank == 0 else runner.step(target=y)
    except Exception as error:
        return type(error).__name__
    return "no error"


def test_a_named_error_inside_a_stages_forward_comes_out_as_itself() -> None:
    """torch wraps what a stage's forward raises in RuntimeError("[Stage 0] failed to
    run forward"). Before: rank 1's flatshard.CollectiveMismatchError came out as that
    RuntimeError, which ``except flatshard.CollectiveError`` missed. (Rank 3, waiting in
    torch's receive for rank 1's activations, sees gloo's closed connection.)"""
    outcomes = run_isolated(switch_alone_job, world_size=4)
    assert outcomes[:3] == ["CollectiveMismatchError"] * 3, outcomes


def held_unit_job(ctx: WorkerContext) -> int | None:
    """One stage over 2 data-parallel ranks; a block held by ``flatshard.unshard`` stays
    gathered through the schedule's step: calling it before the optimizer steps gathers
    nothing (all-gathers counted)."""
    dps, pps = _groups(1, 2)
    if ctx.rank >= 2:
        return None
    torch.manual_seed(0)
    module = flatshard.fully_shard(
        nn.Sequential(Block(), Block()), auto_wrap_policy={Block}, process_group=dps[0]
    )
    stage = PipelineStage(module, 0, 1, torch.device("cpu"), group=pps[ctx.rank])
    runner = ScheduleGPipe(stage, MICRO, loss_fn=mse)
    optim = torch.optim.SGD(module.parameters(), lr=LR)
    runner.step(torch.randn(BATCH, DIM), target=torch.randn(BATCH, DIM))
    optim.step()  # (an optimizer steps the model: gradients alone write no shard)
    optim.zero_grad()
    flatshard.unshard(module[0])
    runner.step(torch.randn(BATCH, DIM), target=torch.randn(BATCH, DIM))
    with CollectiveTracker() as tracker, torch.no_grad():
        module[0](torch.randn(2, DIM))
    flatshard.reshard(module[0])
    return sum(kind == ALL_GATHER and size > 64 for kind, size in tracker.ops)


def test_a_unit_held_by_unshard_stays_gathered_through_a_step(pool: WorkerPool) -> None:
    assert pool.run(held_unit_job)[:2] == [0, 0]


def schedule_mismatch_job(ctx: WorkerContext) -> str | None:
    """The data-parallel ranks of one stage run different schedules (GPipe, 1F1B)."""
    dps, pps = _groups(1, 2)
    if ctx.rank >= 2:
        return None
    module = flatshard.fully_shard(
        nn.Sequential(Block()), auto_wrap_policy={Block}, process_group=dps[0]
    )
    stage = PipelineStage(module, 0, 1, torch.device("cpu"), group=pps[ctx.rank])
    runner = (ScheduleGPipe if ctx.rank == 0 else Schedule1F1B)(stage, MICRO, loss_fn=mse)
    try:
        runner.step(torch.randn(BATCH, DIM), target=torch.randn(BATCH, DIM))
    except flatshard.CollectiveMismatchError as error:
        return str(error)
    return "no error"


def test_ranks_of_a_stage_running_different_schedules_are_named(pool: WorkerPool) -> None:
    """Before: gloo aborted the process ("Received data size doesn't match")."""
    for message in pool.run(schedule_mismatch_job)[:2]:
        assert "flatshard PipelineStage 0 of 1 runs F1" in message, message
        assert "flatshard PipelineStage 0 of 1 runs B" in message, message


# ------------------------------------------------ the plan of a pipeline against a run
GPT_SHAPE = {"vocab": 256, "dim": 64, "heads": 4, "layers": 4, "seq_len": 64}
GPT_BATCH, GPT_MICRO = 4, 4  # sequences per micro-batch, micro-batches a step


def _gpt() -> nn.Module:
    from flatshard.models import GPT

    return GPT(**GPT_SHAPE, tied=False)


def _gpt_batch() -> tuple[torch.Tensor, ...]:
    return (torch.randint(0, GPT_SHAPE["vocab"], (GPT_BATCH, GPT_SHAPE["seq_len"])),)


def _gpt_loss(logits: torch.Tensor, batch: tuple[torch.Tensor, ...]) -> torch.Tensor:
    return nn.functional.cross_entropy(logits.flatten(0, 1).float(), batch[0].flatten())


def measured_stage_peak_job(ctx: WorkerContext, schedule: str) -> int:
    """This rank's steady-state peak of live tensors at PP2 x DP2 (the GPT cut as
    flatshard train cuts it, AdamW, clipping), counted from the model's construction."""
    from flatshard.models import GPTBlock
    from flatshard.models.gpt import cut_to_stage

    dps, pps = _groups(2, 2)
    pp_rank, dp_rank = divmod(ctx.rank, 2)
    torch.manual_seed(0)
    with flatshard.measure.PeakStorage() as tracker:
        model = _gpt()
        cut_to_stage(model, pp_rank, 2)
        model = flatshard.fully_shard(
            model, auto_wrap_policy={GPTBlock}, process_group=dps[pp_rank]
        )
        stage = PipelineStage(model, pp_rank, 2, torch.device("cpu"), group=pps[dp_rank])
        loss = lambda out, target: _gpt_loss(out, (target,))  # noqa: E731
        run = SCHEDULES[schedule](stage, GPT_MICRO, loss_fn=loss)
        optim = torch.optim.AdamW(model.parameters(), weight_decay=0.1, foreach=False)
        for step in range(3):
            if step == 2:
                tracker.reset_peak()
            ids = torch.cat([_gpt_batch()[0] for _ in range(GPT_MICRO)])
            run.step(ids) if pp_rank == 0 else run.step(target=ids)
            flatshard.clip_grad_norm_(model, 1.0)
            optim.step()
            optim.zero_grad()
    peak: int = tracker.peak
    return peak


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b"])
def test_the_plan_of_a_pipeline_predicts_each_stages_peak(pool: WorkerPool, schedule: str) -> None:
    """flatshard.plan with a Pipeline: each pipeline rank's peak (its stage's simulated
    step, the micro-batches in flight, torch's receive buffers) within 15% of the peak
    measured at the dispatcher on that rank of a PP2 x DP2 run; GPipe holds more than
    1F1B on both, in the plan as in the run."""
    from flatshard.models import GPTBlock
    from flatshard.models.gpt import cut_to_stage
    from flatshard.planner import Pipeline

    measured = pool.run(measured_stage_peak_job, schedule)
    planned = flatshard.plan(
        _gpt,
        _gpt_batch,
        auto_wrap_policy={GPTBlock},
        cluster="cpu-dev",
        ranks_per_host=4,
        pipeline=Pipeline(2, GPT_MICRO, cut_to_stage, _gpt_loss, schedule),
    )
    assert planned.pipeline is not None
    for rank, peak in enumerate(measured):
        predicted = planned.pipeline.ranks[rank // 2].peak_memory_bytes
        assert predicted == pytest.approx(peak, rel=0.15), (schedule, rank, predicted, peak)
    in_flight = [r.in_flight for r in planned.pipeline.ranks]
    assert in_flight == ([GPT_MICRO, GPT_MICRO] if schedule == "gpipe" else [2, 1])
    assert planned.peak_memory_bytes == max(r.peak_memory_bytes for r in planned.pipeline.ranks)


def _tiny_llama() -> nn.Module:
    import transformers

    config = transformers.LlamaConfig(
        vocab_size=64, hidden_size=16, intermediate_size=32, num_hidden_layers=4,
        num_attention_heads=2, num_key_value_heads=2, tie_word_embeddings=False,
    )  # fmt: skip
    torch.manual_seed(0)
    return transformers.LlamaForCausalLM(config)


def export_job(ctx: WorkerContext, out: str) -> dict[str, Any] | None:
    """A Hugging Face Llama cut in two stages torchtitan's way (the other stage's layers
    nn.Identity, the embedding on the first, the norm and head on the last), each sharded
    over its 2 data-parallel ranks as a PipelineStage, exported from the stages; rank 0
    loads the export with ``from_pretrained`` and compares it with the stages' own full
    state dicts, which together name every entry of the whole model."""
    import transformers

    dps, pps = _groups(2, 2)
    pp_rank, dp_rank = divmod(ctx.rank, 2)
    model = _tiny_llama()
    layers = model.model.layers
    for index in range(len(layers)):
        if index // 2 != pp_rank:
            layers[index] = nn.Identity()
    if pp_rank == 0:
        model.model.norm, model.lm_head = nn.Identity(), None
    else:
        model.model.embed_tokens = None
    layer = type(_tiny_llama().model.layers[0])
    sharded = flatshard.fully_shard(model, auto_wrap_policy={layer}, process_group=dps[pp_rank])
    PipelineStage(sharded, pp_rank, 2, torch.device("cpu"), group=pps[dp_rank])
    with torch.no_grad():  # trained weights, not the initial ones
        for param in sharded.parameters():
            param.add_(0.5)
    full = flatshard.full_state_dict(sharded)  # this stage's part, before the export
    files = flatshard.export_safetensors(sharded, out)
    parts: list[Any] = [None] * 4
    dist.all_gather_object(parts, full if dp_rank == 0 else None)  # the world
    if ctx.rank != 0:
        return None
    loaded = transformers.LlamaForCausalLM.from_pretrained(out).state_dict()
    expected = {**parts[0], **parts[2]}
    return {
        "files": sorted(files),
        "whole": sorted(_tiny_llama().state_dict()) == sorted(expected),
        "missing": sorted(set(expected) - set(loaded)),
        "worst": max(_relative(loaded[k], v) for k, v in expected.items()),
    }


def test_an_export_of_pipeline_stages_loads_with_from_pretrained(
    pool: WorkerPool, tmp_path: Any
) -> None:
    """export_safetensors on every rank of a PP2 x DP2 Llama: each stage's first rank
    writes its part, the first stage the joint index and config.json; from_pretrained
    reads the whole model, equal to the stages' parts."""
    pytest.importorskip("transformers")
    result = pool.run(export_job, str(tmp_path / "hf"))[0]
    assert result is not None
    assert result["whole"] and not result["missing"], result
    assert result["worst"] == 0.0, result
    assert sorted(Path(f).name for f in result["files"]) == [
        "config.json",
        "generation_config.json",
        "model-stage001-00001-of-00001.safetensors",
        "model.safetensors.index.json",
    ], result["files"]


class Lookup(nn.Module):
    """A token embedding as a first stage's own part (its table row-sparse)."""

    def __init__(self, vocab: int) -> None:
        super().__init__()
        self.table = nn.Embedding(vocab, DIM)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = self.table(ids)
        return out


def row_sparse_job(ctx: WorkerContext, schedule: str) -> dict[str, Any]:
    """PP2 x DP2: a row-sparse embedding and a block on the first stage, a block on the
    last, STEPS SGD steps of MICRO micro-batches against the unsharded model (DDP's
    semantics): the lookups' rows kept by every micro-batch's backward are exchanged once,
    at the step's reduction."""
    dps, pps = _groups(2, 2)
    pp_rank, dp_rank = divmod(ctx.rank, 2)
    torch.manual_seed(0)
    reference = nn.Sequential(Lookup(512), Block(), Block())
    initial = copy.deepcopy(reference)
    part = copy.deepcopy(reference)
    if pp_rank == 0:
        del part[2]
    else:
        del part[1], part[0]
    flatshard.fully_shard(
        part, auto_wrap_policy={Block}, process_group=dps[pp_rank], placement=flatshard.RowSparse()
    )
    stage = PipelineStage(part, pp_rank, 2, torch.device("cpu"), group=pps[dp_rank])
    runner = SCHEDULES[schedule](stage, MICRO, loss_fn=mse)
    optim = torch.optim.SGD(part.parameters(), lr=LR)
    ref_optim = torch.optim.SGD(reference.parameters(), lr=LR)
    for step in range(STEPS):
        gen = torch.Generator().manual_seed(step)
        ids = torch.randint(0, 512, (2, BATCH, 3), generator=gen)
        ys = torch.randn(2, BATCH, 3, DIM, generator=gen)
        runner.step(ids[dp_rank]) if pp_rank == 0 else runner.step(target=ys[dp_rank])
        optim.step()
        optim.zero_grad()
        ref_optim.zero_grad()
        for r in range(2):
            for xm, ym in zip(ids[r].chunk(MICRO), ys[r].chunk(MICRO), strict=True):
                (mse(reference(xm), ym) / (MICRO * 2)).backward()
        ref_optim.step()
    worst = 0.0
    offset = 0 if pp_rank == 0 else 2
    with flatshard.summon_full_params(part):
        for index, module in enumerate(part):
            theirs = reference[index + offset]
            for p, q in zip(module.parameters(), theirs.parameters(), strict=True):
                worst = max(worst, _relative(p.detach(), q.detach()))
    return {"worst": worst, "moved": _moved(reference, initial)}


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b"])
def test_a_row_sparse_table_in_a_stage_matches(pool: WorkerPool, schedule: str) -> None:
    """Before: the table's gradient was zero at DP2 with several micro-batches (the rows
    were kept, never exchanged: the step's reduction started only the dense part)."""
    for result in pool.run(row_sparse_job, schedule):
        assert result["moved"] > 1e-3 and result["worst"] < TOLERANCE, result


def stage_misuse_job(ctx: WorkerContext, case: str) -> str:
    """PP2 x DP2: ``clip``, the first stage's ranks clip over every stage and the last
    stage's go on to the next step; ``stages``, the last stage is built with another
    num_stages. Each rank's error (or "no error")."""
    dps, pps = _groups(2, 2)
    pp_rank, dp_rank = divmod(ctx.rank, 2)
    torch.manual_seed(0)
    module = flatshard.fully_shard(
        nn.Sequential(Block()), auto_wrap_policy={Block}, process_group=dps[pp_rank]
    )
    stages = 3 if case == "stages" and pp_rank == 1 else 2
    try:
        stage = PipelineStage(module, pp_rank, stages, torch.device("cpu"), group=pps[dp_rank])
        runner = Schedule1F1B(stage, MICRO, loss_fn=mse)
        for _ in range(2):
            x, y = torch.randn(BATCH, DIM), torch.randn(BATCH, DIM)
            runner.step(x) if pp_rank == 0 else runner.step(target=y)
            if pp_rank == 0:
                flatshard.clip_grad_norm_(module, 1.0)
    except (flatshard.CollectiveMismatchError, ValueError) as error:
        return str(error)
    return "no error"


@pytest.mark.parametrize("case", ["clip", "stages"])
def test_stages_that_part_ways_are_named_within_seconds(pool: WorkerPool, case: str) -> None:
    """Before: a hang to the process group's timeout (the other stage waited in torch's
    sends and receives, which flatshard does not see)."""
    for message in pool.run(stage_misuse_job, case):
        if case == "clip":
            assert "clip_grad_norm_(max_norm=1.0, norm_type=2.0)" in message, message
            assert "pipeline schedule step" in message, message
            assert "pipeline schedule step at step" not in message, message  # no one model's
        else:
            assert "build pipeline stages with different numbers of stages" in message, message
