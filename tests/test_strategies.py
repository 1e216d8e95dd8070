"""Sharding strategies, hybrid sharding, no_sync, clip_grad_norm_ and communication hooks.

Parity cases compare per-step losses, gradient norms and final parameters with the
non-sharded reference (fp32, rtol 1e-5); FULL_SHARD and SHARD_GRAD_OP also with FSDP2.
"""

from __future__ import annotations

import math
from dataclasses import replace
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh
from torch.utils._python_dispatch import TorchDispatchMode

import flatshard
from flatshard import comm_hooks
from flatshard.measure import (
    ALL_GATHER,
    ALL_REDUCE,
    ALL_TO_ALL,
    REDUCE_SCATTER,
    STEP_CHECK,
    CollectiveTracker,
    distinct_storage_bytes,
)
from flatshard.report import ShardGroups
from flatshard.testing import internals
from flatshard.testing.models import build
from flatshard.testing.parity import (
    ParityConfig,
    batches,
    install_custom_comms,
    parity_job,
    shard_with_flatshard,
    slice_batch,
)
from flatshard.testing.workers import WorkerContext, WorkerPool

FSDP2_STRATEGIES = {"FULL_SHARD", "SHARD_GRAD_OP"}

# (strategy, world size, sharding factor F); hybrid at 4 as 2x2, 1x4 (F = 4) and 4x1 (F = 1).
STRATEGIES = [
    ("FULL_SHARD", 2, None),
    ("FULL_SHARD", 4, None),
    ("SHARD_GRAD_OP", 2, None),
    ("SHARD_GRAD_OP", 4, None),
    ("NO_SHARD", 2, None),
    ("NO_SHARD", 4, None),
    ("HYBRID_SHARD", 2, 2),
    ("HYBRID_SHARD", 4, 2),
    ("HYBRID_SHARD", 4, 4),
    ("HYBRID_SHARD", 4, 1),
    ("HYBRID_SHARD_ZERO2", 4, 2),
    ("HYBRID_SHARD_ZERO2", 4, 1),
    # Gradients and optimizer state over all W: 2x2, and 4x1 (ZeRO-2 over 4 replicas)
    ("HYBRID_SHARD_OPTIM", 4, 2),
    ("HYBRID_SHARD_OPTIM", 4, 1),
]


def _id(case: tuple[str, int, int | None]) -> str:
    strategy, world, factor = case
    return f"{strategy}-w{world}" + (f"-F{factor}" if factor else "")


@pytest.mark.parametrize("optimizer", ["adamw", "sgd"])
@pytest.mark.parametrize("case", STRATEGIES, ids=_id)
def test_strategy_parity(
    pool: WorkerPool, case: tuple[str, int, int | None], optimizer: str
) -> None:
    strategy, world, factor = case
    config = ParityConfig(
        model="gpt",
        world_size=world,
        strategy=strategy,
        sharding_factor=factor,
        optimizer=optimizer,
    )
    pool.run(parity_job, config, strategy in FSDP2_STRATEGIES)


@pytest.mark.parametrize(
    "config",
    [
        ParityConfig(model="gpt", world_size=4, root_strategy="NO_SHARD"),
        ParityConfig(
            model="nested",
            world_size=4,
            strategy="HYBRID_SHARD",
            sharding_factor=2,
            root_strategy="SHARD_GRAD_OP",
        ),
        ParityConfig(
            model="frozen", world_size=3, strategy="SHARD_GRAD_OP", root_strategy="FULL_SHARD"
        ),
        ParityConfig(model="mlp", world_size=4, strategy="NO_SHARD", root_strategy="FULL_SHARD"),
        ParityConfig(model="gpt", world_size=2, keep_gathered=1),  # --keep-gathered
        ParityConfig(
            model="gpt", world_size=4, strategy="HYBRID_SHARD", sharding_factor=2, keep_gathered=2
        ),
        # --units sublayers --keep-gathered 4: the last block with its attention and MLP
        # (sharded inside out), and the MLP of the block before, without its block.
        ParityConfig(model="gpt", world_size=2, keep_gathered=4, policy="sublayers"),
    ],
    ids=lambda c: (
        f"{c.model}-{c.strategy}-root-{c.root_strategy}-kept-{c.keep_gathered}-{c.policy}"
        f"-w{c.world_size}"
    ),
)
def test_mixed_strategy_parity(pool: WorkerPool, config: ParityConfig) -> None:
    pool.run(parity_job, config, False)


@pytest.mark.parametrize("hybrid_from", ["groups", "mesh"])
def test_hybrid_groups_given_explicitly(pool: WorkerPool, hybrid_from: str) -> None:
    config = ParityConfig(
        model="gpt",
        world_size=4,
        strategy="HYBRID_SHARD",
        sharding_factor=2,
        hybrid_from=hybrid_from,
        optimizer="sgd",
    )
    pool.run(parity_job, config, False)


def bad_groups_job(ctx: WorkerContext) -> str:
    world = ctx.group(4)
    try:
        grid = [[0, 1], [2, 3]]  # claimed; both groups are the whole world: no grid
        mesh = DeviceMesh.from_group([world, world], "cpu", mesh=grid, mesh_dim_names=("r", "s"))
        flatshard.fully_shard(
            build("mlp"), process_group=mesh, strategy=flatshard.ShardingStrategy.HYBRID_SHARD
        )
    except ValueError as error:
        return str(error)
    return "no error"


def test_inconsistent_hybrid_groups_are_an_error(pool: WorkerPool) -> None:
    for message in pool.run(bad_groups_job):
        assert "must cut the W=4 ranks into a grid" in message
        assert "shard group [0, 1, 2, 3] and replicate group [0, 1, 2, 3]" in message


def test_default_factor_is_ranks_per_host(monkeypatch: pytest.MonkeyPatch) -> None:
    ranks_per_host = internals.ranks_per_host

    monkeypatch.setenv("LOCAL_WORLD_SIZE", "8")
    assert ranks_per_host(32) == 8
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "3")
    assert ranks_per_host(32) == 32  # does not divide: shard over everything
    monkeypatch.delenv("LOCAL_WORLD_SIZE")
    assert ranks_per_host(32) == 32


