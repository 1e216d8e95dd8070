"""Sharded loading from safetensors (``flatshard.load_safetensors``, ``flatshard.skip_init``).

A model built on the meta device and sharded with ``skip_init`` loads a checkpoint written
by an unsharded model (several files and an index, tied weights stored once): at world
sizes 2 and 3 its full state dict and its logits equal the unsharded model's, and while
loading a rank holds no more than the largest tensor's rows beyond its shard.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import save_file
from torch import nn

import flatshard
from flatshard.measure import PeakStorage
from flatshard.testing import internals
from flatshard.testing.models import TinyGPT
from flatshard.testing.workers import WorkerContext, WorkerPool

SEED = 3


def _reference() -> TinyGPT:
    torch.manual_seed(SEED)
    return TinyGPT(vocab=41, dim=16, heads=2, layers=3)  # its causal masks: persistent buffers


def write_checkpoint(directory: Path) -> None:
    """The reference model's state dict in two files and an index; the tied head once."""
    state = {k: v.clone() for k, v in _reference().state_dict().items() if k != "head.weight"}
    names = sorted(state)
    halves = {"model-00001-of-00002.safetensors": names[::2]}
    halves["model-00002-of-00002.safetensors"] = names[1::2]
    weight_map = {}
    for file, keys in halves.items():
        save_file({k: state[k] for k in keys}, str(directory / file))
        weight_map.update(dict.fromkeys(keys, file))
    index = {"metadata": {}, "weight_map": weight_map}
    (directory / "model.safetensors.index.json").write_text(json.dumps(index))


def _meta_sharded(ctx: WorkerContext, world: int) -> nn.Module | None:
    group = ctx.group(world)
    if group is None:
        return None
    with torch.device("meta"):
        model = TinyGPT(vocab=41, dim=16, heads=2, layers=3)
    return flatshard.fully_shard(
        model,
        auto_wrap_policy=set(TinyGPT.UNIT_CLASSES),
        process_group=group,
        param_init_fn=flatshard.skip_init,
        device="cpu",
    )


def load_job(ctx: WorkerContext, world: int, directory: str) -> dict[str, Any] | None:
    model = _meta_sharded(ctx, world)
    if model is None:
        return None
    idx = torch.randint(0, 41, (2, 9), generator=torch.Generator().manual_seed(0))
    try:
        model(idx)
        refused = ""
    except RuntimeError as error:
        refused = str(error)
    shard = sum(p.numel() * p.element_size() for p in model.parameters())
    with PeakStorage() as peak:
        flatshard.load_safetensors(model, directory)
    largest_rows = max(p.numel() * p.element_size() for p in model.parameters())
    full = flatshard.full_state_dict(model)
    with torch.no_grad():
        logits = model(idx)
    return {
        "refused": refused,
        "peak": peak.peak,
        "largest_rows": largest_rows,
        "shard": shard,
        "full": full,
        "logits": logits,
    }


