"""Matrix optimizers (Muon, Adafactor) never compute on a slice of a matrix in silence.

Before, ``torch.optim.Muon`` on row-sharded parameters trained without a word and drifted
from the unsharded run (it orthogonalizes each rank's slice), and ``torch.optim.Adafactor``
failed with a bare ZeroDivisionError. Now their first step refuses row-sharded parameters
on every rank, naming the parameter and the fix; with the matrices in NO_SHARD units
(whole on every rank) Muon trains exactly like the unsharded model.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

import flatshard
from flatshard.testing.jobs import shard_units
from flatshard.testing.models import build
from flatshard.testing.parity import batches, slice_batch
from flatshard.testing.workers import WorkerContext, WorkerPool

WORLD = 2


def _muon_and_adamw(model: nn.Module) -> list[torch.optim.Optimizer]:
    """Muon for the blocks' matrices, AdamW for the rest, as Muon is used."""
    matrices = [p for n, p in model.named_parameters() if n.startswith("blocks.") and p.dim() == 2]
    ids = {id(p) for p in matrices}
    rest = [p for p in model.parameters() if id(p) not in ids]
    return [torch.optim.Muon(matrices, lr=0.02), torch.optim.AdamW(rest, lr=1e-2)]


def _optimizers(kind: str, model: nn.Module) -> list[torch.optim.Optimizer]:
    if kind == "muon":
        return _muon_and_adamw(model)
    return [torch.optim.Adafactor(model.parameters(), lr=1e-2)]


def refused_job(ctx: WorkerContext, kind: str, strategy: str) -> str | None:
    group = ctx.group(WORLD)
    if group is None:
        return None
    model: Any = shard_units(build("gpt"), group, strategy)
    optimizers = _optimizers(kind, model)
    model.loss(slice_batch(next(batches(model, 1)), ctx.rank, WORLD)).backward()
    try:
        for optim in optimizers:
            optim.step()
    except RuntimeError as error:
        return str(error)
    return "no error"


@pytest.mark.parametrize("strategy", ["FULL_SHARD", "SHARD_GRAD_OP", "HYBRID_SHARD"])
@pytest.mark.parametrize("kind", ["muon", "adafactor"])
def test_a_matrix_optimizer_refuses_row_shards_on_every_rank(
    pool: WorkerPool, kind: str, strategy: str
) -> None:
    name, first, unit = {  # the first row-sharded parameter in the optimizer's order
        "muon": ("torch.optim.Muon", "'blocks.0.attn.qkv.weight' (48, 16)", "blocks.0"),
        "adafactor": ("torch.optim.Adafactor", "'tok.weight' (37, 16)", "<root>"),
    }[kind]
    for rank, message in enumerate(pool.run(refused_job, kind, strategy)[:WORLD]):
        assert message.startswith(
            f"flatshard: {name} updates each parameter as a whole matrix, but {first} is cut "
            f"into rows across 2 ranks (unit '{unit}', rank {rank})"
        ), message
        assert "strategy=flatshard.ShardingStrategy.NO_SHARD" in message


class MyShampoo(torch.optim.SGD):
    """A user's matrix optimizer, declared with register_matrix_optimizer."""


def declared_job(ctx: WorkerContext) -> str | None:
    group = ctx.group(WORLD)
    if group is None:
        return None
    flatshard.register_matrix_optimizer(MyShampoo)
    model: Any = shard_units(build("gpt"), group, "FULL_SHARD")
    optim = MyShampoo(model.parameters(), lr=0.1)
    model.loss(slice_batch(next(batches(model, 1)), ctx.rank, WORLD)).backward()
    try:
        optim.step()
    except RuntimeError as error:
        return str(error)
    return "no error"


def test_a_declared_matrix_optimizer_refuses_row_shards(pool: WorkerPool) -> None:
    for message in pool.run(declared_job)[:WORLD]:
        assert "test_matrix_optimizers.MyShampoo updates each parameter as a whole" in message
    not_a_class: Any = torch.optim.SGD(nn.Linear(1, 1).parameters())
    with pytest.raises(TypeError, match=r"expected a torch\.optim\.Optimizer subclass"):
        flatshard.register_matrix_optimizer(not_a_class)


