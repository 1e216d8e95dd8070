"""The placement conformance matrix: every placement through every path a user reaches.

Rows: the placements. Every concrete ``ShardPlacement`` subclass is found from the protocol
(``test_every_placement_has_a_case`` fails for one without a case here), and layouts made
by options join them (``Rows`` with a gather dtype). Columns: ``PATHS``, every one a
function ``path(model, reference, ctx)`` run on a freshly sharded model beside its
unsharded reference. A cell is exact against the reference (DDP's semantics: each rank
trains on its own batch, the gradients averaged), or a named error on every rank listed in
``REFUSED``; anything else fails: a mismatch, an error on one rank, an unnamed error, or a
named one nobody listed.

The model holds what each placement serves: an embedding table (row-sparse), matrices and
vectors (rows, whole, quantized), a mixture of experts called as torchtitan's is (expert
slices) and a head bias (left alone, trained by each rank on its own batch). The
tensor-parallel row runs at 4 ranks (dp 2 x tp 2), the blocks' ``fc`` column-parallel: the
data-parallel ranks are the reference's replicas, and the TP ranks beside one see its batch.
"""

from __future__ import annotations

import os
import tempfile
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.tensor import Replicate
from torch.distributed.tensor.parallel import ColwiseParallel, parallelize_module

import flatshard
from flatshard import ShardPlacement
from flatshard.models.moe import MoELayer
from flatshard.testing.parity import quantized_by_formula
from flatshard.testing.workers import WorkerContext, WorkerPool

WORLD = 2  # data-parallel ranks: the reference's replicas
TP = 2  # tensor-parallel ranks beside each, in the tensor-parallel row
STEPS = 2
VOCAB, DIM, OUT = 11, 8, 5
RTOL, ATOL = 1e-5, 1e-6
Batch = tuple[torch.Tensor, torch.Tensor]
Rule = Callable[[str, nn.Parameter], ShardPlacement | None]


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(DIM, DIM)
        self.norm = nn.LayerNorm(DIM)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + F.gelu(self.norm(self.fc(x)))


