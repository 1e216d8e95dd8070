"""Gathers in one byte per weight with a scale per row, or in a cast dtype
(``MixedPrecision(gather_dtype=...)``, ``Rows(gather_dtype=...)``; [Note: row-wise
quantized all-gather]).

The algebra exactly: the same run at 1, 2, 3 and 4 ranks ends with bitwise the same
parameters, equal to an unsharded reference that quantizes and dequantizes its weights by
the formula (written here and in ``testing.parity``, not taken from flatshard's codec)
before each forward; rank 0 alone carries a batch and the others' gradients are exact
zeros, so that no sum of gradients rounds differently across world sizes. Then parity
with that reference under DDP's semantics across the strategies and the switches it meets;
the bytes of every all-gather by formula; state dicts and summon hold the master weights;
earlier units inherit the policy; named errors.
"""

from __future__ import annotations

from contextlib import nullcontext
from dataclasses import replace
from functools import partial
from typing import Any, cast

import pytest
import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

import flatshard
from flatshard.measure import ALL_GATHER, STEP_CHECK_BYTES, CollectiveTracker
from flatshard.testing.internals import units_of
from flatshard.testing.models import build
from flatshard.testing.parity import (
    ParityConfig,
    assert_same,
    batches,
    make_optimizer,
    quantized_weights,
    run_flatshard,
    run_mixed_reference,
)
from flatshard.testing.workers import WorkerContext, WorkerPool

SCALED = ("int8", "float8_e4m3fn", "float8_e5m2")


def _train_rank0_batch(
    model: nn.Module, config: ParityConfig, rank: int, reference: bool
) -> dict[str, torch.Tensor]:
    """``config.steps`` SGD steps on the global batch; ranks other than 0 contribute exact
    zero gradients (their loss times 0), the sum is not divided."""
    m: Any = model
    optim = make_optimizer(model, config.lr, "sgd")
    for batch in batches(model, config.steps):
        with quantized_weights(model, config) if reference else nullcontext():
            loss = m.loss(batch) * (1.0 if rank == 0 else 0.0)
            loss.backward()
        optim.step()
        optim.zero_grad()
    if reference:
        return {n: p.detach().clone() for n, p in model.named_parameters()}
    return flatshard.full_state_dict(model)


def _world_sizes_job(ctx: WorkerContext, config: ParityConfig) -> None:
    """The run at 1, 2, 3 and 4 ranks: bitwise each other and the reference."""
    expected = None
    if ctx.rank == 0:
        expected = _train_rank0_batch(build(config.model), config, 0, reference=True)
    for world_size in (1, 2, 3, 4):
        group = ctx.group(world_size)
        if group is None:
            continue
        model = build(config.model)
        flatshard.fully_shard(
            model,
            auto_wrap_policy=set(cast(Any, model).UNIT_CLASSES),
            process_group=group,
            mixed_precision=flatshard.MixedPrecision(
                gather_dtype=getattr(torch, cast(str, config.gather_dtype))
            ),
        )
        flatshard.set_gradient_divide_factor(model, 1.0)
        got = _train_rank0_batch(model, config, ctx.rank, reference=False)
        if ctx.rank == 0:
            assert expected is not None
            for name, value in expected.items():
                assert torch.equal(got[name], value), (world_size, name, got[name] - value)
    return None


@pytest.mark.parametrize("gather_dtype", [*SCALED, "bfloat16"])
def test_bitwise_the_same_at_every_world_size(pool: WorkerPool, gather_dtype: str) -> None:
    config = ParityConfig(model="gpt", world_size=4, gather_dtype=gather_dtype, steps=3)
    pool.run(_world_sizes_job, config)


def test_the_reference_tells_the_gather_dtypes_apart(pool: WorkerPool) -> None:
    """The bitwise test can fail: int8 gathers against a float8 reference differ."""
    config = ParityConfig(model="gpt", world_size=4, gather_dtype="float8_e4m3fn", steps=1)
    with pytest.raises(Exception, match="differs"):
        pool.run(_mismatch_job, config)