def whole_matrices_job(ctx: WorkerContext) -> None:
    """Blocks NO_SHARD (whole matrices, Muon), the rest FULL_SHARD (AdamW), against the
    unsharded model on the global batch. Muon orthogonalizes in bfloat16, which turns the
    last-bit differences of a gradient averaged over ranks into visible ones; so the
    reference takes the matrices' averaged gradients from the sharded run (whole on every
    rank under NO_SHARD) and must then make the very same update."""
    group = ctx.group(WORLD)
    if group is None:
        return
    model: Any = build("gpt")
    for block in model.blocks:
        flatshard.fully_shard(block, strategy="NO_SHARD", process_group=group)
    flatshard.fully_shard(model, process_group=group)
    reference: Any = build("gpt")
    sharded, plain = _muon_and_adamw(model), _muon_and_adamw(reference)
    muon_pairs = list(
        zip(sharded[0].param_groups[0]["params"], plain[0].param_groups[0]["params"], strict=True)
    )
    for batch in batches(reference, 3):
        model.loss(slice_batch(batch, ctx.rank, WORLD)).backward()
        reference.loss(batch).backward()
        for mine, theirs in muon_pairs:
            torch.testing.assert_close(mine.grad, theirs.grad)  # the same up to the last bits
            theirs.grad.copy_(mine.grad)
        for optim in (*sharded, *plain):
            optim.step()
            optim.zero_grad()
    for mine, theirs in muon_pairs:
        assert torch.equal(mine, theirs)  # Muon saw whole matrices: the same updates
    with flatshard.summon_full_params(model):
        for (name, p), q in zip(model.named_parameters(), reference.parameters(), strict=True):
            torch.testing.assert_close(p, q, rtol=1e-5, atol=1e-6, msg=name)


def test_muon_on_whole_matrices_makes_the_unsharded_update(pool: WorkerPool) -> None:
    pool.run(whole_matrices_job)


# ---------------------------------------------------------------- placement=Whole()
class ExpertBlock(nn.Module):
    """An attention-like mixing matrix, a router and a 3-D expert weight (top-1 per token:
    routing depends on the token alone, so DDP's semantics hold per rank)."""

    def __init__(self, dim: int = 8, experts: int = 3) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(dim)
        self.mix = nn.Linear(dim, dim, bias=False)
        self.router = nn.Linear(dim, experts, bias=False)
        self.experts = nn.Parameter(torch.randn(experts, dim, dim) / dim**0.5)  # (E, D, D)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # (B, T, D)
        h = torch.tanh(self.mix(self.norm(x)))
        gate = torch.softmax(self.router(h), dim=-1)  # (B, T, E)
        top = torch.nn.functional.one_hot(gate.argmax(-1), gate.shape[-1]) * gate
        out = torch.einsum("bte,btd,edf->btf", top, h, self.experts)
        return x + out


class ExpertLM(nn.Module):
    """Tied embedding and head, ExpertBlocks as units."""

    UNIT_CLASSES = frozenset({ExpertBlock})

    def __init__(self, vocab: int = 23, dim: int = 8, layers: int = 3) -> None:
        super().__init__()
        self.vocab = vocab
        self.tok = nn.Embedding(vocab, dim)
        self.blocks = nn.ModuleList([ExpertBlock(dim) for _ in range(layers)])
        self.norm = nn.LayerNorm(dim)
        self.head = nn.Linear(dim, vocab, bias=False)
        self.head.weight = self.tok.weight

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        x = self.tok(idx)
        for block in self.blocks:
            x = block(x)
        out: torch.Tensor = self.head(self.norm(x))
        return out

    def make_batch(self, gen: torch.Generator, batch_size: int) -> tuple[torch.Tensor, ...]:
        idx = torch.randint(0, self.vocab, (batch_size, 7), generator=gen)
        return idx[:, :-1], idx[:, 1:]

    def loss(self, batch: tuple[torch.Tensor, ...]) -> torch.Tensor:
        x, y = batch
        out = nn.functional.cross_entropy(self(x).flatten(0, 1), y.flatten())
        return out


def _matrix_optimizers(kind: str, model: nn.Module) -> list[torch.optim.Optimizer]:
    """Muon for the blocks' 2-D matrices and AdamW for the rest (embedding, norms, the 3-D
    experts), in one optimizer setup as Muon is used; or Adafactor for everything."""
    if kind == "adafactor":
        return [torch.optim.Adafactor(model.parameters(), lr=1e-2)]
    matrices = [p for n, p in model.named_parameters() if n.startswith("blocks.") and p.dim() == 2]
    ids = {id(p) for p in matrices}
    rest = [p for p in model.parameters() if id(p) not in ids]
    return [torch.optim.Muon(matrices, lr=0.02), torch.optim.AdamW(rest, lr=1e-2)]


def _muon_matrices(name: str, param: nn.Parameter) -> bool:
    """Whole() for Muon + AdamW: only Muon's matrices whole, the rest row-sharded."""
    return name.startswith("blocks.") and param.dim() == 2


