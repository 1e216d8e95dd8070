"""Mixed precision, the dtype plan, the sharded grad scaler and CPU offload."""

from __future__ import annotations

from typing import Any, cast

import pytest
import torch
from torch import nn

import flatshard
from flatshard.measure import ALL_GATHER, STEP_CHECK_BYTES, CollectiveTracker
from flatshard.testing.models import GPTBlock, build
from flatshard.testing.parity import (
    ParityConfig,
    assert_same,
    batches,
    parity_job,
    run_flatshard,
    run_fsdp2,
    run_mixed_reference,
    slice_batch,
)
from flatshard.testing.workers import WorkerContext, WorkerPool

BF16 = torch.bfloat16


def mixed_job(ctx: WorkerContext, config: ParityConfig) -> None:
    group = ctx.group(config.world_size)
    if group is None:
        return None
    ours = run_flatshard(config, group)
    fsdp2 = run_fsdp2(config, group)
    if ctx.rank == 0:
        # FSDP2 with the equivalent MixedPrecisionPolicy casts, gathers and reduces the
        # same tensors in the same dtypes: the same losses, to fp32 rounding of the means.
        assert_same(fsdp2, ours.__class__(ours.losses, fsdp2.params), rtol=1e-6)
        # The one-process reference does what the policy promises (fp32 master, bf16
        # compute copy, reduce_dtype gradients), but rounds differently: each rank's loss
        # and gradient are bf16 numbers rounded on their own slice of the batch and then
        # averaged, the reference rounds once over the whole batch. bf16 keeps 8
        # significant bits (relative spacing <= 2^-7), so losses may differ by a couple
        # of roundings on each side: rtol = 4 * 2^-7. Parameters move by lr-scaled
        # gradients whose own bf16 roundings differ the same way: rtol 4 * 2^-7 of the
        # parameter plus atol = steps * lr_sgd * 2^-7 * max|g| (~1e-2 here).
        reference = run_mixed_reference(config)
        assert_same(reference, ours.__class__(ours.losses, ours.params), rtol=4 * 2**-7)
    return None


@pytest.mark.parametrize("reduce_dtype", [None, "bfloat16"])
def test_bf16_parity_with_fsdp2_and_reference(pool: WorkerPool, reduce_dtype: str | None) -> None:
    config = ParityConfig(
        model="gpt",
        world_size=2,
        param_dtype="bfloat16",
        reduce_dtype=reduce_dtype,
        optimizer="sgd",
        steps=3,
    )
    pool.run(mixed_job, config)


def test_output_dtype_parity_with_fsdp2(pool: WorkerPool) -> None:
    """MixedPrecision(output_dtype=torch.float32): the model's bf16 outputs cast to fp32,
    as FSDP2's MixedPrecisionPolicy(output_dtype=...) on the root casts them: the same
    run."""
    config = ParityConfig(
        model="gpt",
        world_size=2,
        param_dtype="bfloat16",
        output_dtype="float32",
        optimizer="sgd",
        steps=3,
    )
    pool.run(mixed_job, config)


def output_dtype_job(ctx: WorkerContext) -> list[str] | None:
    group = ctx.group(2)
    if group is None:
        return None
    model: Any = build("gpt")
    policy = flatshard.MixedPrecision(BF16, output_dtype=torch.float32)
    units = set(model.UNIT_CLASSES)
    flatshard.fully_shard(
        model, auto_wrap_policy=units, process_group=group, mixed_precision=policy
    )
    seen: list[str] = []
    for module in (model.blocks[0], model):  # a unit inside: as computed; the model: cast
        module.register_forward_hook(lambda m, a, out: seen.append(str(out.dtype)))
    batch = slice_batch(next(batches(model, 1)), ctx.rank, 2)
    model.loss(batch).backward()
    return seen


def test_output_dtype_casts_the_models_outputs(pool: WorkerPool) -> None:
    assert pool.run(output_dtype_job)[0] == ["torch.bfloat16", "torch.float32"]


def gathered_bytes_job(ctx: WorkerContext, param_dtype: str | None) -> int | None:
    group = ctx.group(2)
    if group is None:
        return None
    model: Any = build("gpt")
    mixed = flatshard.MixedPrecision(getattr(torch, param_dtype)) if param_dtype else None
    flatshard.fully_shard(
        model, auto_wrap_policy={GPTBlock}, process_group=group, mixed_precision=mixed
    )
    with CollectiveTracker() as tracker:
        model.loss(slice_batch(next(batches(model, 1)), ctx.rank, 2)).backward()
    return tracker.bytes[ALL_GATHER]


