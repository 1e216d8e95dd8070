"""2-D parallelism: tensor parallel (DTensor, ``parallelize_module``) x flatshard over dp.

At world size 4 (dp 2 x tp 2) on gloo, a model with a tied embedding/head (both split over
the vocabulary), column- and row-parallel MLPs, plain LayerNorms and a frozen block trains
exactly like the TP-only model on the global batch: losses, gradient norms (flatshard's
``clip_grad_norm_`` over dp x tp against the norm of the full gradients) and the full
state dict. A checkpoint saved at dp 2 loads at dp 1 (same TP degree), and into the model
without TP at dp 4, and continues with the same losses; PyTorch's ``fully_shard`` on the
same 2-D run gives the same losses; the full state dict and the safetensors export
(global tensors) load back exactly. The hybrid strategies over dp match TP alone too,
and a TP model built on the meta device starts from exactly the weights of the model
without TP. See [Note: DTensor parameters].
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.tensor import DTensor, Replicate
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    RowwiseParallel,
    parallelize_module,
)

import flatshard
from flatshard.testing.workers import WorkerContext, WorkerPool

VOCAB, DIM, LAYERS, BATCH = 32, 16, 3, 4  # BATCH: the global batch, split over dp
STEPS, MORE = 3, 2  # steps before the checkpoint, and after it


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(DIM)
        self.up = nn.Linear(DIM, 4 * DIM)
        self.down = nn.Linear(4 * DIM, DIM)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = x + self.down(torch.relu(self.up(self.norm(x))))
        return out


class TiedNet(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.tok = nn.Embedding(VOCAB, DIM)
        self.blocks = nn.ModuleList(Block() for _ in range(LAYERS))
        self.norm = nn.LayerNorm(DIM)
        self.head = nn.Linear(DIM, VOCAB, bias=False)
        self.head.weight = self.tok.weight

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        x = self.tok(idx)
        for block in self.blocks:
            x = block(x)
        out: torch.Tensor = self.head(self.norm(x))
        return out


def build(tp: DeviceMesh, model: TiedNet | None = None) -> TiedNet:
    """The same TP model on every rank: vocabulary split for the tied embedding and head."""
    if model is None:
        torch.manual_seed(0)
        model = TiedNet()
    plan: dict[str, Any] = {
        "tok": RowwiseParallel(input_layouts=Replicate()),
        "head": ColwiseParallel(output_layouts=Replicate()),
    }
    for i in range(LAYERS):
        plan[f"blocks.{i}.up"] = ColwiseParallel()
        plan[f"blocks.{i}.down"] = RowwiseParallel()
    parallelize_module(model, tp, plan)
    model.head.weight = model.tok.weight  # both Shard(0): still one tensor
    for param in model.blocks[0].parameters():
        param.requires_grad_(False)  # a frozen part
    return model


def _optimizer(model: nn.Module) -> torch.optim.Optimizer:
    return torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)


def _loss(model: nn.Module, idx: torch.Tensor) -> torch.Tensor:
    logits = model(idx[:, :-1])
    return nn.functional.cross_entropy(logits.reshape(-1, VOCAB), idx[:, 1:].reshape(-1))


def _batches(count: int, seed: int) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(0, VOCAB, (BATCH, 9), generator=gen) for _ in range(count)]


def _full(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.full_tensor() if isinstance(tensor, DTensor) else tensor


def _train(
    model: nn.Module, optim: torch.optim.Optimizer, batches: list[torch.Tensor], dp: Any
) -> list[tuple[float, float]]:
    """(global-batch loss, gradient norm) per step; each dp rank its slice of the batch."""
    size, rank = dist.get_world_size(dp), dist.get_rank(dp)
    out = []
    for idx in batches:
        rows = BATCH // size
        loss = _loss(model, idx[rank * rows : (rank + 1) * rows])
        loss.backward()
        norm = flatshard.clip_grad_norm_(model, 1e9)
        optim.step()
        optim.zero_grad()
        mean = loss.detach().clone()
        dist.all_reduce(mean, group=dp)
        out.append((float(mean) / size, float(norm)))
    return out


def _reference(model: nn.Module, batches: list[torch.Tensor]) -> list[tuple[float, float]]:
    optim = _optimizer(model)
    out = []
    for idx in batches:
        loss = _loss(model, idx)
        loss.backward()
        grads = [_full(p.grad) for p in model.parameters() if p.grad is not None]
        out.append((float(loss), float(sum((g**2).sum() for g in grads) ** 0.5)))
        optim.step()
        optim.zero_grad()
    return out


def _sharded_2d(mesh: DeviceMesh, strategy: str, **options: Any) -> TiedNet:
    """The TP model sharded over the mesh's dp dimension."""
    model = build(mesh["tp"])
    strategy_ = flatshard.ShardingStrategy[strategy]
    flatshard.fully_shard(
        model, auto_wrap_policy={Block}, process_group=mesh["dp"], strategy=strategy_, **options
    )
    return model