# ---------------------------------------------------------------- collective counts
def strategy_counts_job(
    ctx: WorkerContext, config: ParityConfig, micro_batches: int
) -> dict[str, Any] | None:
    group = ctx.group(config.world_size)
    if group is None:
        return None
    model: Any = build(config.model)
    shard_with_flatshard(model, config, group)
    flatshard.set_reshard_after_backward(model, config.reshard_after_backward)
    if config.reshard_after_forward is not None:
        flatshard.set_reshard_after_forward(model, config.reshard_after_forward)
    local = slice_batch(next(batches(model, 1)), ctx.rank, config.world_size)
    with CollectiveTracker() as tracker:
        for micro in range(micro_batches):
            part = slice_batch(local, micro, micro_batches)
            if config.all_reduce_last:
                flatshard.set_requires_all_reduce(model, micro == micro_batches - 1)
            if config.no_sync and micro < micro_batches - 1:
                with flatshard.no_sync(model):
                    model.loss(part).backward()
            else:
                model.loss(part).backward()
    flats = flatshard.sharding_summary(model).flat_params
    return {"counts": dict(tracker.counts), "flats": [(f.unit, f.requires_grad) for f in flats]}


@pytest.mark.parametrize("case", STRATEGIES, ids=_id)
def test_collectives_per_step_by_strategy(
    pool: WorkerPool, case: tuple[str, int, int | None]
) -> None:
    strategy, world, factor = case
    config = ParityConfig(model="gpt", world_size=world, strategy=strategy, sharding_factor=factor)
    result = pool.run(strategy_counts_job, config, 1)[0]
    units = len(result["flats"])  # TinyGPT: one trainable FlatParameter per unit
    blocks = units - 1  # every unit but the root
    F = world if factor is None else factor
    if strategy == "NO_SHARD":
        F = 1
    replicas = world // F
    regathering = ("FULL_SHARD", "HYBRID_SHARD", "HYBRID_SHARD_OPTIM")
    gathers = 0 if F == 1 else units + (blocks if strategy in regathering else 0)
    split = strategy == "HYBRID_SHARD_OPTIM" and replicas > 1
    expected = {
        # F = 1: nothing to gather. FULL_SHARD / HYBRID_SHARD gather each block again in
        # backward; SHARD_GRAD_OP / ZERO2 and the root keep parameters until backward.
        ALL_GATHER: gathers + STEP_CHECK,
        # One reduce-scatter per unit inside the shard group (on gloo an all-to-all:
        # flatshard.report.describe_collectives), then one all-reduce per unit
        # across the replicas (HYBRID_SHARD_OPTIM: a reduce-scatter there too).
        ALL_TO_ALL: (units if F > 1 else 0) + (units if split else 0),
        ALL_REDUCE: units if replicas > 1 and not split else 0,
    }
    assert result["counts"] == {k: v for k, v in expected.items() if v}


@pytest.mark.parametrize("strategy", ["FULL_SHARD", "NO_SHARD", "HYBRID_SHARD"])
def test_no_sync_reduces_once_per_unit(pool: WorkerPool, strategy: str) -> None:
    factor = 2 if strategy == "HYBRID_SHARD" else None
    config = ParityConfig(
        model="gpt", world_size=4, strategy=strategy, sharding_factor=factor, no_sync=True
    )
    with_sync = pool.run(strategy_counts_job, config, 4)[0]
    units = len(with_sync["flats"])
    counts = with_sync["counts"]
    reductions = sum(counts.get(kind, 0) for kind in (REDUCE_SCATTER, ALL_REDUCE, ALL_TO_ALL))
    per_unit = {"FULL_SHARD": 1, "NO_SHARD": 1, "HYBRID_SHARD": 2}[strategy]
    assert reductions == per_unit * units  # four backward passes, one reduction


@pytest.mark.parametrize(
    "case", [("FULL_SHARD", 2, None), ("SHARD_GRAD_OP", 2, None), ("HYBRID_SHARD", 4, 2)], ids=_id
)
def test_units_kept_gathered_after_backward_are_not_gathered_again(
    pool: WorkerPool, case: tuple[str, int, int | None]
) -> None:
    """set_reshard_after_backward(model, False): the forward of each micro-batch after the
    first gathers nothing (N micro-batches: (N - 1) x units all-gathers fewer); backward
    gathers what forward freed, as before."""
    strategy, world, factor = case
    counts = []
    for keep in (False, True):
        config = ParityConfig(
            model="gpt",
            world_size=world,
            strategy=strategy,
            sharding_factor=factor,
            no_sync=True,
            reshard_after_backward=not keep,
        )
        result = pool.run(strategy_counts_job, config, 4)[0]
        counts.append(result["counts"])
    units = len(result["flats"])
    resharding, keeping = counts
    assert resharding[ALL_GATHER] - keeping[ALL_GATHER] == (4 - 1) * units
    assert {k: v for k, v in resharding.items() if k != ALL_GATHER} == {
        k: v for k, v in keeping.items() if k != ALL_GATHER
    }


@pytest.mark.parametrize(
    "case", [("FULL_SHARD", 2, None), ("SHARD_GRAD_OP", 2, None), ("HYBRID_SHARD", 4, 2)], ids=_id
)
def test_reshard_after_forward_and_gathered_once_accumulation_by_formula(
    pool: WorkerPool, case: tuple[str, int, int | None]
) -> None:
    """N = 4 micro-batches under no_sync, U units of which B = U - 1 blocks (the root is
    kept from forward to backward by every strategy). set_reshard_after_forward(False):
    backward gathers nothing again, fewer all-gathers than FULL_SHARD by the blocks it
    regathers (none fewer than SHARD_GRAD_OP, which keeps them already); True makes
    SHARD_GRAD_OP regather like FULL_SHARD. With set_reshard_after_backward(False) as well,
    each unit is gathered once per step: U all-gathers for the N micro-batches, forward and
    backward."""
    strategy, world, factor = case
    n = 4

    def gathers(after_forward: bool | None, after_backward: bool = True) -> int:
        config = ParityConfig(
            model="gpt",
            world_size=world,
            strategy=strategy,
            sharding_factor=factor,
            no_sync=True,
            reshard_after_backward=after_backward,
            reshard_after_forward=after_forward,
        )
        result = pool.run(strategy_counts_job, config, n)[0]
        gathers.units = len(result["flats"])  # type: ignore[attr-defined]
        return int(result["counts"][ALL_GATHER])

    default, kept, resharded = gathers(None), gathers(False), gathers(True)
    once = gathers(False, after_backward=False)
    units = gathers.units  # type: ignore[attr-defined]
    blocks = units - 1
    # Backward regathers the blocks but the one forward ran last (kept: backward starts
    # there), which the very first micro-batch does not know yet.
    regathered = blocks + (n - 1) * (blocks - 1)
    assert default - kept == (0 if strategy == "SHARD_GRAD_OP" else regathered)
    assert resharded - kept == regathered
    checks = kept - n * units  # the end-of-step digests, alike in every run
    assert once == units + checks


