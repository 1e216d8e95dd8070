"""flatshard.unshard / flatshard.reshard (FSDP2's methods as free functions): generation
with every unit gathered once, then training on; misuse errors."""

from __future__ import annotations

from typing import Any

import pytest
import torch

import flatshard
from flatshard.measure import ALL_GATHER, STEP_CHECK, CollectiveTracker
from flatshard.testing import internals
from flatshard.testing.models import build
from flatshard.testing.parity import (
    ParityConfig,
    batches,
    make_optimizer,
    shard_with_flatshard,
    slice_batch,
)
from flatshard.testing.workers import WorkerContext, WorkerPool

WORLD = 2


def _units(model: Any) -> list[torch.nn.Module]:
    return [model, *model.blocks]


def generate_then_train_job(ctx: WorkerContext, async_op: bool) -> dict[str, Any] | None:
    group = ctx.group(WORLD)
    if group is None:
        return None
    model: Any = build("gpt")
    shard_with_flatshard(model, ParityConfig(model="gpt", world_size=WORLD), group)
    reference: Any = build("gpt")
    prompt = torch.arange(6).reshape(1, 6) % 37
    with CollectiveTracker() as tracker:
        handles = [flatshard.unshard(unit, async_op=async_op) for unit in _units(model)]
        for handle in handles:
            if handle is not None:
                handle.wait()
        gathered = tracker.counts.get(ALL_GATHER, 0)
        with torch.no_grad():
            tokens = [model(prompt)[0, -1].argmax() for _ in range(3)]  # "decoding"
    per_forward = tracker.counts.get(ALL_GATHER, 0) - gathered
    with torch.no_grad():
        expected = [reference(prompt)[0, -1].argmax() for _ in range(3)]
    for unit in _units(model):
        flatshard.reshard(unit)
    left = internals.gathered_units(model)
    # Training on, against the unsharded model.
    optim, ref_optim = make_optimizer(model, 1e-2, "sgd"), make_optimizer(reference, 1e-2, "sgd")
    for batch in batches(reference, 2):
        model.loss(slice_batch(batch, ctx.rank, WORLD)).backward()
        reference.loss(batch).backward()
        for o in (optim, ref_optim):
            o.step()
            o.zero_grad()
    with flatshard.summon_full_params(model):
        for (name, p), q in zip(model.named_parameters(), reference.parameters(), strict=True):
            torch.testing.assert_close(p, q, msg=name)
    return {
        "gathered": gathered,
        "per_forward": per_forward,
        "same_tokens": tokens == expected,
        "left": left,
        "units": len(_units(model)),
    }


@pytest.mark.parametrize("async_op", [False, True], ids=["wait", "async"])
def test_generate_with_unsharded_units_then_train(pool: WorkerPool, async_op: bool) -> None:
    result = pool.run(generate_then_train_job, async_op)[0]
    assert result["gathered"] == result["units"]  # one all-gather per unit, once
    assert result["per_forward"] == 3 * STEP_CHECK  # decoding gathers nothing (digests only)
    assert result["same_tokens"]
    assert result["left"] == []  # reshard freed them


def misuse_job(ctx: WorkerContext) -> list[str] | None:
    group = ctx.group(WORLD)
    if group is None:
        return None
    model: Any = build("gpt")
    shard_with_flatshard(model, ParityConfig(model="gpt", world_size=WORLD), group)
    errors = []
    try:
        flatshard.unshard(model.blocks[0].mlp)
    except ValueError as error:
        errors.append(str(error))

    def reshard_inside(*unused: Any) -> None:
        flatshard.reshard(model)

    handle = model.blocks[0].register_forward_pre_hook(reshard_inside)
    try:
        model.loss(slice_batch(next(batches(model, 1)), ctx.rank, WORLD))
    except RuntimeError as error:
        errors.append(str(error))
    handle.remove()
    return errors


def test_unshard_and_reshard_misuse(pool: WorkerPool) -> None:
    not_a_unit, inside = pool.run(misuse_job)[0]
    assert not_a_unit.startswith("flatshard.unshard: Sequential is not a flatshard unit")
    assert inside.startswith("flatshard.reshard: unit '<root>' is in its forward pass"), inside
