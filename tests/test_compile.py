"""torch.compile on a sharded model: flatshard's hooks stay outside the compiled region.

Compiling each unit (``module.compile()``) gives one graph per unit forward with no graph
break and no recompilation from step to step; compiling the whole model splits it only at
the units' hooks (and at each row-sparse embedding lookup, which runs eagerly). Both train
exactly like the uncompiled sharded model, row-sparse tables or not. The tests use the
``aot_eager`` backend: dynamo's tracing (where graph breaks come from) without inductor's
code generation, which would take minutes on this CPU.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch import nn
from torch._dynamo.utils import counters

import flatshard
from flatshard.testing.jobs import sharded
from flatshard.testing.workers import WorkerContext, WorkerPool

STEPS = 3


def _train(model: Any, rank: int) -> tuple[list[float], list[int]]:
    """Losses, and dynamo's count of distinct graphs after each step."""
    optim = torch.optim.AdamW(model.parameters(), lr=1e-2)
    gen = torch.Generator().manual_seed(rank)
    losses, graphs = [], []
    for _ in range(STEPS):
        loss = model.loss(model.make_batch(gen, 4))
        loss.backward()
        optim.step()
        optim.zero_grad()
        losses.append(float(loss))
        graphs.append(int(counters["stats"]["unique_graphs"]))
    return losses, graphs


def compile_job(ctx: WorkerContext, how: str, sparse: bool = False) -> dict[str, Any] | None:
    torch._dynamo.reset()
    counters.clear()
    model: Any = sharded("gpt", ctx, 2, placement=flatshard.RowSparse() if sparse else None)
    if model is None:
        return None
    if how == "units":
        for block in model.blocks:
            block.compile(backend="aot_eager")
    elif how == "whole":
        model = _Whole(model)
    losses, graphs = _train(model, ctx.rank)
    traffic = flatshard.embedding_traffic(model.model if how == "whole" else model)
    lookups = sum(t.lookups for t in traffic.values())
    return {
        "losses": losses,
        "graphs": graphs,
        "breaks": dict(counters["graph_break"]),
        "sparse_lookups": lookups,
    }


class _Whole(nn.Module):
    """The model called through its compiled forward, hooks and all (as torch.compile(model)
    would, keeping ``make_batch`` and ``loss`` reachable)."""

    def __init__(self, model: Any) -> None:
        super().__init__()
        self.model = model
        self.compiled = torch.compile(model, backend="aot_eager")

    def make_batch(self, gen: torch.Generator, size: int) -> Any:
        return self.model.make_batch(gen, size)

    def loss(self, batch: Any) -> torch.Tensor:
        x, y = batch
        out: torch.Tensor = nn.functional.cross_entropy(self.compiled(x).flatten(0, 1), y.flatten())
        return out


@pytest.mark.parametrize("sparse", [False, True], ids=["dense", "sparse_embeddings"])
def test_compiled_units_have_no_graph_break_and_train_exactly(
    pool: WorkerPool, sparse: bool
) -> None:
    eager = pool.run(compile_job, "none", sparse)[:2]
    units = pool.run(compile_job, "units", sparse)[:2]
    for plain, compiled in zip(eager, units, strict=True):
        assert compiled["sparse_lookups"] == plain["sparse_lookups"] == (STEPS if sparse else 0)
        assert compiled["breaks"] == {}, compiled["breaks"]
        assert compiled["graphs"][0] == compiled["graphs"][-1] > 0  # no recompilation
        torch.testing.assert_close(compiled["losses"], plain["losses"], rtol=1e-6, atol=0)


@pytest.mark.parametrize("sparse", [False, True], ids=["dense", "sparse_embeddings"])
def test_a_compiled_whole_model_trains_exactly(pool: WorkerPool, sparse: bool) -> None:
    eager = pool.run(compile_job, "none", sparse)[:2]
    whole = pool.run(compile_job, "whole", sparse)[:2]
    for plain, compiled in zip(eager, whole, strict=True):
        assert compiled["sparse_lookups"] == plain["sparse_lookups"] == (STEPS if sparse else 0)
        # A row-sparse lookup runs eagerly (its ids' values size its collectives): the
        # model's graph splits there, and nowhere else.
        breaks = [b for b in compiled["breaks"] if not (sparse and "_row_sparse_lookup" in b)]
        assert breaks == [], compiled["breaks"]
        assert bool(compiled["breaks"]) == sparse
        assert compiled["graphs"][0] == compiled["graphs"][-1]
        torch.testing.assert_close(compiled["losses"], plain["losses"], rtol=1e-6, atol=0)
