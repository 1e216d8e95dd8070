"""Deferred initialization, rank-0 loading, startup consistency checks, hook-bypass guard."""

from __future__ import annotations

import time
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch import nn

import flatshard
from flatshard.measure import (
    ALL_GATHER,
    CollectiveTracker,
    PeakStorage,
    distinct_storage_bytes,
)
from flatshard.testing.models import MLPBlock, TinyGPT, build, twins
from flatshard.testing.parity import (
    ParityConfig,
    assert_same,
    run_reference,
    train,
)
from flatshard.testing.workers import WorkerContext, WorkerPool


def gpt_init(module: nn.Module) -> None:
    """GPT-2 style: small normal weights, zero biases, unit norms; the causal mask rebuilt."""
    if isinstance(module, nn.Linear | nn.Embedding):
        nn.init.normal_(module.weight, std=0.02)
    if isinstance(module, nn.Linear) and module.bias is not None:
        nn.init.zeros_(module.bias)
    if isinstance(module, nn.LayerNorm):
        module.reset_parameters()
    mask = getattr(module, "causal_mask", None)
    if mask is not None:
        mask.copy_(torch.tril(torch.ones_like(mask)))


def _full_params(model: nn.Module) -> dict[str, torch.Tensor]:
    with flatshard.summon_full_params(model, writeback=False):
        return {n: p.detach().clone() for n, p in model.named_parameters()}


# ---------------------------------------------------------------- meta-device build
def meta_job(ctx: WorkerContext, use_init_fn: bool) -> None:
    group = ctx.group(2)
    if group is None:
        return None
    init_fn = gpt_init if use_init_fn else None
    reference = flatshard.init_weights(TinyGPT(), init_fn, seed=7)
    with torch.device("meta"):
        model = TinyGPT()
    flatshard.fully_shard(
        model,
        auto_wrap_policy={type(model.blocks[0])},
        process_group=group,
        param_init_fn=init_fn,
        init=flatshard.InitOptions(seed=7),
    )
    assert model.head.weight is model.tok.weight  # the tie survives materialization
    full = _full_params(model)
    for name, param in reference.named_parameters():
        assert torch.equal(full[name], param), name  # exactly the same start
    for (name, buf), ref in zip(model.named_buffers(), reference.buffers(), strict=True):
        assert torch.equal(buf, ref), name
    # ...and the same training.
    config = ParityConfig(model="gpt", world_size=2)
    ours = train(model, config, ctx.rank, 2, group, "flatshard")
    theirs = train(reference, config, 0, 1, None, "reference")
    ours.params, theirs.params = _full_params(model), dict(reference.named_parameters())
    assert_same(theirs, ours)
    return None


@pytest.mark.parametrize("use_init_fn", [True, False])
def test_meta_build_starts_from_the_reference_weights(pool: WorkerPool, use_init_fn: bool) -> None:
    if not use_init_fn:
        # reset_parameters() cannot rebuild the causal mask: that is the named error.
        with pytest.raises(AssertionError, match=r"causal_mask' came from the meta device"):
            pool.run(meta_job, use_init_fn)
        return
    pool.run(meta_job, use_init_fn)


class Wide(nn.Module):
    """Four 256x256 blocks: 1 MiB of parameters per block."""

    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.Sequential(*(MLPBlock(256, 256) for _ in range(4)))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = self.blocks(x)
        return out


def init_memory_job(ctx: WorkerContext) -> dict[str, int] | None:
    """Peak bytes of live tensors allocated while fully_shard materializes a meta model."""
    group = ctx.group(2)
    if group is None:
        return None
    with torch.device("meta"):
        model = Wide()
    unit_bytes = sum(p.numel() for p in model.blocks[0].parameters()) * 4
    with PeakStorage() as tracker:
        flatshard.fully_shard(model, auto_wrap_policy={MLPBlock}, process_group=group)
    sharded = distinct_storage_bytes(list(model.parameters()))
    return {"peak": tracker.peak, "unit": unit_bytes, "sharded": sharded}