def test_bf16_halves_the_gathered_bytes(pool: WorkerPool) -> None:
    check = 2 * STEP_CHECK_BYTES  # the end-of-step digests of both ranks, in any dtype
    full = pool.run(gathered_bytes_job, None)[0] - check
    half = pool.run(gathered_bytes_job, "bfloat16")[0] - check
    assert full > 0
    assert half * 2 == full


def plan_job(ctx: WorkerContext) -> dict[str, Any] | None:
    group = ctx.group(2)
    if group is None:
        return None
    model: Any = build("gpt")
    policy = flatshard.MixedPrecision(BF16, keep_full_precision={nn.LayerNorm})
    flatshard.fully_shard(
        model, auto_wrap_policy={GPTBlock}, process_group=group, mixed_precision=policy
    )
    loss = model.loss(slice_batch(next(batches(model, 1)), ctx.rank, 2))
    loss.backward()
    assert all(p.dtype == torch.float32 for p in model.parameters())  # the masters
    assert all(p.grad.dtype == torch.float32 for p in model.parameters())
    with flatshard.summon_full_params(model):
        assert model.tok.weight.dtype == torch.float32  # full precision values
    plan = flatshard.dtype_report(model)
    return {
        "text": str(plan),
        "rows": [(r.unit, r.compute, r.all_gather, r.reduce, r.master) for r in plan.rows],
    }


def test_dtype_plan_and_full_precision_norms(pool: WorkerPool) -> None:
    result = pool.run(plan_job)[0]
    rows = result["rows"]
    # Each block: one bf16 FlatParameter, one fp32 for its two LayerNorms; reduction in
    # the compute dtype unless reduce_dtype says otherwise; masters fp32.
    assert ("blocks.0", "bfloat16", "bfloat16", "bfloat16", "float32") in rows
    assert ("blocks.0", "float32", "float32", "float32", "float32") in rows
    assert "all-gather" in result["text"] and "bfloat16" in result["text"]


# ---------------------------------------------------------------- fp16 and the scaler
def scaler_job(ctx: WorkerContext, inject_inf: bool, steps: int) -> dict[str, Any] | None:
    group = ctx.group(2)
    if group is None:
        return None
    model: Any = build("mlp")
    flatshard.fully_shard(
        model,
        auto_wrap_policy=set(model.UNIT_CLASSES),
        process_group=group,
        mixed_precision=flatshard.MixedPrecision(torch.float16),
    )
    optim = torch.optim.AdamW(model.parameters(), lr=1e-2)
    scaler = flatshard.ShardedGradScaler("cpu", process_group=group, init_scale=2.0**10)
    losses = []
    batch = next(batches(model, 1))  # one fixed batch: a task a few steps can learn
    for _ in range(steps):
        loss = model.loss(slice_batch(batch, ctx.rank, 2))
        scaler.scale(loss).backward()
        if inject_inf and ctx.rank == 1:
            next(p for p in model.parameters() if p.grad is not None and p.grad.numel()).grad[0] = (
                float("inf")
            )
        before = [p.detach().clone() for p in model.parameters()]
        scaler.step(optim)
        scaler.update()
        optim.zero_grad()
        losses.append(loss.item())
        if inject_inf:
            changed = any(
                not torch.equal(a, p) for a, p in zip(before, model.parameters(), strict=True)
            )
            return {"changed": changed, "scale": scaler.get_scale()}
    return {"losses": losses}


def test_inf_on_one_rank_skips_the_step_everywhere(pool: WorkerPool) -> None:
    for result in pool.run(scaler_job, True, 1)[:2]:
        assert result["changed"] is False
        assert result["scale"] == 2.0**9  # backed off on every rank


def test_fp16_with_the_scaler_trains(pool: WorkerPool) -> None:
    losses = pool.run(scaler_job, False, 30)[0]["losses"]
    assert losses[-1] < 0.5 * losses[0], losses


