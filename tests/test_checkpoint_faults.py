"""Checkpoint faults: entries that do not fit, damaged or foreign checkpoints, saves that
die midway (in-process and by SIGKILL), each named in user terms or leaving the previous
checkpoint loadable.
"""

from __future__ import annotations

import errno
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from torch import nn

import flatshard
from flatshard.testing import internals
from flatshard.testing.jobs import shard_units as shard
from flatshard.testing.models import build
from flatshard.testing.parity import make_optimizer
from flatshard.testing.workers import WorkerContext, WorkerPool

STEPS, SPLIT = 6, 3
Layout = tuple[int, str]  # (world size, strategy name); world size 0: plain, no group


# ---------------------------------------------------------------- errors
def load_errors_job(ctx: WorkerContext) -> None:
    group = ctx.group(2)
    if group is None:
        return
    model = shard(build("gpt"), group, "FULL_SHARD")
    full = flatshard.full_state_dict(model, rank0_only=False)
    broken = dict(full)
    del broken["blocks.0.mlp.0.weight"]
    broken["blocks.0.extra"] = torch.zeros(1)
    with pytest.raises(ValueError, match=r"Missing: 'blocks.0.mlp.0.weight'.*Unexpected: "):
        flatshard.load_state_dict(model, broken)
    wrong = dict(full)
    wrong["ln_f.bias"] = torch.zeros(3)
    with pytest.raises(ValueError, match=r"'ln_f.bias': expected shape \(16,\), found \(3,\)"):
        flatshard.load_state_dict(model, wrong)
    other = shard(build("gpt"), group, "NO_SHARD")
    with pytest.raises(ValueError, match="same layout"):
        flatshard.load_state_dict(other, flatshard.sharded_state_dict(model))
    optim = make_optimizer(model, 1e-2, "adamw")
    swapped = torch.optim.AdamW(list(reversed(list(model.parameters()))))
    osd = flatshard.full_optim_state_dict(model, optim, rank0_only=False)
    with pytest.raises(ValueError, match="parameter group"):
        flatshard.load_optim_state_dict(model, swapped, osd)


def test_load_state_dict_errors_name_entries(pool: WorkerPool) -> None:
    pool.run(load_errors_job)


def test_an_optimizer_of_the_same_groups_in_another_order_loads_by_name(
    local_group: object,
) -> None:
    """A pipeline's checkpoint keeps each group's parameters stage by stage; the model
    without a pipeline may order them otherwise (a model of two ModuleDicts cut into
    stages across both). Before: refused, "(same names, other order)", with a fix that
    could not be followed. Each parameter's state is its own, found by name."""
    torch.manual_seed(0)
    model = flatshard.fully_shard(build("mlp"))
    optim = make_optimizer(model, 1e-2, "adamw")
    model(torch.randn(4, 7)).sum().backward()
    optim.step()
    osd = flatshard.full_optim_state_dict(model, optim, rank0_only=False)
    groups = [{**g, "params": list(reversed(g["params"]))} for g in optim.param_groups]
    reordered = torch.optim.AdamW(groups)
    flatshard.load_optim_state_dict(model, reordered, osd)
    for param in model.parameters():
        for key, value in optim.state[param].items():
            assert torch.equal(reordered.state[param][key], value), key
    assert [g["weight_decay"] for g in reordered.param_groups] == [0.1, 0.0]


def holder_job(ctx: WorkerContext, folder: str) -> list[str] | None:
    """A module holding a sharded model, given to the calls that write or read one
    directory with the model's ranks together. Each call's error."""
    group = ctx.group(2)
    if group is None:
        return None
    holder = nn.ModuleDict({"model": shard(build("mlp"), group, "FULL_SHARD")})
    said = []
    for call in (
        lambda: flatshard.save_checkpoint(f"{folder}/ckpt", holder),
        lambda: flatshard.load_checkpoint(f"{folder}/ckpt", holder),
        lambda: flatshard.export_safetensors(holder, f"{folder}/export"),
    ):
        try:
            call()
            said.append("no error")
        except ValueError as error:
            said.append(str(error))
    return said


def test_a_module_holding_a_sharded_model_is_refused_where_ranks_write_together(
    pool: WorkerPool, tmp_path: Path
) -> None:
    """Before: each rank took the holder for an unsharded model and wrote alone: a
    checkpoint of rank 0's rows only (its load then failed, "Missing: 'model.0.weight'"),
    two ranks renaming one export (an interleaved pipeline's ModuleList of stages: half
    the model written, the others' renames failing)."""
    for said in pool.run(holder_job, str(tmp_path))[:2]:
        for message in said:
            assert "ModuleDict holds 1 sharded model(s) (model) and is not one" in message
    assert not list(tmp_path.iterdir())  # nothing written


