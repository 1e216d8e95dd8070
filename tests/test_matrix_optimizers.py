"""Matrix optimizers (Muon, Adafactor) never compute on a slice of a matrix in silence.

Before, ``torch.optim.Muon`` on row-sharded parameters trained without a word and drifted
from the unsharded run (it orthogonalizes each rank's slice), and ``torch.optim.Adafactor``
failed with a bare ZeroDivisionError. Now their first step refuses row-sharded parameters
on every rank, naming the parameter and the fix; with the matrices in NO_SHARD units
(whole on every rank) Muon trains exactly like the unsharded model.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch import nn

import flatshard
from flatshard.testing.jobs import shard_units
from flatshard.testing.models import build
from flatshard.testing.parity import batches, slice_batch
from flatshard.testing.workers import WorkerContext, WorkerPool

WORLD = 2


def _muon_and_adamw(model: nn.Module) -> list[torch.optim.Optimizer]:
    """Muon for the blocks' matrices, AdamW for the rest, as Muon is used."""
    matrices = [p for n, p in model.named_parameters() if n.startswith("blocks.") and p.dim() == 2]
    ids = {id(p) for p in matrices}
    rest = [p for p in model.parameters() if id(p) not in ids]
    return [torch.optim.Muon(matrices, lr=0.02), torch.optim.AdamW(rest, lr=1e-2)]


def _optimizers(kind: str, model: nn.Module) -> list[torch.optim.Optimizer]:
    if kind == "muon":
        return _muon_and_adamw(model)
    return [torch.optim.Adafactor(model.parameters(), lr=1e-2)]


def refused_job(ctx: WorkerContext, kind: str, strategy: str) -> str | None:
    group = ctx.group(WORLD)
    if group is None:
        return None
    model: Any = shard_units(build("gpt"), group, strategy)
    optimizers = _optimizers(kind, model)
    model.loss(slice_batch(next(batches(model, 1)), ctx.rank, WORLD)).backward()
    try:
        for optim in optimizers:
            optim.step()
    except RuntimeError as error:
        return str(error)
    return "no error"


@pytest.mark.parametrize("strategy", ["FULL_SHARD", "SHARD_GRAD_OP", "HYBRID_SHARD"])
@pytest.mark.parametrize("kind", ["muon", "adafactor"])
def test_a_matrix_optimizer_refuses_row_shards_on_every_rank(
    pool: WorkerPool, kind: str, strategy: str
) -> None:
    name, first, unit = {  # the first row-sharded parameter in the optimizer's order
        "muon": ("torch.optim.Muon", "'blocks.0.attn.qkv.weight' (48, 16)", "blocks.0"),
        "adafactor": ("torch.optim.Adafactor", "'tok.weight' (37, 16)", "<root>"),
    }[kind]
    for rank, message in enumerate(pool.run(refused_job, kind, strategy)[:WORLD]):
        assert message.startswith(
            f"flatshard: {name} updates each parameter as a whole matrix, but {first} is cut "
            f"into rows across 2 ranks (unit '{unit}', rank {rank})"
        ), message
        assert "strategy=flatshard.ShardingStrategy.NO_SHARD" in message


class MyShampoo(torch.optim.SGD):
    """A user's matrix optimizer, declared with register_matrix_optimizer."""


def declared_job(ctx: WorkerContext) -> str | None:
    group = ctx.group(WORLD)
    if group is None:
        return None
    flatshard.register_matrix_optimizer(MyShampoo)
    model: Any = shard_units(build("gpt"), group, "FULL_SHARD")
    optim = MyShampoo(model.parameters(), lr=0.1)
    model.loss(slice_batch(next(batches(model, 1)), ctx.rank, WORLD)).backward()
    try:
        optim.step()
    except RuntimeError as error:
        return str(error)
    return "no error"


def test_a_declared_matrix_optimizer_refuses_row_shards(pool: WorkerPool) -> None:
    for message in pool.run(declared_job)[:WORLD]:
        assert "test_matrix_optimizers.MyShampoo updates each parameter as a whole" in message
    not_a_class: Any = torch.optim.SGD(nn.Linear(1, 1).parameters())
    with pytest.raises(TypeError, match=r"expected a torch\.optim\.Optimizer subclass"):
        flatshard.register_matrix_optimizer(not_a_class)


def whole_matrices_job(ctx: WorkerContext) -> None:
    """Blocks NO_SHARD (whole matrices, Muon), the rest FULL_SHARD (AdamW), against the
    unsharded model on the global batch. Muon orthogonalizes in bfloat16, which turns the
    last-bit differences of a gradient averaged over ranks into visible ones; so the
    reference takes the matrices' averaged gradients from the sharded run (whole on every
    rank under NO_SHARD) and must then make the very same update."""
    group = ctx.group(WORLD)
    if group is None:
        return
    model: Any = build("gpt")
    for block in model.blocks:
        flatshard.fully_shard(block, strategy="NO_SHARD", process_group=group)
    flatshard.fully_shard(model, process_group=group)
    reference: Any = build("gpt")
    sharded, plain = _muon_and_adamw(model), _muon_and_adamw(reference)
    muon_pairs = list(
        zip(sharded[0].param_groups[0]["params"], plain[0].param_groups[0]["params"], strict=True)
    )
    for batch in batches(reference, 3):
        model.loss(slice_batch(batch, ctx.rank, WORLD)).backward()
        reference.loss(batch).backward()
        for mine, theirs in muon_pairs:
            torch.testing.assert_close(mine.grad, theirs.grad)  # the same up to the last bits
            theirs.grad.copy_(mine.grad)
        for optim in (*sharded, *plain):
            optim.step()
            optim.zero_grad()
    for mine, theirs in muon_pairs:
        assert torch.equal(mine, theirs)  # Muon saw whole matrices: the same updates
    with flatshard.summon_full_params(model):
        for (name, p), q in zip(model.named_parameters(), reference.parameters(), strict=True):
            torch.testing.assert_close(p, q, rtol=1e-5, atol=1e-6, msg=name)


def test_muon_on_whole_matrices_makes_the_unsharded_update(pool: WorkerPool) -> None:
    pool.run(whole_matrices_job)
