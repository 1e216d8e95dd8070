"""Asynchronous checkpoint saves (``save_checkpoint(..., async_op=True)``): the state of the
call, written while training changes the live tensors, resumes bit for bit; failures are
raised on every rank; staging memory is reused; a process that exits finishes the write.

The crash of a rank during a background write, under ``flatshard train --ckpt-async``, is
in tests/test_restarts.py (the torchrun recipe); the CLI's resume in tests/test_cli.py.
"""

from __future__ import annotations

import errno
import os
import signal
import subprocess
import sys
from contextlib import nullcontext
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

import flatshard
from flatshard.testing.internals import (
    checkpoint_file_reads_fail,
    checkpoint_writes_start_after,
    staging_buffers,
)
from flatshard.testing.isolated import Died, run_isolated
from flatshard.testing.models import build
from flatshard.testing.parity import make_optimizer
from flatshard.testing.workers import WorkerContext, WorkerPool
from test_checkpoint import SPLIT, STEPS, Layout, _model_in, resume_job, train_steps

LATE_S = 0.3  # the writer starts this late: the training after the call changes the state


def async_save_job(
    ctx: WorkerContext, name: str, optimizer: str, layout: Layout, directory: str
) -> dict[str, Any] | None:
    """Train; save synchronously to ``sync`` and asynchronously to ``async``; train on
    while the writer writes. The uninterrupted losses, and what the save staged."""
    built = _model_in(ctx, name, layout)
    if built is None:
        return None
    model, group = built
    optim = make_optimizer(model, 1e-2, optimizer)
    train_steps(model, optim, range(SPLIT), group)
    extra = {"step": SPLIT, "rank": ctx.rank, "rng": torch.get_rng_state()}
    flatshard.save_checkpoint(f"{directory}/sync", model, optim, extra=extra)
    with checkpoint_writes_start_after(LATE_S):
        save = flatshard.save_checkpoint(
            f"{directory}/async", model, optim, extra=extra, async_op=True
        )
        extra["step"] = -1  # the caller's values change at once, as the weights do below
        written_late = not save.done()
        after = train_steps(model, optim, range(SPLIT, STEPS), group)
        save.wait()
    state = flatshard.sharded_state_dict(model)
    nbytes = {
        k: (v.local if isinstance(v, flatshard.RowShard) else v).nbytes for k, v in state.items()
    }
    params = [n for n, p in model.named_parameters() if p.requires_grad]
    return {
        "after": after,
        "written_late": written_late,
        "staged_bytes": save.staged_bytes,
        "model_bytes": sum(nbytes.values()),
        "param_bytes": sum(nbytes[n] for n in params),
        "params": len(params),
        "rng_bytes": extra["rng"].nbytes,
    }


ASYNC_RESHARD = [
    ("gpt", "adamw", (4, "FULL_SHARD"), (2, "FULL_SHARD")),
    ("gpt", "adamw", (4, "HYBRID_SHARD_OPTIM"), (3, "SHARD_GRAD_OP")),
    ("gpt", "adamw", (2, "SHARD_GRAD_OP"), (4, "FULL_SHARD")),
    ("mlp", "sgd", (0, ""), (4, "FULL_SHARD")),
]


@pytest.mark.parametrize(("name", "optimizer", "saved", "other"), ASYNC_RESHARD)
def test_async_save_resumes_bitwise_at_the_same_and_another_world_size(
    pool: WorkerPool, tmp_path: Path, name: str, optimizer: str, saved: Layout, other: Layout
) -> None:
    ranks = pool.run(async_save_job, name, optimizer, saved, str(tmp_path))
    done = [r for r in ranks if r is not None]
    assert all(r["written_late"] for r in done)  # the writer ran while training went on
    same = pool.run(resume_job, name, optimizer, saved, str(tmp_path / "async"))[0]
    assert same["losses"] == done[0]["after"]  # bit for bit: the state of the call
    assert same["extra"]["step"] == SPLIT  # not the value the caller changed afterwards
    elsewhere = pool.run(resume_job, name, optimizer, other, str(tmp_path / "async"))[0]
    synced = pool.run(resume_job, name, optimizer, other, str(tmp_path / "sync"))[0]
    assert elsewhere["losses"] == synced["losses"]
    for r in done:  # staged: the model's rows and its optimizer state, once
        per_optimizer = {  # AdamW: two moments and a float32 step; SGD: a momentum buffer
            "adamw": 2 * r["param_bytes"] + 4 * r["params"],
            "sgd": r["param_bytes"],
        }
        moments = per_optimizer[optimizer]
        assert r["staged_bytes"] == r["model_bytes"] + moments + r["rng_bytes"], r