def two_d_job(ctx: WorkerContext, strategy: str, directory: str) -> dict[str, Any]:
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    reference = build(mesh["tp"])
    batches = _batches(STEPS + MORE, seed=1)
    expected = _reference(reference, batches)
    model = _sharded_2d(mesh, strategy)
    optim = _optimizer(model)
    dp = mesh["dp"].get_group()
    got = _train(model, optim, batches[:STEPS], dp)
    flatshard.save_checkpoint(Path(directory) / "ckpt", model, optim)
    got += _train(model, optim, batches[STEPS:], dp)
    full = flatshard.full_state_dict(model, rank0_only=False)
    want = {k: _full(v) for k, v in reference.state_dict().items()}
    # Global tensors back into fresh 2-D models (at their initial weights): as a state
    # dict, and exported as safetensors.
    flatshard.export_safetensors(model, Path(directory) / "export")
    dist.barrier()  # one rank writes; every rank reads
    reloaded = []
    for load in (
        lambda m: flatshard.load_state_dict(m, full),
        lambda m: flatshard.load_safetensors(m, Path(directory) / "export"),
    ):
        fresh = build(mesh["tp"])
        flatshard.fully_shard(fresh, auto_wrap_policy={Block}, process_group=mesh["dp"])
        load(fresh)
        reloaded.append(flatshard.full_state_dict(fresh))
    return {"expected": expected, "got": got, "full": full, "want": want, "reloaded": reloaded}


def fsdp2_job(ctx: WorkerContext) -> list[float]:
    """PyTorch's fully_shard over the same dp dimension of the same TP model: its losses."""
    from torch.distributed.fsdp import fully_shard

    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    model = build(mesh["tp"])
    for block in model.blocks:
        fully_shard(block, mesh=mesh["dp"])
    fully_shard(model, mesh=mesh["dp"])
    optim = _optimizer(model)
    dp, losses = mesh["dp"].get_group(), []
    for idx in _batches(STEPS + MORE, seed=1):
        rows = BATCH // 2
        loss = _loss(model, idx[dist.get_rank(dp) * rows :][:rows])
        loss.backward()
        optim.step()
        optim.zero_grad()
        mean = loss.detach().clone()
        dist.all_reduce(mean, group=dp)
        losses.append(float(mean) / 2)
    return losses


def dp1_job(ctx: WorkerContext, directory: str) -> list[tuple[float, float]]:
    """Two independent tp-2 replicas, each with dp 1 (a group of one rank)."""
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("replica", "tp"))
    alone = [dist.new_group([r]) for r in range(4)][ctx.rank]
    model = build(mesh["tp"])
    flatshard.fully_shard(model, auto_wrap_policy={Block}, process_group=alone)
    optim = _optimizer(model)
    flatshard.load_checkpoint(Path(directory) / "ckpt", model, optim)
    return _train(model, optim, _batches(STEPS + MORE, seed=1)[STEPS:], alone)


def no_tp_job(ctx: WorkerContext, directory: str) -> list[tuple[float, float]]:
    """The model without TP, sharded over all 4 ranks (dp 4), from the tp-2 checkpoint."""
    torch.manual_seed(1)  # other weights than the checkpoint's
    model = TiedNet()
    for param in model.blocks[0].parameters():
        param.requires_grad_(False)
    flatshard.fully_shard(model, auto_wrap_policy={Block})
    optim = _optimizer(model)
    flatshard.load_checkpoint(Path(directory) / "ckpt", model, optim)
    world = dist.group.WORLD
    assert world is not None
    return _train(model, optim, _batches(STEPS + MORE, seed=1)[STEPS:], world)


@pytest.mark.parametrize("strategy", ["FULL_SHARD", "SHARD_GRAD_OP"])
def test_tp_times_dp_matches_tp_alone_and_reloads_at_dp_1(
    pool: WorkerPool, tmp_path: Path, strategy: str
) -> None:
    results = pool.run(two_d_job, strategy, str(tmp_path))
    for rank, result in enumerate(results):
        for step, ((loss, norm), (want_loss, want_norm)) in enumerate(
            zip(result["got"], result["expected"], strict=True)
        ):
            assert loss == pytest.approx(want_loss, rel=1e-5), (rank, step)
            assert norm == pytest.approx(want_norm, rel=1e-5), (rank, step)
    full, want = results[0]["full"], results[0]["want"]
    assert full.keys() == want.keys()
    for key, value in want.items():
        torch.testing.assert_close(full[key], value, rtol=1e-5, atol=1e-6)
        for reloaded in results[0]["reloaded"]:
            assert torch.equal(reloaded[key], full[key]), key
    if strategy == "FULL_SHARD":  # PyTorch's fully_shard + TP on the same run
        for rank, losses in enumerate(pool.run(fsdp2_job)):
            got = [loss for loss, _ in results[rank]["got"]]
            assert losses == pytest.approx(got, rel=1e-5), rank
    if strategy == "FULL_SHARD":  # across TP degrees: tp 2 -> tp 1 (dp 4), DCP reshards
        for rank, losses in enumerate(pool.run(no_tp_job, str(tmp_path))):
            for (loss, norm), (want_loss, want_norm) in zip(
                losses, results[0]["got"][STEPS:], strict=True
            ):
                assert loss == pytest.approx(want_loss, rel=1e-5), rank
                assert norm == pytest.approx(want_norm, rel=1e-5), rank
    resumed = pool.run(dp1_job, str(tmp_path))
    for rank, losses in enumerate(resumed):
        for (loss, norm), (want_loss, want_norm) in zip(
            losses, results[rank % 2]["got"][STEPS:], strict=True
        ):
            assert loss == pytest.approx(want_loss, rel=1e-5), rank
            assert norm == pytest.approx(want_norm, rel=1e-5), rank


