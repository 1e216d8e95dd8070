"""The runtime on several ranks: profiler ranges, collective counts and memory by formula,
prefetch order (model patterns: ``test_model_patterns.py``).

Jobs run on every rank of the shared pool; rank-local checks assert inside the job and
anything compared across ranks comes back to the test.
"""

from __future__ import annotations

import math
from typing import Any

import pytest
import torch

import flatshard
from flatshard.measure import (
    ALL_GATHER,
    ALL_TO_ALL,
    STEP_CHECK,
    CollectiveTracker,
    distinct_storage_bytes,
)
from flatshard.testing import internals
from flatshard.testing.jobs import loss_backward, sharded
from flatshard.testing.models import build
from flatshard.testing.parity import batches, make_optimizer, slice_batch
from flatshard.testing.workers import WorkerContext, WorkerPool

FP32 = 4


# ---------------------------------------------------------------- profiler ranges
def profiler_ranges_job(ctx: WorkerContext) -> dict[str, list[str]] | None:
    model = sharded("gpt", ctx, 2)
    if model is None:
        return None
    batch = next(batches(model, 1))
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        loss_backward(model, batch, ctx.rank, 2)
    profiled = sorted({e.key for e in prof.key_averages() if e.key.startswith("flatshard::")})
    # Without a profiler no range is entered (each costs CPU time).
    with internals.profiler_ranges_entered() as entered:
        loss_backward(model, batch, ctx.rank, 2)
    return {"profiled": profiled, "unprofiled": entered}


def test_profiler_shows_unit_ranges(pool: WorkerPool) -> None:
    result = pool.run(profiler_ranges_job)[0]
    assert result["unprofiled"] == []
    names = result["profiled"]
    for expected in (
        "flatshard::pre_forward <root>",
        "flatshard::post_forward blocks.0",
        "flatshard::pre_backward blocks.1",
        "flatshard::post_backward blocks.0",
        "flatshard::prefetch blocks.1",
        "flatshard::finish_backward",
    ):
        assert expected in names, (expected, names)


# ---------------------------------------------------------------- collective counts
def counts_job(ctx: WorkerContext, name: str, world_size: int) -> dict[str, Any] | None:
    model = sharded(name, ctx, world_size)
    if model is None:
        return None
    summary = flatshard.sharding_summary(model)
    batch = next(batches(model, 1))
    with CollectiveTracker() as train_step:
        loss_backward(model, batch, ctx.rank, world_size)
    with CollectiveTracker() as second_step:
        loss_backward(model, batch, ctx.rank, world_size)
    with torch.no_grad(), CollectiveTracker() as eval_step:
        model.loss(slice_batch(batch, ctx.rank, world_size))
    return {
        "flats": [(f.unit, f.requires_grad) for f in summary.flat_params],
        "train": dict(train_step.counts),
        "second": dict(second_step.counts),
        "eval": dict(eval_step.counts),
    }


@pytest.mark.parametrize("name", ["gpt", "frozen", "nested"])
def test_collective_counts_perloss_backward(pool: WorkerPool, name: str) -> None:
    result = pool.run(counts_job, name, 3)[0]
    flats = result["flats"]
    # Every unit of these models takes part in backward. The root keeps its parameters
    # from forward to backward: one all-gather per FlatParameter; every other unit
    # gathers in forward and again in backward. One reduce-scatter per trainable
    # FlatParameter; frozen ones are never reduced.
    root = [f for f in flats if f[0] == "<root>"]
    others = [f for f in flats if f[0] != "<root>"]
    assert result["train"] == {
        ALL_GATHER: len(root) + 2 * len(others) + STEP_CHECK,
        # gloo: the shard group's reduce-scatter runs as an all-to-all
        # (flatshard.report.describe_collectives).
        ALL_TO_ALL: sum(1 for _, grad in flats if grad),
    }
    # From the second step on, the unit that ran last in forward stays gathered into
    # backward (it comes first there): one all-gather fewer for its FlatParameters.
    last_unit_flats = {"gpt": 1, "frozen": 2, "nested": 1}[name]
    assert result["second"] == {
        **result["train"],
        ALL_GATHER: result["train"][ALL_GATHER] - last_unit_flats,
    }
    # A no_grad forward gathers each FlatParameter once and reduces nothing.
    assert result["eval"] == {ALL_GATHER: len(flats) + STEP_CHECK}


