"""Where ``flatshard train`` keeps its checkpoints: which one ``--resume`` names (and one
this run's model cannot take), and a ``--ckpt-dir`` that cannot hold them found before
training."""

from __future__ import annotations

import os
import shutil
from pathlib import Path
from typing import Any

import flatshard
from flatshard.cli.config import ConfigError
from flatshard.cli.internals import EXTRA, checkpoint_metadata, load_raw, read_manifest
from flatshard.cli.lm.config import TrainConfig
from flatshard.state import CheckpointError


def resume_from(config: TrainConfig) -> Path | None:
    """The checkpoint ``--resume`` names (None: start from step 0).

    A directory; ``latest``, the newest ``step_*`` (an error if there is none or it is
    damaged); ``auto``, the newest whole one, or a fresh start if there is none: the
    setting for a job that is restarted after a crash (a save cut short is never picked).
    """
    if not config.resume:
        return None
    if config.resume == "auto":  # a damaged one is passed over for an older whole one
        return flatshard.latest_checkpoint(config.checkpoint_dir)
    latest = config.resume == "latest"
    path = _newest_saved(config.checkpoint_dir) if latest else Path(config.resume)
    try:
        read_manifest(path)
    except CheckpointError as error:
        raise ConfigError(f"--resume: {str(error).removeprefix('flatshard: ')}") from None
    return path


def check_resumable(config: TrainConfig, path: Path | None) -> None:
    """A checkpoint of a model this run builds otherwise is refused before any rank
    starts: the built-in GPT ties its head to its embedding, and pipeline stages (--pp 2
    or more) keep the two apart, so a checkpoint saved on one side of --pp 1 names state
    the other model has not (a rank's traceback, before)."""
    if path is None or config.model != "gpt":
        return
    saved = saved_options(path)
    was, now = int(saved.get("pp", 1)), config.pp
    if (was > 1) == (now > 1):
        return

    def tie(pp: int) -> str:
        return "its head apart from its embedding" if pp > 1 else "its head tied to its embedding"

    keep = "--pp 2 or more (any --pp-schedule)" if was > 1 else "--pp 1"
    raise ConfigError(
        f"--resume: {path} holds a GPT trained with --pp {was}, {tie(was)}; --pp {now} builds "
        f"{tie(now)}: another model, which the checkpoint cannot load. Resume with {keep}."
    )


def saved_options(path: Path) -> dict[str, Any]:
    """The options of the run that saved ``path`` (rank 0's record; {} if it has none)."""
    key = f"{EXTRA}0"
    if key not in checkpoint_metadata(path).state_dict_metadata:
        return {}
    holder: dict[str, Any] = {key: None}
    load_raw(path, holder)
    extra = holder[key]
    options = extra.get("config") if isinstance(extra, dict) else None
    return options if isinstance(options, dict) else {}


def check_checkpoint_dir(config: TrainConfig) -> None:
    """An unwritable ``--ckpt-dir`` is found before training, not at the first save."""
    if not config.ckpt_every and not config.ckpt_on_preempt:
        return
    directory = config.checkpoint_dir
    try:
        directory.mkdir(parents=True, exist_ok=True)
        probe = directory / f".write-test-{os.getpid()}"
        probe.write_bytes(b"0")
        probe.unlink()
    except OSError as error:
        raise ConfigError(
            f"--ckpt-dir {directory}: cannot write there ({error.strerror or error}); choose "
            "a writable directory (or --ckpt-every 0 to save nothing)."
        ) from None


def check_checkpoint_room(config: TrainConfig, params: int) -> None:
    """A ``--ckpt-dir`` too small for the checkpoints kept is found before training.

    A checkpoint holds the parameters and AdamW's two moments in fp32 (12 bytes per
    parameter); ``--keep-ckpts`` of them stay, and one more is written before the oldest
    is removed.
    """
    if not config.ckpt_every:
        return
    directory = config.checkpoint_dir
    need = 12 * params * (config.keep_ckpts + 1)
    free = shutil.disk_usage(directory).free
    if free < need:
        raise ConfigError(
            f"--ckpt-dir {directory}: {free / 2**20:,.0f} MiB free, but --keep-ckpts "
            f"{config.keep_ckpts} checkpoints plus the one being written need about "
            f"{need / 2**20:,.0f} MiB ({12 * params / 2**20:,.0f} MiB each: parameters and "
            "AdamW moments in fp32). Free space, lower --keep-ckpts, or choose another "
            "--ckpt-dir."
        )


def saved_checkpoints(directory: Path) -> list[Path]:
    """``step_NNNNNN`` directories, oldest first (not ``.partial`` or ``.previous`` ones)."""
    return sorted(directory.glob("step_[0-9]*[0-9]"))


def _newest_saved(directory: Path) -> Path:
    found = saved_checkpoints(directory)
    if not found:
        raise ConfigError(f"--resume latest: no checkpoint (step_*) in {directory}")
    return found[-1]
