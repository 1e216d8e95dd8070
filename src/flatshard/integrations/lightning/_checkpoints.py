"""Lightning checkpoints of a sharded model: a flatshard checkpoint directory, or one file.

[Note: Lightning's part of a sharded checkpoint]
Lightning's checkpoint is one dict: the model's and optimizers' state plus its own (epoch,
loops, callbacks, learning-rate schedulers, hyperparameters, the precision plugin's
scaler). Sharded (the default), the model and optimizers go through
``flatshard.save_checkpoint`` (each rank writes its rows; any world size and strategy
loads it, resharding), and Lightning's own part rides in its ``extra``, serialized by
``torch.save`` as Lightning would write it to a file, so that hyperparameters of any type
survive and the whole directory is still swapped in atomically. Loading reads it back with
Lightning's ``weights_only`` choice. Full (``state_dict_type="full"``), rank 0 writes one
``torch.save`` file with the full state dict and full optimizer states, as Lightning's
other strategies do; loading it shards it again on every rank.
"""

from __future__ import annotations

import io
import shutil
from pathlib import Path
from typing import Any

import torch
from torch import nn

import flatshard

MANIFEST = "flatshard.json"  # what marks a flatshard checkpoint directory
LIGHTNING_KEY = "lightning"


def is_sharded_checkpoint(path: Path) -> bool:
    return path.is_dir() and (path / MANIFEST).is_file()


def save_sharded(
    checkpoint: dict[str, Any],
    path: Path,
    model: nn.Module,
    optimizers: list[Any],
    async_op: bool = False,
) -> flatshard.CheckpointSave | None:
    """Every rank: write a Trainer ``checkpoint`` as a flatshard checkpoint directory (in
    the background with ``async_op``: its handle)."""
    rest = {k: v for k, v in checkpoint.items() if k not in ("state_dict", "optimizer_states")}
    saved = optimizers if "optimizer_states" in checkpoint else []  # weights_only saves
    return write(path, model, saved, rest, async_op)


def write(
    path: Path,
    model: nn.Module,
    optimizers: list[Any],
    rest: dict[str, Any],
    async_op: bool = False,
) -> flatshard.CheckpointSave | None:
    """Every rank: model and optimizers through flatshard, ``rest`` (Lightning's own
    state) as ``torch.save`` bytes in the checkpoint's extra."""
    if path.is_file():
        raise FileExistsError(
            f"flatshard.integrations.lightning: {path} is a file (a full checkpoint); a "
            "sharded checkpoint is a directory. Remove it or save under another name."
        )
    buffer = io.BytesIO()
    torch.save(rest, buffer)
    blob = torch.frombuffer(bytearray(buffer.getvalue()), dtype=torch.uint8)
    return flatshard.save_checkpoint(
        path, model, optimizers or None, extra={LIGHTNING_KEY: blob}, async_op=async_op
    )


def read(
    path: Path,
    model: nn.Module,
    optimizers: list[Any],
    *,
    strict: bool,
    weights_only: bool | None,
) -> dict[str, Any]:
    """Every rank: load a directory ``write`` wrote; return its ``rest``."""
    extra = flatshard.load_checkpoint(path, model, optimizers or None, strict=strict)
    if LIGHTNING_KEY not in extra:
        raise flatshard.CheckpointError(
            f"flatshard.integrations.lightning: {path} is a flatshard checkpoint without "
            "Lightning's state (saved by flatshard.save_checkpoint, not by Lightning); "
            "load its weights with flatshard.load_checkpoint instead."
        )
    rest: dict[str, Any] = torch.load(
        io.BytesIO(extra[LIGHTNING_KEY].numpy().tobytes()),
        map_location="cpu",
        weights_only=weights_only,
    )
    return rest


def load(
    path: Path,
    model: nn.Module,
    optimizers: list[Any],
    *,
    strict: bool,
    weights_only: bool | None,
) -> dict[str, Any]:
    """Every rank: load ``path`` (sharded or full) into ``model`` and ``optimizers`` (none
    outside fitting); return Lightning's part of the checkpoint."""
    if is_sharded_checkpoint(path):
        return read(path, model, optimizers, strict=strict, weights_only=weights_only)
    if path.is_dir():
        raise flatshard.CheckpointError(
            f"flatshard.integrations.lightning: {path} is a directory but not a flatshard "
            f"checkpoint (no {MANIFEST}); pass the checkpoint FlatshardStrategy saved."
        )
    checkpoint: dict[str, Any] = torch.load(path, map_location="cpu", weights_only=weights_only)
    flatshard.load_state_dict(model, checkpoint.pop("state_dict"), strict=strict)
    states = checkpoint.pop("optimizer_states", [])
    if optimizers and len(states) != len(optimizers):
        raise flatshard.CheckpointError(
            f"flatshard.integrations.lightning: {path} holds {len(states)} optimizer states, "
            f"configure_optimizers made {len(optimizers)}; resume with the same optimizers."
        )
    for optimizer, state in zip(optimizers, states, strict=False):
        flatshard.load_optim_state_dict(model, optimizer, state)
    return checkpoint


def remove(path: Path) -> None:
    """Rank 0: delete a checkpoint, file or directory."""
    if path.is_dir():
        shutil.rmtree(path)
    elif path.exists():
        path.unlink()