def _whole_model(
    group: Any, strategy: str, precision: str, offload: bool, only_muons: bool = False
) -> Any:
    torch.manual_seed(0)
    model = ExpertLM()
    whole: Any = flatshard.Whole()
    if only_muons:
        whole = lambda name, p: flatshard.Whole() if _muon_matrices(name, p) else None  # noqa: E731
    options: dict[str, Any] = {"strategy": strategy, "placement": whole}
    if strategy.startswith("HYBRID"):
        options["sharding_factor"] = 2
    if precision == "bf16":
        options["mixed_precision"] = flatshard.MixedPrecision(param_dtype=torch.bfloat16)
    if offload:
        options["cpu_offload"] = flatshard.CPUOffload()
    return flatshard.fully_shard(
        model, auto_wrap_policy=set(ExpertLM.UNIT_CLASSES), process_group=group, **options
    )


def _full_grad(param: nn.Parameter, shape: torch.Size, group: Any, factor: int) -> torch.Tensor:
    """The whole gradient of ``param``: the rows of the first shard group's F ranks, in rank
    order (a whole parameter's owner holds all of them, the others none)."""
    empty = torch.zeros((0, *shape[1:]) if len(shape) else (0,))
    mine = param.grad.detach() if param.grad is not None else empty
    every: list[Any] = [None] * torch.distributed.get_world_size(group)
    torch.distributed.all_gather_object(every, mine, group=group)
    full = torch.cat([g.reshape(-1) for g in every[:factor]]).view(shape)
    return full


def whole_params_job(
    ctx: WorkerContext, world: int, cases: list[tuple[str, str, str, bool, int, bool]]
) -> None:
    """Each case against the unsharded model under DDP's semantics (each rank's batch,
    gradients averaged): gradients close, then, given the same gradient, bitwise the same
    parameters after every step (the optimizer made the unsharded update on each whole
    parameter). Clipped by torch's own clip_grad_norm_."""
    group = ctx.group(world)
    if group is None:
        return
    for kind, strategy, precision, offload, accumulate, only_muons in cases:
        label = f"{kind} {strategy} {precision} offload={offload} accumulate={accumulate}"
        model = _whole_model(group, strategy, precision, offload, only_muons)
        if only_muons:  # Muon's matrices whole on one rank, the embedding cut into rows
            assert sum(p.numel() == 0 for p in model.parameters() if p.dim() == 2) > 0
            assert 0 < model.tok.weight.shape[0] < 23
        torch.manual_seed(0)
        reference = ExpertLM()
        sharded, plain = _matrix_optimizers(kind, model), _matrix_optimizers(kind, reference)
        names = [n for n, _ in reference.named_parameters()]
        for batch in batches(reference, 3):
            for micro in range(accumulate):
                part = slice_batch(batch, micro, accumulate)
                mine = slice_batch(part, ctx.rank, world)
                if micro < accumulate - 1:
                    with flatshard.no_sync(model):
                        (model.loss(mine) / accumulate).backward()
                else:
                    (model.loss(mine) / accumulate).backward()
                for r in range(world):
                    (reference.loss(slice_batch(part, r, world)) / (world * accumulate)).backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 0.5)
            torch.nn.utils.clip_grad_norm_(reference.parameters(), 0.5)
            for name, p, q in zip(names, model.parameters(), reference.parameters(), strict=True):
                assert q.grad is not None
                factor = 2 if strategy.startswith("HYBRID") else world
                full = _full_grad(p, q.shape, group, factor)
                tol = 2e-2 if precision == "bf16" else 1e-5
                torch.testing.assert_close(full, q.grad, rtol=tol, atol=tol, msg=f"{label} {name}")
                q.grad.copy_(full)
            for optim in (*sharded, *plain):
                optim.step()
                optim.zero_grad()
            with flatshard.summon_full_params(model):
                for name, p, q in zip(
                    names, model.parameters(), reference.parameters(), strict=True
                ):
                    assert torch.equal(p.detach(), q.detach()), f"{label}: {name}"


# (optimizer, strategy, precision, CPU offload, micro-batches, only Muon's matrices whole)
WHOLE_CASES = {
    2: [
        ("muon", "FULL_SHARD", "fp32", False, 1, False),
        ("muon", "FULL_SHARD", "fp32", False, 1, True),
        ("adafactor", "FULL_SHARD", "fp32", False, 1, False),
        ("muon", "SHARD_GRAD_OP", "bf16", False, 1, True),
        ("adafactor", "FULL_SHARD", "fp32", True, 2, False),
    ],
    3: [
        ("muon", "SHARD_GRAD_OP", "fp32", False, 1, True),
        ("adafactor", "FULL_SHARD", "bf16", False, 1, False),
    ],
    4: [
        ("muon", "HYBRID_SHARD", "fp32", False, 2, True),
        ("adafactor", "HYBRID_SHARD", "fp32", False, 1, False),
        ("muon", "FULL_SHARD", "fp32", True, 1, False),
    ],
}


@pytest.mark.parametrize("world", [2, 3, 4])
def test_whole_params_make_matrix_optimizers_exact(pool: WorkerPool, world: int) -> None:
    pool.run(whole_params_job, world, WHOLE_CASES[world])


