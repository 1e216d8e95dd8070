"""Write the safetensors format, streaming: sharded files plus the index Hugging Face uses.

A safetensors file is an 8-byte little-endian header length, a JSON header mapping each
name to its dtype, shape and byte range, then the raw bytes. All shapes are known before any
tensor is gathered, so the header is written first and tensors are appended as they arrive,
one at a time: memory stays at one tensor (plus whatever the caller gathers), not a model.
Files over ``max_shard_bytes`` are split like ``transformers`` does:
``model-00001-of-00003.safetensors`` plus ``model.safetensors.index.json``.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import BinaryIO

import torch

DTYPES = {
    torch.float64: "F64",
    torch.float32: "F32",
    torch.float16: "F16",
    torch.bfloat16: "BF16",
    torch.int64: "I64",
    torch.int32: "I32",
    torch.int16: "I16",
    torch.int8: "I8",
    torch.uint8: "U8",
    torch.bool: "BOOL",
    torch.float8_e4m3fn: "F8_E4M3",
    torch.float8_e5m2: "F8_E5M2",
}
INDEX = "model.safetensors.index.json"


@dataclass(frozen=True)
class Entry:
    """One tensor to write."""

    name: str
    dtype: torch.dtype
    shape: tuple[int, ...]

    @property
    def nbytes(self) -> int:
        numel = 1
        for size in self.shape:
            numel *= size
        return numel * torch.empty((), dtype=self.dtype).element_size()


def split_into_files(
    entries: list[Entry], max_shard_bytes: int, prefix: str = "model"
) -> list[tuple[str, list[Entry]]]:
    """Split ``entries`` (in write order) into files of at most ``max_shard_bytes``.

    A tensor larger than the limit gets a file of its own. ``prefix``: the files' names
    (another than "model": a part of an export, numbered even when one file).
    """
    for entry in entries:
        if entry.dtype not in DTYPES:
            raise ValueError(f"safetensors cannot store '{entry.name}' of dtype {entry.dtype}")
    groups: list[list[Entry]] = []
    size = 0
    for entry in entries:
        if not groups or (size + entry.nbytes > max_shard_bytes and groups[-1]):
            groups.append([])
            size = 0
        groups[-1].append(entry)
        size += entry.nbytes
    if len(groups) == 1 and prefix == "model":
        return [("model.safetensors", groups[0])]
    total = len(groups)
    return [(f"{prefix}-{i + 1:05d}-of-{total:05d}.safetensors", g) for i, g in enumerate(groups)]


def weight_map(files: list[tuple[str, list[Entry]]]) -> tuple[dict[str, str], int]:
    """Which file holds each name, and the bytes of them all."""
    names = {e.name: name for name, group in files for e in group}
    return names, sum(e.nbytes for _, group in files for e in group)


def write_index(out_dir: Path, names: dict[str, str], total_size: int) -> None:
    """``model.safetensors.index.json``: which file holds each name."""
    index = {"metadata": {"total_size": total_size}, "weight_map": names}
    (out_dir / INDEX).write_text(json.dumps(index, indent=2))


class FileWriter:
    """Appends the planned tensors of one file, in the planned order."""

    def __init__(self, handle: BinaryIO, entries: list[Entry]) -> None:
        self._handle = handle
        self._pending = list(reversed(entries))
        header: dict[str, object] = {"__metadata__": {"format": "pt"}}
        offset = 0
        for entry in entries:
            end = offset + entry.nbytes
            header[entry.name] = {
                "dtype": DTYPES[entry.dtype],
                "shape": list(entry.shape),
                "data_offsets": [offset, end],
            }
            offset = end
        blob = json.dumps(header, separators=(",", ":")).encode()
        blob += b" " * (-len(blob) % 8)  # data starts 8-byte aligned
        handle.write(len(blob).to_bytes(8, "little"))
        handle.write(blob)

    def write(self, name: str, tensor: torch.Tensor) -> None:
        entry = self._pending.pop()
        if entry.name != name or tuple(tensor.shape) != entry.shape or tensor.dtype != entry.dtype:
            raise RuntimeError(
                f"safetensors writer: expected '{entry.name}' {entry.shape} {entry.dtype}, "
                f"got '{name}' {tuple(tensor.shape)} {tensor.dtype}"
            )
        data = tensor.detach().to("cpu").contiguous().reshape(-1).view(torch.uint8)
        self._handle.write(data.numpy().tobytes())

    def close(self) -> None:
        if self._pending:
            raise RuntimeError(f"safetensors writer: '{self._pending[-1].name}' never arrived")


class StreamWriter:
    """Writes the planned files one after another; tensors arrive in the planned order.

    Each file is written under a temporary name and renamed once complete.
    """

    def __init__(
        self, out_dir: Path, entries: list[Entry], max_shard_bytes: int, prefix: str = "model"
    ) -> None:
        out_dir.mkdir(parents=True, exist_ok=True)
        self.out_dir = out_dir
        self.files = split_into_files(entries, max_shard_bytes, prefix)
        self._next_file = 0
        self._writer: FileWriter | None = None
        self._handle: BinaryIO | None = None
        self._left = 0

    def write(self, name: str, tensor: torch.Tensor) -> None:
        if self._writer is None:
            self._open_next()
        assert self._writer is not None
        self._writer.write(name, tensor)
        self._left -= 1
        if self._left == 0:
            self._close_current()

    def _open_next(self) -> None:
        if self._next_file == len(self.files):
            raise RuntimeError("safetensors writer: more tensors than planned")
        _, entries = self.files[self._next_file]
        self._handle = self._partial_path(self._next_file).open("wb")
        self._writer = FileWriter(self._handle, entries)
        self._left = len(entries)

    def _close_current(self) -> None:
        assert self._writer is not None and self._handle is not None
        self._writer.close()
        self._handle.close()
        name, _ = self.files[self._next_file]
        os.replace(self._partial_path(self._next_file), self.out_dir / name)
        self._writer = self._handle = None
        self._next_file += 1

    def _partial_path(self, index: int) -> Path:
        return self.out_dir / (self.files[index][0] + ".partial")

    def finish(self, index: bool = True) -> list[str]:
        """Write the index (``index``: where there are 2+ files); the files written."""
        if self._writer is not None or self._next_file != len(self.files):
            raise RuntimeError("safetensors writer: finished before every tensor arrived")
        if index and len(self.files) > 1:
            write_index(self.out_dir, *weight_map(self.files))
        return [name for name, _ in self.files]