class Zoo(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.tok = nn.Embedding(VOCAB, DIM)
        self.blocks = nn.ModuleList([Block(), Block()])
        self.moe = MoELayer(experts=4, dim=DIM, hidden=6, top_k=2)
        self.head = nn.Linear(DIM, OUT)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        h = self.tok(ids)
        for block in self.blocks:
            h = block(h)
        h = h + self.moe(h)
        out: torch.Tensor = self.head(h)
        return out


@dataclass(frozen=True)
class Case:
    """A placement given to some of the model's parameters (the rest: ``Rows()``)."""

    kind: type[ShardPlacement]
    rule: Rule
    quantized: torch.dtype | None = None  # the matrices of the blocks travel so
    own: tuple[str, ...] = ()  # parameters each rank trains on its own batch alone
    tensor_parallel: bool = False  # the blocks' fc column-parallel over TP ranks beside


def _blocks_matrix(name: str, p: nn.Parameter) -> bool:
    return name.startswith("blocks.") and p.ndim == 2


CASES: dict[str, Case] = {
    "Rows": Case(flatshard.Rows, lambda n, p: flatshard.Rows()),
    "Rows-int8": Case(
        flatshard.Rows,
        lambda n, p: flatshard.Rows(gather_dtype=torch.int8) if _blocks_matrix(n, p) else None,
        quantized=torch.int8,
    ),
    "Whole": Case(flatshard.Whole, lambda n, p: flatshard.Whole() if p.ndim == 2 else None),
    "RowSparse": Case(
        flatshard.RowSparse, lambda n, p: flatshard.RowSparse() if n == "tok.weight" else None
    ),
    "Experts": Case(
        flatshard.Experts, lambda n, p: flatshard.Experts(2) if ".experts." in n else None
    ),
    "Rows-TP": Case(flatshard.Rows, lambda n, p: None, tensor_parallel=True),
    "Unmanaged": Case(
        flatshard.Unmanaged,
        lambda n, p: flatshard.Unmanaged() if n == "head.bias" else None,
        own=("head.bias",),
    ),
}

# (case, path) -> the words of the named refusal every rank raises there.
REFUSED: dict[tuple[str, str], str] = {
    # Inside summon_full_params a tensor-parallel parameter is this rank's part, which its
    # layers read as a DTensor: a plain state dict or forward there would see parts.
    ("Rows-TP", "summon_state_dict"): "tensor-parallel part",
    ("Rows-TP", "summon_load_state_dict"): "tensor-parallel part",
    ("Rows-TP", "summon_decode"): "ran forward inside summon_full_params",
}


def _tensor_parallel(name: str) -> bool:
    return name.startswith("blocks.") and ".fc." in name


def _placement_classes() -> set[type[ShardPlacement]]:
    found: set[type[ShardPlacement]] = set()
    todo = [ShardPlacement]
    while todo:
        for sub in todo.pop().__subclasses__():
            todo.append(sub)
            if sub.__module__.startswith("flatshard."):
                found.add(sub)
    return found


def test_every_placement_has_a_case() -> None:
    """The matrix's rows come from the protocol: a placement added without a case fails."""
    covered = {case.kind for case in CASES.values()}
    missing = sorted(c.__name__ for c in _placement_classes() - covered)
    assert not missing, f"placements without a conformance case: {missing}; add them to CASES"


# ---------------------------------------------------------------------- the reference
def _batch(step: int, rank: int) -> Batch:
    gen = torch.Generator().manual_seed(1000 * step + rank)
    return torch.randint(0, VOCAB, (3, 4), generator=gen), torch.randint(
        0, OUT, (3, 4), generator=gen
    )


def _loss(model: nn.Module, batch: Batch) -> torch.Tensor:
    return F.cross_entropy(model(batch[0]).reshape(-1, OUT), batch[1].reshape(-1))


def _zoo() -> Zoo:
    torch.manual_seed(0)
    return Zoo()


@contextmanager
def _as_gathered(model: nn.Module, case: Case) -> Iterator[None]:
    """The reference's block matrices as a quantized gather delivers them, while inside."""
    if case.quantized is None:
        yield
        return
    masters = [(p, p.data) for n, p in model.named_parameters() if _blocks_matrix(n, p)]
    for param, data in masters:
        param.data = quantized_by_formula(data, case.quantized)
    try:
        yield
    finally:
        for param, data in masters:
            param.data = data


class Reference:
    """The unsharded model, stepped as DDP would step it from every rank's batch: one
    replica per rank (they differ only in the parameters each rank trains alone)."""

    def __init__(self, case: Case, rank: int) -> None:
        self.case, self.rank = case, rank
        self.replicas = [_zoo() for _ in range(WORLD)]
        self.optims = [torch.optim.AdamW(r.parameters(), lr=1e-2, eps=1e-3) for r in self.replicas]

    @property
    def model(self) -> Zoo:
        return self.replicas[self.rank]

    def grads(self, step: int, micro: int = 1, average_own: bool = False) -> None:
        names = [n for n, _ in self.model.named_parameters()]
        every = []
        for rank, replica in enumerate(self.replicas):
            params = list(replica.parameters())
            total = [torch.zeros_like(p) for p in params]
            for m in range(micro):
                with _as_gathered(replica, self.case):
                    loss = _loss(replica, _batch(step * micro + m, rank))
                    got = torch.autograd.grad(loss, params, allow_unused=True)
                for t, g in zip(total, got, strict=True):
                    if g is not None:
                        t.add_(g)
            every.append(total)
        for i, name in enumerate(names):
            average = sum(g[i] for g in every) / WORLD
            for rank, replica in enumerate(self.replicas):
                param = replica.get_parameter(name)
                own = name in self.case.own and not average_own
                param.grad = every[rank][i].clone() if own else average.clone()

    def step(self, step: int, micro: int = 1, clip: float | None = None) -> float | None:
        self.grads(step, micro, average_own=clip is not None)
        norms = []
        for replica, optim in zip(self.replicas, self.optims, strict=True):
            if clip is not None:
                norms.append(float(torch.nn.utils.clip_grad_norm_(replica.parameters(), clip)))
            optim.step()
            optim.zero_grad()
        return norms[self.rank] if norms else None

    def state(self) -> dict[str, torch.Tensor]:
        return {k: v.detach().clone() for k, v in self.model.state_dict().items()}


def _shard(
    case: Case, group: dist.ProcessGroup, tp: DeviceMesh | None = None
) -> tuple[Zoo, torch.optim.Optimizer]:
    model = _zoo()
    if case.tensor_parallel:
        assert tp is not None
        for block in model.blocks:
            parallelize_module(block, tp, {"fc": ColwiseParallel(output_layouts=Replicate())})
    model = flatshard.fully_shard(
        model, auto_wrap_policy={Block, MoELayer}, process_group=group, placement=case.rule
    )
    return model, torch.optim.AdamW(model.parameters(), lr=1e-2, eps=1e-3)


def _sharded(run: Run) -> tuple[Zoo, torch.optim.Optimizer]:
    return _shard(run.case, run.group, run.tp)


def _same(expected: dict[str, torch.Tensor], actual: dict[str, torch.Tensor], what: str) -> None:
    assert sorted(expected) == sorted(actual), f"{what}: keys {sorted(actual)}"
    for key, want in expected.items():
        got = actual[key]
        assert got.shape == want.shape, (
            f"{what}: '{key}' shape {tuple(got.shape)} of {tuple(want.shape)}"
        )
        torch.testing.assert_close(
            got.float(), want.float(), rtol=RTOL, atol=ATOL, msg=f"{what}: '{key}'"
        )


def _full(model: nn.Module) -> dict[str, torch.Tensor]:
    return flatshard.full_state_dict(model, rank0_only=False)


def _train(model: nn.Module, optim: torch.optim.Optimizer, ref: Reference, rank: int) -> None:
    for step in range(STEPS):
        _loss(model, _batch(step, rank)).backward()
        optim.step()
        optim.zero_grad()
        ref.step(step)


# ---------------------------------------------------------------------- the paths
@dataclass
class Run:
    case: Case
    rank: int  # among the data-parallel ranks: the reference replica and batches it has
    group: dist.ProcessGroup  # the data-parallel ranks
    tmp: str
    tp: DeviceMesh | None = None  # the TP ranks beside (the tensor-parallel row)

    def summoned(self, name: str, full: torch.Tensor) -> torch.Tensor:
        """What ``name`` holds inside summon_full_params: the whole tensor, or this rank's
        part of a tensor-parallel one (its layers read it as a DTensor there)."""
        if self.tp is None or not _tensor_parallel(name):
            return full
        return full.chunk(TP, dim=0)[self.tp.get_local_rank()]  # column-parallel: dim 0


def _trained(run: Run) -> tuple[Zoo, torch.optim.Optimizer, Reference]:
    """A sharded model and its reference, both trained ``STEPS`` steps."""
    model, optim = _sharded(run)
    ref = Reference(run.case, run.rank)
    _train(model, optim, ref, run.rank)
    return model, optim, ref


def path_train(run: Run) -> None:
    model, _, ref = _trained(run)
    _same(ref.state(), _full(model), "after training")


def path_accumulate(run: Run) -> None:
    model, optim = _sharded(run)
    ref = Reference(run.case, run.rank)
    for step in range(STEPS):
        with flatshard.no_sync(model):
            _loss(model, _batch(2 * step, run.rank)).backward()
        _loss(model, _batch(2 * step + 1, run.rank)).backward()  # the sum, reduced once
        optim.step()
        optim.zero_grad()
        ref.step(step, micro=2)
    _same(ref.state(), _full(model), "after accumulation")


def _clip_path(run: Run, clip: Callable[[nn.Module], torch.Tensor]) -> None:
    model, optim = _sharded(run)
    ref = Reference(run.case, run.rank)
    for step in range(STEPS):
        _loss(model, _batch(step, run.rank)).backward()
        for name in run.case.own:  # a rank's own gradient: averaged by hand, as documented,
            grad = model.get_parameter(name).grad  # or each rank's norm would differ
            assert grad is not None
            dist.all_reduce(grad, group=run.group)
            grad.div_(WORLD)
        norm = float(clip(model))
        optim.step()
        optim.zero_grad()
        want = ref.step(step, clip=0.05)
        assert want is not None and abs(norm - want) <= 1e-5 * max(1.0, want), (
            f"norm {norm} != {want}"
        )
    _same(ref.state(), _full(model), "after clipped steps")


def path_clip_flatshard(run: Run) -> None:
    _clip_path(run, lambda m: flatshard.clip_grad_norm_(m, 0.05))


def path_clip_torch(run: Run) -> None:
    _clip_path(run, lambda m: torch.nn.utils.clip_grad_norm_(m.parameters(), 0.05))


def path_unshard_held(run: Run) -> None:
    model, optim = _sharded(run)
    ref = Reference(run.case, run.rank)
    units = [model, *model.blocks, model.moe]
    for unit in units:
        flatshard.unshard(unit)
    _train(model, optim, ref, run.rank)
    for unit in units:
        flatshard.reshard(unit)
    _same(ref.state(), _full(model), "with units held gathered")


def path_summon_read(run: Run) -> None:
    model, _, ref = _trained(run)
    with flatshard.summon_full_params(model):
        got = {n: p.detach().clone() for n, p in model.named_parameters()}
    want = {n: run.summoned(n, p.detach()) for n, p in ref.model.named_parameters()}
    _same(want, got, "inside summon")


def path_summon_writeback(run: Run) -> None:
    model, _ = _sharded(run)
    ref = Reference(run.case, run.rank)
    with flatshard.summon_full_params(model), torch.no_grad():
        for p in model.parameters():
            p.add_(1.0)
    with torch.no_grad():
        for replica in ref.replicas:
            for p in replica.parameters():
                p.add_(1.0)
    _same(ref.state(), _full(model), "after a write inside summon")


def path_summon_state_dict(run: Run) -> None:
    model, _, ref = _trained(run)
    with flatshard.summon_full_params(model):
        got = {k: v.detach().clone() for k, v in model.state_dict().items()}
    _same(ref.state(), got, "state_dict() inside summon")


def path_summon_load_state_dict(run: Run) -> None:
    model, _ = _sharded(run)
    ref = Reference(run.case, run.rank)
    ref.step(0)
    with flatshard.summon_full_params(model):
        model.load_state_dict(ref.state())
    _same(ref.state(), _full(model), "after load_state_dict() inside summon")


def path_summon_decode(run: Run) -> None:
    model, _, ref = _trained(run)
    ids = _batch(99, run.rank)[0]
    with flatshard.summon_full_params(model), torch.no_grad():
        got = model(ids)
    with torch.no_grad(), _as_gathered(ref.model, run.case):
        want = ref.model(ids)
    if run.case.quantized is not None:  # summon holds the master weights, unquantized
        with torch.no_grad():
            want = ref.model(ids)
    torch.testing.assert_close(got, want, rtol=RTOL, atol=ATOL)


def path_sharded_state_dict(run: Run) -> None:
    model, _, ref = _trained(run)
    saved = {k: v for k, v in flatshard.sharded_state_dict(model).items()}
    fresh, _ = _sharded(run)
    flatshard.load_state_dict(fresh, saved)
    _same(ref.state(), _full(fresh), "a sharded state dict loaded")


def path_full_state_dicts(run: Run) -> None:
    """Full model and optimizer state dicts, and a sharded optimizer state dict, loaded
    into fresh models: the same parameters, and the next step the reference's."""
    model, optim, ref = _trained(run)
    full = _full(model)
    full_optim = flatshard.full_optim_state_dict(model, optim, rank0_only=False)
    sharded_optim = flatshard.sharded_optim_state_dict(model, optim)
    fresh, fresh_optim = _sharded(run)
    flatshard.load_state_dict(fresh, full)
    _same(ref.state(), _full(fresh), "a full state dict loaded")
    flatshard.load_optim_state_dict(fresh, fresh_optim, full_optim)
    again, again_optim = _sharded(run)
    flatshard.load_state_dict(again, flatshard.sharded_state_dict(model))
    flatshard.load_optim_state_dict(again, again_optim, sharded_optim)
    for trained, its_optim in ((fresh, fresh_optim), (again, again_optim)):
        _loss(trained, _batch(STEPS, run.rank)).backward()
        its_optim.step()
        its_optim.zero_grad()
    ref.step(STEPS)
    _same(ref.state(), _full(fresh), "a step after full state dicts loaded")
    _same(ref.state(), _full(again), "a step after a sharded optimizer state dict loaded")


def _checkpoint(run: Run, async_op: bool) -> None:
    model, optim, ref = _trained(run)
    path = os.path.join(run.tmp, f"ckpt-{async_op}")
    if async_op:
        flatshard.save_checkpoint(path, model, optim, async_op=True).wait()
    else:
        flatshard.save_checkpoint(path, model, optim)
    # loaded at another layout: every parameter in rows, then one more step on both
    other, other_optim = _shard(CASES["Rows"], run.group)
    flatshard.load_checkpoint(path, other, other_optim)
    plain = _zoo()
    flatshard.load_checkpoint(path, plain)  # and unsharded, with no group
    expected = ref.state()
    if run.case.own:  # a parameter left alone is this rank's own, saved as rank 0's
        theirs = [None] * WORLD
        dist.all_gather_object(theirs, {k: expected[k] for k in run.case.own}, group=run.group)
        expected.update(theirs[0])  # type: ignore[arg-type]
    _same(expected, _full(other), "a checkpoint loaded in rows")
    _same(expected, {k: v.detach() for k, v in plain.state_dict().items()}, "unsharded")


def path_checkpoint(run: Run) -> None:
    _checkpoint(run, async_op=False)


def path_async_checkpoint(run: Run) -> None:
    _checkpoint(run, async_op=True)


def path_export_safetensors(run: Run) -> None:
    from safetensors.torch import load_file

    model, _, ref = _trained(run)
    out = os.path.join(run.tmp, "export")
    files = flatshard.export_safetensors(model, out)
    dist.barrier(group=run.group)
    if dist.get_rank(run.group) != 0:
        return
    got: dict[str, torch.Tensor] = {}
    for name in files or sorted(f for f in os.listdir(out) if f.endswith(".safetensors")):
        got.update(load_file(os.path.join(out, os.path.basename(name))))
    _same(ref.state(), got, "exported safetensors")


def path_non_finite(run: Run) -> None:
    """A NaN in one weight of every placement's parameters shows in the loss on every
    rank, as it does in the unsharded model."""
    model, _ = _sharded(run)
    ref = Reference(run.case, run.rank)
    targets = [n for n, p in model.named_parameters() if run.case.rule(n, p) is not None]
    with flatshard.summon_full_params(model), torch.no_grad():
        for name in targets or ["blocks.0.fc.weight"]:
            model.get_parameter(name).view(-1)[0] = float("nan")
    with torch.no_grad():
        for name in targets or ["blocks.0.fc.weight"]:
            ref.model.get_parameter(name).view(-1)[0] = float("nan")  # this rank's replica
    batch = _batch(0, run.rank)
    got = _loss(model, batch)
    with _as_gathered(ref.model, run.case):
        want = _loss(ref.model, batch)
    assert got.isnan() == want.isnan(), (
        f"loss {got.item()} where the unsharded model gives {want.item()}"
    )
    got.backward()


PATHS: dict[str, Callable[[Run], None]] = {
    name.removeprefix("path_"): fn
    for name, fn in dict(globals()).items()
    if name.startswith("path_")
}


# ---------------------------------------------------------------------- the matrix
def matrix_job(ctx: WorkerContext, case_name: str) -> dict[str, str]:
    """Every path of one case on this rank: path -> "exact", or the error."""
    case = CASES[case_name]
    world = WORLD * (TP if case.tensor_parallel else 1)
    everyone = ctx.group(world)
    if everyone is None:
        return {}
    group, rank, tp = everyone, ctx.rank, None
    if case.tensor_parallel:
        mesh = init_device_mesh("cpu", (WORLD, TP), mesh_dim_names=("dp", "tp"))
        group, rank, tp = mesh["dp"].get_group(), mesh["dp"].get_local_rank(), mesh["tp"]
    flatshard.set_checks(flatshard.Checks(timeout=20.0))
    outcomes: dict[str, str] = {}
    with tempfile.TemporaryDirectory() as mine:
        holder = [mine]
        dist.broadcast_object_list(holder, src=0, group=everyone)  # rank 0's folder for all
        for path, fn in PATHS.items():
            try:
                fn(Run(case, rank, group, os.path.join(holder[0], path), tp))
                outcomes[path] = "exact"
            except AssertionError as error:
                outcomes[path] = f"mismatch: {error}"
            except Exception as error:
                named = str(error).startswith("flatshard") or isinstance(
                    error, flatshard.CollectiveError
                )
                outcomes[path] = f"{'named' if named else 'error'}: {type(error).__name__}: {error}"
            dist.barrier(group=everyone)
    return outcomes


_RESULTS: dict[str, list[dict[str, str]]] = {}


def _outcomes(pool: WorkerPool, case: str) -> list[dict[str, str]]:
    if case not in _RESULTS:
        world = WORLD * (TP if CASES[case].tensor_parallel else 1)
        _RESULTS[case] = pool.run(matrix_job, case)[:world]
    return _RESULTS[case]


@pytest.mark.parametrize("path", sorted(PATHS))
@pytest.mark.parametrize("case", sorted(CASES))
def test_conformance(pool: WorkerPool, case: str, path: str) -> None:
    outcomes = [o[path] for o in _outcomes(pool, case)]
    refusal = REFUSED.get((case, path))
    for rank, outcome in enumerate(outcomes):
        if refusal is None:
            assert outcome == "exact", f"{case} x {path}, rank {rank}: {outcome}"
        else:
            assert outcome.startswith("named") and refusal in outcome, (
                f"{case} x {path}, rank {rank}: expected the refusal '{refusal}', got {outcome}"
            )