def _step(model: Any, optimizers: list[torch.optim.Optimizer], batch: Any, group: Any) -> float:
    """One step on this rank's slice; the loss averaged over the ranks (the global one)."""
    world = torch.distributed.get_world_size(group)
    loss = model.loss(slice_batch(batch, torch.distributed.get_rank(group), world))
    loss.backward()
    for optim in optimizers:
        optim.step()
        optim.zero_grad()
    mean = loss.detach().clone() / world
    torch.distributed.all_reduce(mean, group=group)
    return float(mean)


def _full_states(model: Any, optimizers: list[torch.optim.Optimizer]) -> list[Any]:
    return [flatshard.full_optim_state_dict(model, optim) for optim in optimizers]


def save_whole_job(ctx: WorkerContext, kind: str, path: str) -> dict[str, Any] | None:
    """At 4 ranks: 2 steps, a checkpoint, the full optimizer state then, 2 more steps."""
    group = ctx.group(4)
    if group is None:
        return None
    model = _whole_model(group, "FULL_SHARD", "fp32", False, only_muons=kind == "muon")
    optimizers = _matrix_optimizers(kind, model)
    steps = list(batches(model, 4))
    for batch in steps[:2]:
        _step(model, optimizers, batch, group)
    flatshard.save_checkpoint(path, model, optimizers, extra={"step": 2})  # Muon + AdamW
    states = _full_states(model, optimizers)
    losses = [_step(model, optimizers, batch, group) for batch in steps[2:]]
    return {"states": states, "losses": losses}


def resume_whole_job(ctx: WorkerContext, kind: str, path: str) -> dict[str, Any] | None:
    """At 2 ranks: load, the full optimizer state, a fresh optimizer loaded from rank 0's
    full dict, and the next 2 steps."""
    group = ctx.group(2)
    if group is None:
        return None
    model = _whole_model(group, "FULL_SHARD", "fp32", False, only_muons=kind == "muon")
    optimizers = _matrix_optimizers(kind, model)
    assert flatshard.load_checkpoint(path, model, optimizers) == {"step": 2}
    states = _full_states(model, optimizers)
    fresh = _matrix_optimizers(kind, model)
    for optim, full in zip(fresh, states, strict=True):
        flatshard.load_optim_state_dict(
            model, optim, full if ctx.rank == 0 else {}, from_rank0=True
        )
    again = _full_states(model, fresh)
    steps = list(batches(model, 4))
    losses = [_step(model, fresh, batch, group) for batch in steps[2:]]
    return {"states": states, "again": again, "losses": losses}


def _assert_states_equal(expected: Any, actual: Any) -> None:
    assert expected["param_groups"] == actual["param_groups"]
    assert expected["state"].keys() == actual["state"].keys()
    for name, values in expected["state"].items():
        assert values.keys() == actual["state"][name].keys(), name
        for key, value in values.items():
            found = actual["state"][name][key]
            assert torch.equal(torch.as_tensor(value), torch.as_tensor(found)), (name, key)


@pytest.mark.parametrize("kind", ["muon", "adafactor"])
def test_whole_params_checkpoint_at_4_ranks_resumes_at_2(
    pool: WorkerPool, tmp_path: Path, kind: str
) -> None:
    path = str(tmp_path / "ckpt")
    saved = pool.run(save_whole_job, kind, path)[0]
    resumed = pool.run(resume_whole_job, kind, path)[0]
    assert len(saved["states"]) == len(resumed["states"])
    for expected, actual, again in zip(
        saved["states"], resumed["states"], resumed["again"], strict=True
    ):
        assert expected["state"], "the optimizer held state"
        _assert_states_equal(expected, actual)  # resharded from 4 owners to 2, exactly
        _assert_states_equal(expected, again)  # and through a full dict from rank 0
    torch.testing.assert_close(resumed["losses"], saved["losses"], rtol=1e-5, atol=0)


def test_a_checkpoint_of_several_optimizers_names_what_does_not_fit(tmp_path: Path) -> None:
    model = nn.Sequential(nn.Linear(3, 3), nn.Linear(3, 1))
    first = torch.optim.SGD(model[0].parameters(), lr=0.1)
    both = torch.optim.SGD(model.parameters(), lr=0.1)
    with pytest.raises(flatshard.CheckpointError, match=r"optimizers 0 and 1 both hold \['0\."):
        flatshard.save_checkpoint(tmp_path / "overlap", model, [first, both])
    second = torch.optim.SGD(model[1].parameters(), lr=0.1)
    flatshard.save_checkpoint(tmp_path / "two", model, [first, second])
    with pytest.raises(flatshard.CheckpointError, match=r"state of 2 optimizer\(s\), 1 were"):
        flatshard.load_checkpoint(tmp_path / "two", model, first)
    flatshard.load_checkpoint(tmp_path / "two", model, [first, second])
