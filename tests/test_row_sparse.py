"""Row-sparse embedding tables (``fully_shard(..., placement=flatshard.RowSparse())``; [Note:
row-sparse embedding tables]).

Parity with the unsharded reference (DDP's semantics: each rank its slice of the global
batch, gradients averaged) at 2, 3 and 4 ranks, tied and untied tables, repeated and absent
tokens, ranks whose batches share no token, padding_idx, FULL_SHARD, SHARD_GRAD_OP,
HYBRID_SHARD and its ZeRO-2 form, other unit policies, activation checkpointing, the
prefetch switches, accumulation with and without no_sync, clip, offload and bf16; the lookup's
gradient equal bit for bit to the dense path's at 2 ranks; the bytes a table moves per step
against a formula in the unique tokens per rank; the dense-or-sparse rule; errors for what
the path cannot serve.
"""

from __future__ import annotations

from typing import Any, cast

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

import flatshard
from flatshard import comm_hooks
from flatshard.measure import ALL_TO_ALL, CollectiveTracker
from flatshard.testing.models import VocabGPT, build
from flatshard.testing.parity import (
    GLOBAL_BATCH,
    ParityConfig,
    assert_same,
    batches,
    parity_job,
    run_flatshard,
    run_mixed_reference,
    slice_batch,
)
from flatshard.testing.workers import WorkerContext, WorkerPool

SPARSE: dict[str, Any] = {"sparse_embeddings": True, "optimizer": "sgd", "steps": 3}


def _shard(model: nn.Module, group: dist.ProcessGroup, sparse: bool = True) -> None:
    """The model's blocks and root as units, tables row-sparse unless told."""
    flatshard.fully_shard(
        model,
        auto_wrap_policy=set(cast(Any, model).UNIT_CLASSES),
        process_group=group,
        placement=flatshard.RowSparse() if sparse else None,
    )


@pytest.mark.parametrize("model", ["vocab_gpt", "untied_vocab_gpt", "padded_vocab_gpt"])
@pytest.mark.parametrize("world_size", [2, 3, 4])
def test_parity_tied_untied_and_padded(pool: WorkerPool, model: str, world_size: int) -> None:
    pool.run(parity_job, ParityConfig(model, world_size, **SPARSE), False)


@pytest.mark.parametrize(
    "options",
    [
        {"strategy": "SHARD_GRAD_OP"},
        {"strategy": "HYBRID_SHARD", "sharding_factor": 2, "world_size": 4},
        {"micro_batches": 2, "no_sync": True, "clip": 0.5},
        {"micro_batches": 2, "clip": 0.5, "optimizer": "adamw"},
        {
            "micro_batches": 2,
            "strategy": "HYBRID_SHARD",
            "sharding_factor": 2,
            "world_size": 4,
            "all_reduce_last": True,
        },
        {"offload": True},
        {"reshard_after_backward": False, "micro_batches": 2},
        {"forwards_per_backward": 2},
        {"strategy": "HYBRID_SHARD_ZERO2", "sharding_factor": 2, "world_size": 4},
        {"strategy": "HYBRID_SHARD", "hybrid_from": "mesh", "sharding_factor": 2, "world_size": 4},
        {"root_strategy": "SHARD_GRAD_OP"},
        {"keep_gathered": 1},
        {"policy": "size"},  # the tables' unit chosen by size
        {"policy": "none"},  # the root alone: tables and blocks in one unit
        {"checkpoint": "around"},
        {"clip": 0.5, "clip_with": "torch"},
        {"clip": 0.5, "norm_type": float("inf")},
        {"forward_prefetch": True, "backward_prefetch": "BACKWARD_POST"},
        {"backward_prefetch": None, "limit_all_gathers": False},
        {"micro_batches": 2, "no_sync": True, "accumulate_with": "switch"},
        {"world_size": 3, "micro_batches": 2, "no_sync": True, "offload": True},
    ],
)
@pytest.mark.parametrize("model", ["vocab_gpt", "untied_vocab_gpt"])
def test_parity_across_options(pool: WorkerPool, model: str, options: dict[str, Any]) -> None:
    settings = {**SPARSE, "world_size": 2, **options}
    pool.run(parity_job, ParityConfig(model, **settings), False)