def _trained_mlp(ctx: WorkerContext) -> tuple[nn.Module, torch.optim.Optimizer, Any] | None:
    """The MLP sharded over ranks 0-1 and trained a step (None on the other ranks)."""
    group = ctx.group(2)
    if group is None:
        return None
    model = flatshard.fully_shard(build("mlp"), process_group=group)
    optim = make_optimizer(model, 1e-2, "adamw")
    train_steps(model, optim, range(1), group)
    return model, optim, group


def failing_save_job(ctx: WorkerContext, directory: str) -> dict[str, Any] | None:
    """Rank 1 cannot read back its files during an asynchronous save over a whole
    checkpoint: every rank is told, at ``wait`` and once more at the next save."""
    trained = _trained_mlp(ctx)
    if trained is None:
        return None
    model, optim, group = trained
    path = f"{directory}/ckpt"
    flatshard.save_checkpoint(path, model, optim, extra={"step": 1})
    train_steps(model, optim, range(1, 2), group)
    broken = OSError(errno.EIO, "Input/output error")
    failing = checkpoint_file_reads_fail(broken) if ctx.rank == 1 else _nothing()
    with failing:
        save = flatshard.save_checkpoint(path, model, optim, extra={"step": 2}, async_op=True)
        with pytest.raises(flatshard.CheckpointError) as at_wait:
            save.wait()
    with pytest.raises(flatshard.CheckpointError) as at_next:
        flatshard.save_checkpoint(f"{directory}/other", model, optim)
    kept = flatshard.load_checkpoint(path, model, optim)["step"]  # the one before
    again = flatshard.save_checkpoint(path, model, optim, extra={"step": 2}, async_op=True)
    again.wait()  # the failure was raised once: saving works again
    return {
        "wait": str(at_wait.value),
        "next": str(at_next.value),
        "kept": kept,
        "repr": repr(save),
        "other_written": Path(f"{directory}/other").exists(),
    }


def _nothing() -> Any:
    return nullcontext()


def test_a_failed_background_write_is_raised_on_every_rank(
    pool: WorkerPool, tmp_path: Path
) -> None:
    ranks = [r for r in pool.run(failing_save_job, str(tmp_path)) if r is not None]
    assert len(ranks) == 2
    for r in ranks:
        assert "the asynchronous save of" in r["wait"] and "rank 1: " in r["wait"], r
        assert "Input/output error" in r["wait"] and "untouched" in r["wait"], r
        assert r["next"].startswith("flatshard.save_checkpoint: the asynchronous save"), r
        assert r["kept"] == 1 and not r["other_written"], r
        assert "failed" in r["repr"], r
    assert not (tmp_path / "ckpt.partial").exists()


def staging_job(ctx: WorkerContext, directory: str) -> dict[str, Any] | None:
    """Two asynchronous saves of the same state: the second copies into the first's
    buffers (no new host memory); a save of other shapes replaces them."""
    trained = _trained_mlp(ctx)
    if trained is None:
        return None
    model, optim, _ = trained
    flatshard.save_checkpoint(f"{directory}/a", model, optim, async_op=True).wait()
    first = {k: v.data_ptr() for k, v in staging_buffers().items()}
    flatshard.save_checkpoint(f"{directory}/b", model, optim, async_op=True).wait()
    second = {k: v.data_ptr() for k, v in staging_buffers().items()}
    flatshard.save_checkpoint(f"{directory}/c", model, async_op=True).wait()  # no optimizer
    third = staging_buffers()
    return {
        "reused": first == second,
        "optimizer_keys_dropped": all(not k.startswith("optim/") for k in third),
        "count": len(first),
    }


def test_staging_buffers_are_reused_between_saves(pool: WorkerPool, tmp_path: Path) -> None:
    ranks = [r for r in pool.run(staging_job, str(tmp_path)) if r is not None]
    assert ranks and all(r["reused"] and r["optimizer_keys_dropped"] for r in ranks), ranks
    assert all(r["count"] > 0 for r in ranks)


