"""Which checkpoints a directory holds: a checkpoint's manifest, the newest whole one, and
the older ones a save with ``keep=N`` removes.

[Note: numbered checkpoints]
A run saves its checkpoints side by side under names that differ in a trailing number
(``step_000120``, ``epoch-3``). ``latest_checkpoint(directory)`` is the whole one (a
manifest that reads) with the highest number: a save cut short (``.partial``), a
directory another tool wrote, a damaged manifest are passed over for an older whole one.
``save_checkpoint(path, ..., keep=N)``, once ``path`` is committed (by the background
writer for an asynchronous save), removes the whole checkpoints of the same series (the
same name up to the number) with lower numbers, so that N stay: a save that fails leaves
the older ones, and a pending one is never counted. Other names in the directory are
never touched.
"""

from __future__ import annotations

import json
import os
import re
import shutil
from pathlib import Path
from typing import Any

from flatshard.state._errors import CheckpointError

MANIFEST = "flatshard.json"
FORMAT = "flatshard-checkpoint"
VERSION = 1
_NUMBERED = re.compile(r"^(.*?)(\d+)$")


def read_manifest(target: Path) -> dict[str, Any]:
    """The manifest of a checkpoint directory, or an error saying what is there instead."""
    if not target.exists():
        hint = ""
        if target.with_name(target.name + ".previous").exists():
            hint = (
                f" {target.name}.previous is a complete checkpoint left by a save that was "
                f"interrupted between its two renames: rename it to {target.name}."
            )
        elif target.with_name(target.name + ".partial").exists():
            hint = f" {target.name}.partial is an unfinished save; it cannot be loaded."
        raise CheckpointError(f"flatshard: no checkpoint at {target}.{hint}")
    if not target.is_dir():
        raise CheckpointError(
            f"flatshard: {target} is a file; a flatshard checkpoint is a directory written "
            "by flatshard.save_checkpoint."
        )
    manifest_path = target / MANIFEST
    if not manifest_path.exists():
        what = (
            "a torch.distributed.checkpoint directory"
            if (target / ".metadata").exists()
            else "a directory"
        )
        raise CheckpointError(
            f"flatshard: {target} is {what} without {MANIFEST}: not written by "
            "flatshard.save_checkpoint (or its save never finished)."
        )
    try:
        manifest = json.loads(manifest_path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as error:
        raise CheckpointError(f"flatshard: {manifest_path} is damaged: {error}") from None
    if not isinstance(manifest, dict) or manifest.get("format") != FORMAT:
        raise CheckpointError(f"flatshard: {manifest_path} is not a flatshard manifest.")
    if manifest.get("version") != VERSION:
        raise CheckpointError(
            f"flatshard: {target} has checkpoint format version {manifest.get('version')}; "
            f"this flatshard reads version {VERSION}."
        )
    return manifest


def latest_checkpoint(directory: str | os.PathLike[str]) -> Path | None:
    """The newest whole checkpoint in ``directory``: the one whose name ends in the highest
    number (``step_000120``), among those with a manifest that reads; None if there is none
    (or no such directory). Names without a trailing number are not considered."""
    for path in reversed(numbered_checkpoints(Path(directory))):
        try:
            read_manifest(path)
        except CheckpointError:
            continue  # damaged or foreign: an older one may be whole
        return path
    return None


def numbered_checkpoints(directory: Path, series: str | None = None) -> list[Path]:
    """Directories in ``directory`` named ``<series><number>``, lowest number first (any
    series if None); ``.partial`` and ``.previous`` ones end in no number."""
    if not directory.is_dir():
        return []
    found = []
    for path in directory.iterdir():
        match = _NUMBERED.match(path.name)
        if match and path.is_dir() and series in (None, match.group(1)):
            found.append((int(match.group(2)), path.name, path))
    return [path for _, _, path in sorted(found)]


def check_keep(target: Path, keep: int | None) -> None:
    """``keep`` is a number >= 1, for a name that ends in a number (before anything is
    sent: every rank checks alike)."""
    if keep is None:
        return
    if isinstance(keep, bool) or not isinstance(keep, int) or keep < 1:
        raise ValueError(f"flatshard.save_checkpoint: keep must be an int >= 1, got {keep!r}")
    if not _NUMBERED.match(target.name):
        raise ValueError(
            f"flatshard.save_checkpoint: keep={keep} removes older checkpoints of the same "
            f"series, named alike up to a trailing number, but '{target.name}' ends in no "
            "number; name checkpoints like step_000120 (or drop keep)."
        )


def prune_older(target: Path, keep: int) -> None:
    """Remove the whole checkpoints of ``target``'s series numbered below it, but the
    ``keep`` - 1 newest of them (``target`` is committed)."""
    match = _NUMBERED.match(target.name)
    assert match is not None  # check_keep
    number = int(match.group(2))
    older = [
        path
        for path in numbered_checkpoints(target.parent, match.group(1))
        if int(_NUMBERED.match(path.name).group(2)) < number  # type: ignore[union-attr]
        and (path / MANIFEST).is_file()
    ]
    for path in older[: max(0, len(older) - (keep - 1))]:
        shutil.rmtree(path, ignore_errors=True)
