"""Uneven inputs: ``flatshard.join`` against DDP's ``Join`` (each rank's batches, as many
as it has; gradients summed over the ranks that still have data, divided by the world).

Rank 0 has 2 batches, rank 1 has 5: after its second step rank 0 replays its last
iteration with zero gradients while rank 1 trains on. The final weights equal DDP's under
``Join`` (whose final model is the last rank's) and the same semantics computed in one
process, swept over plain SGD, AdamW with a learning-rate schedule and clipping, and
micro-batches under ``no_sync`` (there by hand only: DDP's ``Join`` with two forwards per
step ends 6e-3 away from its own semantics, measured here). Before, rank 0
left and rank 1 waited until the timeout (then, since issue 60, a ``PeerLostError``).
"""

from __future__ import annotations

import copy
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch.distributed.algorithms.join import Join
from torch.nn.parallel import DistributedDataParallel

import flatshard
from flatshard.testing.isolated import run_isolated
from flatshard.testing.models import MLPStack, build
from flatshard.testing.workers import WorkerContext, WorkerPool

BATCHES = (2, 5)  # per rank
CASES = {
    "sgd": {"optimizer": "sgd", "clip": None, "micro": 1},
    "adamw-schedule-clip": {"optimizer": "adamw", "clip": 0.05, "micro": 1},
    "no-sync-micro-batches": {"optimizer": "sgd", "clip": None, "micro": 2},
}


def _optimizer(params: Any, kind: str) -> tuple[torch.optim.Optimizer, Any]:
    if kind == "sgd":
        optimizer: torch.optim.Optimizer = torch.optim.SGD(params, lr=0.1, momentum=0.9)
    else:
        optimizer = torch.optim.AdamW(params, lr=0.02, weight_decay=0.1)
    return optimizer, torch.optim.lr_scheduler.StepLR(optimizer, step_size=1, gamma=0.7)


def _batches(rank: int, micro: int) -> list[list[tuple[torch.Tensor, torch.Tensor]]]:
    gen = torch.Generator().manual_seed(100 + rank)
    mlp = MLPStack()
    return [[mlp.make_batch(gen, 4) for _ in range(micro)] for _ in range(BATCHES[rank])]


def uneven_job(ctx: WorkerContext, case: str) -> dict[str, Any] | None:
    group = ctx.group(2)
    if group is None:
        return None
    options = CASES[case]
    steps = _batches(ctx.rank, options["micro"])
    reference = DistributedDataParallel(copy.deepcopy(build("mlp")), process_group=group)
    model = flatshard.fully_shard(
        build("mlp"), auto_wrap_policy=set(MLPStack.UNIT_CLASSES), process_group=group
    )
    ref_opt, ref_schedule = _optimizer(reference.parameters(), options["optimizer"])
    # (DDP's Join with several forwards per step ends elsewhere: compared by hand only)
    with Join([reference]):
        for micro_batches in steps:
            for x, y in micro_batches:
                (F.cross_entropy(reference(x), y) / len(micro_batches)).backward()
            if options["clip"]:
                torch.nn.utils.clip_grad_norm_(reference.parameters(), options["clip"])
            ref_opt.step()
            ref_opt.zero_grad()
            ref_schedule.step()
    optimizer, schedule = _optimizer(model.parameters(), options["optimizer"])
    with flatshard.join(model, [optimizer]):
        for micro_batches in steps:
            for index, (x, y) in enumerate(micro_batches):
                quiet = index < len(micro_batches) - 1
                with flatshard.no_sync(model) if quiet else _nothing():
                    (F.cross_entropy(model(x), y) / len(micro_batches)).backward()
            if options["clip"]:
                flatshard.clip_grad_norm_(model, options["clip"])
            optimizer.step()
            optimizer.zero_grad()
            schedule.step()
    full = flatshard.full_state_dict(model, rank0_only=False)
    expected = reference.module.state_dict()
    by_hand = _semantics(case)
    return {
        "ddp": _relative(full, expected) if options["micro"] == 1 else 0.0,
        "by hand": _relative(full, by_hand),
    }


def _semantics(case: str) -> dict[str, torch.Tensor]:
    """DDP Join's result, computed in one process: each step, the gradients of the ranks
    that still have a batch, summed and divided by the world size."""
    options = CASES[case]
    model = build("mlp")
    optimizer, schedule = _optimizer(model.parameters(), options["optimizer"])
    per_rank = [_batches(rank, options["micro"]) for rank in range(len(BATCHES))]
    for step in range(max(BATCHES)):
        for batches in per_rank:
            for x, y in batches[step] if step < len(batches) else []:
                loss = F.cross_entropy(model(x), y) / len(batches[step]) / len(BATCHES)
                loss.backward()
        if options["clip"]:
            torch.nn.utils.clip_grad_norm_(model.parameters(), options["clip"])
        optimizer.step()
        optimizer.zero_grad()
        schedule.step()
    return model.state_dict()


def _relative(got: dict[str, torch.Tensor], expected: dict[str, torch.Tensor]) -> float:
    return max(
        float((got[name] - want).abs().max() / want.abs().max()) for name, want in expected.items()
    )


class _nothing:
    def __enter__(self) -> None:
        return None

    def __exit__(self, *args: object) -> None:
        return None


@pytest.mark.parametrize("case", CASES)
def test_uneven_inputs_match_ddp_join(pool: WorkerPool, case: str) -> None:
    for rank, errors in enumerate(r for r in pool.run(uneven_job, case) if r is not None):
        assert max(errors.values()) < 1e-5, f"rank {rank}: {errors}"


def unreplayable_job(rank: int, how: str) -> tuple[str, str]:
    """Rank 0 has 1 batch, rank 1 has 3; the loop uses what a replay cannot repeat."""
    flatshard.set_checks(flatshard.Checks(timeout=3.0))  # rank 1's end: see below
    model = flatshard.fully_shard(build("mlp"), auto_wrap_policy=set(MLPStack.UNIT_CLASSES))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    try:
        with flatshard.join(model, [optimizer]):
            for x, y in [b[0] for b in _batches(rank, 1)][: 1 + 2 * rank]:
                if how == "train_step":
                    flatshard.train_step(model, [optimizer], lambda _, x=x: model(x).sum())
                    continue
                F.cross_entropy(model(x), y).backward()
                torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
                optimizer.step()
                optimizer.zero_grad()
    except (RuntimeError, flatshard.CollectiveError) as error:
        return type(error).__name__, str(error)
    return "", ""


@pytest.mark.parametrize(
    ("how", "said"),
    [
        ("train_step", "called flatshard.train_step"),
        ("torch-clip", "called torch.nn.utils.clip_grad_norm_"),
    ],
)
def test_what_a_replay_cannot_repeat_is_named(how: str, said: str) -> None:
    (error, message), (other, _) = run_isolated(unreplayable_job, how)
    assert error == "RuntimeError" and said in message and "cannot be replayed" in message
    # Rank 1 waits in an agreement for rank 0, whose process (forked by multiprocessing,
    # which runs no exit handler) leaves no exit record: the timeout tells it.
    assert other in ("CollectiveTimeoutError", "PeerLostError"), other
