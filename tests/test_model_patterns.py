"""Model patterns on several ranks: parameter views with whole rows, tied parameters,
no_grad/eval forwards, summon_full_params, unused parameters, gradient accumulation,
outputs flatshard cannot see into.

Jobs run on every rank of the shared pool; rank-local checks assert inside the job and
anything compared across ranks comes back to the test.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch import nn

import flatshard
from flatshard.measure import (
    CollectiveTracker,
)
from flatshard.testing.jobs import loss_backward, sharded
from flatshard.testing.models import build, twins
from flatshard.testing.parity import batches, make_optimizer
from flatshard.testing.workers import WorkerContext, WorkerPool

FP32 = 4


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
    assert list(flatshard.sharded_state_dict(model)) == keys_before
    assert list(flatshard.full_state_dict(model, rank0_only=False)) == keys_before
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
    model: Any = sharded("gpt", ctx, 2)
    assert model.head.weight is model.tok.weight
    optim = make_optimizer(model, 1e-2)
    for batch in batches(model, 2):
        loss_backward(model, batch, ctx.rank, 2)
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
    model: Any = sharded("gpt", ctx, 3)
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
    model: Any = sharded("nested", ctx, 3)
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
    loss_backward(model, next(batches(model, 1)), ctx.rank, 3)
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
    model: Any = sharded("mlp", ctx, 2)
    if model is None:
        return None
    reference: Any = build("mlp")
    batch = next(batches(model, 1))
    for _ in range(3):
        loss_backward(model, batch, ctx.rank, 2)
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
