"""Features combined, against DDP's semantics, and targeted cases where features meet.

The sweep: every strategy x accumulation form x optimizer x clipping (every pair of the
last three), at 2 and 4 ranks.
Each rank trains on its own batch. The reference, in each rank's process, is the same
model unsharded (same seed) trained on every rank's batch: each rank's (micro-batch)
losses backpropagated separately and the gradients averaged over the ranks (the sum over
r of grad(loss_r) / W), with the same optimizer, clipping and 3 steps. Every combination
must either match it within fp32 tolerance, or raise on every rank an error whose message
starts with "flatshard" (a named refusal): never a hang, an abort, an error on one rank
only, or a silent mismatch.

All combinations of one (world size, strategy) run in one pool job (each builds and drops
its own model and optimizer), so that the sweep costs 8 jobs. After each combination the
ranks compare what became of it over a group of their own: a combination that ended
differently on different ranks, or in a collective error, may leave the model's group with
collectives in flight, so the job stops there and the test goes on from the next
combination with a fresh pool (a rank that dies is reported against its combination).
"""

from __future__ import annotations

import json
import math
from collections.abc import Iterator
from contextlib import AbstractContextManager, contextmanager, nullcontext
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

import flatshard
from flatshard.testing.workers import JobFailed, WorkerContext, WorkerPool

Batch = tuple[torch.Tensor, torch.Tensor]
# kind (exact, mismatch, error, died, not run; "no error" or "norm" in targeted jobs), detail;
# errors also: named (message starts with "flatshard"), collective, flatshard_class.
Outcome = dict[str, Any]

STEPS = 3
PER_MICRO = 2  # samples per rank and micro-batch
RTOL, ATOL = 1e-5, 1e-6  # exact combinations differ by ~1e-7 (summation order)
LR = 1e-2  # AdamW
SGD_LR = 0.05  # the hand-written loop
# eps well above fp32 noise: a gradient element that nearly cancels would otherwise take a
# full-size step whose sign depends on the summation order (which differs between any two
# reductions): see make_optimizer in flatshard.testing.parity.
EPS = 1e-3
MAX_NORM = 0.5
TIMEOUT_S = 10.0  # flatshard.Checks in the sweep: a hang is reported within seconds

# Loop variant -> micro-batches per step.
VARIANTS: dict[str, int] = {
    "plain": 1,
    "no_sync": 2,
    "switch_sync": 2,
    "keep_gathered": 2,
    "all_reduce_last": 2,
    "unshard_held": 2,
    "forward_without_backward": 1,
}
OPTIMIZERS = ("adamw_foreach", "adamw_fused", "plain_loop")
CLIPS = ("none", "flatshard", "torch")
# Every pair of (variant, optimizer), (variant, clip) and (optimizer, clip), 21 per job
# instead of all 63 (a third of the time): each silent result found so far came from a pair.
COMBINATIONS = [
    (v, o, CLIPS[(i + k) % len(CLIPS)])
    for k, v in enumerate(VARIANTS)
    for i, o in enumerate(OPTIMIZERS)
]
STRATEGIES = ("FULL_SHARD", "SHARD_GRAD_OP", "HYBRID_SHARD", "HYBRID_SHARD_OPTIM")


