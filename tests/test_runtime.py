"""The runtime on several ranks: collective counts and memory by formula, parameter views,
no_grad/eval forwards, summon_full_params, unused parameters.

Jobs run on every rank of the shared pool; rank-local checks assert inside the job and
anything compared across ranks comes back to the test.
"""

from __future__ import annotations

import math
from typing import Any

import pytest
import torch
from torch import nn

import flatshard
from flatshard.testing import internals
from flatshard.testing.accounting import (
    ALL_GATHER,
    ALL_TO_ALL,
    CollectiveTracker,
    distinct_storage_bytes,
)
from flatshard.testing.models import build, twins
from flatshard.testing.parity import batches, make_optimizer, slice_batch
from flatshard.testing.workers import WorkerContext, WorkerPool

FP32 = 4


def _sharded(name: str, ctx: WorkerContext, world_size: int, **options: Any) -> nn.Module | None:
    group = ctx.group(world_size)
    if group is None:
        return None
    model = build(name)
    return flatshard.fully_shard(
        model, auto_wrap_policy=set(model.UNIT_CLASSES), process_group=group, **options
    )


def _step(model: Any, batch: Any, rank: int, world_size: int) -> torch.Tensor:
    loss: torch.Tensor = model.loss(slice_batch(batch, rank, world_size))
    loss.backward()
    return loss


# ---------------------------------------------------------------- profiler ranges
def profiler_ranges_job(ctx: WorkerContext) -> dict[str, list[str]] | None:
    model = _sharded("gpt", ctx, 2)
    if model is None:
        return None
    batch = next(batches(model, 1))
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        _step(model, batch, ctx.rank, 2)
    profiled = sorted({e.key for e in prof.key_averages() if e.key.startswith("flatshard::")})
    # Without a profiler no range is entered (each costs CPU time).
    with internals.profiler_ranges_entered() as entered:
        _step(model, batch, ctx.rank, 2)
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
    model = _sharded(name, ctx, world_size)
    if model is None:
        return None
    summary = flatshard.sharding_summary(model)
    batch = next(batches(model, 1))
    with CollectiveTracker() as train_step:
        _step(model, batch, ctx.rank, world_size)
    with CollectiveTracker() as second_step:
        _step(model, batch, ctx.rank, world_size)
    with torch.no_grad(), CollectiveTracker() as eval_step:
        model.loss(slice_batch(batch, ctx.rank, world_size))
    return {
        "flats": [(f.unit, f.requires_grad) for f in summary.flat_params],
        "train": dict(train_step.counts),
        "second": dict(second_step.counts),
        "eval": dict(eval_step.counts),
    }