EXIT_SCRIPT = """
import os, signal, sys, time
import torch
import flatshard
from flatshard.testing.internals import checkpoint_writes_start_after
from flatshard.testing.models import build

def own_handler(signum, frame):
    print("own handler", flush=True)
    sys.exit(3)

if sys.argv[2] == "own-handler":
    signal.signal(signal.SIGTERM, own_handler)
model = build("gpt")
with checkpoint_writes_start_after(0.5):
    save = flatshard.save_checkpoint(sys.argv[1], model, extra={"i": 7}, async_op=True)
    print("returned", save.done(), flush=True)
    if sys.argv[2] == "raise":
        raise SystemExit("the program ends by an error")
    if sys.argv[2] in ("sigterm", "own-handler"):  # preempted: SLURM, Kubernetes, torchrun
        os.kill(os.getpid(), signal.SIGTERM)
        time.sleep(60)
"""

# how the program ends -> its exit status: SIGTERM's default (death by the signal, -15)
# and the program's own handler are what they were, after the save committed
ENDS = {"normally": 0, "raise": 1, "sigterm": -signal.SIGTERM, "own-handler": 3}


@pytest.mark.parametrize("how", ENDS)
def test_a_process_that_exits_finishes_its_pending_save(tmp_path: Path, how: str) -> None:
    """Before, SIGTERM left a 2.2 MB ``.partial`` of a 146 MB checkpoint."""
    path = tmp_path / "ckpt"
    done = subprocess.run(
        [sys.executable, "-c", EXIT_SCRIPT, str(path), how],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.stdout.startswith("returned False"), done.stdout + done.stderr
    assert done.returncode == ENDS[how], done.stdout + done.stderr
    assert ("own handler" in done.stdout) == (how == "own-handler")
    if how in ("sigterm", "own-handler"):
        assert "SIGTERM received while" in done.stderr and "committed" in done.stderr
    model = build("gpt", seed=3)
    assert flatshard.load_checkpoint(path, model)["i"] == 7
    reference = build("gpt")
    for (name, p), q in zip(model.named_parameters(), reference.parameters(), strict=True):
        assert torch.equal(p, q), name


FAILING_EXIT_SCRIPT = """
import errno, sys
import flatshard
from flatshard.testing.internals import checkpoint_file_reads_fail
from flatshard.testing.models import build

with checkpoint_file_reads_fail(OSError(errno.EIO, "Input/output error")):
    flatshard.save_checkpoint(sys.argv[1], build("mlp"), async_op=True)
    import time; time.sleep(2)  # the writer fails meanwhile; nobody waits for it
"""


def test_a_failure_nobody_waited_for_is_said_at_exit(tmp_path: Path) -> None:
    done = subprocess.run(
        [sys.executable, "-c", FAILING_EXIT_SCRIPT, str(tmp_path / "ckpt")],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert "the asynchronous save of" in done.stderr, done.stderr
    assert "Input/output error" in done.stderr, done.stderr
    assert not (tmp_path / "ckpt").exists() and not (tmp_path / "ckpt.partial").exists()


def parting_save_job(rank: int, how: str, directory: str) -> str:
    """An asynchronous save whose write starts late; meanwhile ``how``: "killed", rank 1
    dies as by SIGKILL (no exit record); "destroyed", every rank destroys the process
    group before waiting for the save. Rank 0's error at ``wait()``."""
    import torch.distributed as dist

    model = flatshard.fully_shard(build("mlp"))
    with checkpoint_writes_start_after(1.0):
        save = flatshard.save_checkpoint(f"{directory}/ckpt", model, async_op=True)
        if how == "killed" and rank == 1:
            os._exit(3)
        if how == "destroyed":
            dist.destroy_process_group()
        try:
            save.wait()
        except flatshard.CheckpointError as error:
            return str(error)
    return "no error"


@pytest.mark.parametrize("how", ["killed", "destroyed"])
def test_a_save_that_fails_with_its_group_says_why(tmp_path: Path, how: str) -> None:
    """Before: gloo's "Connection closed by peer" with no rank named, or "Default process
    group has not been initialized" where the guide says to look for a destroyed group."""
    outcomes = run_isolated(parting_save_job, how, str(tmp_path))
    message = outcomes[0]
    assert isinstance(message, str) and "the asynchronous save of" in message, outcomes
    if how == "killed":
        assert outcomes[1] == Died(3), outcomes
        assert "Rank 1 of its group ended (no answer and no exit record: killed" in message
    else:
        assert "The process group was destroyed while it was being written" in message
        assert "call wait() on the save before dist.destroy_process_group()" in message
    assert not (tmp_path / "ckpt").exists() and not (tmp_path / "ckpt.partial").exists()
