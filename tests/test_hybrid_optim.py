"""HYBRID_SHARD_OPTIM: hybrid sharding's parameters, the gradients and the optimizer state
cut across all W ranks ([Note: optimizer state sharded across the replicas]).

At 4 ranks as 2 x 2: parity with the unsharded reference (DDP's semantics: each rank its
slice of the global batch, gradients averaged) with clipping and every accumulation mode;
bf16 against HYBRID_SHARD's and the mixed-precision reference; the optimizer state equal
to FULL_SHARD's over the same 4 ranks, by formula; the collectives of a step by formula.
Checkpoints reshard to and from it in test_checkpoint.py.
"""

from __future__ import annotations

from typing import Any

import pytest

import flatshard
from flatshard.measure import (
    ALL_GATHER,
    ALL_REDUCE,
    ALL_TO_ALL,
    CollectiveTracker,
    distinct_storage_bytes,
)
from flatshard.testing.models import build
from flatshard.testing.parity import (
    ParityConfig,
    assert_same,
    batches,
    make_optimizer,
    parity_job,
    run_flatshard,
    run_mixed_reference,
    shard_with_flatshard,
    slice_batch,
)
from flatshard.testing.workers import WorkerContext, WorkerPool

OPTIM = {"world_size": 4, "strategy": "HYBRID_SHARD_OPTIM", "sharding_factor": 2}


@pytest.mark.parametrize("accumulate", ["reduce", "no_sync", "all_reduce_last"])
@pytest.mark.parametrize("optimizer", ["adamw", "sgd"])
def test_parity_with_clipping_and_accumulation(
    pool: WorkerPool, accumulate: str, optimizer: str
) -> None:
    config = ParityConfig(
        model="gpt",
        **OPTIM,
        optimizer=optimizer,
        clip=0.5,
        micro_batches=2,
        no_sync=accumulate == "no_sync",
        all_reduce_last=accumulate == "all_reduce_last",
    )
    pool.run(parity_job, config, False)


def bf16_job(ctx: WorkerContext) -> None:
    group = ctx.group(4)
    if group is None:
        return None
    common: dict[str, Any] = {"param_dtype": "bfloat16", "optimizer": "sgd", "steps": 3}
    ours = run_flatshard(ParityConfig("gpt", **OPTIM, **common), group)
    hybrid_config = ParityConfig("gpt", 4, strategy="HYBRID_SHARD", sharding_factor=2, **common)
    hybrid = run_flatshard(hybrid_config, group)
    if ctx.rank == 0:
        # The same casts and fp32 sums (a reduce-scatter across the 2 replicas adds the
        # same two numbers the all-reduce adds): HYBRID_SHARD's losses and parameters.
        assert_same(hybrid, ours, rtol=1e-6)
        # What the policy promises, within bf16 rounding (see test_mixed_precision.py).
        reference = run_mixed_reference(ParityConfig("gpt", **OPTIM, **common))
        assert_same(reference, ours.__class__(ours.losses, ours.params), rtol=4 * 2**-7)
    return None


def test_bf16_matches_hybrid_shard_and_the_reference(pool: WorkerPool) -> None:
    pool.run(bf16_job)


def optimizer_state_job(
    ctx: WorkerContext, strategy: str, factor: int | None
) -> dict[str, int] | None:
    group = ctx.group(4)
    if group is None:
        return None
    config = ParityConfig("gpt", 4, strategy=strategy, sharding_factor=factor)
    model: Any = build("gpt")
    shard_with_flatshard(model, config, group)
    optim = make_optimizer(model, 1e-3)
    model.loss(slice_batch(next(batches(model, 1)), ctx.rank, 4)).backward()
    optim.step()
    moments = [v for st in optim.state.values() for k, v in st.items() if k != "step"]
    # The original parameters are views of the rows this rank's optimizer steps
    held = sum(p.numel() for p in model.parameters() if p.requires_grad)
    return {"bytes": distinct_storage_bytes(moments), "held": held}


def test_optimizer_state_equals_full_sharding(pool: WorkerPool) -> None:
    split = pool.run(optimizer_state_job, "HYBRID_SHARD_OPTIM", 2)[:4]
    full = pool.run(optimizer_state_job, "FULL_SHARD", None)[:4]
    hybrid = pool.run(optimizer_state_job, "HYBRID_SHARD", 2)[:4]
    for rank in range(4):
        # AdamW's two fp32 moments of the rows this rank steps: its part of its shard
        assert split[rank]["bytes"] == 2 * 4 * split[rank]["held"]
        # FULL_SHARD's over the same 4 ranks: the same W-chunk layout, where rank r * F + s
        # (shard rank s of replica r) steps W-chunk s * R + r
        replica, shard_rank = divmod(rank, 2)
        assert split[rank]["bytes"] == full[shard_rank * 2 + replica]["bytes"]
        # HYBRID_SHARD keeps moments for its whole shard: about R = 2 times more (its
        # layout is row-aligned at F = 2 chunks, so the padding differs a little)
        assert hybrid[rank]["bytes"] == 2 * 4 * hybrid[rank]["held"]
    # Summed over the ranks: every element once (split, FULL_SHARD) or R = 2 times (hybrid)
    assert sum(r["held"] for r in hybrid) == 2 * sum(r["held"] for r in split)


def step_counts_job(ctx: WorkerContext, strategy: str) -> list[dict[str, int]] | None:
    group = ctx.group(4)
    if group is None:
        return None
    model: Any = build("gpt")
    shard_with_flatshard(model, ParityConfig("gpt", 4, strategy=strategy, sharding_factor=2), group)
    optim = make_optimizer(model, 1e-3)
    local = slice_batch(next(batches(model, 1)), ctx.rank, 4)
    counts = []
    for _ in range(2):
        with CollectiveTracker() as tracker:
            model.loss(local).backward()
            optim.step()
            optim.zero_grad()
        counts.append(dict(tracker.counts))
    counts.append({"units": len(flatshard.sharding_summary(model).flat_params)})
    return counts


def test_collectives_of_a_step_by_formula(pool: WorkerPool) -> None:
    first, second, sizes = pool.run(step_counts_job, "HYBRID_SHARD_OPTIM")[0]
    hybrid_first, hybrid_second, _ = pool.run(step_counts_job, "HYBRID_SHARD")[0]
    units = sizes["units"]
    # HYBRID_SHARD's gathers (its all-reduce across the replicas becomes a reduce-scatter:
    # all-to-alls on gloo, two per unit)...
    assert first == {ALL_GATHER: hybrid_first[ALL_GATHER], ALL_TO_ALL: 2 * units}
    assert hybrid_first[ALL_REDUCE] == units and hybrid_first[ALL_TO_ALL] == units
    # ...and after a step, each unit first gathers the replicas' updated parts (R-way)
    assert second == {ALL_GATHER: hybrid_second[ALL_GATHER] + units, ALL_TO_ALL: 2 * units}


def test_offload_and_whole_parameters_are_refused(local_group: Any) -> None:
    model = build("mlp")
    with pytest.raises(ValueError, match=r"HYBRID_SHARD_OPTIM does not combine with CPUOffload"):
        flatshard.fully_shard(
            model, strategy="HYBRID_SHARD_OPTIM", cpu_offload=flatshard.CPUOffload(params=True)
        )
    with pytest.raises(
        ValueError, match=r"Whole\(\) cannot serve '.+' \(rank 0\): HYBRID_SHARD_OPTIM"
    ):
        flatshard.fully_shard(
            build("mlp"), strategy="HYBRID_SHARD_OPTIM", placement=flatshard.Whole()
        )