@pytest.mark.parametrize("name", ["gpt", "frozen", "nested"])
def test_collective_counts_per_step(pool: WorkerPool, name: str) -> None:
    result = pool.run(counts_job, name, 3)[0]
    flats = result["flats"]
    # Every unit of these models takes part in backward. The root keeps its parameters
    # from forward to backward: one all-gather per FlatParameter; every other unit
    # gathers in forward and again in backward. One reduce-scatter per trainable
    # FlatParameter; frozen ones are never reduced.
    root = [f for f in flats if f[0] == "<root>"]
    others = [f for f in flats if f[0] != "<root>"]
    assert result["train"] == {
        ALL_GATHER: len(root) + 2 * len(others),
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
    assert result["eval"] == {ALL_GATHER: len(flats)}


# ---------------------------------------------------------------- memory
def memory_job(
    ctx: WorkerContext, name: str, world_size: int, options: dict[str, Any] | None = None
) -> dict[str, Any] | None:
    model = _sharded(name, ctx, world_size, **(options or {}))
    if model is None:
        return None
    reference = dict(build(name).named_parameters())
    optim = make_optimizer(model, 1e-3)
    tracker = CollectiveTracker()
    for step, batch in enumerate(batches(model, 2)):
        with tracker if step == 1 else _nothing():
            _step(model, batch, ctx.rank, world_size)
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
    model: Any = _sharded("gpt", ctx, 2, **options)
    if model is None:
        return None
    if explicit_off:
        for block in model.blocks:
            flatshard.set_prefetch(block, backward=[])
    batch = next(batches(model, 1))
    _step(model, batch, ctx.rank, 2)  # the first iteration records the forward order
    with CollectiveTracker() as tracker:
        _step(model, batch, ctx.rank, 2)
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
        assert result["counts"] == {ALL_GATHER: 6, ALL_TO_ALL: 4}
    # Backward starts with the last block, still gathered; BACKWARD_PRE gathers the block
    # before it before the last block's reduce-scatter.
    assert none["gathers_before_first_reduce"] == 4
    assert pre["gathers_before_first_reduce"] == 4 + 1
    assert off["gathers_before_first_reduce"] == 4  # set_prefetch(backward=[])
    # Prefetching holds the next block while the current one runs: one block more.
    assert forward["peak"] == pre["peak"] == both["peak"] > none["peak"]
    assert forward["gathers_before_first_reduce"] == 4


# ---------------------------------------------------------------- parameter views
def views_job(ctx: WorkerContext, world_size: int) -> dict[str, Any] | None:
    group = ctx.group(world_size)
    if group is None:
        return None
    model = build("mlp")
    full = {n: p.detach().clone() for n, p in model.named_parameters()}
    keys_before = list(model.state_dict())
    flatshard.fully_shard(
        model, auto_wrap_policy=flatshard.SizePolicy(min_params=50), process_group=group
    )
    assert list(model.state_dict()) == keys_before
    assert [n for n, _ in model.named_parameters()] == list(full)
    rows = {}
    for name, param in model.named_parameters():
        original = full[name]
        if original.dim() == 0:
            assert param.shape in (torch.Size(()), torch.Size((0,))), name
            rows[name] = param.numel()
            continue
        assert param.dim() == original.dim(), name  # rows keep the parameter's ndim
        assert param.shape[1:] == original.shape[1:], name
        rows[name] = param.shape[0]
    return {"rows": rows, "shapes": {n: tuple(t.shape) for n, t in full.items()}}


def test_each_rank_holds_whole_rows_with_original_ndim(pool: WorkerPool) -> None:
    results = pool.run(views_job, 3)[:3]
    shapes = results[0]["shapes"]
    for name, shape in shapes.items():
        held = [r["rows"][name] for r in results]
        assert sum(held) == (shape[0] if shape else 1), (name, held)
    assert any(0 in [r["rows"][n] for r in results] for n in shapes), "no zero-row shard seen"


def tied_job(ctx: WorkerContext) -> None:
    group = ctx.group(2)
    if group is None:
        return None
    model: Any = _sharded("gpt", ctx, 2)
    assert model.head.weight is model.tok.weight
    optim = make_optimizer(model, 1e-2)
    for batch in batches(model, 2):
        _step(model, batch, ctx.rank, 2)
        optim.step()
        optim.zero_grad()
    assert model.head.weight is model.tok.weight
    names = [n for n, _ in model.named_parameters()]
    assert "head.weight" not in names  # deduplicated like any tied module
    with flatshard.summon_full_params(model):
        assert model.head.weight is model.tok.weight
        assert model.tok.weight.shape == (model.vocab, 16)
    return None


def test_tied_parameters_stay_tied(pool: WorkerPool) -> None:
    pool.run(tied_job)


# ---------------------------------------------------------------- no_grad / eval
def eval_job(ctx: WorkerContext) -> None:
    model: Any = _sharded("gpt", ctx, 3)
    if model is None:
        return None
    reference: Any = build("gpt")
    batch = next(batches(model, 1))
    tracker = CollectiveTracker()
    with torch.no_grad(), tracker:
        out = model(batch[0])
    torch.testing.assert_close(out, reference(batch[0]), rtol=1e-5, atol=1e-6)
    assert not out.requires_grad
    assert tracker.gathered_bytes() == 0  # resharded after use, the root too
    model.eval()
    with tracker:
        out = model(batch[0])  # eval() with grad enabled still builds a graph
    assert out.requires_grad
    assert all(p.grad is None for p in model.parameters())
    return None


def test_no_grad_forward_matches_and_reshards(pool: WorkerPool) -> None:
    pool.run(eval_job)


# ---------------------------------------------------------------- summon_full_params
def summon_job(ctx: WorkerContext) -> None:
    model: Any = _sharded("nested", ctx, 3)
    if model is None:
        return None
    reference = dict(build("nested").named_parameters())
    with flatshard.summon_full_params(model):
        for name, param in model.named_parameters():
            torch.testing.assert_close(param, reference[name])
            with torch.no_grad():
                param.add_(1.0)
        model.out.bias.data = torch.full_like(model.out.bias, 7.0)  # a new .data is kept too
    with flatshard.summon_full_params(model, writeback=False):
        for name, param in model.named_parameters():
            expected = torch.full_like(param, 7.0) if name == "out.bias" else reference[name] + 1
            torch.testing.assert_close(param, expected)
            with torch.no_grad():
                param.zero_()  # discarded on exit
    with flatshard.summon_full_params(model, writeback=False):
        torch.testing.assert_close(model.outers[0].pre.weight, reference["outers.0.pre.weight"] + 1)
    # The edited parameters train: a step runs on the written-back shards.
    _step(model, next(batches(model, 1)), ctx.rank, 3)
    return None


def test_summon_full_params_reads_and_writes_back(pool: WorkerPool) -> None:
    pool.run(summon_job)


# ---------------------------------------------------------------- unused parameters
class WithUnused(nn.Module):
    UNIT_CLASSES = frozenset({nn.Sequential})

    def __init__(self) -> None:
        super().__init__()
        self.body = nn.Sequential(nn.Linear(5, 7), nn.Tanh())
        self.unused = nn.Linear(7, 7)  # in the root unit, never called
        self.skipped = nn.Sequential(nn.Linear(7, 7))  # a unit of its own, never called
        self.head = nn.Linear(7, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = self.head(self.body(x))
        return out


def unused_job(ctx: WorkerContext) -> dict[str, Any] | None:
    group = ctx.group(2)
    if group is None:
        return None
    model, reference = twins(WithUnused)
    flatshard.fully_shard(model, auto_wrap_policy={nn.Sequential}, process_group=group)
    optim = torch.optim.SGD(model.parameters(), lr=0.1)
    ref_optim = torch.optim.SGD(reference.parameters(), lr=0.1)
    gen = torch.Generator().manual_seed(0)
    for _ in range(3):
        x = torch.randn(4, 5, generator=gen)
        model(x[ctx.rank * 2 : ctx.rank * 2 + 2]).square().mean().backward()
        reference(x).square().mean().backward()
        # Unused but in a unit that ran: a zero gradient (the whole flat gradient is
        # reduced). In a unit that never ran: no gradient at all.
        assert model.unused.weight.grad is not None
        assert model.unused.weight.grad.abs().sum() == 0
        assert model.skipped[0].weight.grad is None
        optim.step()
        ref_optim.step()
        optim.zero_grad()
        ref_optim.zero_grad()
    with flatshard.summon_full_params(model):
        for name, param in model.named_parameters():
            torch.testing.assert_close(param, dict(reference.named_parameters())[name])
    return None


def test_unused_parameters(pool: WorkerPool) -> None:
    pool.run(unused_job)


# ---------------------------------------------------------------- gradient accumulation
def accumulate_job(ctx: WorkerContext) -> None:
    """Without zero_grad, sharded gradients add up across backward passes."""
    model: Any = _sharded("mlp", ctx, 2)
    if model is None:
        return None
    reference: Any = build("mlp")
    batch = next(batches(model, 1))
    for _ in range(3):
        _step(model, batch, ctx.rank, 2)
        reference.loss(batch).backward()
    summary = flatshard.sharding_summary(model)
    for (name, param), ref in zip(model.named_parameters(), reference.parameters(), strict=True):
        first, count = summary.held_rows(name)
        assert param.grad is not None, name
        # This rank's rows of the reference gradient (a scalar is one row of one).
        expected = ref.grad if ref.dim() else ref.grad.reshape(1)
        expected = expected[first : first + count].reshape(param.grad.shape)
        torch.testing.assert_close(param.grad, expected, rtol=1e-5, atol=1e-7)
    return None


def test_gradients_accumulate_without_zero_grad(pool: WorkerPool) -> None:
    pool.run(accumulate_job)


# ---------------------------------------------------------------- opaque outputs
class Opaque:
    """An output type that torch's pytree does not know."""

    def __init__(self, value: torch.Tensor) -> None:
        self.value = value


class OpaqueBlock(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> Opaque:
        return Opaque(torch.tanh(self.lin(x)))


class OpaqueModel(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.block = OpaqueBlock()
        self.head = nn.Linear(4, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = self.head(self.block(x).value)
        return out


def opaque_job(ctx: WorkerContext, only_unit: bool) -> None:
    group = ctx.group(2)
    if group is None:
        return None
    model, reference = twins(OpaqueBlock if only_unit else OpaqueModel)
    flatshard.fully_shard(model, auto_wrap_policy={OpaqueBlock}, process_group=group)
    x = torch.randn(4, 4, generator=torch.Generator().manual_seed(1))
    with pytest.warns(UserWarning, match="returned Opaque with no tensor"):
        out = model(x[ctx.rank * 2 : ctx.rank * 2 + 2])
    loss = (out.value if only_unit else out).sum() / 4 * 2  # sum over the global batch
    loss.backward()
    ref_out = reference(x)
    (ref_out.value if only_unit else ref_out).sum().div(4).backward()
    summary = flatshard.sharding_summary(model)
    for (name, param), ref in zip(model.named_parameters(), reference.parameters(), strict=True):
        first, count = summary.held_rows(name)
        assert param.grad is not None, name
        torch.testing.assert_close(param.grad, ref.grad[first : first + count])
    tracker = CollectiveTracker()
    with torch.no_grad(), tracker:
        model(x)
    assert tracker.gathered_bytes() == 0
    return None


@pytest.mark.parametrize("only_unit", [False, True])
def test_output_flatshard_cannot_see_into(pool: WorkerPool, only_unit: bool) -> None:
    """The unit stays unsharded until its backward instead of reading freed storage."""
    pool.run(opaque_job, only_unit)
