"""Checkpoints as a series: the newest whole one, ``keep=N`` counting committed saves only
(asynchronous ones too), and the resume state (RNG states, LR schedulers, the data
position) saved and restored with one argument, bit-identical, per rank."""

from __future__ import annotations

import random
import shutil
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

import flatshard
from flatshard.testing.models import build
from flatshard.testing.parity import make_optimizer
from flatshard.testing.workers import WorkerContext, WorkerPool
from test_checkpoint import train_steps


def _names(directory: Path) -> list[str]:
    return sorted(p.name for p in directory.iterdir())


def series_job(ctx: WorkerContext, directory: str, async_op: bool) -> list[list[str]] | None:
    """Five saves with keep=2 (and a checkpoint of another name beside them): what the
    directory holds after each save is committed."""
    group = ctx.group(2)
    if group is None:
        return None
    model = flatshard.fully_shard(build("mlp"), process_group=group)
    optim = make_optimizer(model, 1e-2, "adamw")
    flatshard.save_checkpoint(f"{directory}/best", model, optim)
    seen = []
    for step in range(1, 6):
        train_steps(model, optim, range(step - 1, step), group)
        save = flatshard.save_checkpoint(
            f"{directory}/step_{step:06d}", model, optim, keep=2, async_op=async_op
        )
        if save is not None:
            save.wait()
        torch.distributed.barrier(group)  # rank 0 prunes: look after it did
        seen.append(_names(Path(directory)))
    return seen


@pytest.mark.parametrize("async_op", [False, True], ids=["sync", "async"])
def test_keep_counts_committed_saves(pool: WorkerPool, tmp_path: Path, async_op: bool) -> None:
    """Before (the CLI's pruning at the start of a save), --keep-ckpts 2 with --ckpt-async
    left 3: the pending save was not counted and nothing pruned after the last."""
    seen = pool.run(series_job, str(tmp_path), async_op)[0]
    assert seen[0] == ["best", "step_000001"]
    assert seen[1] == ["best", "step_000001", "step_000002"]
    assert seen[4] == ["best", "step_000004", "step_000005"]
    assert flatshard.latest_checkpoint(tmp_path) == tmp_path / "step_000005"


def test_the_latest_checkpoint_is_the_newest_whole_one(pool: WorkerPool, tmp_path: Path) -> None:
    pool.run(series_job, str(tmp_path), False)
    assert flatshard.latest_checkpoint(tmp_path / "nothing-here") is None
    shutil.copytree(tmp_path / "step_000005", tmp_path / "step_000006.partial")  # cut short
    (tmp_path / "step_000007").mkdir()  # another tool's directory
    assert flatshard.latest_checkpoint(tmp_path) == tmp_path / "step_000005"
    (tmp_path / "step_000005" / "flatshard.json").write_text("{damaged")
    assert flatshard.latest_checkpoint(tmp_path) == tmp_path / "step_000004"
    model = build("mlp")
    flatshard.load_checkpoint(flatshard.latest_checkpoint(tmp_path) or "", model)


@pytest.mark.parametrize(
    ("name", "keep", "said"),
    [("step_000001", 0, "keep must be an int >= 1"), ("final", 2, "'final' ends in no number")],
)
def test_a_bad_keep_is_named(tmp_path: Path, name: str, keep: int, said: str) -> None:
    with pytest.raises(ValueError, match=said):
        flatshard.save_checkpoint(tmp_path / name, build("mlp"), keep=keep)
    assert not (tmp_path / name).exists()


class _Position:
    """A stateful sampler: where in its permutation the data stands."""

    def __init__(self) -> None:
        self.index = 0

    def state_dict(self) -> dict[str, Any]:
        return {"index": self.index}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.index = int(state["index"])


def _draws() -> list[float]:
    """One draw from every RNG a training loop may use."""
    return [torch.rand(1).item(), random.random(), float(np.random.rand())]


def resume_state_job(ctx: WorkerContext, directory: str) -> dict[str, Any] | None:
    """Each rank seeds its RNGs differently, saves with a resume state, draws; then
    scrambles everything, loads, and draws again: the same numbers, per rank."""
    group = ctx.group(2)
    if group is None:
        return None
    model = flatshard.fully_shard(build("mlp"), process_group=group)
    optim = torch.optim.SGD(model.parameters(), lr=1.0)
    scheduler = torch.optim.lr_scheduler.StepLR(optim, step_size=2, gamma=0.5)
    data = _Position()
    for _ in range(3):
        scheduler.step()
    data.index = 17 + ctx.rank
    torch.manual_seed(100 + ctx.rank)
    random.seed(200 + ctx.rank)
    np.random.seed(300 + ctx.rank)
    resume_state = flatshard.ResumeState(scheduler=scheduler, data=data)
    flatshard.save_checkpoint(f"{directory}/step_3", model, optim, resume_state=resume_state)
    expected = _draws()
    torch.manual_seed(0), random.seed(0), np.random.seed(0)
    for _ in range(4):
        scheduler.step()
    data.index = 0
    extra = flatshard.load_checkpoint(
        f"{directory}/step_3", model, optim, resume_state=resume_state
    )
    return {
        "draws": _draws() == expected,
        "rank_draws": expected,
        "lr": optim.param_groups[0]["lr"],
        "epoch": scheduler.last_epoch,
        "data": data.index,
        "extra": extra,
    }


def test_the_resume_state_round_trips_per_rank(pool: WorkerPool, tmp_path: Path) -> None:
    ranks = [r for r in pool.run(resume_state_job, str(tmp_path)) if r is not None]
    assert len(ranks) == 2
    for rank, result in enumerate(ranks):
        assert result["draws"], result
        assert result["epoch"] == 3 and result["lr"] == 0.5, result  # 1.0 * 0.5 ** (3 // 2)
        assert result["data"] == 17 + rank and result["extra"] == {}, result
    assert ranks[0]["rank_draws"] != ranks[1]["rank_draws"]  # each rank got its own back


def test_a_resume_state_part_the_checkpoint_lacks_is_named(tmp_path: Path) -> None:
    model = build("mlp")
    flatshard.save_checkpoint(tmp_path / "step_1", model, resume_state=flatshard.ResumeState())
    resume_state = flatshard.ResumeState(data=_Position())
    with pytest.raises(ValueError, match="saved without the resume state's data"):
        flatshard.load_checkpoint(tmp_path / "step_1", model, resume_state=resume_state)
    with pytest.raises(TypeError, match="must have state_dict"):
        flatshard.ResumeState(scheduler=object())  # type: ignore[arg-type]