@pytest.mark.parametrize(
    "config",
    [
        ParityConfig(model="gpt", world_size=2, micro_batches=2, reshard_after_forward=False),
        ParityConfig(
            model="gpt",
            world_size=2,
            strategy="SHARD_GRAD_OP",
            micro_batches=2,
            no_sync=True,
            accumulate_with="switch",
            reshard_after_forward=True,
        ),
    ],
    ids=["full-shard-kept", "shard-grad-op-resharded"],
)
def test_reshard_after_forward_matches_fsdp2_and_the_reference(
    pool: WorkerPool, config: ParityConfig
) -> None:
    """set_reshard_after_forward against the unsharded model and FSDP2 with the same
    switch, over several steps and micro-batches."""
    pool.run(parity_job, config, True)


@pytest.mark.parametrize(
    ("config", "against_fsdp2"),
    [
        (
            ParityConfig(
                model="gpt", world_size=2, micro_batches=4, no_sync=True, accumulate_with="switch"
            ),
            True,
        ),
        (
            ParityConfig(
                model="gpt",
                world_size=2,
                micro_batches=4,
                no_sync=True,
                reshard_after_backward=False,
            ),
            False,
        ),
        (
            ParityConfig(
                model="gpt",
                world_size=2,
                micro_batches=3,
                no_sync=True,
                accumulate_with="switch",
                reshard_after_backward=False,
                strategy="SHARD_GRAD_OP",
            ),
            True,
        ),
        (
            ParityConfig(
                model="nested",
                world_size=4,
                micro_batches=2,
                no_sync=True,
                reshard_after_backward=False,
                strategy="HYBRID_SHARD",
                sharding_factor=2,
                optimizer="sgd",
            ),
            False,
        ),
        (ParityConfig(model="frozen", world_size=2, steps=3, reshard_after_backward=False), False),
        (
            ParityConfig(
                model="gpt",
                world_size=4,
                micro_batches=3,
                all_reduce_last=True,
                strategy="HYBRID_SHARD",
                sharding_factor=2,
                clip=0.5,
            ),
            False,
        ),
        (
            ParityConfig(
                model="nested",
                world_size=4,
                micro_batches=2,
                all_reduce_last=True,
                reshard_after_backward=False,
                strategy="HYBRID_SHARD_ZERO2",
                sharding_factor=2,
                optimizer="sgd",
            ),
            False,
        ),
    ],
    ids=[
        "switch-fsdp2",
        "keep-gathered",
        "switch-keep-zero2-fsdp2",
        "keep-hybrid",
        "keep-frozen",
        "all-reduce-last-clip",
        "all-reduce-last-keep-zero2",
    ],
)
def test_fsdp2_named_switches_parity(
    pool: WorkerPool, config: ParityConfig, against_fsdp2: bool
) -> None:
    """set_requires_gradient_sync and set_reshard_after_backward against the unsharded
    model and, where marked, FSDP2 with the same settings; over several steps, so a unit
    kept gathered across optimizer.step() would show (it is gathered again)."""
    pool.run(parity_job, config, against_fsdp2)


@pytest.mark.parametrize("micro_batches", [1, 2, 3])
def test_requires_all_reduce_false_all_reduces_across_replicas_once_per_step(
    pool: WorkerPool, micro_batches: int
) -> None:
    """HYBRID_SHARD 2 x 2, N micro-batches: every micro-batch reduce-scatters each unit in
    its shard group (N x units all-to-alls, gloo's form); across the replicas, N x units
    all-reduces by default, and units all-reduces once (of the sum) with
    set_requires_all_reduce(False) for all micro-batches but the last."""
    config = ParityConfig(model="gpt", world_size=4, strategy="HYBRID_SHARD", sharding_factor=2)
    default = pool.run(strategy_counts_job, config, micro_batches)[0]
    once = pool.run(strategy_counts_job, replace(config, all_reduce_last=True), micro_batches)[0]
    units = len(once["flats"])
    for counts in (default["counts"], once["counts"]):
        assert counts.get(ALL_TO_ALL, 0) + counts.get(REDUCE_SCATTER, 0) == micro_batches * units
    assert default["counts"][ALL_REDUCE] == micro_batches * units
    assert once["counts"][ALL_REDUCE] == units


def owed_step_job(ctx: WorkerContext) -> str | None:
    group = ctx.group(4)
    if group is None:
        return None
    model: Any = build("gpt")
    config = ParityConfig(model="gpt", world_size=4, strategy="HYBRID_SHARD", sharding_factor=2)
    shard_with_flatshard(model, config, group)
    optim = torch.optim.SGD(model.parameters(), lr=0.1)
    flatshard.set_requires_all_reduce(model, False)
    model.loss(slice_batch(next(batches(model, 1)), ctx.rank, 4)).backward()
    try:
        optim.step()
    except RuntimeError as error:
        return str(error)
    finally:
        flatshard.set_requires_all_reduce(model, True)
    return "no error"


def test_a_step_while_the_all_reduce_is_owed_is_an_error(pool: WorkerPool) -> None:
    for rank, message in enumerate(pool.run(owed_step_job)):
        assert message.startswith(f"flatshard: optimizer.step() on rank {rank} while unit"), message
        assert "flatshard.set_requires_all_reduce(model, True) before the last" in message


def switch_misuse_job(ctx: WorkerContext) -> list[str] | None:
    group = ctx.group(2)
    if group is None:
        return None
    model: Any = build("gpt")
    shard_with_flatshard(model, ParityConfig(model="gpt", world_size=2), group)
    errors = []
    for call in (
        lambda: flatshard.set_reshard_after_backward(model.blocks[0], False),
        lambda: flatshard.set_requires_gradient_sync(torch.nn.Linear(2, 2), False),
    ):
        try:
            call()
            errors.append("no error")
        except ValueError as error:
            errors.append(str(error))
    return errors


def test_switches_apply_to_a_whole_model(pool: WorkerPool) -> None:
    block, plain = pool.run(switch_misuse_job)[0]
    assert block.startswith(
        "flatshard.set_reshard_after_backward: GPTBlock is part of the model that fully_shard "
        "was last called on (TinyGPT)"
    ), block
    assert "set_requires_gradient_sync: Linear holds no" in plain, plain