# ---------------------------------------------------------------- memory
def memory_job(
    ctx: WorkerContext, name: str, world_size: int, options: dict[str, Any] | None = None
) -> dict[str, Any] | None:
    model = sharded(name, ctx, world_size, **(options or {}))
    if model is None:
        return None
    reference = dict(build(name).named_parameters())
    optim = make_optimizer(model, 1e-3)
    tracker = CollectiveTracker()
    for step, batch in enumerate(batches(model, 2)):
        with tracker if step == 1 else _nothing():
            loss_backward(model, batch, ctx.rank, world_size)
        optim.step()
        if step == 0:
            optim.zero_grad()
    summary = flatshard.sharding_summary(model)
    # Per FlatParameter: its originals' elements, ceil-padded to the world size, plus the
    # reported alignment padding, split evenly over the ranks.
    expected_shard = [
        (
            math.ceil(sum(reference[n].numel() for n in f.param_names) / world_size) * world_size
            + f.alignment_padding_numel
        )
        // world_size
        for f in summary.flat_params
    ]
    flats = list(zip(summary.flat_params, expected_shard, strict=True))
    params = list(model.parameters())
    trainable = [p for p in params if p.requires_grad]
    assert all(p.grad is None for p in params if not p.requires_grad)
    return {
        "param_bytes": distinct_storage_bytes(params),
        "expected_param_bytes": FP32 * sum(expected_shard),
        "grad_bytes": distinct_storage_bytes([p.grad for p in trainable if p.grad is not None]),
        "expected_grad_bytes": FP32 * sum(n for f, n in flats if f.requires_grad),
        "gathered_after_step": tracker.gathered_bytes(),
        "peak_gathered": tracker.peak_gathered_bytes,
        "peak_reduce_input": tracker.peak_reduce_input_bytes,
        "unsharded_bytes": {f.unit: FP32 * n * world_size for f, n in flats},
    }


class _nothing:
    def __enter__(self) -> None:
        return None

    def __exit__(self, *args: object) -> None:
        return None


@pytest.mark.parametrize("name", ["gpt", "frozen", "mlp"])
def test_storage_by_formula(pool: WorkerPool, name: str) -> None:
    for rank, result in enumerate(pool.run(memory_job, name, 3)[:3]):
        assert result["param_bytes"] == result["expected_param_bytes"], rank
        assert result["grad_bytes"] == result["expected_grad_bytes"], rank
        # No unsharded storage outlives the step.
        assert result["gathered_after_step"] == 0, rank


@pytest.mark.parametrize("prefetch", [None, "BACKWARD_POST", "BACKWARD_PRE"])
def test_peak_unsharded_by_prefetch(pool: WorkerPool, prefetch: str | None) -> None:
    # TinyGPT: the root (embeddings, final norm; tied head) stays unsharded through the
    # step, and in forward each block is freed before the next is gathered. In backward,
    # autograd accumulates a block's gradient (which reduces and frees it) before it
    # reaches the previous block's output (whose hook gathers that block): one block at a
    # time, unless BACKWARD_PRE gathers the previous block while this one still computes.
    option = None if prefetch is None else flatshard.BackwardPrefetch[prefetch]
    options = {"prefetch": flatshard.Prefetch(backward=option, forward=False)}
    for result in pool.run(memory_job, "gpt", 2, options)[:2]:
        unsharded = result["unsharded_bytes"]
        blocks = sorted(b for u, b in unsharded.items() if u != "<root>")
        gathered_blocks = 2 if prefetch == "BACKWARD_PRE" else 1
        assert result["peak_gathered"] == unsharded["<root>"] + sum(blocks[-gathered_blocks:])
        # Each reduction waits for the one before it, so flatshard holds one unit's
        # unsharded gradient (the largest, here a block's) at a time. gloo's worker thread
        # may drop its own reference to the previous input a moment after wait() returns
        # (seen with prefetch gathers queued on the same group), so that one may still be
        # alive when the next starts: at most the two largest, never all of them (the
        # pile-up this guards against measured 41856 bytes here).
        largest = sorted(unsharded.values())[-2:]
        assert largest[-1] <= result["peak_reduce_input"] <= sum(largest)


def prefetch_order_job(ctx: WorkerContext, options: dict[str, Any]) -> dict[str, Any] | None:
    explicit_off = options.pop("explicit_off", False)
    model: Any = sharded("gpt", ctx, 2, **options)
    if model is None:
        return None
    if explicit_off:
        for block in model.blocks:
            flatshard.set_prefetch(block, backward=[])
    batch = next(batches(model, 1))
    loss_backward(model, batch, ctx.rank, 2)  # the first iteration records the forward order
    with CollectiveTracker() as tracker:
        loss_backward(model, batch, ctx.rank, 2)
    kinds = [kind for kind, _ in tracker.timeline]
    first_reduce = kinds.index(ALL_TO_ALL)  # gloo reduce-scatters by all-to-all
    return {
        "counts": dict(tracker.counts),
        "gathers_before_first_reduce": kinds[:first_reduce].count(ALL_GATHER),
        "peak": tracker.peak_gathered_bytes,
    }