def overlapping_job(ctx: WorkerContext) -> str:
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    model = build(mesh["tp"])
    try:
        flatshard.fully_shard(model, auto_wrap_policy={Block})  # the world: holds TP peers
    except ValueError as error:
        return str(error)
    return "no error"


def hybrid_job(ctx: WorkerContext) -> dict[str, Any]:
    """Replicated over dp (sharding factor 1: each dp rank a replica group of its own) x
    tp, for both hybrid strategies: the same losses and norms as TP alone."""
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    batches = _batches(STEPS, seed=3)
    expected = _reference(build(mesh["tp"]), batches)
    got = {}
    for strategy in ("HYBRID_SHARD", "HYBRID_SHARD_ZERO2"):
        model = _sharded_2d(mesh, strategy, sharding_factor=1)
        got[strategy] = _train(model, _optimizer(model), batches, mesh["dp"].get_group())
    return {"expected": expected, "got": got}


def test_hybrid_times_tp_matches_tp_alone(pool: WorkerPool) -> None:
    for rank, result in enumerate(pool.run(hybrid_job)):
        for strategy, steps in result["got"].items():
            for (loss, norm), (want_loss, want_norm) in zip(steps, result["expected"], strict=True):
                assert loss == pytest.approx(want_loss, rel=1e-5), (rank, strategy)
                assert norm == pytest.approx(want_norm, rel=1e-5), (rank, strategy)


def meta_job(ctx: WorkerContext) -> dict[str, Any]:
    """A TP model built and parallelized on the meta device, initialized by fully_shard,
    against the model without TP initialized by ``init_weights`` and then parallelized."""
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    with torch.device("meta"):
        model = build(mesh["tp"], TiedNet())
    init = flatshard.InitOptions(seed=7)
    flatshard.fully_shard(
        model, auto_wrap_policy={Block}, process_group=mesh["dp"], device="cpu", init=init
    )
    plain = TiedNet()
    flatshard.init_weights(plain, seed=7)
    reference = build(mesh["tp"], plain)
    batches = _batches(STEPS, seed=2)
    want = {k: _full(v).clone() for k, v in reference.state_dict().items()}
    full = flatshard.full_state_dict(model, rank0_only=False)
    got = _train(model, _optimizer(model), batches, mesh["dp"].get_group())
    return {"full": full, "want": want, "got": got, "expected": _reference(reference, batches)}


def test_a_tp_model_built_on_meta_starts_from_the_weights_without_tp(pool: WorkerPool) -> None:
    """[Note: initializing TP parameters]: each TP shard is its part of the weights the
    model without TP draws (not a copy of its peers' shards), and training matches."""
    for rank, result in enumerate(pool.run(meta_job)):
        full, want = result["full"], result["want"]
        assert full.keys() == want.keys()
        for key, value in want.items():
            assert torch.equal(full[key], value), (rank, key)
        up = full["blocks.1.up.weight"]
        assert not torch.equal(up[: 2 * DIM], up[2 * DIM :])  # TP halves differ
        for (loss, norm), (want_loss, want_norm) in zip(
            result["got"], result["expected"], strict=True
        ):
            assert loss == pytest.approx(want_loss, rel=1e-5), rank
            assert norm == pytest.approx(want_norm, rel=1e-5), rank


def test_sharding_over_tp_peers_is_an_error(pool: WorkerPool) -> None:
    for message in pool.run(overlapping_job):
        assert "must not be sharded together" in message, message
        assert 'process_group=mesh["dp"]' in message


def summon_state_dict_job(ctx: WorkerContext) -> list[str]:
    """Inside summon_full_params a TP parameter is this rank's TP part: a plain state dict
    there is refused by name (before: it returned the parts without a word)."""
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    model = _sharded_2d(mesh, "FULL_SHARD")
    full = flatshard.full_state_dict(model, rank0_only=False)
    messages = []
    with flatshard.summon_full_params(model):
        for call in (model.state_dict, lambda: model.load_state_dict(full)):
            try:
                call()
                messages.append("no error")
            except RuntimeError as error:
                messages.append(str(error))
    return messages


def test_a_plain_state_dict_inside_summon_names_the_tensor_parallel_parts(
    pool: WorkerPool,
) -> None:
    for rank, messages in enumerate(pool.run(summon_state_dict_job)):
        for message in messages:
            assert message.startswith("flatshard") and "tensor-parallel part" in message, (
                f"rank {rank}: {message}"
            )
            assert "flatshard.full_state_dict(model)" in message
