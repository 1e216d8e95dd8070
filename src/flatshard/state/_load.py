"""``flatshard.load_safetensors``: each rank reads only its own rows of a safetensors checkpoint.

[Note: sharded loading]
Starting a sharded model from pretrained weights the usual way (rank 0 loads the whole
model, ``sync_module_states`` broadcasts it) needs the whole model in one process's memory.
Here every rank opens the files memory-mapped and, for each tensor, reads just the rows its
shard holds (``safe_open(...).get_slice(name)[first:last]`` reads that byte range only), so
a rank holds its shard plus one tensor's rows at a time, and no collective is needed beyond
the agreement on the call. Tied parameters (one tensor under two names; checkpoints keep one
name) are loaded once. Names and shapes are checked before anything is written: every
missing, unexpected or mis-shaped entry in one error.
"""

from __future__ import annotations

import json
import os
import zlib
from collections.abc import Iterator
from contextlib import ExitStack
from pathlib import Path
from typing import Any

import torch
from torch import nn

from flatshard.comm._agreement import check_same_on_all_ranks
from flatshard.runtime._changes import mark_loaded
from flatshard.runtime._step import every_rank_calls
from flatshard.state._state_dict import (
    HeldRows,
    Names,
    agree_on_names,
    entries_do_not_fit,
    model_device,
    model_group,
    param_places,
    plain_state_dict,
    renamed,
    reshard_for_load,
)

INDEX = "model.safetensors.index.json"
_SAMPLE = 1 << 16  # bytes checksummed at each end of a file
_IN_TENSOR = 64  # bytes checksummed at the start, the middle and the end of each tensor
SINGLE = "model.safetensors"


@every_rank_calls("load_safetensors", agreed=("path", "strict", "dtype", "names"))
def load_safetensors(
    model: nn.Module,
    path: str | os.PathLike[str],
    *,
    strict: bool = True,
    dtype: torch.dtype | None = None,
    names: Names | None = None,
) -> None:
    """Load a safetensors checkpoint (a file, or a directory with ``model.safetensors`` or
    ``model.safetensors.index.json`` and its shards) into ``model``, sharded or not.

    Each rank reads only the rows of each tensor its shard holds (see [Note: sharded
    loading]). ``strict``: every model entry must be in the files and every file entry in
    the model (one error lists all that do not fit; shapes are always checked).
    ``dtype``: read floating-point tensors as this dtype first (default: as stored; they are
    then converted to the model's dtype). ``names``: each model entry's name in the files
    (a ``state_dict()`` key -> the file's key, or None for an entry the files do not hold,
    which keeps its values and is not missing), e.g. for a peft model over a base
    checkpoint. A collective: call it on every rank.
    """
    try:
        from safetensors import safe_open
    except ImportError:  # pragma: no cover - an optional dependency
        raise ImportError(
            "flatshard.load_safetensors needs safetensors: pip install safetensors"
        ) from None
    files = tensor_files(Path(path))
    agree_on_names(model, names, "load_safetensors")
    targets = renamed(plain_state_dict(model), names, "load_safetensors")
    places = param_places(model)
    with ExitStack() as stack:
        handles = {
            f: stack.enter_context(safe_open(str(f), framework="pt")) for f in set(files.values())
        }
        _check_names(targets, files, handles, places, strict)
        _check_same_checkpoint(model, files)
        reshard_for_load(model, "load_safetensors")
        loaded: set[int] = set()
        for key, target in targets.items():
            if id(target) in loaded or key not in files:
                continue  # a tied alias (loaded under its other name), or not strict
            rows = _read_rows(handles[files[key]], key, places.get(id(target)))
            if dtype is not None and rows.is_floating_point():
                rows = rows.to(dtype)
            with torch.no_grad():
                target.detach().copy_(rows.view(target.shape))
            mark_loaded(target)
            loaded.add(id(target))


def tensor_files(path: Path) -> dict[str, Path]:
    """tensor name -> the file holding it, for a file or a checkpoint directory."""
    if path.is_file():
        return {name: path for name in _names_in(path)}
    index = path / INDEX
    if index.is_file():
        weight_map: dict[str, str] = json.loads(index.read_text())["weight_map"]
        return {name: path / file for name, file in weight_map.items()}
    if (path / SINGLE).is_file():
        return tensor_files(path / SINGLE)
    raise FileNotFoundError(
        f"flatshard.load_safetensors: {path} is neither a .safetensors file nor a directory "
        f"holding {SINGLE} or {INDEX}"
    )