def _mismatch_job(ctx: WorkerContext, config: ParityConfig) -> None:
    group = ctx.group(2)
    if group is None:
        return None
    model = build(config.model)
    flatshard.fully_shard(
        model,
        auto_wrap_policy=set(cast(Any, model).UNIT_CLASSES),
        process_group=group,
        mixed_precision=flatshard.MixedPrecision(gather_dtype=torch.int8),
    )
    flatshard.set_gradient_divide_factor(model, 1.0)
    got = _train_rank0_batch(model, config, ctx.rank, reference=False)
    if ctx.rank == 0:
        expected = _train_rank0_batch(build(config.model), config, 0, reference=True)
        for name, value in expected.items():
            assert torch.equal(got[name], value), f"{name} differs"
    return None


# Parity with the quantizing reference under DDP's semantics (each rank its slice of the
# batch, gradients averaged). The master weights of the two runs differ by fp32 rounding
# of the averaged gradients, and a weight that lies on a rounding boundary of its row's
# grid may then round to the neighbouring level: 1e-4 covers that, a wrong row or scale
# is off by whole levels (~1%).
QUANTIZED_RTOL = 1e-4

COMPOSED: list[dict[str, Any]] = [
    {"strategy": "FULL_SHARD", "world_size": 3},
    {"strategy": "FULL_SHARD", "gather_dtype": "float8_e4m3fn", "clip": 0.5},
    {"strategy": "SHARD_GRAD_OP", "micro_batches": 2, "no_sync": True},
    {"strategy": "NO_SHARD"},
    {"strategy": "HYBRID_SHARD", "world_size": 4, "sharding_factor": 2, "clip": 0.5},
    {"strategy": "HYBRID_SHARD_OPTIM", "world_size": 4, "sharding_factor": 2},
    {"reshard_after_backward": False, "micro_batches": 2},
    {"reshard_after_forward": 2, "world_size": 4},
    {"offload": True, "forward_prefetch": True},
    {"checkpoint": "inside", "backward_prefetch": "BACKWARD_POST"},
    {"custom_comms": True},
    {"separate_reduce_scatter_group": True, "world_size": 4},
    {"model": "embedding_units_gpt", "no_unshard_in_backward": ("tok", "pos")},
    {"model": "vocab_gpt", "sparse_embeddings": True, "optimizer": "sgd"},
    {"unmanaged": ("head.weight",)},
    {"policy": "bottom_up", "gather_dtype": "bfloat16"},
]


def _quantized_parity_job(ctx: WorkerContext, config: ParityConfig) -> None:
    group = ctx.group(config.world_size)
    if group is None:
        return None
    ours = run_flatshard(config, group)
    if ctx.rank == 0:
        from flatshard.testing.parity import run_reference

        assert_same(run_reference(config), ours, rtol=QUANTIZED_RTOL)
        # the comparison can fail: the reference that does not quantize is too far
        with pytest.raises(AssertionError):
            assert_same(run_reference(replace(config, gather_dtype=None)), ours, QUANTIZED_RTOL)
    return None


def _id(options: dict[str, Any]) -> str:
    return "-".join(f"{key}={value}" for key, value in options.items())


@pytest.mark.parametrize("options", COMPOSED, ids=_id)
def test_parity_where_features_meet(pool: WorkerPool, options: dict[str, Any]) -> None:
    base: dict[str, Any] = {"model": "gpt", "world_size": 2, "gather_dtype": "int8", "steps": 3}
    pool.run(_quantized_parity_job, ParityConfig(**{**base, **options}))


def _bf16_job(ctx: WorkerContext, config: ParityConfig) -> None:
    group = ctx.group(config.world_size)
    if group is None:
        return None
    ours = run_flatshard(config, group)
    if ctx.rank == 0:  # bf16 compute: the tolerance of test_mixed_precision's parity
        assert_same(run_mixed_reference(config), ours, rtol=4 * 2**-7)
    return None


def test_bf16_compute_decoded_from_int8(pool: WorkerPool) -> None:
    config = ParityConfig(
        model="gpt",
        world_size=2,
        param_dtype="bfloat16",
        gather_dtype="int8",
        optimizer="sgd",
        steps=2,
    )
    pool.run(_bf16_job, config)