def test_prefetch_changes_order_not_counts(pool: WorkerPool) -> None:
    no_fwd = {"prefetch": flatshard.Prefetch(forward=False)}  # BACKWARD_PRE is the default
    none = pool.run(prefetch_order_job, {"prefetch": flatshard.Prefetch(None, forward=False)})[0]
    pre = pool.run(prefetch_order_job, no_fwd)[0]
    forward = pool.run(prefetch_order_job, {"prefetch": flatshard.Prefetch(backward=None)})[0]
    off = pool.run(prefetch_order_job, {"explicit_off": True, **no_fwd})[0]
    both = pool.run(prefetch_order_job, {})[0]  # the defaults: forward and BACKWARD_PRE
    # TinyGPT, 3 blocks: forward gathers root + 3 blocks; backward the first 2 blocks
    # again (the last block of the forward order stays gathered into backward, like the
    # root: backward starts with it).
    for result in (none, pre, forward, off, both):
        assert result["counts"] == {ALL_GATHER: 6 + STEP_CHECK, ALL_TO_ALL: 4}
    # Backward starts with the last block, still gathered; BACKWARD_PRE gathers the block
    # before it before the last block's reduce-scatter.
    assert none["gathers_before_first_reduce"] == 4
    assert pre["gathers_before_first_reduce"] == 4 + 1
    assert off["gathers_before_first_reduce"] == 4  # set_prefetch(backward=[])
    # Prefetching holds the next block while the current one runs: one block more.
    assert forward["peak"] == pre["peak"] == both["peak"] > none["peak"]
    assert forward["gathers_before_first_reduce"] == 4


def gradient_penalty_job(ctx: WorkerContext, strategy: str, keep: bool) -> dict[str, Any] | None:
    """A gradient penalty (``autograd.grad(..., create_graph=True)`` on the input, then a
    backward through that graph) on 2 ranks, each its own batch; ranks 2 and 3 the
    unsharded reference, stepped on both batches as DDP would."""
    from flatshard.testing.models import ReluLinear, ReluNet

    group = ctx.group(2)
    torch.manual_seed(0)
    net = ReluNet()
    if group is not None:
        net = flatshard.fully_shard(
            net, auto_wrap_policy={ReluLinear}, strategy=strategy, process_group=group
        )
        if keep:
            flatshard.set_reshard_after_backward(net, False)
    optim = torch.optim.SGD(net.parameters(), lr=0.1)
    shares = [torch.randn(3, 4, generator=torch.Generator().manual_seed(r)) for r in range(2)]
    mine = shares[ctx.rank] if group is not None else torch.cat(shares)

    def penalized(x: torch.Tensor) -> torch.Tensor:
        x = x.clone().requires_grad_()
        y = net(x).sum()
        (gx,) = torch.autograd.grad(y, x, create_graph=True)
        return gx.pow(2).sum() + y

    try:
        # the reference as DDP: the mean of each rank's loss
        loss = sum(penalized(s) for s in shares) / 2 if group is None else penalized(mine)
        assert isinstance(loss, torch.Tensor)
        loss.backward()
        optim.step()
    except RuntimeError as error:
        return {"error": str(error)}
    if group is None:
        return {"weights": dict(net.state_dict())} if ctx.rank == 3 else None
    return {"weights": flatshard.full_state_dict(net, rank0_only=False)}


@pytest.mark.parametrize(
    ("strategy", "keep"),
    [("FULL_SHARD", False), ("SHARD_GRAD_OP", False), ("FULL_SHARD", True), ("NO_SHARD", False)],
)
def test_a_gradient_penalty_is_exact_or_refused_by_name(
    pool: WorkerPool, strategy: str, keep: bool
) -> None:
    """A backward with create_graph=True saves the gathered parameters in the graph it
    builds. Before: the units freed them at the end of that backward and the second
    backward failed inside torch ("out of bounds for storage of size 0"). Now: refused on
    every rank, naming the fix; kept gathered (or NO_SHARD), exact."""
    first, second, _, reference = pool.run(gradient_penalty_job, strategy, keep)
    if strategy != "NO_SHARD" and not keep:
        for outcome in (first, second):
            assert "flatshard: a backward with create_graph=True" in outcome["error"]
            assert "set_reshard_after_backward(model, False)" in outcome["error"]
        return
    for outcome in (first, second):
        assert "error" not in outcome, outcome["error"]
        for name, value in reference["weights"].items():
            torch.testing.assert_close(outcome["weights"][name], value, msg=name)