@pytest.mark.parametrize(
    "config",
    [
        ParityConfig(model="gpt", world_size=2, micro_batches=4, no_sync=True),
        ParityConfig(model="frozen", world_size=3, micro_batches=4, no_sync=True),
        ParityConfig(model="gpt", world_size=4, micro_batches=3, no_sync=True, strategy="NO_SHARD"),
        ParityConfig(
            model="nested",
            world_size=4,
            micro_batches=3,
            no_sync=True,
            strategy="HYBRID_SHARD",
            sharding_factor=2,
            optimizer="sgd",
        ),
        ParityConfig(model="gpt", world_size=2, micro_batches=4, strategy="SHARD_GRAD_OP"),
    ],
    ids=lambda c: f"{c.model}-{c.strategy}-nosync{c.no_sync}-mb{c.micro_batches}",
)
def test_accumulation_parity(pool: WorkerPool, config: ParityConfig) -> None:
    """With or without no_sync, micro-batches equal one step on the concatenated batch."""
    pool.run(parity_job, config, False)


# ---------------------------------------------------------------- clip_grad_norm_
@pytest.mark.parametrize("norm_type", [1.0, 2.0, math.inf])
@pytest.mark.parametrize(
    "case",
    [*STRATEGIES[1::2], ("mixed", 4, None)],
    ids=_id,
)
def test_clip_grad_norm_matches_torch(
    pool: WorkerPool, case: tuple[str, int, int | None], norm_type: float
) -> None:
    pool.run(parity_job, _clipped(case, norm_type, "flatshard"), False)


def _clipped(case: tuple[str, int, int | None], norm_type: float, clip_with: str) -> ParityConfig:
    """A parity run that clips every step (``mixed``: hybrid blocks under a NO_SHARD root,
    with frozen parts)."""
    strategy, world, factor = case
    mixed = strategy == "mixed"
    return ParityConfig(
        model="frozen" if mixed else "gpt",
        world_size=world,
        strategy="HYBRID_SHARD" if mixed else strategy,
        sharding_factor=2 if mixed else factor,
        root_strategy="NO_SHARD" if mixed else None,
        clip=0.05,  # below the gradient norm: every step clips
        norm_type=norm_type,
        clip_with=clip_with,
        optimizer="sgd",
    )


@pytest.mark.parametrize("norm_type", [2.0, math.inf])
@pytest.mark.parametrize(
    "case",
    [
        ("FULL_SHARD", 2, None),
        ("SHARD_GRAD_OP", 4, None),
        ("HYBRID_SHARD", 4, 2),
        ("mixed", 4, None),
    ],
    ids=_id,
)
def test_torch_clip_grad_norm_takes_the_norm_of_the_whole_gradient(
    pool: WorkerPool, case: tuple[str, int, int | None], norm_type: float
) -> None:
    """torch.nn.utils.clip_grad_norm_(model.parameters(), ...) as FSDP2 users call it: on
    a sharded model it returns and clips by the unsharded model's norm (each rank's own
    norm would scale each rank's rows differently)."""
    pool.run(parity_job, _clipped(case, norm_type, "torch"), False)


@pytest.mark.parametrize("case", [("FULL_SHARD", 2, None), ("mixed", 4, None)], ids=_id)
def test_clipping_by_a_given_norm_as_accelerate_does_is_global(
    pool: WorkerPool, case: tuple[str, int, int | None]
) -> None:
    """torch's get_total_norm, then clip_grads_with_norm_ with it: how accelerate (and so
    the Hugging Face Trainer) clips. The norm is the unsharded model's, and every rank
    scales its rows by the same factor."""
    pool.run(parity_job, _clipped(case, 2.0, "torch-split"), False)


def test_torch_clip_grad_value_is_exact_on_shards(pool: WorkerPool) -> None:
    """clip_grad_value_ clamps each element alone: this rank's rows are clipped right."""
    config = ParityConfig(model="gpt", world_size=2, clip=1e-3, clip_with="value", optimizer="sgd")
    pool.run(parity_job, config, False)


def nan_in_the_last_ranks_rows_job(ctx: WorkerContext, strategy: str, world: int) -> list[str]:
    """A NaN in one gradient element of the last rank's rows (the trap of
    ``torch.where(x > 0, x.sqrt(), 0)``): the inf-norm is NaN on every rank, as on the
    unsharded model; ``error_if_nonfinite`` raises on every rank."""
    group = ctx.group(world)
    if group is None:
        return []
    config = ParityConfig(model="gpt", world_size=world, strategy=strategy, sharding_factor=2)
    model: Any = build("gpt")
    shard_with_flatshard(model, config, group)
    batch = next(batches(model, 1))
    model.loss(slice_batch(batch, dist.get_rank(group), world)).backward()
    last = dist.get_rank(group) == world - 1
    grads = [p.grad for p in model.parameters() if p.grad is not None and p.grad.numel()]
    found = []
    for clip in ("flatshard", "torch", "torch-raises"):
        if last:
            grads[-1].view(-1)[-1] = math.nan
        try:
            if clip == "flatshard":
                norm = flatshard.clip_grad_norm_(model, 1.0, norm_type=math.inf)
            else:
                raises = clip == "torch-raises"
                params = model.parameters()
                norm = torch.nn.utils.clip_grad_norm_(
                    params, 1.0, norm_type=math.inf, error_if_nonfinite=raises
                )
            found.append(f"{clip}: norm {float(norm)}")
        except RuntimeError as error:
            found.append(f"{clip}: raised {str(error)[:40]}")
    return found


@pytest.mark.parametrize(
    ("strategy", "world"), [("FULL_SHARD", 2), ("FULL_SHARD", 4), ("HYBRID_SHARD_OPTIM", 4)]
)
def test_a_nan_gradient_on_a_later_rank_makes_the_inf_norm_nan(
    pool: WorkerPool, strategy: str, world: int
) -> None:
    """Before: gloo's MAX dropped a NaN coming from a later rank: the norm was finite on
    every rank, error_if_nonfinite passed, and the optimizer wrote the NaN into the
    weights (torch on the unsharded model: NaN, or its "non-finite" error)."""
    expected = [
        "flatshard: norm nan",
        "torch: norm nan",
        "torch-raises: raised The total norm of order inf for gradient",
    ]
    for found in pool.run(nan_in_the_last_ranks_rows_job, strategy, world)[:world]:
        assert found == expected, found