def _plain_checkpoint(path: Path, scale: float = 1.0) -> nn.Module:
    model = build("mlp")
    with torch.no_grad():
        for p in model.parameters():
            p.mul_(scale)
    flatshard.save_checkpoint(path, model, extra={"scale": scale})
    return model


def test_damaged_checkpoints_are_named(tmp_path: Path) -> None:
    path = tmp_path / "ckpt"
    _plain_checkpoint(path)
    data = sorted(path.glob("*.distcp"))[0]
    blob = bytearray(data.read_bytes())
    blob[len(blob) // 2] ^= 0xFF
    data.write_bytes(bytes(blob))
    with pytest.raises(flatshard.CheckpointError, match=rf"{data.name} .*wrong checksum"):
        flatshard.load_checkpoint(path, build("mlp"))
    data.write_bytes(bytes(blob[: len(blob) // 3]))
    with pytest.raises(flatshard.CheckpointError, match=rf"{data.name} is \d+ bytes.*truncated"):
        flatshard.load_checkpoint(path, build("mlp"))
    (path / "flatshard.json").unlink()
    with pytest.raises(flatshard.CheckpointError, match=r"checkpoint directory without"):
        flatshard.load_checkpoint(path, build("mlp"))
    with pytest.raises(flatshard.CheckpointError, match="no checkpoint at"):
        flatshard.load_checkpoint(tmp_path / "nowhere", build("mlp"))
    (tmp_path / "model.pt").write_bytes(b"not a directory")
    with pytest.raises(flatshard.CheckpointError, match="is a file"):
        flatshard.load_checkpoint(tmp_path / "model.pt", build("mlp"))


def test_checkpoint_of_another_model_lists_differences(tmp_path: Path) -> None:
    path = tmp_path / "ckpt"
    _plain_checkpoint(path)
    with pytest.raises(ValueError, match=r"Missing: .*Unexpected: "):
        flatshard.load_checkpoint(path, build("gpt"))
    with pytest.raises(flatshard.CheckpointError, match="no optimizer state"):
        model = build("mlp")
        flatshard.load_checkpoint(path, model, make_optimizer(model, 1e-2))


def test_failed_save_leaves_previous_checkpoint(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    path = tmp_path / "ckpt"
    old = _plain_checkpoint(path, scale=1.0)

    killed = KeyboardInterrupt("killed mid-save")
    with internals.checkpoint_save_fails(killed), pytest.raises(KeyboardInterrupt):
        _plain_checkpoint(path, scale=2.0)
    loaded = build("mlp", seed=5)
    assert flatshard.load_checkpoint(path, loaded) == {"scale": 1.0}
    for a, b in zip(loaded.parameters(), old.parameters(), strict=True):
        assert torch.equal(a, b)


def test_a_full_disk_is_said_in_words_and_the_partial_save_removed(tmp_path: Path) -> None:
    path = tmp_path / "ckpt"
    _plain_checkpoint(path, scale=1.0)
    full = OSError(errno.ENOSPC, "No space left on device")
    with (
        internals.checkpoint_save_fails(full),
        pytest.raises(flatshard.CheckpointError, match="no space left on the device of"),
    ):
        _plain_checkpoint(path, scale=2.0)
    assert not (tmp_path / "ckpt.partial").exists()  # it would keep the disk full
    assert flatshard.load_checkpoint(path, build("mlp", seed=5)) == {"scale": 1.0}


KILL_SCRIPT = """
import sys, itertools
import flatshard
from flatshard.testing.jobs import shard_units as shard
from flatshard.testing.models import build
import torch
model = build("gpt")
for i in itertools.count():
    with torch.no_grad():
        for p in model.parameters():
            p.fill_(i)
    flatshard.save_checkpoint(sys.argv[1], model, extra={"i": i})
    print(i, flush=True)
"""


def test_killed_save_leaves_a_loadable_checkpoint(tmp_path: Path) -> None:
    """SIGKILL a process that saves in a loop: what is left is a whole checkpoint."""
    path = tmp_path / "ckpt"
    proc = subprocess.Popen(
        [sys.executable, "-c", KILL_SCRIPT, str(path)], stdout=subprocess.PIPE, text=True
    )
    assert proc.stdout is not None
    proc.stdout.readline()  # one save finished
    time.sleep(0.05)
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait()
    if not path.exists():  # killed between the two renames: the old one is kept aside
        with pytest.raises(flatshard.CheckpointError, match="previous is a complete"):
            flatshard.load_checkpoint(path, build("gpt"))
        path = tmp_path / "ckpt.previous"
    model = build("gpt")
    i = flatshard.load_checkpoint(path, model)["i"]
    assert all(bool((p == i).all()) for p in model.parameters())