def _grads_job(ctx: WorkerContext, model_name: str, sparse: bool) -> dict[str, torch.Tensor] | None:
    group = ctx.group(2)
    if group is None:
        return None
    model = build(model_name)
    _shard(model, group, sparse)
    batch = slice_batch(next(batches(model, 1)), dist.get_rank(group), 2)
    cast(Any, model).loss(batch).backward()
    grads = {n: cast(torch.Tensor, p.grad).clone() for n, p in model.named_parameters()}
    return grads


def _discarded_then_grads_job(
    ctx: WorkerContext, model_name: str
) -> dict[str, torch.Tensor] | None:
    """A micro-batch under no_sync whose gradients are zeroed (discarded), then the first
    batch's synchronized backward: its gradients alone must reach .grad."""
    group = ctx.group(2)
    if group is None:
        return None
    model = build(model_name)
    _shard(model, group)
    first, discarded = (slice_batch(b, dist.get_rank(group), 2) for b in batches(model, 2))
    with flatshard.no_sync(model):
        cast(Any, model).loss(discarded).backward()
    model.zero_grad()
    cast(Any, model).loss(first).backward()
    return {n: cast(torch.Tensor, p.grad).clone() for n, p in model.named_parameters()}


@pytest.mark.parametrize("model", ["vocab_gpt", "untied_vocab_gpt"])
def test_zero_grad_drops_the_rows_kept_under_no_sync(pool: WorkerPool, model: str) -> None:
    """A table's lookup rows kept under no_sync go with zero_grad, as DDP's would: the
    next synchronized step's gradients are that batch's alone (bit for bit)."""
    expected = pool.run(_grads_job, model, True)
    got = pool.run(_discarded_then_grads_job, model)
    for rank in range(2):
        for name, grad in expected[rank].items():
            assert torch.equal(got[rank][name], grad), (rank, name)


@pytest.mark.parametrize("model", ["vocab_gpt", "untied_vocab_gpt"])
def test_lookup_gradient_is_bitwise_the_dense_one(pool: WorkerPool, model: str) -> None:
    """At 2 ranks the owner adds the same two numbers the dense reduce-scatter adds."""
    dense = pool.run(_grads_job, model, False)
    sparse = pool.run(_grads_job, model, True)
    for name in dense[0]:
        # Each rank holds whole rows, in rank order: the full gradient is their concatenation.
        expected, actual = (
            torch.cat([grads[0][name], grads[1][name]]) for grads in (dense, sparse)
        )
        if model == "vocab_gpt" and name == "tok.weight":
            # head + lookup summed per rank first (dense), or each over the ranks (sparse)
            torch.testing.assert_close(actual, expected, rtol=1e-6, atol=1e-9)
        else:
            assert torch.equal(actual, expected), name


def _bf16_job(ctx: WorkerContext, model: str) -> None:
    group = ctx.group(2)
    if group is None:
        return None
    common: dict[str, Any] = {**SPARSE, "param_dtype": "bfloat16"}
    ours = run_flatshard(ParityConfig(model, 2, **common), group)
    dense = run_flatshard(ParityConfig(model, 2, **{**common, "sparse_embeddings": False}), group)
    if ctx.rank == 0:
        if model == "untied_vocab_gpt":  # the same casts, the same fp32 sums
            assert_same(dense, ours, rtol=1e-6)
        # Tied, the dense path adds the head's and the lookup's gradients in bf16 on each
        # rank; the sparse path reduces each in fp32 and adds them there: closer to the
        # reference, not equal to dense.
        reference = run_mixed_reference(ParityConfig(model, 2, **common))
        assert_same(reference, ours, rtol=4 * 2**-7)
    return None


@pytest.mark.parametrize("model", ["vocab_gpt", "untied_vocab_gpt"])
def test_bf16(pool: WorkerPool, model: str) -> None:
    pool.run(_bf16_job, model)