def test_meta_init_peak_is_sharded_model_plus_one_unit(pool: WorkerPool) -> None:
    for result in pool.run(init_memory_job)[:2]:
        # While a unit is sharded its full tensors (one unit) and the growing shards are
        # alive; the 1-D tensors (norms, biases) add under one row per parameter.
        assert result["peak"] <= result["sharded"] + result["unit"] + 4 * 1024, result
        assert result["peak"] >= result["unit"], result  # the measurement sees the unit


# ---------------------------------------------------------------- sync_module_states
def sync_job(ctx: WorkerContext) -> None:
    group = ctx.group(2)
    if group is None:
        return None
    if ctx.rank == 0:
        model = build("gpt")  # rank 0 "loads the checkpoint"
    else:
        with torch.device("meta"):
            model = build("gpt")  # the others hold no weights at all
    flatshard.fully_shard(
        model,
        auto_wrap_policy={type(model.blocks[0])},
        process_group=group,
        init=flatshard.InitOptions(sync_module_states=True),
    )
    config = ParityConfig(model="gpt", world_size=2)
    ours = train(model, config, ctx.rank, 2, group, "flatshard")
    ours.params = _full_params(model)
    if ctx.rank == 0:
        assert_same(run_reference(config), ours)
    return None


def test_sync_module_states_from_rank_0(pool: WorkerPool) -> None:
    pool.run(sync_job)


# ---------------------------------------------------------------- consistency checks
def mismatch_job(ctx: WorkerContext, case: str) -> str:
    group = ctx.group(2)
    if group is None:
        return ""
    odd = ctx.rank == 1
    options: dict[str, Any] = {"process_group": group, "auto_wrap_policy": {MLPBlock}}
    model: nn.Module = build("mlp")
    if case == "shape" and odd:
        model = type(model)(dims=(7, 13, 12, 13))  # type: ignore[call-arg]
    if case == "name" and odd:
        model.add_module("extra", nn.Linear(2, 2))
    if case == "requires_grad" and odd:
        model.head.requires_grad_(False)  # type: ignore[union-attr]
    if case == "strategy" and odd:
        options["strategy"] = flatshard.ShardingStrategy.SHARD_GRAD_OP
    if case == "buffer":
        model = TinyGPT()
        options["auto_wrap_policy"] = {type(model.blocks[0])}
        if odd:
            model.blocks[1].attn.causal_mask[0, 0] = False  # type: ignore[index]
    if case in ("padding_idx", "sparse"):
        model = TinyGPT()
        options["auto_wrap_policy"] = {type(model.blocks[0])}
        options["placement"] = flatshard.RowSparse()
        if odd and case == "padding_idx":
            model.tok.padding_idx = 0  # type: ignore[union-attr]
        if odd and case == "sparse":  # served row-sparse here, but still another model
            model.tok.sparse = True  # type: ignore[union-attr]
    if case == "gather_dtype":  # each rank's payload a different size: gloo would abort
        options["mixed_precision"] = flatshard.MixedPrecision(
            gather_dtype=torch.int8 if odd else None,
            keep_full_precision={nn.LayerNorm, nn.Embedding, nn.GELU},  # a set: any order
        )
    if case == "none":  # the same policy, its set of classes built in another order
        kept = [nn.LayerNorm, nn.Embedding, nn.GELU]
        options["mixed_precision"] = flatshard.MixedPrecision(
            keep_full_precision=set(reversed(kept) if odd else kept)
        )
    if case == "weights" and odd:
        with torch.no_grad():
            model.head.weight.add_(1e-3)  # type: ignore[union-attr, operator]
        options["init"] = flatshard.InitOptions(check_weights=True)
    if case == "weights":
        options["init"] = flatshard.InitOptions(check_weights=True)
    start = time.perf_counter()
    try:
        flatshard.fully_shard(model, **options)
    except ValueError as error:
        assert time.perf_counter() - start < 10
        return str(error)
    return "no error"


