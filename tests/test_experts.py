"""Expert parallelism: ``flatshard.Experts(degree)`` ([Note: expert parallelism]).

The test suite's mixture of experts (``TinyMoE``: top-2 routing over 4 stacked experts in
each of 2 blocks, dropless, with a load-balancing loss) trains as DDP trains the unsharded
model: each rank its own rows of the batch (so routing is per rank), gradients averaged
over the ranks, the global norm clipped, AdamW. The reference runs that in one process
(rank by rank, gradients summed and divided by W). Swept: EP 2 x data 2 and EP 4 at 4
ranks, EP 2 at 2 ranks, EP 1; FULL_SHARD, SHARD_GRAD_OP and NO_SHARD; flatshard's and
torch's ``clip_grad_norm_``; accumulation with ``no_sync``. A checkpoint saved at EP 2 x
data 2 resumes at EP 4, without experts at all, and at EP 1 x data 2. Misuse is a named
error on every rank.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch import nn

import flatshard
from flatshard.cli.bench.formula import flatshard_formulas
from flatshard.measure import ALL_GATHER, ALL_REDUCE, CollectiveTracker
from flatshard.testing.models import MoEBlock, TinyMoE, experts_of
from flatshard.testing.workers import WorkerContext, WorkerPool

ROWS, STEPS, MORE, MAX_NORM = 8, 3, 2, 0.5  # ROWS: the global batch


def _batches(count: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    gen = torch.Generator().manual_seed(3)
    return [
        (torch.randn(ROWS, 8, generator=gen), torch.randn(ROWS, 8, generator=gen))
        for _ in range(count)
    ]


def _mine(
    batch: tuple[torch.Tensor, torch.Tensor], rank: int, world: int
) -> tuple[torch.Tensor, torch.Tensor]:
    rows = ROWS // world
    return batch[0][rank * rows : (rank + 1) * rows], batch[1][rank * rows : (rank + 1) * rows]


class Reference:
    """The unsharded model trained with DDP's semantics, in one process."""

    def __init__(self) -> None:
        torch.manual_seed(0)
        self.model = TinyMoE()
        self.optim = torch.optim.AdamW(self.model.parameters(), lr=1e-2)

    def step(self, batch: tuple[torch.Tensor, torch.Tensor], world: int) -> tuple[float, float]:
        """(mean loss over the ranks, gradient norm before clipping)."""
        total = 0.0
        for rank in range(world):
            loss = self.model.loss(_mine(batch, rank, world)) / world
            loss.backward()
            total += float(loss.detach())
        norm = float(torch.nn.utils.clip_grad_norm_(self.model.parameters(), MAX_NORM))
        self.optim.step()
        self.optim.zero_grad()
        return total, norm


def _sharded(group: dist.ProcessGroup, degree: int | None, strategy: str = "FULL_SHARD") -> TinyMoE:
    torch.manual_seed(0)
    model = TinyMoE()
    flatshard.fully_shard(
        model,
        auto_wrap_policy={MoEBlock},
        process_group=group,
        strategy=strategy,
        placement=None
        if degree is None
        else lambda name, p: flatshard.Experts(degree) if experts_of(name, p) else None,
    )
    return model


def _train(
    model: nn.Module,
    optim: torch.optim.Optimizer,
    batches: list[tuple[torch.Tensor, torch.Tensor]],
    group: dist.ProcessGroup,
    clip: str = "flatshard",
    micro: int = 1,
) -> list[tuple[float, float]]:
    """(mean loss over the ranks, gradient norm) per step; ``micro`` micro-batches each."""
    rank, world = dist.get_rank(group), dist.get_world_size(group)
    out = []
    for batch in batches:
        x, y = _mine(batch, rank, world)
        total = torch.zeros(())
        for i in range(micro):
            part = (x[i::micro], y[i::micro])
            if i < micro - 1:
                with flatshard.no_sync(model):
                    loss = model.loss(part) / micro
                    loss.backward()
            else:
                loss = model.loss(part) / micro
                loss.backward()
            total += loss.detach()
        if clip == "torch":
            norm = torch.nn.utils.clip_grad_norm_(model.parameters(), MAX_NORM)
        else:
            norm = flatshard.clip_grad_norm_(model, MAX_NORM)
        optim.step()
        optim.zero_grad()
        dist.all_reduce(total, group=group)
        out.append((float(total) / world, float(norm)))
    return out