def torch_norm_of_other_tensors_job(ctx: WorkerContext) -> None:
    """Tensors flatshard does not manage keep torch's own (local) norm, also once a model
    is sharded in the process."""
    group = ctx.group(2)
    if group is None:
        return
    model: Any = build("gpt")
    shard_with_flatshard(model, ParityConfig(model="gpt", world_size=2), group)
    plain = [torch.full((3,), float(ctx.rank + 1))]
    expected = torch.linalg.vector_norm(plain[0])
    torch.testing.assert_close(torch.nn.utils.get_total_norm(plain), expected)


def test_torch_norm_of_other_tensors_is_unchanged(pool: WorkerPool) -> None:
    pool.run(torch_norm_of_other_tensors_job)


# ---------------------------------------------------------------- memory by formula
def strategy_memory_job(ctx: WorkerContext, config: ParityConfig) -> dict[str, int] | None:
    group = ctx.group(config.world_size)
    if group is None:
        return None
    model: Any = build(config.model)
    sizes = {n: p.numel() for n, p in model.named_parameters()}
    shard_with_flatshard(model, config, group)
    model.loss(slice_batch(next(batches(model, 1)), ctx.rank, config.world_size)).backward()
    params = list(model.parameters())
    grads = [p.grad for p in params if p.grad is not None]
    F = {"NO_SHARD": 1}.get(config.strategy, config.sharding_factor or config.world_size)
    # HYBRID_SHARD_OPTIM: the gradient is this rank's part of its shard, 1 / R of it
    R = config.world_size // F if config.strategy == "HYBRID_SHARD_OPTIM" else 1
    expected = 0
    for flat in flatshard.sharding_summary(model).flat_params:
        numel = sum(sizes[n] for n in flat.param_names)
        # ceil-padded to F, plus the reported alignment padding, split over F ranks;
        # a parameter and (if trainable) a gradient element each.
        shard = (math.ceil(numel / F) * F + flat.alignment_padding_numel) // F
        expected += shard + (shard // R if flat.requires_grad else 0)
    return {
        "bytes": distinct_storage_bytes(params) + distinct_storage_bytes(grads),
        "expected": 4 * expected,
    }


@pytest.mark.parametrize("case", STRATEGIES, ids=_id)
def test_param_and_grad_bytes_by_strategy(
    pool: WorkerPool, case: tuple[str, int, int | None]
) -> None:
    strategy, world, factor = case
    config = ParityConfig(
        model="frozen", world_size=world, strategy=strategy, sharding_factor=factor
    )
    for rank, result in enumerate(pool.run(strategy_memory_job, config)[:world]):
        assert result["bytes"] == result["expected"], rank


# ---------------------------------------------------------------- communication hooks
@pytest.mark.parametrize("hook", ["bf16", "fp16"])
@pytest.mark.parametrize("strategy", ["FULL_SHARD", "HYBRID_SHARD"])
def test_low_precision_hook_parity(pool: WorkerPool, hook: str, strategy: str) -> None:
    config = ParityConfig(
        model="gpt",
        world_size=4,
        strategy=strategy,
        sharding_factor=2 if strategy == "HYBRID_SHARD" else None,
        comm_hook=hook,
        optimizer="sgd",
    )
    pool.run(parity_job, config, False)


def overflow_job(ctx: WorkerContext, predivide: int | None) -> bool | None:
    """fp16 gradients of 30000 on 4 ranks: their sum (120000) overflows fp16 (max 65504)."""
    group = ctx.group(4)
    if group is None:
        return None
    groups = ShardGroups(shard=group, replicate=None)
    hook = comm_hooks.LowPrecisionHook(torch.float16, predivide=predivide)
    shard = hook(torch.full((8,), 30000.0), groups)
    assert shard.dtype == torch.float32
    return bool(torch.isfinite(shard).all() and torch.allclose(shard, torch.full((2,), 30000.0)))


def test_predivision_avoids_fp16_overflow(pool: WorkerPool) -> None:
    assert pool.run(overflow_job, None)[:4] == [True] * 4  # split: /2 before, /2 after
    assert pool.run(overflow_job, 1)[:4] == [False] * 4  # all after: the sum overflows


def test_low_precision_hook_rejects_other_dtypes() -> None:
    with pytest.raises(ValueError, match=r"torch.bfloat16 or torch.float16"):
        comm_hooks.LowPrecisionHook(torch.float32)


def hybrid_groups_job(ctx: WorkerContext) -> int | None:
    group = ctx.group(4)
    if group is None:
        return None
    internals.forget_hybrid_groups()
    made: list[Any] = []
    real = torch.distributed.new_group

    def counted(*args: Any, **kwargs: Any) -> Any:
        made.append(args)
        return real(*args, **kwargs)

    torch.distributed.new_group = counted  # type: ignore[assignment]
    try:
        model: Any = build("gpt")
        options: Any = {"strategy": "HYBRID_SHARD", "sharding_factor": 2, "process_group": group}
        for block in model.blocks:
            flatshard.fully_shard(block, **options)
        flatshard.fully_shard(model, **options)
    finally:
        torch.distributed.new_group = real  # type: ignore[assignment]
    model.loss(slice_batch(next(batches(model, 1)), ctx.rank, 4)).backward()
    return len(made)


def test_hybrid_calls_share_their_groups(pool: WorkerPool) -> None:
    """Four hybrid fully_shard calls (three blocks, then the root) at 2 x 2 create the two
    shard and two replicate groups once (on NCCL each group is a communicator per rank)."""
    assert pool.run(hybrid_groups_job)[0] == 4


@pytest.mark.parametrize(
    "config",
    [
        ParityConfig(model="gpt", world_size=2, gradient_divide_factor=1.0),
        ParityConfig(model="gpt", world_size=2, gradient_divide_factor=3.0, clip=0.5),
        ParityConfig(
            model="gpt", world_size=2, gradient_divide_factor=0.5, micro_batches=2, no_sync=True
        ),
    ],
    ids=["sum", "by-3-clipped", "by-half-accumulated"],
)
def test_gradient_divide_factor_matches_the_reference(
    pool: WorkerPool, config: ParityConfig
) -> None:
    """set_gradient_divide_factor(model, f): gradients summed over the ranks divided by
    f instead of W, as the unsharded model's with its loss scaled by W / f."""
    pool.run(parity_job, config, False)


def test_gradient_divide_factor_matches_fsdp2(pool: WorkerPool) -> None:
    config = ParityConfig(model="gpt", world_size=2, gradient_divide_factor=1.0)
    pool.run(parity_job, config, True)


@pytest.mark.parametrize(
    "config",
    [
        ParityConfig(
            model="gpt",
            world_size=4,
            strategy="HYBRID_SHARD",
            sharding_factor=2,
            gradient_divide_factor=2.0,
            micro_batches=2,
            all_reduce_last=True,
        ),
        ParityConfig(
            model="vocab_gpt", world_size=2, gradient_divide_factor=1.0, sparse_embeddings=True
        ),
    ],
    ids=["hybrid-owed", "row-sparse"],
)
def test_gradient_divide_factor_meets_hybrid_and_row_sparse_tables(
    pool: WorkerPool, config: ParityConfig
) -> None:
    pool.run(parity_job, config, False)


# ---------------------------------------------------------------- set_unshard_in_backward
EMBEDDINGS = ("tok", "pos")  # EmbeddingUnitsGPT's tables: units no backward op reads


@pytest.mark.parametrize(
    "config",
    [
        ParityConfig(
            model="embedding_units_gpt",
            world_size=2,
            micro_batches=2,
            no_unshard_in_backward=EMBEDDINGS,
            clip=0.5,
        ),
        ParityConfig(
            model="embedding_units_gpt",
            world_size=2,
            strategy="SHARD_GRAD_OP",
            micro_batches=2,
            no_sync=True,
            accumulate_with="switch",
            no_unshard_in_backward=("tok",),
        ),
    ],
    ids=["full-shard-clipped", "shard-grad-op-accumulated"],
)
def test_unshard_in_backward_off_matches_fsdp2_and_the_reference(
    pool: WorkerPool, config: ParityConfig
) -> None:
    """set_unshard_in_backward(table, False) on the embedding units: their gradients are
    reduced as always, against the unsharded model and FSDP2 with the same switch."""
    pool.run(parity_job, config, True)


def unshard_in_backward_counts_job(
    ctx: WorkerContext, strategy: str, off: tuple[str, ...], micro_batches: int
) -> dict[str, Any] | None:
    group = ctx.group(2)
    if group is None:
        return None
    config = ParityConfig(model="embedding_units_gpt", world_size=2, strategy=strategy)
    model: Any = build(config.model)
    shard_with_flatshard(model, config, group)
    for name in off:
        flatshard.set_unshard_in_backward(model.get_submodule(name), False)
    local = slice_batch(next(batches(model, 1)), ctx.rank, 2)
    with CollectiveTracker() as tracker:
        for micro in range(micro_batches):
            model.loss(slice_batch(local, micro, micro_batches)).backward()
    return dict(tracker.counts)


@pytest.mark.parametrize("strategy", ["FULL_SHARD", "SHARD_GRAD_OP"])
def test_unshard_in_backward_off_gathers_the_unit_once_per_forward(
    pool: WorkerPool, strategy: str
) -> None:
    """N = 3 backward passes: FULL_SHARD gathers each table again in each backward, so
    switching both off saves 2 x N all-gathers; SHARD_GRAD_OP kept them from forward to
    backward (no saving: forward now frees them). Reductions are unchanged."""
    n = 3
    default = pool.run(unshard_in_backward_counts_job, strategy, (), n)[0]
    off = pool.run(unshard_in_backward_counts_job, strategy, EMBEDDINGS, n)[0]
    saved = len(EMBEDDINGS) * n if strategy == "FULL_SHARD" else 0
    assert default[ALL_GATHER] - off[ALL_GATHER] == saved
    assert {k: v for k, v in default.items() if k != ALL_GATHER} == {
        k: v for k, v in off.items() if k != ALL_GATHER
    }


def unshard_in_backward_misuse_job(ctx: WorkerContext) -> list[str] | None:
    group = ctx.group(2)
    if group is None:
        return None
    config = ParityConfig(model="embedding_units_gpt", world_size=2)
    model: Any = build(config.model)
    shard_with_flatshard(model, config, group)
    messages = []
    for call in (
        lambda: flatshard.set_unshard_in_backward(model.blocks[0].attn, False),  # no unit
        lambda: flatshard.set_unshard_in_backward(model.tok, 0),  # not a bool
    ):
        try:
            call()
        except (TypeError, ValueError) as error:
            messages.append(str(error))
    # A unit whose backward does read its parameters: the claim is wrong, and backward
    # fails (never a silent gradient from a freed buffer).
    flatshard.set_unshard_in_backward(model.blocks[1], False)
    try:
        model.loss(slice_batch(next(batches(model, 1)), ctx.rank, 2)).backward()
    except RuntimeError as error:
        messages.append(str(error))
    return messages


def test_unshard_in_backward_misuse_is_an_error(pool: WorkerPool) -> None:
    for messages in pool.run(unshard_in_backward_misuse_job)[:2]:
        assert len(messages) == 3, messages
        assert "is not a flatshard unit" in messages[0]
        assert "pass True or False, got 0" in messages[1]
        assert "storage of size 0" in messages[2]


# ---------------------------------------------------------------- custom collectives
@pytest.mark.parametrize(
    ("config", "against_fsdp2"),
    [
        (ParityConfig(model="gpt", world_size=2, micro_batches=2, custom_comms=True), True),
        (
            ParityConfig(
                model="gpt",
                world_size=2,
                strategy="SHARD_GRAD_OP",
                micro_batches=2,
                no_sync=True,
                accumulate_with="switch",
                custom_comms=True,
                clip=0.5,
            ),
            True,
        ),
        (
            ParityConfig(
                model="nested",
                world_size=4,
                strategy="HYBRID_SHARD",
                sharding_factor=2,
                custom_comms=True,
                optimizer="sgd",
            ),
            False,
        ),
    ],
    ids=["full-shard-fsdp2", "shard-grad-op-accumulated-fsdp2", "hybrid"],
)
def test_custom_collectives_match_fsdp2_and_the_reference(
    pool: WorkerPool, config: ParityConfig, against_fsdp2: bool
) -> None:
    """set_custom_all_gather / set_custom_reduce_scatter with FSDP2's comm objects
    (torch's collectives behind them) on every unit: the same training as without."""
    pool.run(parity_job, config, against_fsdp2)


def custom_comms_counts_job(ctx: WorkerContext, blocking: bool) -> dict[str, Any] | None:
    group = ctx.group(2)
    if group is None:
        return None
    config = ParityConfig(model="gpt", world_size=2)
    plain: Any = build(config.model)
    shard_with_flatshard(plain, config, group)
    model: Any = build(config.model)
    shard_with_flatshard(model, config, group)
    gather, scatter = install_custom_comms(model, "flatshard", blocking)
    local = slice_batch(next(batches(model, 1)), ctx.rank, 2)
    plain.loss(local).backward()
    with CollectiveTracker() as tracker:
        model.loss(local).backward()
    units = len(flatshard.unit_modules(model))
    grads = [p.grad for p in model.parameters()]
    return {
        "counts": dict(tracker.counts),
        "gather": gather.calls,
        "scatter": scatter.calls,
        "units": units,
        "same_grads": all(
            (a is None and b is None) or torch.allclose(a, b, rtol=1e-5, atol=1e-7)
            for a, b in zip(grads, [p.grad for p in plain.parameters()], strict=True)
        ),
    }


@pytest.mark.parametrize("blocking", [False, True], ids=["work", "done-on-return"])
def test_custom_collectives_carry_every_gather_and_reduce_scatter(
    pool: WorkerPool, blocking: bool
) -> None:
    """One step of a FULL_SHARD TinyGPT (U units, U - 1 blocks gathered again in backward):
    the user's all-gather is called U + (U - 1) times, the reduce-scatter U times, and the
    gradients travel by reduce_scatter_tensor, none by gloo's all-to-all form; they equal
    torch's collectives' gradients, whether the comms return a work or None (done)."""
    result = pool.run(custom_comms_counts_job, blocking)[0]
    assert result["same_grads"]
    units = result["units"]
    assert result["gather"] == 2 * units - 1
    assert result["scatter"] == units
    assert result["counts"] == {
        ALL_GATHER: 2 * units - 1 + STEP_CHECK,
        REDUCE_SCATTER: units,
    }


def custom_comms_misuse_job(ctx: WorkerContext) -> list[str] | None:
    group = ctx.group(2)
    if group is None:
        return None

    def refusal(call: Any) -> str:
        try:
            call()
        except (TypeError, ValueError) as error:
            return str(error)
        return "no error"

    def no_op(*args: Any, **kwargs: Any) -> None:
        return None

    gpt: Any = build("gpt")
    shard_with_flatshard(gpt, ParityConfig(model="gpt", world_size=2), group)
    comm_hooks.register_comm_hook(gpt, comm_hooks.LowPrecisionHook(torch.bfloat16))
    tables: Any = build("vocab_gpt")
    config = ParityConfig(model="vocab_gpt", world_size=2, sparse_embeddings=True)
    shard_with_flatshard(tables, config, group)  # the root holds the row-sparse table
    custom: Any = build("gpt")
    shard_with_flatshard(custom, ParityConfig(model="gpt", world_size=2), group)
    flatshard.set_custom_reduce_scatter(custom, no_op)
    hook = comm_hooks.LowPrecisionHook(torch.bfloat16)
    return [
        refusal(lambda: flatshard.set_custom_all_gather(gpt, 3)),
        refusal(lambda: flatshard.set_custom_reduce_scatter(gpt, no_op)),
        refusal(lambda: flatshard.set_custom_all_gather(tables, no_op)),
        refusal(lambda: comm_hooks.register_comm_hook(custom, hook)),
    ]


def test_custom_collectives_misuse_is_an_error(pool: WorkerPool) -> None:
    for messages in pool.run(custom_comms_misuse_job)[:2]:
        assert "comm must be callable" in messages[0]
        assert "reduces through a communication hook" in messages[1]
        assert "holds the row-sparse table 'tok.weight'" in messages[2]
        assert "reduce-scatters with a custom collective" in messages[3]


# ---------------------------------------------------------------- separate reduction group
# The twin groups are made by every rank of the world, so these models span the pool's 4.
# FSDP2's own switch makes its group with use_local_synchronization, which hangs in this
# pool (its ranks made different groups before: pytorch/pytorch#173608): no FSDP2 run.
@pytest.mark.parametrize(
    "config",
    [
        ParityConfig(
            model="gpt", world_size=4, micro_batches=2, separate_reduce_scatter_group=True
        ),
        ParityConfig(
            model="gpt",
            world_size=4,
            strategy="HYBRID_SHARD",
            sharding_factor=2,
            micro_batches=2,
            all_reduce_last=True,
            separate_reduce_scatter_group=True,
            clip=0.5,
        ),
        ParityConfig(
            model="vocab_gpt",
            world_size=4,
            sparse_embeddings=True,
            separate_reduce_scatter_group=True,
        ),
    ],
    ids=["full-shard", "hybrid-owed-clipped", "row-sparse"],
)
def test_separate_reduce_scatter_group_matches_the_reference(
    pool: WorkerPool, config: ParityConfig
) -> None:
    pool.run(parity_job, config, False)


def separate_group_job(ctx: WorkerContext, enable_after: bool) -> dict[str, Any] | None:
    group = ctx.group(4)
    assert group is not None
    model: Any = build("gpt")
    shard_with_flatshard(model, ParityConfig(model="gpt", world_size=4), group)
    flatshard.set_separate_reduce_scatter_group(model, True)
    flatshard.set_separate_reduce_scatter_group(model, enable_after)
    gather, scatter = install_custom_comms(model, "flatshard")
    model.loss(slice_batch(next(batches(model, 1)), ctx.rank, 4)).backward()
    return {"gather": gather.groups, "scatter": scatter.groups, "shard": group.group_name}


@pytest.mark.parametrize("enable", [True, False])
def test_reductions_take_a_group_of_their_own(pool: WorkerPool, enable: bool) -> None:
    """Every reduce-scatter on one twin group, every all-gather on the shard group; set
    False again, both on the shard group."""
    for result in pool.run(separate_group_job, enable):
        assert result["gather"] == {result["shard"]}
        if enable:
            assert len(result["scatter"]) == 1
            assert result["scatter"] != result["gather"]
        else:
            assert result["scatter"] == {result["shard"]}


def separate_group_refusal_job(ctx: WorkerContext) -> str | None:
    group = ctx.group(2)
    if group is None:
        return None
    model: Any = build("gpt")
    shard_with_flatshard(model, ParityConfig(model="gpt", world_size=2), group)
    try:
        flatshard.set_separate_reduce_scatter_group(model, True)
    except ValueError as error:
        return str(error)
    return "no error"


def test_separate_reduce_scatter_group_needs_the_whole_world(pool: WorkerPool) -> None:
    for message in pool.run(separate_group_refusal_job)[:2]:
        assert "sharded over 2 of the 4 ranks" in message


# ---------------------------------------------------------------- reshard to N ranks
@pytest.mark.parametrize(
    "config",
    [
        ParityConfig(model="gpt", world_size=4, micro_batches=2, reshard_after_forward=2),
        ParityConfig(
            model="gpt",
            world_size=4,
            strategy="SHARD_GRAD_OP",
            micro_batches=2,
            no_sync=True,
            reshard_after_forward=2,
            checkpoint="inside",
            clip=0.5,
        ),
        ParityConfig(
            model="nested",
            world_size=4,
            strategy="HYBRID_SHARD",
            sharding_factor=4,
            reshard_after_forward=2,
            reshard_after_backward=False,
            micro_batches=2,
            no_sync=True,
            optimizer="sgd",
        ),
    ],
    ids=["full-shard", "zero2-accumulated-checkpointed", "hybrid-kept-after-backward"],
)
def test_reshard_after_forward_to_fewer_ranks_matches_the_reference(
    pool: WorkerPool, config: ParityConfig
) -> None:
    """set_reshard_after_forward(model, 2) at 4 ranks: backward gathers each unit from
    the parts kept in groups of 2; the training is the unsharded model's."""
    pool.run(parity_job, config, False)


class GatherInputs(TorchDispatchMode):
    """The elements each all-gather sends from this rank, in order."""

    def __init__(self) -> None:
        super().__init__()
        self.sent: list[int] = []

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        if "allgather" in str(func.overloadpacket):
            self.sent.append(int(args[1].numel()))
        return func(*args, **(kwargs or {}))


def reshard_to_job(ctx: WorkerContext, size: int | bool) -> dict[str, Any] | None:
    group = ctx.group(4)
    assert group is not None
    model: Any = build("gpt")
    shard_with_flatshard(model, ParityConfig(model="gpt", world_size=4), group)
    flatshard.set_reshard_after_forward(model, size)
    loss = model.loss(slice_batch(next(batches(model, 1)), ctx.rank, 4))
    with GatherInputs() as inputs:
        loss.backward()
    flats = flatshard.sharding_summary(model).flat_params
    return {
        "sent": inputs.sent,
        "unsharded": {f.unit: f.shard_numel * f.factor for f in flats},
    }


def test_reshard_after_forward_to_fewer_ranks_by_formula(pool: WorkerPool) -> None:
    """The first backward of TinyGPT at W = 4 (the root kept; every block gathered again:
    the first forward does not know yet which block ends it): FULL_SHARD sends L / 4 per
    block, N = 2 sends L / 2 from the part kept in its group of 2 (half the ranks, the
    same buffer)."""
    full = pool.run(reshard_to_job, True)[0]
    halves = pool.run(reshard_to_job, 2)[0]
    regathered = sorted(n for u, n in full["unsharded"].items() if u != "<root>")
    assert sorted(n for n in full["sent"] if n * 4 in regathered) == [n // 4 for n in regathered]
    assert sorted(n for n in halves["sent"] if n * 2 in regathered) == [n // 2 for n in regathered]
    assert len(full["sent"]) == len(halves["sent"])


def reshard_to_refusal_job(ctx: WorkerContext) -> list[str] | None:
    group = ctx.group(4)
    assert group is not None
    model: Any = build("gpt")
    shard_with_flatshard(model, ParityConfig(model="gpt", world_size=4), group)
    messages = []
    for bad in (3, 1, 2.0):
        try:
            flatshard.set_reshard_after_forward(model, bad)  # type: ignore[arg-type]
        except (TypeError, ValueError) as error:
            messages.append(str(error))
    return messages


def test_reshard_after_forward_to_a_non_divisor_is_an_error(pool: WorkerPool) -> None:
    for messages in pool.run(reshard_to_refusal_job):
        assert "3 ranks do not divide the 4 ranks of a shard group" in messages[0]
        assert "got 1" in messages[1]
        assert "got 2.0" in messages[2]


# ---------------------------------------------------------------- parameters left alone
@pytest.mark.parametrize(
    ("config", "against_fsdp2"),
    [
        (
            ParityConfig(
                model="gpt",
                world_size=2,
                micro_batches=2,
                no_sync=True,
                accumulate_with="switch",
                unmanaged=("ln_f.weight", "blocks.1.ln1.bias"),
            ),
            True,
        ),
        (
            ParityConfig(
                model="gpt",
                world_size=2,
                policy="bottom_up",
                unmanaged=("blocks.0.mlp.0.weight", "pos.weight"),
                clip=0.5,
            ),
            False,
        ),
    ],
    ids=["fsdp2-ignored-params", "bottom-up-clipped"],
)
def test_unmanaged_parameters_match_fsdp2_ignored_params_and_the_reference(
    pool: WorkerPool, config: ParityConfig, against_fsdp2: bool
) -> None:
    """placement Unmanaged() for some parameters (FSDP2's ignored_params): whole on every
    rank, their gradients averaged by hand before each step; the rest sharded as always.
    Bottom-up, the later call on the root leaves the blocks' choice alone."""
    pool.run(parity_job, config, against_fsdp2)


def unmanaged_state_job(ctx: WorkerContext, path: str) -> dict[str, Any] | None:
    group = ctx.group(2)
    if group is None:
        return None
    config = ParityConfig(model="gpt", world_size=2, unmanaged=("ln_f.weight",))

    def sharded() -> Any:
        model: Any = build("gpt")
        shard_with_flatshard(model, config, group)
        return model

    model = sharded()
    left = model.get_parameter("ln_f.weight")
    summary = flatshard.sharding_summary(model)
    in_groups = any("ln_f.weight" in f.param_names for f in summary.flat_params)
    with torch.no_grad():
        left.fill_(2.0 + ctx.rank)  # each rank's own, as a user who never averages it
    full = flatshard.full_state_dict(model)
    flatshard.save_checkpoint(path, model)
    fresh = sharded()
    flatshard.load_checkpoint(path, fresh)
    loaded = fresh.get_parameter("ln_f.weight").detach()
    return {
        "in_groups": in_groups,
        "shape": tuple(left.shape),
        "full_equal": ctx.rank != 0 or torch.equal(full["ln_f.weight"], left.detach()),
        "loaded": loaded,
    }


def test_unmanaged_parameters_in_state_dicts_and_checkpoints(
    pool: WorkerPool, tmp_path: Any
) -> None:
    results = pool.run(unmanaged_state_job, str(tmp_path / "ckpt"))[:2]
    for result in results:
        assert not result["in_groups"]
        assert result["shape"] == (16,)  # whole on every rank
        assert result["full_equal"]
    # One rank's copy (DCP saves a replicated tensor once), the same on both after loading
    assert torch.equal(results[0]["loaded"], results[1]["loaded"])
    assert results[0]["loaded"][0].item() in (2.0, 3.0)