def _expected_traffic(
    uniques: list[torch.Tensor], vocab: int, dim: int, me: int
) -> flatshard.TableTraffic:
    """One lookup per rank of ``uniques[r]`` (its unique ids) in a table of ``vocab`` rows
    alone in its group: the row-aligned layout gives each rank ceil(vocab / W) rows."""
    rows_per_rank = -(-vocab // len(uniques))

    def held_by(ids: torch.Tensor, rank: int) -> int:
        return int((ids // rows_per_rank == rank).sum())

    asked = uniques[me].numel() - held_by(uniques[me], me)  # ids this rank asks of others
    answered = sum(held_by(u, me) for s, u in enumerate(uniques) if s != me)
    # The rule ([Note: row-sparse embedding tables]), in fp32: ids and rows both ways
    # against the table's all-gather and reduce-scatter.
    world = len(uniques)
    every_ask = sum(u.numel() - held_by(u, r) for r, u in enumerate(uniques))
    if every_ask * (2 * 8 + dim * 8) >= world * (world - 1) * rows_per_rank * dim * 8:
        return flatshard.TableTraffic(dense_lookups=1)
    return flatshard.TableTraffic(
        lookups=1,
        lookup_ids=asked,
        lookup_rows=answered * dim,
        grad_ids=asked,
        grad_rows=asked * dim,
    )


def _traffic_job(ctx: WorkerContext, world_size: int, model_name: str) -> None:
    group = ctx.group(world_size)
    if group is None:
        return None
    model = build(model_name)
    _shard(model, group)
    me, dim = dist.get_rank(group), 16
    batch = next(batches(model, 1))
    tokens = [torch.unique(slice_batch(batch, r, world_size)[0]) for r in range(world_size)]
    positions = [torch.arange(9)] * world_size  # the position table: 9 rows, all looked up
    expected = {
        "tok.weight": _expected_traffic(tokens, 512, dim, me),
        "pos.weight": _expected_traffic(positions, 9, dim, me),
    }
    with CollectiveTracker() as tracker:
        loss = cast(Any, model).loss(slice_batch(batch, me, world_size))
    # The forward's all-to-alls: per table the requests reaching this rank (its own too),
    # then the rows of its unique ids.
    forward_bytes = sum(
        (e.lookup_rows // dim + u[me].numel() - e.lookup_ids) * 8 + u[me].numel() * dim * 4
        for e, u in zip(expected.values(), (tokens, positions), strict=True)
        if e.lookups
    )
    assert tracker.bytes[ALL_TO_ALL] == forward_bytes, (
        dict(tracker.bytes),
        forward_bytes,
        flatshard.embedding_traffic(model),
        expected,
    )
    loss.backward()
    assert flatshard.embedding_traffic(model) == expected
    return None


@pytest.mark.parametrize("world_size", [2, 3, 4])
@pytest.mark.parametrize("model", ["vocab_gpt", "untied_vocab_gpt"])
def test_bytes_per_step_by_formula(pool: WorkerPool, model: str, world_size: int) -> None:
    pool.run(_traffic_job, world_size, model)


def _rule_job(ctx: WorkerContext) -> None:
    """TinyGPT's 37-token table against 108 tokens per rank: the rows asked of the other
    rank outweigh the table, so the lookup is dense; parity holds all the same."""
    group = ctx.group(2)
    if group is None:
        return None
    model = build("gpt")
    _shard(model, group)
    batch = next(batches(model, 1))
    uniques = [torch.unique(slice_batch(batch, r, 2)[0]) for r in range(2)]
    rows, dim = 19, 16  # ceil(37 / 2) rows per rank
    asked = sum(int((u // rows != r).sum()) for r, u in enumerate(uniques))
    sparse_bytes = asked * (2 * 8 + dim * (4 + 4))
    dense_bytes = 2 * 1 * rows * dim * (4 + 4)
    assert sparse_bytes >= dense_bytes, (sparse_bytes, dense_bytes)
    cast(Any, model).loss(slice_batch(batch, dist.get_rank(group), 2)).backward()
    traffic = flatshard.embedding_traffic(model)["tok.weight"]
    assert (traffic.lookups, traffic.dense_lookups) == (0, 1), traffic
    return None


def test_dense_when_the_rows_outweigh_the_table(pool: WorkerPool) -> None:
    pool.run(_rule_job)
    pool.run(parity_job, ParityConfig("gpt", 2, **SPARSE), False)


class _ReadsTable(VocabGPT):
    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        return super().forward(idx) + self.tok.weight.sum()


def _errors_job(ctx: WorkerContext) -> None:
    group = ctx.group(2)
    if group is None:
        return None
    options: dict[str, Any] = {"process_group": group, "placement": flatshard.RowSparse()}
    for sparse in (True, False):  # refused on the dense path too: renormalized rows are lost
        capped = VocabGPT()
        capped.tok.max_norm = 1.0
        with pytest.raises(ValueError, match=r"'tok\.weight' has max_norm=1\.0 \(rank \d\)"):
            flatshard.fully_shard(
                capped, process_group=group, placement=flatshard.RowSparse() if sparse else None
            )
    with pytest.raises(ValueError, match="HYBRID_SHARD_OPTIM"):
        flatshard.fully_shard(
            VocabGPT(), strategy="HYBRID_SHARD_OPTIM", sharding_factor=1, **options
        )
    sparse_grads = VocabGPT(tied=False)
    sparse_grads.tok.sparse = True  # torch's sparse gradients: served by the row-sparse path only
    with pytest.raises(ValueError, match=r"Embedding 'tok\.weight' has sparse=True"):
        flatshard.fully_shard(sparse_grads, process_group=group)
    for option in ("sparse", "max_norm"):  # nn.EmbeddingBag: the dense path only, alike
        bag = nn.EmbeddingBag(64, 4, sparse=option == "sparse")
        bag.max_norm = 1.0 if option == "max_norm" else None
        match = r"EmbeddingBag '0\.weight' has sparse=True" if option == "sparse" else "max_norm"
        with pytest.raises(ValueError, match=match):
            flatshard.fully_shard(nn.Sequential(bag, nn.Linear(4, 2)), **options)
    frozen = VocabGPT(tied=False)
    frozen.tok.sparse = True
    frozen.tok.requires_grad_(False)  # no gradient at all: nothing to refuse
    flatshard.fully_shard(frozen, process_group=group)
    for sparse in (True, False):  # options set after fully_shard: refused at the lookup
        later = VocabGPT(tied=False)
        _shard(later, group, sparse)
        later.tok.max_norm = 2.0
        with pytest.raises(ValueError, match=r"'tok\.weight' has max_norm=2\.0"):
            later(torch.zeros(1, 4, dtype=torch.long))
        later.tok.max_norm = None
        later.tok.sparse = True
        if sparse:
            later(torch.zeros(1, 4, dtype=torch.long))  # served by the row-sparse path
        else:
            with pytest.raises(ValueError, match=r"'tok\.weight' has sparse=True"):
                later(torch.zeros(1, 4, dtype=torch.long))
    reader = _ReadsTable(tied=False)
    flatshard.fully_shard(reader, **options)
    with pytest.raises(RuntimeError, match=r"'tok\.weight' is a row-sparse embedding table"):
        reader(torch.zeros(1, 4, dtype=torch.long))
    hooked = VocabGPT(tied=False)
    _shard(hooked, group)
    hook = comm_hooks.LowPrecisionHook()
    with pytest.raises(ValueError, match=r"row-sparse embedding tables \('tok\.weight', 'pos"):
        comm_hooks.register_comm_hook(hooked, hook)
    for block in cast(Any, hooked).blocks:  # units without tables take it
        comm_hooks.register_comm_hook(block, hook)
    batch = slice_batch(next(batches(hooked, 1)), dist.get_rank(group), 2)
    cast(Any, hooked).loss(batch).backward()  # the blocks through the hook, tables as rows
    assert flatshard.embedding_traffic(hooked)["tok.weight"].lookups == 1
    model = VocabGPT(tied=False)
    flatshard.fully_shard(model, **options)
    ids = torch.full((1, 4), 600 if dist.get_rank(group) == 1 else 3)
    with pytest.raises(IndexError, match=r"outside \[0, 512\).*shard rank\(s\) \[1\]"):
        model(ids)
    return None


def _skipped_backward_job(ctx: WorkerContext) -> list[str]:
    """Rank 1 runs a second forward where rank 0 runs the backward: rank 0's gradient
    exchange would meet rank 1's lookup, their all-to-alls paired with different sizes,
    which gloo answers by aborting the process. Rank 1 first agrees, out of band, that
    every rank starts a forward there ([Note: a backward one rank skipped]); rank 0, in
    its backward, never does, and both ranks raise the timeout's diagnosis."""
    group = ctx.group(2)
    if group is None:
        return []
    torch.manual_seed(0)
    model = nn.Sequential(nn.Embedding(512, 8))  # the table alone: nothing else gathered
    flatshard.fully_shard(model, process_group=group, placement=flatshard.RowSparse())
    ids = torch.randint(0, 512, (2, 6))
    out = model(ids)
    flatshard.set_checks(flatshard.Checks(timeout=2.0))
    try:
        with pytest.raises(flatshard.CollectiveTimeoutError) as raised:
            if dist.get_rank(group) == 0:
                out.sum().backward()
            else:
                model(ids)  # a forward with gradients that no backward followed
    finally:
        flatshard.set_checks(flatshard.Checks())
    return [str(raised.value)]


def test_a_skipped_backward_meets_a_named_error_not_an_abort(pool: WorkerPool) -> None:
    messages = [m for r in pool.run(_skipped_backward_job)[:2] for m in r]
    pool.close()  # rank 0's gather is left in flight: the next job gets fresh ranks
    for message in messages:
        assert "rank 0: waiting" in message and "(step 0, backward)" in message
        assert "rank 1: waiting" in message
        assert "the other ranks to reach forward after no backward at step 0" in message


def test_errors_name_the_table(pool: WorkerPool) -> None:
    pool.run(_errors_job)


def _sparse_gradient_job(ctx: WorkerContext) -> None:
    """``nn.Embedding(..., sparse=True)`` under RowSparse(): the rows' gradients are
    the same as with sparse=False, dense in the shard."""
    group = ctx.group(2)
    if group is None:
        return None
    grads = []
    for sparse in (False, True):
        torch.manual_seed(0)
        model = VocabGPT(tied=False)
        model.tok.sparse = sparse
        _shard(model, group)
        batch = slice_batch(next(batches(model, 1)), dist.get_rank(group), 2)
        cast(Any, model).loss(batch).backward()
        grads.append({n: p.grad for n, p in model.named_parameters()})
    assert all(torch.equal(grads[0][n], g) for n, g in grads[1].items())
    assert not grads[1]["tok.weight"].is_sparse
    return None


def test_sparse_gradient_embeddings_are_served(pool: WorkerPool) -> None:
    pool.run(_sparse_gradient_job)


class _Scaled(nn.Module):
    """An embedding looked up twice per forward, with scale_grad_by_freq."""

    UNIT_CLASSES = frozenset({nn.Linear})

    def __init__(self) -> None:
        super().__init__()
        self.tok = nn.Embedding(512, 8, scale_grad_by_freq=True)
        self.out = nn.Linear(8, 4)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = self.out(self.tok(idx) + self.tok(idx.flip(-1) * 2 % 512))
        return out

    def make_batch(self, gen: torch.Generator, batch_size: int) -> tuple[torch.Tensor, ...]:
        return torch.randint(0, 200, (batch_size, 6), generator=gen), torch.zeros(batch_size)

    def loss(self, batch: tuple[torch.Tensor, ...]) -> torch.Tensor:
        return cast(torch.Tensor, F.mse_loss(self(batch[0]).sum(-1).mean(-1), batch[1]))


def _twice_job(
    ctx: WorkerContext,
) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]] | None:
    group = ctx.group(2)
    if group is None:
        return None
    torch.manual_seed(0)
    model, reference = _Scaled(), _Scaled()
    reference.load_state_dict(model.state_dict())
    flatshard.fully_shard(model, process_group=group, placement=flatshard.RowSparse())
    gen = torch.Generator().manual_seed(0)
    batch = model.make_batch(gen, GLOBAL_BATCH)
    model.loss(slice_batch(cast(Any, batch), dist.get_rank(group), 2)).backward()
    for r in range(2):  # DDP's semantics: each rank's loss, gradients averaged
        (reference.loss(slice_batch(cast(Any, batch), r, 2)) / 2).backward()
    assert flatshard.embedding_traffic(model)["tok.weight"].lookups == 2
    ours = {n: cast(torch.Tensor, p.grad).clone() for n, p in model.named_parameters()}
    return ours, {n: cast(torch.Tensor, p.grad) for n, p in reference.named_parameters()}


def test_two_lookups_per_forward_with_scale_grad_by_freq(pool: WorkerPool) -> None:
    results = pool.run(_twice_job)
    for name, expected in results[0][1].items():
        actual = torch.cat([results[0][0][name], results[1][0][name]])  # rows in rank order
        torch.testing.assert_close(actual, expected, rtol=1e-6, atol=1e-8, msg=name)


def _int32_and_pinned_job(ctx: WorkerContext) -> None:
    """int32 token ids on one rank, int64 on the other (and one rank with none to look up
    for its gradient): the exchanges still pair. A unit held by ``flatshard.unshard``
    holds the whole table until ``reshard``: its modules see it while they run (also one
    called alone), and the sharded rows between uses ([Note: held units])."""
    group = ctx.group(2)
    if group is None:
        return None
    me = dist.get_rank(group)
    model = VocabGPT(tied=False)
    flatshard.fully_shard(model, process_group=group, placement=flatshard.RowSparse())
    ids = torch.arange(8).view(1, 8) + (1 - me) * 300  # rows the other rank holds
    model(ids.int() if me == 0 else ids).sum().backward()
    assert flatshard.embedding_traffic(model)["tok.weight"].lookups == 1
    flatshard.unshard(model)
    assert model.tok.weight.shape == (256, 16)  # between uses: this rank's rows
    seen = model.tok(ids)  # the embedding called alone sees the whole table
    assert seen.shape == (1, 8, 16) and torch.isfinite(seen.sum())
    model(ids)  # the module holds the gathered table: a plain lookup, no exchange
    flatshard.reshard(model)
    traffic = flatshard.embedding_traffic(model)["tok.weight"]
    assert (traffic.lookups, traffic.dense_lookups) == (1, 0), traffic
    return None


def test_int32_ids_and_a_pinned_unit(pool: WorkerPool) -> None:
    pool.run(_int32_and_pinned_job)


def _checkpoint_job(ctx: WorkerContext, path: str) -> None:
    """A checkpoint of a model with row-sparse tables is the dense model's: saved by one,
    it loads into the other (weights and AdamW state), which then trains on alike."""
    group = ctx.group(2)
    if group is None:
        return None
    models, optims = [], []
    for sparse in (True, False):
        model = build("untied_vocab_gpt")
        _shard(model, group, sparse)
        models.append(model)
        optims.append(torch.optim.AdamW(model.parameters(), lr=1e-2))
    steps = batches(models[0], 3)
    sparse_model, dense_model = models
    batch = slice_batch(next(steps), dist.get_rank(group), 2)
    cast(Any, sparse_model).loss(batch).backward()
    optims[0].step()
    optims[0].zero_grad()
    flatshard.save_checkpoint(path, sparse_model, optims[0])
    flatshard.load_checkpoint(path, dense_model, optims[1])
    for _ in range(2):
        batch = slice_batch(next(steps), dist.get_rank(group), 2)
        for model, optim in zip(models, optims, strict=True):
            cast(Any, model).loss(batch).backward()
            optim.step()
            optim.zero_grad()
    full = [flatshard.full_state_dict(m) for m in models]
    if ctx.rank == 0:
        for name, value in full[1].items():
            torch.testing.assert_close(full[0][name], value, rtol=1e-5, atol=1e-7, msg=name)
    return None


def test_checkpoints_are_the_dense_models(pool: WorkerPool, tmp_path: Any) -> None:
    pool.run(_checkpoint_job, str(tmp_path / "ckpt"))