def parity_job(
    ctx: WorkerContext, world: int, degree: int, strategy: str, clip: str, micro: int, extra: str
) -> dict[str, Any] | None:
    """``extra``: "checkpoint" (activation checkpointing of the blocks), "keep"
    (set_reshard_after_backward(False)), "capacity" (each rank's router drops what
    exceeds a capacity factor of 1: counts of 0 and uneven splits) or ""."""
    group = ctx.group(world)
    if group is None:
        return None
    model = _sharded(group, degree, strategy)
    model.checkpoint_blocks = extra == "checkpoint"
    capacity = 1.0 if extra == "capacity" else None
    for block in model.blocks:
        block.moe.capacity_factor = capacity
    if extra == "keep":
        flatshard.set_reshard_after_backward(model, False)
    optim = torch.optim.AdamW(model.parameters(), lr=1e-2)
    batches = _batches(STEPS)
    got = _train(model, optim, batches, group, clip, micro)
    full = flatshard.full_state_dict(model)
    with flatshard.summon_full_params(model):  # the unsharded parameters: every expert
        local = {n: tuple(p.shape) for n, p in model.named_parameters() if experts_of(n, p)}
    if ctx.rank != 0:
        return None
    reference = Reference()
    for block in reference.model.blocks:
        block.moe.capacity_factor = capacity
    if micro > 1:  # each rank's loss is the mean of its micro-batches' means
        expected = []
        for batch in batches:
            parts = []
            for rank in range(world):
                x, y = _mine(batch, rank, world)
                parts += [(x[i::micro], y[i::micro]) for i in range(micro)]
            total = 0.0
            for part in parts:
                loss = reference.model.loss(part) / len(parts)
                loss.backward()
                total += float(loss.detach())
            norm = float(torch.nn.utils.clip_grad_norm_(reference.model.parameters(), MAX_NORM))
            reference.optim.step()
            reference.optim.zero_grad()
            expected.append((total, norm))
    else:
        expected = [reference.step(batch, world) for batch in batches]
    want = reference.model.state_dict()
    diff = max(float((full[k] - v).abs().max()) for k, v in want.items())
    return {"got": got, "expected": expected, "diff": diff, "local": local}


@pytest.mark.parametrize(
    ("world", "degree", "strategy", "clip", "micro", "extra"),
    [
        (4, 2, "FULL_SHARD", "flatshard", 1, ""),
        (4, 4, "SHARD_GRAD_OP", "torch", 1, ""),
        (2, 2, "FULL_SHARD", "torch", 1, ""),
        (4, 2, "NO_SHARD", "flatshard", 1, ""),
        (4, 1, "FULL_SHARD", "flatshard", 1, ""),
        (4, 2, "FULL_SHARD", "flatshard", 2, ""),
        (4, 2, "FULL_SHARD", "flatshard", 2, "keep"),
        (4, 2, "FULL_SHARD", "torch", 1, "checkpoint"),
        (4, 2, "FULL_SHARD", "flatshard", 1, "capacity"),
    ],
)
def test_experts_train_as_ddp_trains_the_unsharded_model(
    pool: WorkerPool, world: int, degree: int, strategy: str, clip: str, micro: int, extra: str
) -> None:
    result = pool.run(parity_job, world, degree, strategy, clip, micro, extra)[0]
    for (loss, norm), (want_loss, want_norm) in zip(result["got"], result["expected"], strict=True):
        assert loss == pytest.approx(want_loss, rel=1e-5, abs=1e-6)
        assert norm == pytest.approx(want_norm, rel=1e-5)
    assert all(norm > MAX_NORM for _, norm in result["expected"]), "the clip must act"
    assert result["diff"] < 1e-5
    # Inside summon_full_params every rank holds every expert, as the unsharded model does.
    assert result["local"]["blocks.0.moe.experts.w1"] == (4, 8, 16)