@pytest.mark.parametrize(
    ("case", "expected"),
    [
        ("shape", "parameter 'blocks.1.fc.weight' shape (11, 13)"),
        ("name", "parameter 'extra.weight'"),
        ("requires_grad", "parameter 'head.weight' shape (5, 13) float32 requires_grad=False"),
        ("strategy", "strategy=SHARD_GRAD_OP"),
        ("buffer", "buffer 'blocks.1.attn.causal_mask' checksum"),
        ("weights", "parameter 'head.weight' checksum"),
        ("padding_idx", "'tok.weight' looked up by nn.Embedding(padding_idx=0,"),
        ("sparse", "scale_grad_by_freq=False, sparse=True)"),
        ("gather_dtype", "output_dtype=None, gather_dtype=int8)"),
    ],
)
def test_mismatched_ranks_fail_on_every_rank(pool: WorkerPool, case: str, expected: str) -> None:
    messages = pool.run(mismatch_job, case)[:2]
    for rank, message in enumerate(messages):
        assert "rank 1 differs from rank 0" in message, (rank, message)
        assert expected in message, (rank, message)
        # a buffer may be each rank's own by design: the way to leave it unchecked is named
        own = "InitOptions(check_consistency=False), which leaves the values unchecked"
        assert (own in message) == (case == "buffer"), (rank, message)


def test_same_models_pass_the_weights_check(pool: WorkerPool) -> None:
    def_case = pool.run(mismatch_job, "none")[:2]
    assert def_case == ["no error", "no error"]


def rank_zero_load_job(ctx: WorkerContext, then: str) -> dict[str, Any] | None:
    """DDP's habit under FULL_SHARD: weights loaded on rank 0 only (rank 1 keeps its own
    random ones), no sync_module_states. ``then``: what follows the sharding."""
    group = ctx.group(2)
    if group is None:
        return None
    pretrained = build("mlp", seed=7)  # stands for from_pretrained(...)
    model = build("mlp", seed=100 + ctx.rank)  # each rank's own random initialization
    if ctx.rank == 0:
        model.load_state_dict(pretrained.state_dict())
    flatshard.fully_shard(model, auto_wrap_policy={MLPBlock}, process_group=group)
    x = torch.randn(2, 7, generator=torch.Generator().manual_seed(0))
    if then == "load":  # a correct program: the load makes it one model
        flatshard.load_state_dict(model, pretrained.state_dict())
    if then == "partial":  # each rank its own rows of other entries (strict=False)
        rows = flatshard.sharded_state_dict(
            flatshard.fully_shard(
                build("mlp", seed=7), auto_wrap_policy={MLPBlock}, process_group=group
            )
        )
        mine = {k: v for k, v in rows.items() if ctx.rank == 1 or k.startswith("head.")}
        flatshard.load_state_dict(model, mine, strict=False)
    if then == "read":  # what would be read is the model nobody built
        errors = []
        for read in (
            lambda: flatshard.full_state_dict(model),
            lambda: flatshard.summon_full_params(model).__enter__(),
        ):
            try:
                read()
                errors.append("no error")
            except RuntimeError as error:
                errors.append(str(error))
        return {"error": errors}
    try:
        with torch.no_grad():
            out = model(x)
    except RuntimeError as error:
        return {"error": str(error)}
    with torch.no_grad():
        return {"error": "", "matches": torch.equal(out, pretrained(x))}