def _payload_bytes(layout: Any) -> int:
    """What one rank sends for a group of ``layout`` with a scaled gather dtype, from the
    note's format: its scales (4 bytes per row of a matrix), its vectors' elements (4 bytes,
    fp32 compute), one byte per element of the shard; each part for the rank with the most,
    each rounded up to 8 bytes."""
    rows = vectors = 0
    for rank in range(layout.factor):
        held = [(slot, layout.shard_range(slot, rank)) for slot in layout.slots]
        rows = max(rows, sum(h.rows for s, h in held if len(s.shape) >= 2))
        vectors = max(vectors, sum(h.numel for s, h in held if len(s.shape) < 2))

    def up(n: int) -> int:
        return -(-n // 8) * 8

    return up(4 * rows) + up(4 * vectors) + up(layout.shard_numel)


def _counted(gathers: dict[int, int], key: int, inner: Any, kind: str, numel: int) -> Any:
    gathers[key] += kind == "all_gather"
    return inner(kind, numel)


def _bytes_job(ctx: WorkerContext, gather_dtype: str | None) -> tuple[int, int, int, int] | None:
    """(all-gathers, the groups' gathers and the digest's, their bytes, the formula's bytes)
    of one FULL_SHARD step at 2 ranks. The embedding table travels in fp32 under a one-byte
    gather dtype ([Note: embedding tables gathered exact]): a group of its own."""
    group = ctx.group(2)
    if group is None:
        return None
    model: Any = build("gpt")
    dtype = getattr(torch, gather_dtype) if gather_dtype else None
    flatshard.fully_shard(
        model,
        auto_wrap_policy=set(model.UNIT_CLASSES),
        process_group=group,
        mixed_precision=flatshard.MixedPrecision(gather_dtype=dtype),
    )
    batch = next(batches(model, 1))
    model.loss(batch).backward()  # the first step's gathers (the same every step)
    flats = [f for u in units_of(model, "test") for f in u.flat_params]
    gathers = {id(f): 0 for f in flats}
    for flat in flats:  # count each group's gathers as flatshard records them

        def counted(
            kind: str, numel: int, flat: Any = flat, inner: Any = flat.on_collective
        ) -> Any:
            gathers[id(flat)] += kind == "all_gather"
            return inner(kind, numel)

        flat.on_collective = counted
    with CollectiveTracker() as tracker:
        model.loss(batch).backward()
    expected = group.size() * STEP_CHECK_BYTES  # the end-of-step digests
    for flat in flats:
        travels = flat.placement_value.gathered_in(dtype)
        matrices = any(len(slot.shape) >= 2 for slot in flat.layout.slots)
        if travels in (None, torch.float32) or not matrices:  # (vectors alone: unencoded)
            sent = flat.layout.shard_numel * 4
        elif travels.itemsize == 2:  # a cast: two bytes per element, rounded up to 8
            sent = -(-flat.layout.shard_numel * 2 // 8) * 8
        else:
            sent = _payload_bytes(flat.layout)
        expected += gathers[id(flat)] * group.size() * sent
    issued = sum(gathers.values()) + 1  # and the end-of-step digest's
    return tracker.counts[ALL_GATHER], issued, tracker.bytes[ALL_GATHER], expected


def test_bytes_of_every_gather_by_formula(pool: WorkerPool) -> None:
    plain = pool.run(_bytes_job, None)[0]
    assert plain[0] == plain[1] and plain[2] == plain[3]  # fp32: 4 bytes per element
    for dtype in ("int8", "float8_e4m3fn", "bfloat16"):
        count, issued, sent, expected = pool.run(_bytes_job, dtype)[0]
        assert count == issued, (dtype, count, issued)
        assert sent == expected, (dtype, sent, expected)
        tables_apart = 1 if dtype != "bfloat16" else 0  # the root's table: one more gather
        assert count == plain[0] + tables_apart, (dtype, count, plain[0])
    # TinyGPT's rows are 16 wide: a scale costs 4 bytes per 16 elements, so its matrices
    # travel in (1 + 4/16) / 4 of fp32's bytes, its vectors (a sixth) and its (tied) table
    # in fp32: under half; the benchmark quotes realistic widths.
    int8 = pool.run(_bytes_job, "int8")[0]
    assert int8[2] < 0.5 * plain[2], (int8[2], plain[2])


def _state_job(ctx: WorkerContext) -> None:
    """Full and sharded state dicts and summon hold the master weights, never decoded."""
    group = ctx.group(2)
    if group is None:
        return None
    model: Any = build("gpt")
    original = {n: p.detach().clone() for n, p in model.named_parameters()}
    flatshard.fully_shard(
        model,
        auto_wrap_policy=set(model.UNIT_CLASSES),
        process_group=group,
        mixed_precision=flatshard.MixedPrecision(gather_dtype=torch.int8),
    )
    model.loss(next(batches(model, 1))).backward()  # gathers encoded, weights unchanged
    full = flatshard.full_state_dict(model, rank0_only=False)
    with flatshard.summon_full_params(model, writeback=False):
        summoned = {n: p.detach().clone() for n, p in model.named_parameters()}
    for name, value in original.items():
        assert torch.equal(full[name], value), name
        assert torch.equal(summoned[name], value), name
    return None


def test_state_dicts_and_summon_hold_the_master_weights(pool: WorkerPool) -> None:
    pool.run(_state_job)


def _inherit_job(ctx: WorkerContext) -> None:
    """Blocks sharded first without a policy take the root call's gather dtype."""
    group = ctx.group(2)
    if group is None:
        return None
    model: Any = build("gpt")
    for block in model.blocks:
        flatshard.fully_shard(block, process_group=group)
    flatshard.fully_shard(
        model,
        process_group=group,
        mixed_precision=flatshard.MixedPrecision(gather_dtype=torch.float8_e4m3fn),
    )
    codecs = [f.transport.codec for u in units_of(model, "test") for f in u.flat_params]
    encoded = [c for c in codecs if c is not None]
    assert len(encoded) == len(model.blocks) and all(
        c.dtype == torch.float8_e4m3fn for c in encoded
    )
    # and the root's two groups: its tables (exact: [Note: embedding tables gathered exact])
    # and its norm's vectors (vectors alone: unencoded)
    assert len(codecs) == len(model.blocks) + 2
    return None


def test_units_sharded_earlier_inherit_the_gather_dtype(pool: WorkerPool) -> None:
    pool.run(_inherit_job)


def _per_parameter_job(ctx: WorkerContext) -> None:
    """The placement rule keeps the embedding tables exact under a quantizing policy, and
    quantizes one block alone under no policy."""
    group = ctx.group(2)
    if group is None:
        return None
    model: Any = build("gpt")
    exact = flatshard.Rows(gather_dtype=torch.float32)
    flatshard.fully_shard(
        model,
        auto_wrap_policy=set(model.UNIT_CLASSES),
        process_group=group,
        mixed_precision=flatshard.MixedPrecision(gather_dtype=torch.int8),
        placement=lambda name, p: exact if name.endswith(("tok.weight", "pos.weight")) else None,
    )
    by_name = {
        o.fqn: f.transport.codec
        for u in units_of(model, "test")
        for f in u.flat_params
        for o in f.originals
    }
    assert by_name["tok.weight"] is None and by_name["pos.weight"] is None
    assert by_name["blocks.0.attn.qkv.weight"] is not None
    # the root's other group holds vectors alone: encoding would send 1 byte more each
    assert by_name["ln_f.weight"] is None
    with flatshard.summon_full_params(model, writeback=False):
        master = {n: p.detach().clone() for n, p in model.named_parameters()}
    used: dict[str, torch.Tensor] = {}

    def keep(module: nn.Module, args: object, out: object, name: str) -> None:
        used.setdefault(name, cast(torch.Tensor, module.weight).detach().clone())

    for name in ("tok", "blocks.0.attn.qkv"):
        model.get_submodule(name).register_forward_hook(partial(keep, name=name))
    model.loss(next(batches(model, 1))).backward()
    config = ParityConfig(model="gpt", world_size=2, gather_dtype="int8")
    assert torch.equal(used["tok"], master["tok.weight"])  # exact
    qkv = master["blocks.0.attn.qkv.weight"]
    assert not torch.equal(used["blocks.0.attn.qkv"], qkv)
    assert torch.equal(used["blocks.0.attn.qkv"], _decoded(qkv, config))
    return None


def _decoded(weight: torch.Tensor, config: ParityConfig) -> torch.Tensor:
    module = nn.Linear(weight.shape[1], weight.shape[0], bias=False)
    module.weight.data = weight.clone()
    with quantized_weights(module, config):
        return module.weight.detach().clone()


def test_per_parameter_through_the_placement_rule(pool: WorkerPool) -> None:
    pool.run(_per_parameter_job)


def test_named_errors(local_group: Any) -> None:
    with pytest.raises(ValueError, match=r"gather_dtype=\.\.\.\) must be None or one of"):
        flatshard.MixedPrecision(gather_dtype=torch.int32)
    with pytest.raises(ValueError, match=r"Rows\(gather_dtype=\.\.\.\) must be"):
        flatshard.Rows(gather_dtype=torch.uint8)
    model = nn.Sequential(nn.Linear(4, 4))
    int8_rows = flatshard.Rows(gather_dtype=torch.int8)
    with pytest.raises(ValueError, match=r"'0\.bias'.*rows of one element.*give it Rows\(\)"):
        flatshard.fully_shard(model, placement=lambda name, p: int8_rows)
    # Given for the whole model it serves the matrices; the bias keeps the policy's (none)
    model = nn.Sequential(nn.Linear(4, 4))
    flatshard.fully_shard(model, placement=int8_rows)
    codecs = {
        o.fqn: f.transport.codec
        for u in units_of(model, "test")
        for f in u.flat_params
        for o in f.originals
    }
    assert codecs["0.bias"] is None and codecs["0.weight"] is not None


@pytest.mark.parametrize("dtype", [torch.int8, torch.float8_e4m3fn, torch.float8_e5m2])
@pytest.mark.parametrize("bad", [float("nan"), float("inf"), -float("inf")])
def test_a_non_finite_weight_is_not_hidden_by_its_scale(dtype: torch.dtype, bad: float) -> None:
    """Before: a NaN row's scale became 1 and the decoded row was finite (training went on
    with a hidden NaN in the master weight)."""
    from flatshard.testing.internals import quantize_rows

    rows = torch.randn(3, 5)
    rows[1, 2] = bad
    q, scale = quantize_rows(rows, dtype)
    decoded = q.to(dtype).float() * scale[:, None]
    assert decoded[1].isnan().all()
    assert torch.isfinite(decoded[[0, 2]]).all()
    zero = quantize_rows(torch.zeros(2, 4), dtype)[1]
    assert torch.equal(zero, torch.ones(2))  # an all-zero row keeps the scale 1


class _Launches(TorchDispatchMode):
    """Counts the ops that compute or allocate (views are free): kernel launches on a GPU."""

    def __init__(self) -> None:
        super().__init__()
        self.count = 0

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        if not func.is_view and func is not torch.ops.aten._unsafe_view.default:
            self.count += 1
        return func(*args, **(kwargs or {}))


class _Zeroed(TorchDispatchMode):
    """Counts the bytes that ops writing zeros wrote."""

    def __init__(self) -> None:
        super().__init__()
        self.bytes = 0

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        if func in (torch.ops.aten.zero_.default, torch.ops.aten.zeros.default):
            out = func(*args, **(kwargs or {}))
            self.bytes += out.numel() * out.element_size()
            return out
        if func is torch.ops.aten.index_fill_.int_Scalar:
            self.bytes += args[2].numel() * args[0].element_size()
        return func(*args, **(kwargs or {}))


def _decoded_reference(
    full: torch.Tensor, layout: Any, dtype: torch.dtype, compute: torch.dtype
) -> torch.Tensor:
    """What the gathered buffer holds, parameter by parameter: each matrix row quantized
    and dequantized on its own, vectors in the compute dtype, padding 0."""
    from flatshard.testing.internals import quantize_rows

    expected = torch.zeros(layout.unsharded_numel, dtype=compute)
    for slot in layout.slots:
        values = full[slot.offset : slot.end]
        if dtype not in (torch.int8, torch.float8_e4m3fn, torch.float8_e5m2):
            decoded = values.to(dtype).to(compute)  # a cast dtype: every element cast
        elif len(slot.shape) >= 2:
            q, scale = quantize_rows(values.view(slot.rows, -1), dtype)
            decoded = (q.to(dtype).float() * scale[:, None]).to(compute).flatten()
        else:
            decoded = values.to(compute)
        expected[slot.offset : slot.end] = decoded
    return expected


@pytest.mark.parametrize("dtype", [torch.int8, torch.float8_e4m3fn, torch.bfloat16])
@pytest.mark.parametrize("compute", [torch.float32, torch.bfloat16])
def test_one_decode_for_every_rank_by_count(dtype: torch.dtype, compute: torch.dtype) -> None:
    """A gather's decode takes the same launches at every world size: one cast of every
    rank's rows, the scales put in order, one scaling per matrix for all ranks' rows, the
    vectors in one move (a cast dtype: one cast). Before, each rank's payload was decoded
    parameter by parameter (3 launches per matrix and rank). The result is exact against
    each parameter quantized alone, and no stale value of the buffer survives (padding
    included). Encodes zero only what nothing writes: at most the bytes that are no rows."""
    from flatshard.testing.internals import GatherCodec, row_layout

    shapes = [torch.Size(s) for s in [(7, 5), (3,), (), (6, 2, 3), (5,), (4, 9), (2, 1)]]
    matrices = sum(len(s) >= 2 for s in shapes)
    scaled = dtype != torch.bfloat16
    launches = {}
    for factor in (1, 2, 3, 4):
        layout = row_layout(shapes, factor)
        gen = torch.Generator().manual_seed(factor)
        full = torch.zeros(layout.unsharded_numel)  # padding 0, as in a flat buffer
        for slot in layout.slots:
            full[slot.offset : slot.end] = torch.randn(slot.numel, generator=gen)
        chunk = layout.shard_numel
        codecs = [GatherCodec(layout, rank, dtype) for rank in range(factor)]
        payloads = []
        for rank, codec in enumerate(codecs):
            with _Zeroed() as zeroed:
                payloads.append(codec.encode(full[rank * chunk : (rank + 1) * chunk], compute))
            rows = sum(layout.shard_range(s, rank).numel for s in layout.slots if len(s.shape) > 1)
            written = rows * (1 if scaled else dtype.itemsize)  # bytes no zero is needed for
            assert zeroed.bytes <= payloads[-1].numel() - written, (factor, rank)
        unsharded = torch.full((layout.unsharded_numel,), float("nan"), dtype=compute)
        gathered = torch.cat(payloads)
        with _Launches() as counted:
            codecs[-1].decode(gathered, unsharded)
        assert torch.equal(unsharded, _decoded_reference(full, layout, dtype, compute)), factor
        launches[factor] = counted.count
    if not scaled:
        assert set(launches.values()) == {1}, launches
        return
    # The rows' cast, the scales (a copy out of the F payloads, put in order), one scaling
    # per matrix, the vectors (a copy, put in order, moved). F = 1: no copies.
    assert launches[2] == launches[3] == launches[4] == 1 + 2 + matrices + 3, launches
    assert launches[1] == 1 + 1 + matrices + 2, launches


def _same_report_job(ctx: WorkerContext) -> tuple[str, str] | None:
    """The dtype report of the byte GPT with int8 gathers, built through the API and
    through ``flatshard train``'s option."""
    from flatshard.cli.lm.config import TrainConfig
    from flatshard.cli.lm.model import build_language_model, shard_language_model

    config = TrainConfig(gather_dtype="int8", dim=32, layers=2, heads=2, seq_len=16)
    lm = build_language_model(config)
    through_cli = shard_language_model(lm, config, torch.device("cpu"))
    lm = build_language_model(config)
    through_api = flatshard.fully_shard(
        lm.module,
        auto_wrap_policy=set(lm.unit_classes),
        mixed_precision=flatshard.MixedPrecision(gather_dtype=torch.int8),
    )
    reports = str(flatshard.dtype_report(through_cli)), str(flatshard.dtype_report(through_api))
    return reports if ctx.rank == 0 else None


def test_one_default_for_the_tables_through_the_api_and_the_cli(pool: WorkerPool) -> None:
    """Before, int8 gathers quantized the embedding table through the API and kept it exact
    through the CLI (the measured better choice): now both keep it exact."""
    cli, api = pool.run(_same_report_job)[0]
    assert cli == api, f"CLI:\n{cli}\nAPI:\n{api}"
    rows = api.splitlines()[1:]
    assert all("int8" not in row for row in rows if row.startswith("<root>")), api  # tables
    assert all("int8+scales" in row for row in rows if row.startswith("blocks")), api
    # the unit's two groups told apart by their parameters (before: "<root>" twice)
    assert any(row.startswith("<root> [tok.weight, pos.weight]") for row in rows), api
    assert any(row.startswith("<root> [ln_f.weight, ln_f.bias]") for row in rows), api


def _encodes_job(ctx: WorkerContext, strategy: str) -> dict[str, Any] | None:
    """Encodes and gathers of the groups that encode, per step and per no-grad forward,
    at 2 ranks with int8 gathers; and the losses and weights of 3 AdamW steps."""
    from flatshard.testing.internals import GatherCodec

    group = ctx.group(2)
    if group is None:
        return None
    torch.manual_seed(0)
    model: Any = build("gpt")
    flatshard.fully_shard(
        model,
        auto_wrap_policy=set(model.UNIT_CLASSES),
        process_group=group,
        strategy=getattr(flatshard.ShardingStrategy, strategy),
        mixed_precision=flatshard.MixedPrecision(gather_dtype=torch.int8),
    )
    optim = torch.optim.AdamW(model.parameters(), lr=1e-2)
    encodes = [0]
    encode = GatherCodec.encode

    def counted(self: Any, shard: torch.Tensor, compute: torch.dtype) -> torch.Tensor:
        encodes[0] += 1
        return encode(self, shard, compute)

    encoding = [
        f for u in units_of(model, "test") for f in u.flat_params if f.transport.codec is not None
    ]
    gathers = [0]
    for flat in encoding:

        def gathered(kind: str, numel: int, inner: Any = flat.on_collective) -> Any:
            gathers[0] += kind == "all_gather"
            return inner(kind, numel)

        flat.on_collective = gathered
    found: dict[str, Any] = {"groups": len(encoding), "steps": [], "losses": []}
    GatherCodec.encode = counted  # type: ignore[method-assign]
    try:
        for batch in batches(model, 3):
            encodes[0] = gathers[0] = 0
            loss = model.loss(batch)
            loss.backward()
            optim.step()
            optim.zero_grad()
            found["steps"].append((encodes[0], gathers[0]))
            found["losses"].append(float(loss))
        encodes[0] = gathers[0] = 0
        loss = model.loss(batch)
        with torch.no_grad():  # a write flatshard is not told of: torch's version counter
            for flat in encoding:
                flat.shard.add_(0.0)
        loss.backward()
        optim.zero_grad()
        found["written"] = (encodes[0], gathers[0])
        encodes[0] = gathers[0] = 0
        with torch.no_grad():  # no backward follows: nothing kept
            model.loss(batch)
            model.loss(batch)
        found["no_grad"] = (encodes[0], gathers[0])
    finally:
        GatherCodec.encode = encode  # type: ignore[method-assign]
    found["weights"] = [p.detach().clone() for p in model.parameters()]
    return found


def test_a_shard_is_encoded_once_per_write(pool: WorkerPool) -> None:
    """FULL_SHARD gathers each unit twice a step, and its shard is written once (the
    optimizer step): forward's payload is sent again by backward's gather, one encode per
    group and step (before: one per gather). The same losses and weights, bit for bit,
    as SHARD_GRAD_OP, which gathers once a step. A shard written between forward and
    backward behind flatshard's back is encoded again; a forward with no backward keeps no
    payload (each of two encodes)."""
    full = pool.run(_encodes_job, "FULL_SHARD")[0]
    grad_op = pool.run(_encodes_job, "SHARD_GRAD_OP")[0]
    groups = full["groups"]
    assert groups > 0
    for encodes, gathers in full["steps"]:
        assert gathers > groups, (gathers, groups)  # (the root and the last unit: once)
        assert encodes == groups, (encodes, groups, gathers)
    for encodes, gathers in grad_op["steps"]:
        assert encodes == gathers == groups, (encodes, gathers, groups)
    assert full["no_grad"] == (2 * groups, 2 * groups), full["no_grad"]
    assert full["written"][0] == full["written"][1] > groups, full["written"]  # encoded anew
    assert full["losses"] == grad_op["losses"]
    for ours, theirs in zip(full["weights"], grad_op["weights"], strict=True):
        assert torch.equal(ours, theirs)
