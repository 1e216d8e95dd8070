"""Steady-state tensor memory per rank by formula at world sizes 1, 2 and 4.

What sharding promises: the state a rank keeps between steps (parameter shards, Adam's
moments and step counters, buffers) is its share of the model, so it falls as 1/W, exactly
by the formula below; what a step adds on top (the gradient shard, gathered units,
activations, reduction buffers) does not depend on W beyond the gradient shard and the
alignment padding of the gathered units. Measured at the dispatcher (``PeakStorage``: every
storage created, from building the model on), as ``flatshard bench`` measures "tensors MiB".
"""

from __future__ import annotations

from typing import Any

import flatshard
from flatshard.measure import PeakStorage, distinct_storage_bytes
from flatshard.testing.jobs import loss_backward, sharded
from flatshard.testing.parity import batches, make_optimizer
from flatshard.testing.workers import WorkerContext, WorkerPool

FP32 = 4
WORLDS = (1, 2, 4)


def steady_state_job(ctx: WorkerContext, world: int) -> dict[str, Any] | None:
    with PeakStorage() as tracker:
        model: Any = sharded("gpt", ctx, world)
        if model is None:
            return None
        optim = make_optimizer(model, 1e-3)
        batch = next(batches(model, 1))  # the same per-rank batch at every W
        for step in range(2):
            loss_backward(model, batch, 0, 1)
            optim.step()
            optim.zero_grad()
            if step == 0:
                tracker.reset_peak()
                rest = tracker.peak
        peak = tracker.peak
    summary = flatshard.sharding_summary(model)
    trainable = [p for p in model.parameters() if p.requires_grad]
    kept = [*model.buffers(), *batch]  # the batch: made inside the mode, alive throughout
    return {
        "rest": rest,
        "peak": peak,
        "expected_rest": distinct_storage_bytes(kept)
        + FP32 * sum(f.shard_numel for f in summary.flat_params)  # FlatParameter shards
        # Adam's exp_avg and exp_avg_sq, this rank's rows of each parameter. (Its step
        # counters are made by torch.tensor(), outside the dispatcher: not seen.)
        + 2 * FP32 * sum(p.numel() for p in trainable),
        "largest_unit": max(FP32 * f.shard_numel * world for f in summary.flat_params),
    }


def test_steady_state_memory_by_formula(pool: WorkerPool) -> None:
    results = {w: pool.run(steady_state_job, w)[:w] for w in WORLDS}
    for w, ranks in results.items():
        for rank, result in enumerate(ranks):
            # Between steps a rank holds exactly its share: this falls as 1/W.
            assert result["rest"] == result["expected_rest"], (w, rank, result)
    rest = {w: max(r["rest"] for r in ranks) for w, ranks in results.items()}
    assert rest[2] < 0.52 * rest[1] and rest[4] < 0.28 * rest[1], rest
    # What a step adds (gradient shard, gathered units, reduction buffers, activations of
    # the same per-rank batch) does not grow with W. At W=1 nothing is communicated; at
    # W=2 and 4 a reduction adds at most the unit's unsharded gradient and the all-to-all
    # output gloo's reduce-scatter writes (the same size): two units' bytes. The additions
    # at W=2 and W=4 differ by less than one unit (padding, shard-sized sums).
    added = {w: max(r["peak"] - r["rest"] for r in ranks) for w, ranks in results.items()}
    unit = max(r["largest_unit"] for ranks in results.values() for r in ranks)
    assert added[1] <= added[2] <= added[1] + 2 * unit, (added, unit)
    assert abs(added[4] - added[2]) < unit, (added, unit)