def test_weights_that_differ_under_full_shard_await_a_load(pool: WorkerPool) -> None:
    """Before: no check under FULL_SHARD, and a silent patchwork (rank 0's rows of the
    pretrained model beside rank 1's random rows). Refused at fully_shard, a correct
    program (build anyhow, then load) would fail: so the first forward before a load
    raises on every rank, and a load clears it."""
    for result in pool.run(rank_zero_load_job, "forward")[:2]:
        assert "sharded from weights that differed across ranks" in result["error"], result
        assert "'head.weight'" in result["error"], result  # the root's forward is first
        assert "sync_module_states=True" in result["error"], result
    for result in pool.run(rank_zero_load_job, "load")[:2]:
        assert result == {"error": "", "matches": True}
    # Rank 0 loaded fewer entries: still differing there, so awaiting a load on both (before:
    # rank 0 refused while rank 1 went on into the unit's all-gather)
    for result in pool.run(rank_zero_load_job, "partial")[:2]:
        assert "sharded from weights that differed across ranks ('blocks." in result["error"]
    for result in pool.run(rank_zero_load_job, "read")[:2]:  # saves and exports read too
        full, summoned = result["error"]
        assert "full_state_dict: the model was sharded from weights that differed" in full
        assert "summon_full_params: the model was sharded from weights that differed" in summoned


def unmanaged_own_job(ctx: WorkerContext) -> str | None:
    """A parameter placed ``Unmanaged`` (never sharded, each rank's own) with a value of
    each rank's own."""
    group = ctx.group(2)
    if group is None:
        return None
    model = build("mlp", seed=0)
    own = nn.Parameter(torch.full((2,), float(ctx.rank)), requires_grad=False)
    model.register_parameter("own", own)
    flatshard.fully_shard(
        model,
        auto_wrap_policy={MLPBlock},
        process_group=group,
        placement=lambda name, p: flatshard.Unmanaged() if name == "own" else None,
    )
    with torch.no_grad():
        model(torch.randn(2, 7))
    return str(float(model.own[0]))


def test_an_unmanaged_parameter_is_each_ranks_own(pool: WorkerPool) -> None:
    """Not compared: before, refused as "sharded from weights that differed"."""
    assert pool.run(unmanaged_own_job)[:2] == ["0.0", "1.0"]


