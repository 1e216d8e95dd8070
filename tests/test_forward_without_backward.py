"""A forward with gradients that no backward follows leaves the model as a no-grad forward
does: ``model.parameters()`` are the sharded leaves, and the buffers kept for a backward are
freed at the next forward ([Note: kept for backward]).

Before, the units kept for backward (the root, the last unit, ZeRO-2 units) left views of
their gathered buffers in the modules: ``model.parameters()`` were non-leaf full-size
tensors on one rank and ``(0,)`` on another, and building an optimizer failed with torch's
"can't optimize a non-leaf Tensor" (the README's "logits equal from_pretrained's" check,
written without ``torch.no_grad()``, did this).
"""

from __future__ import annotations

from typing import Any

import pytest
import torch

import flatshard
from flatshard.testing import internals
from flatshard.testing.jobs import shard_units
from flatshard.testing.models import build
from flatshard.testing.parity import batches, make_optimizer, slice_batch
from flatshard.testing.workers import WorkerContext, WorkerPool

STRATEGIES = ["FULL_SHARD", "SHARD_GRAD_OP", "NO_SHARD", "HYBRID_SHARD", "HYBRID_SHARD_ZERO2"]
WORLD = 2


def forward_without_backward_job(ctx: WorkerContext, strategy: str, later_backward: bool) -> None:
    group = ctx.group(WORLD)
    if group is None:
        return
    model: Any = shard_units(build("gpt"), group, strategy)
    reference: Any = build("gpt")  # the same weights, unsharded, on the global batch
    sharded = {name: (p, p.shape) for name, p in model.named_parameters()}
    first, second = list(batches(reference, 2))

    loss = model.loss(slice_batch(first, ctx.rank, WORLD))  # with gradients, no backward yet
    for name, param in model.named_parameters():
        original, shape = sharded[name]
        assert param is original and param.is_leaf and param.shape == shape, (name, param.shape)
        assert param.grad is None, name
    if later_backward:
        loss.backward()  # the kept buffers still serve it
        reference.loss(first).backward()
    else:
        del loss
        with torch.no_grad():  # the next forward frees what the first one kept
            model.loss(slice_batch(first, ctx.rank, WORLD))
    optim = make_optimizer(model, 1e-2, "sgd")  # the sharded leaves: it builds
    ref_optim = make_optimizer(reference, 1e-2, "sgd")
    if later_backward:
        optim.step()
        ref_optim.step()
    optim.zero_grad()
    ref_optim.zero_grad()

    full = flatshard.full_state_dict(model, rank0_only=False)
    for name, tensor in reference.state_dict().items():
        torch.testing.assert_close(full[name], tensor, msg=name)
    # A training step after it: same loss and parameters as the reference.
    step_loss = model.loss(slice_batch(second, ctx.rank, WORLD))
    step_loss.backward()
    optim.step()
    ref_loss = reference.loss(second)
    ref_loss.backward()
    ref_optim.step()
    total = step_loss.detach().clone()
    torch.distributed.all_reduce(total, group=group)
    torch.testing.assert_close(total / WORLD, ref_loss.detach())
    with flatshard.summon_full_params(model):
        for (name, param), ref in zip(
            model.named_parameters(), reference.parameters(), strict=True
        ):
            torch.testing.assert_close(param, ref, msg=name)
    assert internals.gathered_units(model) == []


@pytest.mark.parametrize("later_backward", [False, True], ids=["no-backward", "later-backward"])
@pytest.mark.parametrize("strategy", STRATEGIES)
def test_forward_without_backward_leaves_the_sharded_leaves(
    pool: WorkerPool, strategy: str, later_backward: bool
) -> None:
    pool.run(forward_without_backward_job, strategy, later_backward)


def memory_after_forward_job(ctx: WorkerContext, strategy: str) -> list[list[str]] | None:
    group = ctx.group(WORLD)
    if group is None:
        return None
    model: Any = shard_units(build("gpt"), group, strategy)
    batch = slice_batch(next(batches(model, 1)), ctx.rank, WORLD)
    model.loss(batch).backward()  # a step: the forward order is known (the last unit kept)
    seen = []
    loss = model.loss(batch)  # with gradients: buffers kept for a backward that never comes
    seen.append(internals.gathered_units(model))
    del loss

    def record(*unused: Any) -> None:
        seen.append(internals.gathered_units(model))

    model.blocks[0].register_forward_pre_hook(record)  # runs after flatshard's own
    with torch.no_grad():
        model.loss(batch)  # the next forward frees them before it gathers anything else
    seen.append(internals.gathered_units(model))
    return seen


@pytest.mark.parametrize("strategy", ["FULL_SHARD", "SHARD_GRAD_OP"])
def test_the_next_forward_frees_what_a_forward_without_backward_kept(
    pool: WorkerPool, strategy: str
) -> None:
    kept, at_first_block, after = pool.run(memory_after_forward_job, strategy)[0]
    last = "blocks.2"
    assert {"<root>", last} <= set(kept), kept  # kept for the backward that might come
    # At the next forward's first block: the root and that block, not what was kept.
    assert sorted(at_first_block) == ["<root>", "blocks.0"], at_first_block
    assert after == [], after  # a no-grad forward keeps nothing