# ---------------------------------------------------------------- model, data, optimizers
class Block(nn.Module):
    def __init__(self, dim: int) -> None:
        super().__init__()
        self.fc = nn.Linear(dim, dim)
        self.norm = nn.LayerNorm(dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + F.gelu(self.norm(self.fc(x)))


class Net(nn.Module):
    """Two Block units and a root holding the input and head layers; odd sizes, so that
    no parameter divides the world size."""

    def __init__(self) -> None:
        super().__init__()
        self.inp = nn.Linear(6, 9)
        self.blocks = nn.Sequential(Block(9), Block(9))
        self.head = nn.Linear(9, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = self.head(self.blocks(self.inp(x)))
        return out


def _net(seed: int = 0) -> Net:
    torch.manual_seed(seed)
    return Net()


def _loss(model: nn.Module, batch: Batch) -> torch.Tensor:
    return F.cross_entropy(model(batch[0]), batch[1])


def _batches(size: int, steps: int = STEPS, seed: int = 1234) -> list[Batch]:
    """The global batch of each step; identical on every rank."""
    gen = torch.Generator().manual_seed(seed)
    return [
        (torch.randn(size, 6, generator=gen), torch.randint(0, 4, (size,), generator=gen))
        for _ in range(steps)
    ]


def _part(batch: Batch, index: int, parts: int) -> Batch:
    size = batch[0].shape[0] // parts
    return batch[0][index * size : (index + 1) * size], batch[1][index * size : (index + 1) * size]


def _optimizer(kind: str, model: nn.Module) -> torch.optim.Optimizer | None:
    """AdamW (foreach or fused), or None: the hand-written SGD loop of ``_step``."""
    if kind == "plain_loop":
        return None
    fused = kind == "adamw_fused"
    return torch.optim.AdamW(
        model.parameters(), lr=LR, eps=EPS, foreach=not fused, fused=fused or None
    )


def _step(optim: torch.optim.Optimizer | None, model: nn.Module) -> None:
    if optim is not None:
        optim.step()
        optim.zero_grad()
        return
    for p in model.parameters():  # the hand-written loop, as training scripts have it
        if p.grad is not None:  # a rank that holds no rows of p may have none
            p.data.add_(p.grad, alpha=-SGD_LR)
        p.grad = None


def _shard(model: nn.Module, strategy: str, world: int, group: Any, **options: Any) -> Any:
    if strategy.startswith("HYBRID"):
        options["sharding_factor"] = 2 if world == 4 else 1
    return flatshard.fully_shard(
        model, auto_wrap_policy={Block}, strategy=strategy, process_group=group, **options
    )


@contextmanager
def _short_timeout(seconds: float) -> Iterator[None]:
    """flatshard's collectives time out after ``seconds`` in this job (the pool's default
    after it)."""
    flatshard.set_checks(flatshard.Checks(timeout=seconds))
    try:
        yield
    finally:
        flatshard.set_checks(flatshard.Checks())


def _error(error: BaseException) -> Outcome:
    text = str(error)
    return {
        "kind": "error",
        "detail": f"{type(error).__name__}: {text[:300]}",
        "named": text.startswith("flatshard"),
        "collective": isinstance(error, flatshard.CollectiveError),
        "flatshard_class": type(error).__module__.startswith("flatshard"),
    }


# ---------------------------------------------------------------- the sweep
def _train_sharded(
    model: Any, variant: str, optim_kind: str, clip: str, rank: int, world: int
) -> list[float]:
    """3 steps on this rank's slice of each global batch; the clipping norms."""
    micro = VARIANTS[variant]
    optim = _optimizer(optim_kind, model)
    extra = _batches(world * micro * PER_MICRO, seed=99)  # side forwards' inputs
    norms: list[float] = []
    if variant == "keep_gathered":
        flatshard.set_reshard_after_backward(model, False)
    if variant == "unshard_held":
        flatshard.unshard(model)  # the root unit, held across every step
    for step, batch in enumerate(_batches(world * micro * PER_MICRO)):
        if variant == "forward_without_backward":
            model(_part(extra[step], rank, world)[0])  # with grad, output dropped
        local = _part(batch, rank, world)
        for m in range(micro):
            last = m == micro - 1
            accumulate: AbstractContextManager[Any] = nullcontext()
            if variant in ("no_sync", "keep_gathered") and not last:
                accumulate = flatshard.no_sync(model)
            if variant == "switch_sync":
                flatshard.set_requires_gradient_sync(model, last)
            if variant == "all_reduce_last":
                flatshard.set_requires_all_reduce(model, last)
            with accumulate:
                (_loss(model, _part(local, m, micro)) / micro).backward()
        if clip == "flatshard":
            norms.append(float(flatshard.clip_grad_norm_(model, MAX_NORM)))
        elif clip == "torch":
            norms.append(float(torch.nn.utils.clip_grad_norm_(model.parameters(), MAX_NORM)))
        _step(optim, model)
        if variant == "forward_without_backward":
            with torch.no_grad():
                model(_part(extra[step], rank, world)[0])  # an evaluation between steps
    if variant == "unshard_held":
        flatshard.reshard(model)
    return norms


def _train_reference(
    model: nn.Module, micro: int, optim_kind: str, clip: str, world: int
) -> list[float]:
    """DDP's semantics in one process: every rank's micro-batch losses backpropagated
    separately, the gradients' sum divided by W, then clipping and the optimizer."""
    optim = _optimizer(optim_kind, model)
    norms: list[float] = []
    for batch in _batches(world * micro * PER_MICRO):
        for r in range(world):
            local = _part(batch, r, world)
            for m in range(micro):
                (_loss(model, _part(local, m, micro)) / micro).backward()
        for p in model.parameters():
            assert p.grad is not None
            p.grad.div_(world)
        if clip != "none":
            norms.append(float(torch.nn.utils.clip_grad_norm_(model.parameters(), MAX_NORM)))
        _step(optim, model)
    return norms


def _compare(
    got: dict[str, torch.Tensor],
    expected: dict[str, torch.Tensor],
    norms: list[float],
    ref_norms: list[float],
) -> Outcome:
    """ "exact" if every parameter and clipping norm is within tolerance; else "mismatch"
    with the largest difference and where it is."""
    worst, where, close = 0.0, "", True
    for name, value in expected.items():
        if name not in got or got[name].shape != value.shape:
            shape = tuple(got[name].shape) if name in got else "missing"
            return {"kind": "mismatch", "detail": f"'{name}': {shape} vs {tuple(value.shape)}"}
        diff = (got[name].float() - value).abs().max().item()
        if not diff <= worst:  # NaN counts as the worst
            worst, where = diff, name
        close &= torch.allclose(got[name].float(), value, rtol=RTOL, atol=ATOL)
    detail = f"max abs diff {worst:.3g} ('{where}')"
    if len(norms) != len(ref_norms) or not all(
        math.isclose(a, b, rel_tol=RTOL, abs_tol=ATOL)
        for a, b in zip(norms, ref_norms, strict=True)
    ):
        close = False
        detail += f"; clip norms {norms} vs the reference's {ref_norms}"
    return {"kind": "exact" if close else "mismatch", "detail": detail}


def _combination(
    variant: str, optim_kind: str, clip: str, strategy: str, world: int, group: Any, rank: int
) -> Outcome:
    model = _shard(_net(), strategy, world, group)
    norms = _train_sharded(model, variant, optim_kind, clip, rank, world)
    got = flatshard.full_state_dict(model, rank0_only=False)
    expected, ref_norms = _reference(VARIANTS[variant], optim_kind, clip, world)
    return _compare(got, expected, norms, ref_norms)


# (micro-batches, optimizer, clip, W) -> the reference's parameters and clipping norms. The
# reference does not depend on the strategy or on how accumulation is asked for: each
# worker process trains each one once (the pool's processes outlive the jobs).
_REFERENCES: dict[tuple[int, str, str, int], tuple[dict[str, torch.Tensor], list[float]]] = {}


def _reference(
    micro: int, optim_kind: str, clip: str, world: int
) -> tuple[dict[str, torch.Tensor], list[float]]:
    key = (micro, optim_kind, clip, world)
    if key not in _REFERENCES:
        model = _net()
        norms = _train_reference(model, micro, optim_kind, clip, world)
        _REFERENCES[key] = ({k: v.detach().clone() for k, v in model.state_dict().items()}, norms)
    return _REFERENCES[key]


def sweep_job(ctx: WorkerContext, world: int, strategy: str, log_dir: str, start: int) -> None:
    """Every combination from ``start`` on, for (world, strategy), on the ranks of ``world``.

    Each rank writes what became of each combination to its own file (JSON lines), so that
    what ran before a crash is kept. Stops after a combination that ended differently on
    different ranks, or in a collective error: the model's group may have collectives in
    flight, and the test goes on from the next combination with fresh ranks.
    """
    side = dist.new_group(list(range(world)))  # made by every rank of the pool, in order
    group = ctx.group(world)
    if group is None:
        return None
    log = Path(log_dir) / f"rank{ctx.rank}.jsonl"
    with _short_timeout(TIMEOUT_S):
        for index in range(start, len(COMBINATIONS)):
            variant, optim_kind, clip = COMBINATIONS[index]
            _write(log, {"index": index})
            try:
                outcome = _combination(variant, optim_kind, clip, strategy, world, group, ctx.rank)
            except Exception as error:
                outcome = _error(error)
            _write(log, {"index": index, "outcome": outcome})
            ended: list[Any] = [None] * world
            dist.all_gather_object(ended, outcome, group=side)
            if _left_in_flight(ended):
                break
    return None


def _left_in_flight(outcomes: list[Outcome]) -> bool:
    """Whether the ranks may have left collectives in flight: some raised and others did
    not, or a collective failed."""
    raised = {o["kind"] == "error" for o in outcomes}
    return len(raised) > 1 or any(o.get("collective", False) for o in outcomes)


def _write(log: Path, entry: dict[str, Any]) -> None:
    with log.open("a") as f:
        f.write(json.dumps(entry) + "\n")


def _read(log_dir: Path, world: int) -> tuple[dict[int, dict[int, Outcome]], int]:
    """Outcome by combination and rank, and the last combination any rank started."""
    found: dict[int, dict[int, Outcome]] = {}
    last = -1
    for rank in range(world):
        log = log_dir / f"rank{rank}.jsonl"
        for line in log.read_text().splitlines() if log.exists() else []:
            entry = json.loads(line)
            last = max(last, entry["index"])
            if "outcome" in entry:
                found.setdefault(entry["index"], {})[rank] = entry["outcome"]
    return found, last


MAX_RESTARTS = 4  # fresh pools per (world, strategy) after a hang or crash, then give up


def _sweep(pool: WorkerPool, world: int, strategy: str, log_dir: Path) -> list[list[Outcome]]:
    """Each combination's outcome on each rank: "died" where a rank gave none (the pool's
    report of the job attached), "not run" past the restarts allowed."""
    died: dict[int, str] = {}
    start, restarts = 0, 0
    while start < len(COMBINATIONS) and restarts <= MAX_RESTARTS:
        failure = ""
        try:
            pool.run(sweep_job, world, strategy, str(log_dir), start)
        except JobFailed as error:  # the pool is closed already
            failure = str(error)[-1500:]
        found, last = _read(log_dir, world)
        ended = list(found.get(last, {}).values())
        if last < start:
            died[start] = failure or "no combination started"
            start += 1
        else:
            if len(ended) < world or failure:
                died[last] = failure or "a rank gave no outcome"
            start = last + 1
        if failure or len(ended) < world or _left_in_flight(ended):
            pool.close()  # the next job (of this test or another) gets fresh ranks
            restarts += 1
    found, _ = _read(log_dir, world)
    table = []
    for index in range(len(COMBINATIONS)):
        per_rank = found.get(index, {})
        missing = {"kind": "died", "detail": died.get(index, "")} if index in died else None
        missing = missing or {"kind": "not run", "detail": "after too many restarts"}
        table.append([per_rank.get(rank, missing) for rank in range(world)])
    return table


@pytest.mark.parametrize("strategy", STRATEGIES)
@pytest.mark.parametrize("world", [2, 4])
def test_every_combination_matches_ddp_or_is_refused_by_name(
    pool: WorkerPool, world: int, strategy: str, tmp_path: Path
) -> None:
    """Each combination of loop variant x optimizer x clipping: all ranks equal to the
    reference (fp32 tolerance: rtol 1e-5, atol 1e-6, parameters and clipping norms), or all
    ranks raised an error starting with "flatshard". A collective timeout is a hang (the
    watchdog's report of it), not a refusal. Hybrid strategies: F = 2 at 4 ranks, F = 1
    (replicas only) at 2."""
    bad = []
    for (variant, optim_kind, clip), per_rank in zip(
        COMBINATIONS, _sweep(pool, world, strategy, tmp_path), strict=True
    ):
        kinds = {o["kind"] for o in per_rank}
        if kinds == {"exact"}:
            continue
        named = kinds == {"error"} and all(o["named"] for o in per_rank)
        if named and not any(o["collective"] for o in per_rank):
            continue
        name = f"{variant}/{optim_kind}/clip={clip}"
        if len({o["detail"] for o in per_rank}) == 1:
            bad.append(f"{name}: every rank: {per_rank[0]['kind']}: {per_rank[0]['detail']}")
            continue
        lines = "; ".join(f"rank {r}: {o['kind']}: {o['detail']}" for r, o in enumerate(per_rank))
        bad.append(f"{name}: {lines}")
    assert not bad, f"{len(bad)} of {len(COMBINATIONS)} combinations failed:\n" + "\n".join(bad)


# ---------------------------------------------------------------- targeted cases
def _settle(pool: WorkerPool, outcomes: list[Outcome]) -> None:
    """Restart the pool where a job may have left collectives in flight."""
    if _left_in_flight(outcomes):
        pool.close()


def _train_step(
    model: Any, optim: torch.optim.Optimizer, batch: Batch, rank: int, world: int
) -> None:
    _loss(model, _part(batch, rank, world)).backward()
    optim.step()
    optim.zero_grad()


def hso_state_dict_job(ctx: WorkerContext) -> Outcome | None:
    group = ctx.group(2)
    if group is None:
        return None
    model = _shard(_net(), "HYBRID_SHARD_OPTIM", 2, group)  # F = 1: replicas only
    optim = _optimizer("adamw_foreach", model)
    assert optim is not None
    _train_step(model, optim, _batches(2 * PER_MICRO, steps=1)[0], ctx.rank, 2)
    try:
        state = model.state_dict()
    except Exception as error:
        return _error(error)
    shapes = {k: tuple(v.shape) for k, v in state.items()}
    return {"kind": "no error", "detail": f"state_dict() returned {shapes}"}


def test_hybrid_shard_optim_refuses_a_plain_state_dict(pool: WorkerPool) -> None:
    """HYBRID_SHARD_OPTIM at F = 1 (2 ranks, replicas only): the parameters are each rank's
    own W-chunk of the rows (the part its optimizer steps), not the whole tensors, so
    ``model.state_dict()`` would hold a truncated model. It must raise a RuntimeError
    starting with "flatshard" on every rank, as every other sharded strategy does."""
    outcomes = pool.run(hso_state_dict_job)[:2]
    for rank, outcome in enumerate(outcomes):
        assert outcome["kind"] == "error", f"rank {rank}: {outcome['detail']}"
        assert outcome["detail"].startswith("RuntimeError: flatshard"), outcome["detail"]


def unrelated_optimizer_job(
    ctx: WorkerContext, strategy: str, world: int, keep: bool
) -> Outcome | None:
    group = ctx.group(world)
    if group is None:
        return None
    with _short_timeout(TIMEOUT_S):
        try:
            model = _shard(_net(), strategy, world, group)
            if keep:
                flatshard.set_reshard_after_backward(model, False)
            optim = _optimizer("adamw_foreach", model)
            assert optim is not None
            torch.manual_seed(5)
            other = nn.Linear(3, 3)  # unrelated to the model: e.g. a probe, an EMA helper
            other_optim = torch.optim.SGD(other.parameters(), lr=0.1)
            for batch in _batches(world * 2 * PER_MICRO):
                local = _part(batch, ctx.rank, world)
                for m in range(2):
                    (_loss(model, _part(local, m, 2)) / 2).backward()
                    if m == 0 and ctx.rank == 0:
                        other(torch.ones(2, 3)).sum().backward()
                        other_optim.step()
                        other_optim.zero_grad()
                optim.step()
                optim.zero_grad()
            got = flatshard.full_state_dict(model, rank0_only=False)
        except Exception as error:
            return _error(error)
    expected, _ = _reference(2, "adamw_foreach", "none", world)
    return _compare(got, expected, [], [])


@pytest.mark.parametrize(
    ("strategy", "world", "keep"),
    [("FULL_SHARD", 2, True), ("HYBRID_SHARD_OPTIM", 4, False)],
    ids=["FULL_SHARD-kept-gathered-w2", "HYBRID_SHARD_OPTIM-F2-w4"],
)
def test_an_unrelated_optimizer_on_one_rank_changes_nothing(
    pool: WorkerPool, strategy: str, world: int, keep: bool
) -> None:
    """Rank 0 alone steps an optimizer of a module outside the sharded model between
    micro-batches. Nothing of the model changed, so every rank must decide alike whether
    a kept-gathered unit (set_reshard_after_backward(False)) or a HYBRID_SHARD_OPTIM shard
    (refreshed across the replicas after its optimizer wrote it) must be gathered again:
    training equals the reference, with no hang and no abort. A process-wide count of
    optimizer steps would move on rank 0 only."""
    outcomes = pool.run(unrelated_optimizer_job, strategy, world, keep)[:world]
    _settle(pool, outcomes)
    for rank, outcome in enumerate(outcomes):
        assert outcome["kind"] == "exact", f"rank {rank}: {outcome['kind']}: {outcome['detail']}"


def _block_matrices(model: nn.Module) -> list[nn.Parameter]:
    return [
        p
        for n, p in model.named_parameters()
        if n.startswith("blocks.") and n.endswith("fc.weight")
    ]


def whole_subset_norm_job(ctx: WorkerContext) -> Outcome | None:
    group = ctx.group(3)
    if group is None:
        return None
    batch = _batches(3 * PER_MICRO, steps=1)[0]
    reference = _net()
    for r in range(3):
        _loss(reference, _part(batch, r, 3)).backward()
    for p in reference.parameters():
        assert p.grad is not None
        p.grad.div_(3)
    expected = float(torch.nn.utils.clip_grad_norm_(_block_matrices(reference), MAX_NORM))
    with _short_timeout(TIMEOUT_S):
        try:
            model = flatshard.fully_shard(
                _net(), auto_wrap_policy={Block}, process_group=group, placement=flatshard.Whole()
            )
            _loss(model, _part(batch, ctx.rank, 3)).backward()
            got = float(torch.nn.utils.clip_grad_norm_(_block_matrices(model), MAX_NORM))
        except Exception as error:
            return _error(error)
    return {"kind": "norm", "norm": got, "expected": expected}


def test_torch_clip_over_a_subset_with_whole_parameters_is_the_global_norm(
    pool: WorkerPool,
) -> None:
    """placement=Whole() at 3 ranks: each block matrix lies whole on one rank, the others
    hold it with 0 rows and no gradient. torch.nn.utils.clip_grad_norm_ over the blocks'
    2-D weights only (a subset, as per-group clipping does) must return, on every rank,
    the norm of that subset's gradients in the unsharded model (the ranks must not leave
    each other waiting, whichever of them hold no rows of the subset)."""
    outcomes = pool.run(whole_subset_norm_job)[:3]
    _settle(pool, outcomes)
    for rank, outcome in enumerate(outcomes):
        assert outcome["kind"] == "norm", f"rank {rank}: {outcome['detail']}"
        assert math.isclose(outcome["norm"], outcome["expected"], rel_tol=RTOL), (rank, outcome)


def meta_optimizer_job(ctx: WorkerContext) -> Outcome | None:
    group = ctx.group(2)
    if group is None:
        return None
    with torch.device("meta"):
        model = Net()
    optim = torch.optim.AdamW(model.parameters(), lr=LR)  # too early: meta parameters
    flatshard.fully_shard(model, auto_wrap_policy={Block}, process_group=group)
    _loss(model, _part(_batches(2 * PER_MICRO, steps=1)[0], ctx.rank, 2)).backward()
    try:
        optim.step()
    except Exception as error:
        return _error(error)
    return {"kind": "no error", "detail": "optimizer.step() returned (and stepped nothing)"}


def test_an_optimizer_built_before_a_meta_model_is_sharded_is_refused(pool: WorkerPool) -> None:
    """An optimizer made from a meta-device model's parameters before fully_shard holds
    parameters that fully_shard replaced (materialized and sharded): its step would update
    nothing, silently. optimizer.step() must raise a RuntimeError starting with
    "flatshard" on every rank."""
    for rank, outcome in enumerate(pool.run(meta_optimizer_job)[:2]):
        assert outcome["kind"] == "error", f"rank {rank}: {outcome['detail']}"
        assert outcome["detail"].startswith("RuntimeError: flatshard"), outcome["detail"]


def different_init_job(ctx: WorkerContext, strategy: str) -> Outcome | None:
    group = ctx.group(4)
    if group is None:
        return None
    with _short_timeout(TIMEOUT_S):
        try:
            _shard(_net(seed=ctx.rank), strategy, 4, group)  # every rank its own weights
        except Exception as error:
            return _error(error)
    return {"kind": "no error", "detail": "fully_shard returned"}


@pytest.mark.parametrize("strategy", ["NO_SHARD", "HYBRID_SHARD"])
def test_ranks_initialized_differently_are_refused_by_default(
    pool: WorkerPool, strategy: str
) -> None:
    """Each rank seeded differently, at 4 ranks. NO_SHARD keeps every rank's own weights
    as replicas, and HYBRID_SHARD (F = 2) keeps each shard group's: the replicas would
    train different models under one name, silently. fully_shard must raise on every rank
    with an error starting with "flatshard", with no option passed."""
    outcomes = pool.run(different_init_job, strategy)[:4]
    _settle(pool, outcomes)
    for rank, outcome in enumerate(outcomes):
        assert outcome["kind"] == "error" and outcome["named"], f"rank {rank}: {outcome['detail']}"


def never_synced_job(ctx: WorkerContext, how: str) -> Outcome | None:
    group = ctx.group(2)
    if group is None:
        return None
    model = _shard(_net(), "FULL_SHARD", 2, group)
    optim = _optimizer("adamw_foreach", model)
    assert optim is not None
    local = _part(_batches(2 * 2 * PER_MICRO, steps=1)[0], ctx.rank, 2)
    if how == "switch":
        flatshard.set_requires_gradient_sync(model, False)  # and never True again
    for m in range(2):
        with flatshard.no_sync(model) if how == "no_sync" else nullcontext():
            (_loss(model, _part(local, m, 2)) / 2).backward()
    try:
        optim.step()
    except Exception as error:
        return _error(error)
    finally:
        flatshard.set_requires_gradient_sync(model, True)
    return {"kind": "no error", "detail": "optimizer.step() returned"}


@pytest.mark.parametrize("how", ["switch", "no_sync"])
def test_a_step_on_gradients_never_synchronized_is_refused(pool: WorkerPool, how: str) -> None:
    """set_requires_gradient_sync(model, False) never set True again, or every micro-batch
    inside no_sync: the gradients are kept unreduced and unsharded, and the parameters'
    .grad are not this step's. optimizer.step() must raise a RuntimeError starting with
    "flatshard" on every rank instead of stepping on nothing (or on stale gradients)."""
    for rank, outcome in enumerate(pool.run(never_synced_job, how)[:2]):
        assert outcome["kind"] == "error", f"rank {rank}: {outcome['detail']}"
        assert outcome["detail"].startswith("RuntimeError: flatshard"), outcome["detail"]


def skipped_backward_job(ctx: WorkerContext) -> Outcome | None:
    group = ctx.group(2)
    if group is None:
        return None
    with _short_timeout(2.0):  # as tests/test_hangs.py: a hang is reported in seconds
        try:
            model = _shard(_net(), "FULL_SHARD", 2, group)
            optim = _optimizer("adamw_foreach", model)
            assert optim is not None
            for step, batch in enumerate(_batches(2 * PER_MICRO)):
                loss = _loss(model, _part(batch, ctx.rank, 2))
                if not (step == 1 and ctx.rank == 1):  # a NaN guard skips it on rank 1
                    loss.backward()
                optim.step()
                optim.zero_grad()
        except Exception as error:
            return _error(error)
    return {"kind": "no error", "detail": "3 steps ended normally"}


def test_a_rank_that_skips_a_backward_but_steps_fails_on_every_rank(pool: WorkerPool) -> None:
    """Rank 1 skips loss.backward() at step 2 (as a NaN guard would) and still calls
    optimizer.step(); rank 0 trains on. The ranks' collectives no longer pair: every rank
    must raise a flatshard error (a flatshard exception class, or a message starting with
    "flatshard"), and no rank may die (the pool reports a dead rank as "no answer")."""
    try:
        outcomes = pool.run(skipped_backward_job)[:2]
    finally:
        pool.close()  # collectives may be left in flight: later jobs get fresh ranks
    for rank, outcome in enumerate(outcomes):
        assert outcome["kind"] == "error", f"rank {rank}: {outcome['detail']}"
        assert outcome["named"] or outcome["flatshard_class"], f"rank {rank}: {outcome['detail']}"


def zero_grad_job(ctx: WorkerContext, strategy: str, world: int, how: str, zero: str) -> Outcome:
    """Two micro-batches with gradient sync (or, hybrid, the all-reduce) off, then the
    gradients are zeroed and never stepped on (a discarded accumulation); then 3 plain
    steps, which must equal the reference's 3 steps."""
    group = ctx.group(world)
    if group is None:
        return {"kind": "not run"}
    with _short_timeout(TIMEOUT_S):
        try:
            model = _shard(_net(), strategy, world, group)
            params = list(model.parameters())
            optims = [torch.optim.AdamW(params, lr=LR, eps=EPS, foreach=True)]
            if zero == "two_optimizers":  # each holds every other parameter
                optims = [
                    torch.optim.AdamW(params[i::2], lr=LR, eps=EPS, foreach=True) for i in (0, 1)
                ]
            discarded = _part(_batches(world * 2 * PER_MICRO, steps=1, seed=7)[0], ctx.rank, world)
            for m in range(2):
                accumulate: AbstractContextManager[Any] = nullcontext()
                if how == "no_sync":
                    accumulate = flatshard.no_sync(model)
                elif how == "switch_sync":
                    flatshard.set_requires_gradient_sync(model, False)
                else:
                    flatshard.set_requires_all_reduce(model, False)
                with accumulate:
                    (_loss(model, _part(discarded, m, 2)) / 2).backward()
            if zero == "model":
                model.zero_grad()
            else:
                for optim in optims:
                    optim.zero_grad(set_to_none=zero != "optimizer_to_zeros")
            flatshard.set_requires_gradient_sync(model, True)
            flatshard.set_requires_all_reduce(model, True)
            for batch in _batches(world * PER_MICRO):
                _loss(model, _part(batch, ctx.rank, world)).backward()
                for optim in optims:
                    optim.step()
                    optim.zero_grad()
            got = flatshard.full_state_dict(model, rank0_only=False)
        except Exception as error:
            return _error(error)
    expected, _ = _reference(1, "adamw_foreach", "none", world)
    return _compare(got, expected, [], [])


@pytest.mark.parametrize(
    ("strategy", "world", "how", "zero"),
    [
        ("FULL_SHARD", 2, "no_sync", "optimizer"),
        ("FULL_SHARD", 2, "switch_sync", "model"),
        ("SHARD_GRAD_OP", 2, "no_sync", "optimizer_to_zeros"),
        ("FULL_SHARD", 2, "switch_sync", "two_optimizers"),
        ("HYBRID_SHARD", 4, "all_reduce", "optimizer"),
        ("HYBRID_SHARD_OPTIM", 4, "all_reduce", "two_optimizers"),
    ],
)
def test_zero_grad_drops_the_gradients_kept_unreduced(
    pool: WorkerPool, strategy: str, world: int, how: str, zero: str
) -> None:
    """Under DDP, micro-batches without sync accumulate into .grad, and zero_grad (the
    optimizer's or the module's, to None or to zeros) clears them. flatshard keeps them
    unreduced elsewhere (the unsharded flat gradient; hybrid, a chunk owed to the replicas'
    all-reduce): zero_grad must drop them too, else they join the next synchronized step.
    Two optimizers over alternate parameters drop each one's part only."""
    outcomes = pool.run(zero_grad_job, strategy, world, how, zero)[:world]
    _settle(pool, outcomes)
    for rank, outcome in enumerate(outcomes):
        assert outcome["kind"] == "exact", f"rank {rank}: {outcome['kind']}: {outcome['detail']}"