# ---------------------------------------------------------------- hook bypass
class Generator(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.block = MLPBlock(4, 4)
        self.head = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = self.head(self.block(x))
        return out

    def generate(self, x: torch.Tensor, steps: int) -> torch.Tensor:
        for _ in range(steps):
            x = self.head(self.block.fc(x))  # reaches inside the unit: bypasses its hooks
        return x


def bypass_job(ctx: WorkerContext) -> dict[str, str] | None:
    group = ctx.group(2)
    if group is None:
        return None
    model, reference = twins(Generator)
    flatshard.fully_shard(model, auto_wrap_policy={MLPBlock}, process_group=group)
    x = torch.randn(2, 4)
    errors = {}
    for name, call in [
        ("child", lambda: model.block.fc(x)),
        ("forward", lambda: model.block.forward(x)),
        ("generate", lambda: model.generate(x, 2)),
    ]:
        try:
            call()
            errors[name] = "no error"
        except RuntimeError as error:
            errors[name] = str(error)
    leaf = flatshard.fully_shard(nn.Linear(4, 4), process_group=group)  # owns its params
    try:
        leaf.forward(x)
        errors["leaf forward"] = "no error"
    except RuntimeError as error:
        errors["leaf forward"] = str(error)
    with torch.no_grad():
        errors["leaf call"] = str(leaf(x).shape)  # through the hooks: gathered
    flatshard.register_entry_point(model.block, "forward")  # the unit's own method...
    flatshard.register_entry_point(model, "generate")  # ...and the root's
    with torch.no_grad():
        torch.testing.assert_close(model.block.forward(x), reference.block(x))
    with flatshard.summon_full_params(model), torch.no_grad():
        torch.testing.assert_close(model.block.fc(x), reference.block.fc(x))  # allowed here
    try:
        model.generate(x, 2)
        errors["generate registered"] = "no error"
    except RuntimeError as error:
        errors["generate registered"] = str(error)
    return errors


def test_calls_that_bypass_the_unit_are_named_errors(pool: WorkerPool) -> None:
    errors = pool.run(bypass_job)[0]
    for case in ("child", "forward", "generate"):
        assert "module 'block.fc' ran while its unit 'block' is sharded" in errors[case], case
        assert "'block.fc.weight', 'block.fc.bias'" in errors[case]
    # generate() reaches into block.fc; registering it on the root gathers the root, not
    # the block unit: the guard still names the module to route through the unit.
    assert "block.fc" in errors["generate registered"]
    # A unit whose module holds its parameters itself: its direct forward() is caught too.
    assert "Linear.forward() of unit '<root>' was called directly while" in errors["leaf forward"]
    assert errors["leaf call"] == "torch.Size([2, 4])"


def entry_point_job(ctx: WorkerContext) -> None:
    group = ctx.group(2)
    if group is None:
        return None
    model, reference = twins(Generator)
    flatshard.fully_shard(model, process_group=group)  # one unit: generate's reach is inside
    flatshard.register_entry_point(model, "generate")
    x = torch.randn(2, 4)
    with torch.no_grad():
        torch.testing.assert_close(model.generate(x, 3), reference.generate(x, 3))
    return None


def test_registered_entry_point_gathers(pool: WorkerPool) -> None:
    pool.run(entry_point_job)


class Stepper(Generator):
    """Lightning's shape: a training step that calls the module itself."""

    def step(self, x: torch.Tensor) -> torch.Tensor:
        return self(x).pow(2).mean()


def _train_steps(model: Stepper, reference: Stepper, step: str) -> dict[str, int]:
    optim = torch.optim.SGD(model.parameters(), lr=0.1)
    reference_optim = torch.optim.SGD(reference.parameters(), lr=0.1)
    x = torch.randn(2, 4)
    with CollectiveTracker() as tracker:
        for _ in range(3):
            loss = model.step(x) if step == "step" else model(x).pow(2).mean()
            loss.backward()
            optim.step()
            optim.zero_grad()
            expected = reference.step(x)
            expected.backward()
            reference_optim.step()
            reference_optim.zero_grad()
            torch.testing.assert_close(loss, expected)
    with flatshard.summon_full_params(model):
        for mine, theirs in zip(model.parameters(), reference.parameters(), strict=True):
            torch.testing.assert_close(mine, theirs)
    return dict(tracker.counts)


def nested_entry_point_job(ctx: WorkerContext) -> list[dict[str, int]] | None:
    group = ctx.group(2)
    if group is None:
        return None
    counts = []
    for step in ("forward", "step"):
        model, reference = twins(Stepper)
        # The root keeps head: only the entry point gathers it before step() runs.
        flatshard.fully_shard(model, auto_wrap_policy={MLPBlock}, process_group=group)
        if step == "step":
            flatshard.register_entry_point(model, "step")
        counts.append(_train_steps(model, reference, step))
    return counts


def test_an_entry_point_may_call_its_own_module(pool: WorkerPool) -> None:
    through_forward, through_step = pool.run(nested_entry_point_job)[0]
    # The step's own call of the module passes through: the same collectives as training
    # through forward (a second pre-forward would gather and record the root again).
    assert through_step == through_forward
    assert through_step[ALL_GATHER] > 0


def test_entry_point_needs_a_unit(local_group: dist.ProcessGroup) -> None:
    with pytest.raises(ValueError, match=r"is not a flatshard unit"):
        flatshard.register_entry_point(nn.Linear(2, 2), "forward")


def test_weight_check_memory_is_bounded(local_group: Any) -> None:
    # A 4 MiB weight: its exact checksum widens bytes to int64 and weights them by position
    # (two int64 tensors: 16 bytes per byte, 64 MiB at once; 96+ MiB as first written).
    # Taken 1 MiB at a time: 16 MiB, beside the shard and the briefly allocated unsharded
    # buffer (4 MiB each).
    mib = 1 << 20
    model = nn.Linear(1024, 1024, bias=False)
    with PeakStorage() as tracker:
        flatshard.fully_shard(model, init=flatshard.InitOptions(check_weights=True))
    assert tracker.peak <= 2 * 4 * mib + 16 * mib, tracker.peak / mib