def _check_same_checkpoint(model: nn.Module, files: dict[str, Path]) -> None:
    """An error on every rank unless all ranks read the same checkpoint.

    Each rank reads only its rows, so ranks given different checkpoints (another path on
    one host, a stale copy) would make one model of several, silently. Compared: every
    file's size and a CRC of samples (``file_line``), in one digest all-gather
    (``check_same_on_all_ranks``).
    """
    group = model_group(model)
    if group is None:
        return
    lines = [file_line(file) for file in sorted(set(files.values()))]
    device = model_device(model)
    fix = "Pass the same checkpoint (the same files) to load_safetensors on every rank."
    check_same_on_all_ranks(
        lines, group, device, "read different checkpoints", fix, "load_safetensors"
    )


def file_line(file: Path) -> str:
    """The file's size and a CRC of samples: its first and last 64 KiB (the header and
    some values) and, in every tensor, ``_IN_TENSOR`` bytes at the start, the middle and
    the end of its data, so that files alike but for one tensor differ (a stale copy with
    one layer fine-tuned). A few hundred small reads, not the whole file."""
    size = file.stat().st_size
    with file.open("rb") as handle:
        crc = zlib.crc32(handle.read(_SAMPLE))
        handle.seek(max(0, size - _SAMPLE))
        crc = zlib.crc32(handle.read(_SAMPLE), crc)
        handle.seek(0)
        header_size = int.from_bytes(handle.read(8), "little")
        try:
            header = json.loads(handle.read(header_size)) if header_size < size else {}
        except ValueError:  # not a safetensors header: the loader will say so
            header = {}
        for name in sorted(k for k in header if k != "__metadata__"):
            begin, end = header[name].get("data_offsets", (0, 0))
            for at in (begin, (begin + end) // 2, end - _IN_TENSOR):
                handle.seek(8 + header_size + max(begin, at))
                crc = zlib.crc32(handle.read(min(_IN_TENSOR, end - begin)), crc)
    return f"{file.name}: {size} bytes, sampled crc32 {crc}"


def _names_in(file: Path) -> Iterator[str]:
    from safetensors import safe_open

    with safe_open(str(file), framework="pt") as handle:
        yield from handle.keys()


def _check_names(
    targets: dict[str, torch.Tensor],
    files: dict[str, Path],
    handles: dict[Path, Any],
    places: dict[int, HeldRows],
    strict: bool,
) -> None:
    """One error for every entry that does not fit: missing, unexpected, mis-shaped."""
    problems = []
    present = {id(t) for k, t in targets.items() if k in files}  # tied: any name will do
    for key, target in targets.items():
        place = places.get(id(target))
        shape = tuple(place.global_shape if place is not None else target.shape)
        if key in files:
            stored = tuple(handles[files[key]].get_slice(key).get_shape())
            if stored != shape:
                problems.append(f"'{key}': the file holds shape {stored}, the model {shape}")
        elif strict and id(target) not in present:
            problems.append(f"'{key}': missing from the checkpoint (model shape {shape})")
    if strict:
        problems += [
            f"'{k}': in the checkpoint, not in the model" for k in files if k not in targets
        ]
    if problems:
        raise entries_do_not_fit("load_safetensors", problems)


def _read_rows(handle: Any, key: str, place: HeldRows | None) -> torch.Tensor:
    """This rank's rows of tensor ``key`` (all of it for buffers and unsharded tensors).

    A tensor-parallel parameter's rows lie in its TP shard: the box from the shard's
    offset, the rows along dim 0 and the shard's extent along the others.
    """
    if place is None or place.flat is None or len(place.full_shape) == 0:
        tensor: torch.Tensor = handle.get_tensor(key)
        if place is not None and place.tp is not None:
            tensor = place.tp.local_part(tensor)
        return tensor if place is None or place.rows else tensor.reshape(1)[:0]
    base = place.tp.offset if place.tp is not None else (0,) * len(place.full_shape)
    first = base[0] + place.first_row
    box = [slice(first, first + place.rows)]
    box += [slice(b, b + n) for b, n in zip(base[1:], place.full_shape[1:], strict=True)]
    rows: torch.Tensor = handle.get_slice(key)[tuple(box)]
    return rows