@pytest.mark.parametrize("world", [2, 3])
def test_load_equals_the_unsharded_model(pool: WorkerPool, tmp_path: Path, world: int) -> None:
    write_checkpoint(tmp_path)
    reference = _reference()
    idx = torch.randint(0, 41, (2, 9), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        expected = reference(idx)
    results = pool.run(load_job, world, str(tmp_path))[:world]
    for rank, result in enumerate(results):
        assert "was sharded with param_init_fn=flatshard.skip_init" in result["refused"]
        assert "Call flatshard.load_safetensors(model, path)" in result["refused"]
        if rank == 0:
            for key, value in reference.state_dict().items():
                assert torch.equal(result["full"][key], value), key
        torch.testing.assert_close(result["logits"], expected, rtol=1e-6, atol=0)
        # One tensor's rows in flight at a time, beyond the shard itself.
        assert result["peak"] <= result["largest_rows"] + 1024, result


def bad_checkpoint_job(ctx: WorkerContext, directory: str) -> str | None:
    model = _meta_sharded(ctx, 2)
    if model is None:
        return None
    try:
        flatshard.load_safetensors(model, directory)
    except ValueError as error:
        return str(error)
    return "no error"


def test_every_entry_that_does_not_fit_is_one_error(pool: WorkerPool, tmp_path: Path) -> None:
    state = {k: v.clone() for k, v in _reference().state_dict().items() if k != "head.weight"}
    del state["blocks.0.attn.qkv.weight"]
    state["tok.weight"] = torch.zeros(40, 16)
    state["extra.weight"] = torch.zeros(2)
    save_file(state, str(tmp_path / "model.safetensors"))
    for message in pool.run(bad_checkpoint_job, str(tmp_path))[:2]:
        assert "3 entries do not fit the model" in message, message
        assert "'tok.weight': the file holds shape (40, 16), the model (41, 16)" in message
        assert "'blocks.0.attn.qkv.weight': missing from the checkpoint" in message
        assert "'extra.weight': in the checkpoint, not in the model" in message


def two_checkpoints_job(ctx: WorkerContext, first: str, second: str, relative: bool) -> str | None:
    """Rank 0 reads ``first``, rank 1 ``second``; ``relative``: each by its name from the
    folder above it (the same path on both ranks, other files on each)."""
    model = _meta_sharded(ctx, 2)
    if model is None:
        return None
    mine = Path(first if ctx.rank == 0 else second)
    here = os.getcwd()
    try:
        os.chdir(mine.parent)
        flatshard.load_safetensors(model, mine.name if relative else mine)
    except (ValueError, flatshard.CollectiveError) as error:
        return str(error)
    finally:
        os.chdir(here)
    return "no error"


def test_ranks_given_different_checkpoints_is_an_error(pool: WorkerPool, tmp_path: Path) -> None:
    """Each rank reads only its rows: two checkpoints would make one model of both. Two
    paths are told apart before anything is read; the same path naming other files on one
    rank (here: relative, from another folder; on a cluster: a stale copy on one host), by
    the files' sizes and samples."""
    for side in ("a", "b"):
        (tmp_path / side / "ckpt").mkdir(parents=True)
    write_checkpoint(tmp_path / "a" / "ckpt")
    torch.manual_seed(SEED + 1)
    other = TinyGPT(vocab=41, dim=16, heads=2, layers=3).state_dict()
    save_file(
        {k: v for k, v in other.items() if k != "head.weight"},
        str(tmp_path / "b" / "ckpt" / "model.safetensors"),
    )
    paths = str(tmp_path / "a" / "ckpt"), str(tmp_path / "b" / "ckpt")
    for message in pool.run(two_checkpoints_job, *paths, True)[:2]:
        assert "flatshard.load_safetensors: ranks read different checkpoints" in message, message
        assert "Pass the same checkpoint" in message
    for message in pool.run(two_checkpoints_job, *paths, False)[:2]:
        assert "load_safetensors(path=" in message and "/b/ckpt'" in message, message


def test_files_alike_but_for_one_tensor_in_the_middle_are_told_apart(tmp_path: Path) -> None:
    """The files' sizes and their first and last 64 KiB are the same; one tensor between
    differs (a stale copy with one layer fine-tuned): the line the ranks compare differs.
    Before: only the ends were sampled, and the ranks loaded a mix of the two."""
    pad = torch.zeros(1 << 16)  # 256 KiB at each end
    tensors = {"a.pad": pad, "b.layer": torch.ones(1000, 16), "c.pad": pad.clone()}
    save_file(tensors, str(tmp_path / "one.safetensors"))
    tensors["b.layer"] = tensors["b.layer"] * 2.0
    save_file(tensors, str(tmp_path / "two.safetensors"))
    save_file({**tensors}, str(tmp_path / "three.safetensors"))
    one, two, three = (
        internals.checkpoint_file_line(tmp_path / f"{n}.safetensors").split(": ", 1)[1]
        for n in ("one", "two", "three")
    )
    assert one != two
    assert two == three


def test_names_map_model_entries_to_the_files_names(tmp_path: Path) -> None:
    """``names=``: a model whose entries are named otherwise than the files (peft's wrapped
    base); None leaves an entry out (kept as initialized, not missing); two entries mapped to
    one file name is an error, not one overwriting the other."""
    torch.manual_seed(SEED)
    stored = nn.Sequential(nn.Linear(3, 4), nn.Linear(4, 2))
    save_file(
        {f"net.{k}": v for k, v in stored.state_dict().items()}, str(tmp_path / "w.safetensors")
    )
    model = nn.Sequential(nn.Linear(3, 4), nn.Linear(4, 2), nn.Linear(2, 2))
    extra = model[2].weight.detach().clone()
    path = tmp_path / "w.safetensors"
    flatshard.load_safetensors(model, path, names=lambda k: None if k[0] == "2" else f"net.{k}")
    for key, value in stored.state_dict().items():
        assert torch.equal(model.state_dict()[key], value)
    assert torch.equal(model[2].weight, extra)
    with pytest.raises(ValueError, match=r"names= maps both '0\.weight' and '0\.bias' to 'net\.x'"):
        flatshard.load_safetensors(model, path, names=lambda k: "net.x")