def bf16_job(ctx: WorkerContext, degree: int | None) -> list[tuple[float, float]]:
    """Computing in bf16 (MixedPrecision, gradients reduced in fp32)."""
    group = ctx.group(4)
    assert group is not None
    torch.manual_seed(0)
    model = TinyMoE()
    policy = flatshard.MixedPrecision(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    flatshard.fully_shard(
        model,
        auto_wrap_policy={MoEBlock},
        mixed_precision=policy,
        placement=None
        if degree is None
        else lambda name, p: flatshard.Experts(degree) if experts_of(name, p) else None,
    )
    optim = torch.optim.AdamW(model.parameters(), lr=1e-2)
    return _train(model, optim, _batches(STEPS), group)


def test_experts_in_bf16_train_as_the_data_parallel_experts_do(pool: WorkerPool) -> None:
    """Mixed precision meets expert parallelism: the same steps as with the experts data
    parallel, within bf16's rounding (an expert's rows computed in one matmul with the
    other rank's, its gradient summed before the reduction instead of in it)."""
    split, plain = pool.run(bf16_job, 2)[0], pool.run(bf16_job, None)[0]
    assert _flat(split) == pytest.approx(_flat(plain), rel=2e-2)


def meta_job(ctx: WorkerContext, degree: int | None) -> dict[str, torch.Tensor]:
    with torch.device("meta"):
        model = TinyMoE()
    flatshard.fully_shard(
        model,
        auto_wrap_policy={MoEBlock},
        device="cpu",
        placement=None
        if degree is None
        else lambda name, p: flatshard.Experts(degree) if experts_of(name, p) else None,
    )
    return flatshard.full_state_dict(model)


def test_a_model_built_on_meta_starts_from_the_weights_without_experts(pool: WorkerPool) -> None:
    """Each rank draws the whole expert weight, one module at a time, and keeps its part."""
    plain, split = pool.run(meta_job, None)[0], pool.run(meta_job, 2)[0]
    assert plain.keys() == split.keys()
    for name, tensor in plain.items():
        assert torch.equal(split[name], tensor), name


def divided_by_group_job(ctx: WorkerContext) -> list[tuple[float, float]] | None:
    """The control: the expert gradients divided by their data-parallel group's size (2)
    instead of W (4), as a per-group average would, drift from the reference."""
    group = ctx.group(4)
    assert group is not None
    model = _sharded(group, 2)
    for block in model.blocks:
        flatshard.set_gradient_divide_factor(block, 2.0)
    optim = torch.optim.AdamW(model.parameters(), lr=1e-2)
    return _train(model, optim, _batches(STEPS), group)


def test_dividing_expert_gradients_by_their_group_is_what_the_parity_test_catches(
    pool: WorkerPool,
) -> None:
    got = pool.run(divided_by_group_job)[0]
    reference = Reference()
    expected = [reference.step(batch, 4) for batch in _batches(STEPS)]
    assert got[0][1] != pytest.approx(expected[0][1], rel=1e-3)


def bytes_job(ctx: WorkerContext, degree: int | None) -> dict[str, Any]:
    """One tracked step after a warm-up one: bytes by kind, and the formula's parts."""
    group = ctx.group(4)
    assert group is not None
    model = _sharded(group, degree)
    optim = torch.optim.AdamW(model.parameters(), lr=1e-2)
    batches = _batches(2)
    _train(model, optim, batches[:1], group)
    tracker = CollectiveTracker()
    with tracker:
        _train(model, optim, batches[1:], group)
    return {"bytes": dict(tracker.bytes), "formula": flatshard_formulas(model, [optim], 2, 4)}


def test_bytes_per_step_by_formula_against_the_data_parallel_layout(pool: WorkerPool) -> None:
    """All-gathers per rank: each unsharded group (experts: W / E ranks' shards) gathered
    in forward and again in backward but the root's and the last block's, and the step
    check's 8 bytes per rank. The rest (gloo's reductions, and the tokens' all-to-alls):
    summed over the ranks, since routing decides where rows go but not how many leave:
    W x T x k rows per MoE layer each way in forward (dispatch, combine) and in backward,
    plus one exchange of counts per forward (E rows of 2 + n / E int64 per rank)."""
    world, degree, experts, dim, layers, top_k = 4, 2, 4, 8, 2, 2
    tokens = ROWS // world
    split, dense = pool.run(bytes_job, degree), pool.run(bytes_job, None)

    def rest(ranks: list[dict[str, Any]]) -> int:
        kinds = (ALL_GATHER, ALL_REDUCE)
        return sum(n for r in ranks for k, n in r["bytes"].items() if k not in kinds)

    for ranks in (split, dense):
        for rank in ranks:
            want = rank["formula"]["gathered"] + rank["formula"]["check"]
            assert rank["bytes"][ALL_GATHER] == want
    rows = 4 * world * tokens * top_k * dim * 4
    counts = world * degree * (2 + experts // degree) * 8
    reduced = sum(r["formula"]["reduced"] for r in split)
    assert rest(split) == reduced + layers * (rows + counts)
    assert rest(dense) == sum(r["formula"]["reduced"] for r in dense)
    # The experts are half the parameters here; split over 2, their gathers and
    # reductions halve, which is what the tokens' traffic buys.
    expert_share = split[0]["bytes"][ALL_GATHER] / dense[0]["bytes"][ALL_GATHER]
    assert expert_share < 0.8, expert_share


def save_job(ctx: WorkerContext, directory: str) -> list[tuple[float, float]]:
    """EP 2 x data 2: train, save, train on."""
    group = ctx.group(4)
    assert group is not None
    model = _sharded(group, 2)
    optim = torch.optim.AdamW(model.parameters(), lr=1e-2)
    batches = _batches(STEPS + MORE)
    _train(model, optim, batches[:STEPS], group)
    flatshard.save_checkpoint(Path(directory) / "ckpt", model, optim)
    return _train(model, optim, batches[STEPS:], group)


def resume_job(
    ctx: WorkerContext, directory: str, world: int, degree: int | None
) -> list[tuple[float, float]] | None:
    group = ctx.group(world)
    if group is None:
        return None
    model = _sharded(group, degree)
    optim = torch.optim.AdamW(model.parameters(), lr=1e-2)
    flatshard.load_checkpoint(Path(directory) / "ckpt", model, optim)
    return _train(model, optim, _batches(STEPS + MORE)[STEPS:], group)


def test_a_checkpoint_at_ep2_x_data2_resumes_at_other_ep_degrees(
    pool: WorkerPool, tmp_path: Path
) -> None:
    saved = pool.run(save_job, str(tmp_path))[0]
    for degree in (4, None):  # the same 4 ranks: the same losses
        resumed = pool.run(resume_job, str(tmp_path), 4, degree)[0]
        assert _flat(resumed) == pytest.approx(_flat(saved), rel=1e-5), degree
    # EP 1 x data 2 and EP 2, on 2 of the 4 ranks: each rank's batch (and routing)
    # changes; the reference trains at 4 ranks, then at 2.
    reference = Reference()
    batches = _batches(STEPS + MORE)
    for batch in batches[:STEPS]:
        reference.step(batch, 4)
    expected = [reference.step(batch, 2) for batch in batches[STEPS:]]
    for degree in (1, 2):
        resumed = pool.run(resume_job, str(tmp_path), 2, degree)[0]
        assert _flat(resumed) == pytest.approx(_flat(expected), rel=1e-5), degree


def export_job(ctx: WorkerContext, directory: str) -> list[dict[str, torch.Tensor]]:
    """Weights trained at EP 2 exported as safetensors (the global tensors), loaded at EP 4
    and without experts."""
    group = ctx.group(4)
    assert group is not None
    model = _sharded(group, 2)
    optim = torch.optim.AdamW(model.parameters(), lr=1e-2)
    _train(model, optim, _batches(1), group)
    flatshard.export_safetensors(model, Path(directory) / "export")
    dist.barrier()  # rank 0 writes; every rank reads
    fulls = [flatshard.full_state_dict(model)]
    for degree in (4, None):
        fresh = _sharded(group, degree)
        flatshard.load_safetensors(fresh, Path(directory) / "export")
        fulls.append(flatshard.full_state_dict(fresh))
    return fulls


def test_exported_weights_load_at_other_ep_degrees(pool: WorkerPool, tmp_path: Path) -> None:
    trained, at_ep4, plain = pool.run(export_job, str(tmp_path))[0]
    assert trained["blocks.0.moe.experts.w1"].shape == (4, 8, 16)  # the global tensor
    for loaded in (at_ep4, plain):
        assert loaded.keys() == trained.keys()
        for name, tensor in trained.items():
            assert torch.equal(loaded[name], tensor), name


def _flat(pairs: list[tuple[float, float]]) -> list[float]:
    return [value for pair in pairs for value in pair]


def misuse_job(ctx: WorkerContext, case: str) -> str:
    group = ctx.group(2 if case == "counts" else 4)  # counts: one EP group, both ranks
    if group is None:
        return "outside"
    try:
        if case == "indivisible":
            _sharded(group, 3)
        elif case == "disagree":
            _sharded(group, 2 if ctx.rank == 0 else 4)
        elif case == "counts":
            model = _sharded(group, 2)
            experts = model.blocks[0].moe.experts
            counts = torch.tensor([1, 1, 1, 1])
            if ctx.rank == 1:
                counts = torch.tensor([1, 1, 1])
            experts(torch.zeros(int(counts.sum()), 8), counts)
        elif case in ("bias", "scale"):  # a per-expert bias left whole; a (8,) scale
            torch.manual_seed(0)
            model = TinyMoE()
            shape = (4, 16) if case == "bias" else (8,)
            model.blocks[0].moe.experts.b1 = nn.Parameter(torch.zeros(shape))
            rule: Any = flatshard.Experts(2)  # for the whole model: the 3-D weights
            if case == "scale":
                rule = lambda name, p: flatshard.Experts(2) if experts_of(name, p) else None  # noqa: E731
            flatshard.fully_shard(model, auto_wrap_policy={MoEBlock}, placement=rule)
        elif case == "conv":  # given for the whole model, Experts leaves torch's layers
            torch.manual_seed(0)
            model = TinyMoE()
            model.conv = nn.Conv1d(1, 2, 3)
            flatshard.fully_shard(model, placement=flatshard.Experts(2))
            with flatshard.summon_full_params(model):
                return f"conv {tuple(model.conv.weight.shape)}"
        elif case == "call":
            _sharded(group, 2).blocks[0].moe.experts(torch.zeros(2, 8))
        elif case == "sync":
            torch.manual_seed(0)
            model = TinyMoE()
            flatshard.fully_shard(
                model,
                placement=lambda n, p: flatshard.Experts(2) if experts_of(n, p) else None,
                init=flatshard.InitOptions(sync_module_states=True),
            )
    except (ValueError, TypeError) as error:
        return str(error)
    return "no error"


@pytest.mark.parametrize(
    ("case", "expected"),
    [
        ("indivisible", "4 experts (dim 0 of shape (4, 8, 16)) are not divisible by the "),
        ("disagree", "built different models or sharding options"),
        ("counts", "do not match"),
        ("sync", "sync_module_states would give every rank rank 0's"),
        ("call", "must be called with (tokens sorted by expert, tokens per expert)"),
        ("bias", "also holds 'blocks.0.moe.experts.b1' (shape (4, 16)), placed Rows()"),
        ("scale", "whose dim 0 is not the 4 experts of shape (4, 8, 16)"),
        ("conv", "conv (2, 1, 3)"),
    ],
)
def test_misuse_is_a_named_error_on_every_rank(pool: WorkerPool, case: str, expected: str) -> None:
    errors = pool.run(misuse_job, case)
    for rank, error in enumerate(errors):
        if case == "counts" and rank > 1:
            assert error == "outside"
        elif case == "counts" and rank == 1:
            assert "the counts have shape (3,), expected (4,)" in error
        else:
            assert expected in error, (rank, error)


def test_experts_degree_must_be_a_whole_number() -> None:
    with pytest.raises(ValueError, match="degree must be a whole number >= 1"):
        flatshard.Experts(0)
