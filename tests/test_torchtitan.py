"""torchtitan's own models under flatshard, against DDP's semantics.

Llama 3 (its debug configuration cut to 2 blocks, tied and untied, tables dense and
row-sparse) and DeepSeek-V3 (MLA attention, a dense block and a mixture-of-experts block
with shared experts), built by torchtitan's own config classes, with FlexAttention swapped
for SDPA (no FlexAttention kernels on a CPU). Each rank trains on its slice of the batch;
the reference is the unsharded model with each rank's loss backpropagated separately and
the gradients averaged, as DDP would: MoE routing depends on the batch, so the global batch
in one forward would route differently. Clipping and SGD with momentum on both sides;
parameters after three steps within fp32 rounding. DeepSeek-V3's routed experts also run
expert parallel (``flatshard.Experts``: EP 2 at 2 ranks, EP 2 x data 2 at 4), through
torchtitan's own ``GroupedExperts`` and dispatcher.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import flatshard
from flatshard.testing.workers import WorkerContext, WorkerPool

pytest.importorskip("torchtitan")

VOCAB = 2048
STEPS = 3
ROWS = 6  # sequences per step, split over 2 or 3 ranks


def _build(kind: str, tied: bool) -> tuple[nn.Module, type[nn.Module]]:
    """torchtitan's debug model of ``kind`` with 2 blocks and SDPA attention, its weights
    initialized by torchtitan (``init_states``), and its block class."""
    from torchtitan.models.common.attention import ScaledDotProductAttention

    if kind == "llama3":
        from torchtitan.models.llama3 import llama3_configs

        config = llama3_configs["debugmodel"](attn_backend="flex")
    else:
        from torchtitan.models.deepseek_v3 import deepseekv3_configs

        config = deepseekv3_configs["debugmodel"](attn_backend="flex", moe_comm_backend="standard")
    layers = config.layers[:2]  # DeepSeek-V3: the dense block, then a MoE one
    for layer in layers:
        layer.attention.inner_attention = ScaledDotProductAttention.Config()
    config = dataclasses.replace(config, layers=layers, enable_weight_tying=tied)
    model = config.build()
    model.init_states(buffer_device=None)
    return model, type(model.layers["0"])


def _loss(model: nn.Module, tokens: torch.Tensor) -> torch.Tensor:
    logits = model(tokens[:, :-1])
    return F.cross_entropy(logits.flatten(0, 1).float(), tokens[:, 1:].flatten())


def _placement(sparse: bool, experts: int | None) -> flatshard.ShardPlacement | Any:
    if experts is not None:  # its routed experts' stacked weights, split over EP groups
        return lambda name, p: flatshard.Experts(experts) if ".inner_experts." in name else None
    return flatshard.RowSparse() if sparse else None


def titan_job(
    ctx: WorkerContext, kind: str, tied: bool, sparse: bool, world: int, experts: int | None
) -> dict[str, Any] | None:
    group = ctx.group(world)
    if group is None:
        return None
    torch.manual_seed(0)
    model, block = _build(kind, tied)
    reference, _ = _build(kind, tied)
    reference.load_state_dict(model.state_dict())
    flatshard.fully_shard(
        model,
        auto_wrap_policy={block},
        process_group=group,
        placement=_placement(sparse, experts),
    )
    # SGD: Adam's update divides by the gradient's own scale, so a rounding difference in
    # a near-zero gradient becomes a whole step's difference; SGD keeps it a rounding one.
    optim = torch.optim.SGD(model.parameters(), lr=0.5, momentum=0.9)
    ref_optim = torch.optim.SGD(reference.parameters(), lr=0.5, momentum=0.9)
    gen = torch.Generator().manual_seed(0)
    per_rank = ROWS // world
    for _ in range(STEPS):
        tokens = torch.randint(0, VOCAB, (ROWS, 17), generator=gen)
        tokens[per_rank:] %= 300  # the other ranks' ids from a corner of the vocabulary
        mine = tokens[ctx.rank * per_rank : (ctx.rank + 1) * per_rank]
        _loss(model, mine).backward()
        flatshard.clip_grad_norm_(model, 1.0)
        optim.step()
        optim.zero_grad()
        for r in range(world):  # DDP: each rank's loss, the gradients averaged
            (_loss(reference, tokens[r * per_rank : (r + 1) * per_rank]) / world).backward()
        torch.nn.utils.clip_grad_norm_(reference.parameters(), 1.0)
        ref_optim.step()
        ref_optim.zero_grad()
    with flatshard.summon_full_params(model):  # every routed expert, joined over EP
        local = {n: p.shape[0] for n, p in model.named_parameters() if "inner_experts" in n}
    full = flatshard.full_state_dict(model)  # (every rank takes part; rank 0 holds it)
    traffic = flatshard.embedding_traffic(model) if sparse else {}
    if ctx.rank != 0:
        return None
    # torchtitan's state_dict names the fused attention weights apart (its hooks): compare
    # state dicts, without the MoE's routing statistics (buffers counted per rank's batch).
    expected = reference.state_dict()
    counted = {n for n, _ in reference.named_buffers()}
    return {
        "params": {n: t for n, t in full.items() if n not in counted},
        "expected": {n: t for n, t in expected.items() if n not in counted},
        "lookups": {name: t.lookups for name, t in traffic.items()},
        "local_experts": local,
    }


@pytest.mark.parametrize(
    ("kind", "tied", "sparse", "world", "experts"),
    [
        ("llama3", False, False, 2, None),
        ("llama3", False, True, 3, None),
        ("llama3", True, True, 2, None),
        ("deepseek_v3", False, False, 2, None),
        ("deepseek_v3", False, True, 2, None),
        ("deepseek_v3", False, False, 2, 2),  # expert parallel: EP 2
        ("deepseek_v3", False, False, 4, 2),  # EP 2 x data 2
    ],
)
def test_torchtitan_models_train_like_ddp(
    pool: WorkerPool, kind: str, tied: bool, sparse: bool, world: int, experts: int | None
) -> None:
    result = pool.run(titan_job, kind, tied, sparse, world, experts)[0]
    assert result["params"].keys() == result["expected"].keys()
    for name, expected in result["expected"].items():
        try:
            torch.testing.assert_close(result["params"][name], expected.detach())
        except AssertionError as error:
            raise AssertionError(f"parameter '{name}': {error}") from None
    held = 8  # the debug model's 8 routed experts: whole inside summon_full_params
    if kind == "deepseek_v3":
        assert set(result["local_experts"].values()) == {held}, result["local_experts"]
    if sparse:  # the token table was looked up row-sparse at every step
        assert result["lookups"]["tok_embeddings.weight"] == STEPS, result["lookups"]


def titan_pipeline_job(ctx: WorkerContext, schedule: str) -> dict[str, Any] | None:
    """Llama 3 split into 2 stages by hand as torchtitan splits it (the embedding and the
    first block; the second block, the norm and the head), PP2 x DP2 on 4 ranks, against
    DDP's semantics on the same micro-batches. Full state dicts keep the original names."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.pipelining import Schedule1F1B, ScheduleInterleavedZeroBubble

    from flatshard.integrations.pipelining import PipelineStage

    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("pp", "dp"))
    pp_rank, dp_rank = mesh.get_local_rank("pp"), mesh.get_local_rank("dp")
    torch.manual_seed(0)
    model, block = _build("llama3", tied=False)
    reference, _ = _build("llama3", tied=False)
    reference.load_state_dict(model.state_dict())
    if pp_rank == 0:  # torchtitan's own way: modules of other stages set to None / deleted
        del model.layers["1"]
        model.norm, model.lm_head = None, None
    else:
        del model.layers["0"]
        model.tok_embeddings = None
    flatshard.fully_shard(model, auto_wrap_policy={block}, process_group=mesh["dp"])
    stage = PipelineStage(model, pp_rank, 2, torch.device("cpu"), group=mesh["pp"].get_group())
    micro = 2

    def loss_fn(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        return F.cross_entropy(logits.flatten(0, 1).float(), targets.flatten())

    if schedule == "1f1b":
        runner: Any = Schedule1F1B(stage, micro, loss_fn=loss_fn)
    else:  # one stage per rank: the zero-bubble schedule's stages 0..1 over 2 ranks
        runner = ScheduleInterleavedZeroBubble([stage], micro, loss_fn=loss_fn)
    optim = torch.optim.SGD(model.parameters(), lr=0.5, momentum=0.9)
    ref_optim = torch.optim.SGD(reference.parameters(), lr=0.5, momentum=0.9)
    gen = torch.Generator().manual_seed(0)
    for _ in range(STEPS):
        tokens = torch.randint(0, VOCAB, (2, 4, 17), generator=gen)  # (dp, rows, length)
        mine = tokens[dp_rank]
        if pp_rank == 0:
            runner.step(mine[:, :-1])
        else:
            runner.step(target=mine[:, 1:])
        flatshard.clip_grad_norm_(model, 1.0)
        optim.step()
        optim.zero_grad()
        for r in range(2):
            for rows in tokens[r].chunk(micro):
                (_loss(reference, rows) / (2 * micro)).backward()
        torch.nn.utils.clip_grad_norm_(reference.parameters(), 1.0)
        ref_optim.step()
        ref_optim.zero_grad()
    full = flatshard.full_state_dict(model)
    if dp_rank != 0:
        return None
    expected = reference.state_dict()
    return {"params": full, "expected": {n: expected[n] for n in full}}


@pytest.mark.parametrize("schedule", ["1f1b", "zero-bubble"])
def test_llama3_in_two_pipeline_stages_trains_like_ddp(pool: WorkerPool, schedule: str) -> None:
    results = [r for r in pool.run(titan_pipeline_job, schedule) if r is not None]
    assert len(results) == 2  # one per stage
    names = set()
    for result in results:
        names |= result["params"].keys()
        for name, expected in result["expected"].items():
            got, want = result["params"][name], expected.detach()
            error = float((got - want).norm() / want.norm())
            assert error < 1e-5, (name, error)  # fp32 rounding over 3 steps (lr 0.5)
    assert any("tok_embeddings" in n for n in names) and any("lm_head" in n for n in names)