# ---------------------------------------------------------------- CPU offload
def offload_state_job(ctx: WorkerContext) -> None:
    group = ctx.group(2)
    if group is None:
        return None
    model: Any = build("gpt")
    flatshard.fully_shard(
        model, auto_wrap_policy={GPTBlock}, process_group=group, cpu_offload=flatshard.CPUOffload()
    )
    optim = torch.optim.AdamW(model.parameters())
    model.loss(slice_batch(next(batches(model, 1)), ctx.rank, 2)).backward()
    optim.step()
    for state in optim.state.values():
        for value in state.values():
            assert value.device.type == "cpu"
    assert "cpu" in str(flatshard.dtype_report(model))
    return None


def test_cpu_offload_parity_and_state_on_cpu(pool: WorkerPool) -> None:
    pool.run(parity_job, ParityConfig(model="gpt", world_size=2, offload=True), False)
    # F = 1: offloaded, the shard is never the unsharded buffer itself (copied as on a GPU).
    no_shard = ParityConfig(model="gpt", world_size=2, strategy="NO_SHARD", offload=True)
    pool.run(parity_job, no_shard, False)
    pool.run(offload_state_job)


def test_mixed_precision_rejects_bad_options() -> None:
    with pytest.raises(ValueError, match=r"param_dtype=...\) must be a floating-point"):
        flatshard.MixedPrecision(torch.int32)
    with pytest.raises(TypeError, match=r"keep_full_precision=...\) must be nn.Module classes"):
        flatshard.MixedPrecision(BF16, keep_full_precision={"LayerNorm"})  # type: ignore[arg-type]


def inherit_job(ctx: WorkerContext, override: bool) -> dict[str, Any] | None:
    """Blocks sharded first without a policy inherit the root's; an explicit one stays."""
    group = ctx.group(2)
    if group is None:
        return None
    losses = {}
    for how in ("root only", "everywhere"):
        model: Any = build("gpt")
        policy = flatshard.MixedPrecision(BF16, reduce_dtype=torch.float32)
        block_policy = flatshard.MixedPrecision() if override else None
        for block in model.blocks:
            options = {"mixed_precision": policy if how == "everywhere" else block_policy}
            flatshard.fully_shard(block, process_group=group, **options)
        flatshard.fully_shard(model, process_group=group, mixed_precision=policy)
        plan = {row.unit: row.compute for row in flatshard.dtype_report(model).rows}
        if override:
            break  # fp32 blocks between bf16 embeddings and head: the plan is the point
        loss = model.loss(slice_batch(next(batches(model, 1)), ctx.rank, 2))
        loss.backward()
        losses[how] = loss.item()
    return {"losses": losses, "plan": plan}


def test_units_inherit_the_root_policy(pool: WorkerPool) -> None:
    inherited = pool.run(inherit_job, False)[0]
    assert set(inherited["plan"].values()) == {"bfloat16"}
    assert inherited["losses"]["root only"] == inherited["losses"]["everywhere"]
    overridden = pool.run(inherit_job, True)[0]
    assert overridden["plan"]["blocks.0"] == "float32"  # MixedPrecision(): full precision
    assert overridden["plan"]["<root>"] == "bfloat16"


class _Scaled(nn.Module):
    """loss = sum(w) * scale: every rank's gradient is ``scale`` in every element."""

    def __init__(self) -> None:
        super().__init__()
        self.w = nn.Parameter(torch.zeros(8))

    def forward(self, scale: float) -> torch.Tensor:
        return self.w.sum() * scale


def tiny_gradient_job(ctx: WorkerContext) -> list[float] | None:
    group = ctx.group(4)
    if group is None:
        return None
    model = flatshard.fully_shard(
        _Scaled(),
        process_group=group,
        mixed_precision=flatshard.MixedPrecision(reduce_dtype=torch.float16),
    )
    model(1e-7).backward()
    grad = model.w.grad
    assert grad is not None
    return cast(list[float], grad.tolist())


def test_fp16_reduction_divides_around_the_sum(pool: WorkerPool) -> None:
    # 1e-7 in fp16 is the subnormal 1.19e-7. Divided by W = 4 before the sum it rounds to 0
    # (half the smallest step, to even); divided by 2 before and 2 after, the average
    # of four equal gradients comes back as itself.
    for grads in pool.run(tiny_gradient_job)[:4]:
        assert grads and all(g == pytest.approx(1.19e-7, rel=0.01) for g in grads), grads
