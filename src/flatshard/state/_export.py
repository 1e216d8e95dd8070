"""Export full weights as safetensors: from a live sharded model, or offline from a checkpoint.

Both stream: a live model is gathered one flat parameter group at a time (rank 0 writes each
tensor as it arrives); a checkpoint directory is read one output file at a time on CPU,
with no process group. The result loads with ``safetensors.torch.load_file`` into the plain
model (same names as its ``state_dict()``; tied parameters are written under each name).
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import cast

import torch
from torch import nn

from flatshard.comm._agreement import check_same_on_all_ranks, global_rank, rank_in
from flatshard.comm._collectives import all_gather_object
from flatshard.runtime._by_hand import gather_copies
from flatshard.runtime._changes import refuse_differed
from flatshard.runtime._step import PipelineSeat, context_of, every_rank_calls
from flatshard.state._checkpoint import (
    MODEL,
    checkpoint_metadata,
    is_tensor_entry,
    load_raw,
    verify_files,
)
from flatshard.state._directory import read_manifest
from flatshard.state._errors import CheckpointError
from flatshard.state._lora import LoraMerge
from flatshard.state._safetensors import INDEX, Entry, StreamWriter, weight_map, write_index
from flatshard.state._state_dict import (
    HeldRows,
    Names,
    agree_on_names,
    checkpoint_group,
    flat_params,
    model_group,
    param_places,
    plain_state_dict,
    renamed,
    tensor_parallel_of,
)

DEFAULT_SHARD_BYTES = 5 * 2**30  # transformers' default max_shard_size


@every_rank_calls(
    "export_safetensors",
    agreed=("out_dir", "max_shard_bytes", "dtype", "names"),
    over_stages=True,  # one directory of every stage ([Note: an export of pipeline stages])
)
def export_safetensors(
    model: nn.Module,
    out_dir: str | os.PathLike[str],
    *,
    max_shard_bytes: int = DEFAULT_SHARD_BYTES,
    dtype: torch.dtype | None = None,
    names: Names | None = None,
) -> list[str]:
    """Write the model's full state dict to ``out_dir`` as safetensors; a collective.

    Rank 0 of the model's group writes; at most one flat parameter group is gathered at a time.
    ``dtype``: cast floating-point tensors (e.g. ``torch.bfloat16``); default as stored.
    A Hugging Face model also gets its ``config.json`` (and ``generation_config.json``), so
    ``from_pretrained(out_dir)`` loads the result: this is ``save_pretrained`` for a sharded
    model. ``names``: each entry's name in the files (a ``state_dict()`` key -> the name to
    write, or None to leave it out). A peft LoRA model without ``names`` is written as the
    base model it computes: each base weight with its active adapters merged, under the
    base model's names ([Note: exporting a LoRA model]); the live model is not changed.
    Returns the files written (on rank 0; ``[]`` elsewhere), on every rank only once they
    are all written; if rank 0 cannot write them, every rank raises.
    """
    refuse_differed(model, "export_safetensors")
    keep = rank_in(model_group(model)) == 0
    # With tensor parallelism each TP peer of rank 0 gathers too (the TP collectives need
    # them); only TP rank 0 writes.
    write = keep and all(tp.holds_first for tp in tensor_parallel_of(model))
    checkpoint_group(model)  # refuses a pipeline whose ranks hold several stages, first
    seat = _stage_seat(model)
    agree_on_names(model, names, "export_safetensors")
    lora = LoraMerge.of(model) if names is None else None
    if lora is not None:
        _agree_merge(model, lora)
        lora.check(model, "export_safetensors")
    state = renamed(
        plain_state_dict(model), lora.base_name if lora else names, "export_safetensors"
    )
    keys_of: dict[int, list[str]] = {}
    for key, value in state.items():
        keys_of.setdefault(id(value), []).append(key)
    order = _write_order(model, state)
    places = param_places(model)
    entries = [
        Entry(key, _out_dtype(state[key].dtype, dtype), tuple(_full_shape(state[key], places)))
        for key in order
    ]
    prefix = "model" if seat is None else f"model-stage{seat.stage + 1:03d}"
    writer = _Writer(Path(out_dir), entries, max_shard_bytes, dtype, write, prefix)
    written: set[str] = set()
    flats = list(flat_params(model))
    if lora is not None:  # [Note: exporting a LoRA model]: the adapters first, whole
        for flat in flats:
            if any(lora.is_adapter(o.param) for o in flat.originals):
                copies = gather_copies(flat, flat.param_region, keep, cpu_offload=True)
                for orig, copy in zip(flat.originals, copies, strict=keep):
                    lora.keep(orig.param, copy)
    for flat in flats:
        if not any(keys_of.get(id(o.param)) for o in flat.originals):
            continue  # nothing of it is written (a LoRA model's adapters): alike on every rank
        copies = gather_copies(flat, flat.param_region, keep, cpu_offload=True)
        for orig, copy in zip(flat.originals, copies, strict=keep):
            full = copy if lora is None else lora.merged(orig.param, copy)
            for key in keys_of.get(id(orig.param), []):
                writer.write(key, full)
                written.add(key)
    for key in order:
        if key not in written:
            writer.write(key, state[key].detach())
    if seat is None:
        files = writer.finish(model, index=True, configs=True)
    else:  # [Note: an export of pipeline stages]
        files = writer.finish(model, index=False, configs=seat.stage == 0)
        if write:
            files += writer.joint_index(seat)
    _agree_written(model, Path(out_dir), writer.failure)
    return files


def _agree_merge(model: nn.Module, lora: LoraMerge) -> None:
    """The ranks write one model: they compare what each would merge and write."""
    group = model_group(model)
    flats = list(flat_params(model))
    if group is None or group.size() == 1 or not flats:
        return
    check_same_on_all_ranks(
        lora.lines(),
        group,
        flats[0].compute_device,
        "would merge other adapters",
        "Export with the same adapters active on every rank (set_adapter, "
        "disable_adapter() alike).",
        "export_safetensors",
    )


def _stage_seat(model: nn.Module) -> PipelineSeat | None:
    context = context_of(model)
    return None if context is None else context.pipeline


class _Writer:
    """The writing rank's ``StreamWriter`` (nothing to write elsewhere: ``active`` False),
    which keeps its first failure rather than raise it: the rank still joins every gather
    that follows, and ``_agree_written`` then raises the failure on every rank (not only
    here, leaving the others in the next gather)."""

    def __init__(
        self,
        out_dir: Path,
        entries: list[Entry],
        max_shard_bytes: int,
        dtype: torch.dtype | None,
        active: bool,
        prefix: str = "model",
    ) -> None:
        self.out_dir, self.dtype = out_dir, dtype
        self.failure: Exception | None = None
        self.stream: StreamWriter | None = None
        if not active:
            return
        try:
            self.stream = StreamWriter(out_dir, entries, max_shard_bytes, prefix)
        except Exception as error:
            self.failure = error

    def write(self, key: str, tensor: torch.Tensor) -> None:
        if self.stream is None:
            return
        try:
            self.stream.write(key, tensor.to(_out_dtype(tensor.dtype, self.dtype)))
        except Exception as error:
            self.stream, self.failure = None, error

    def finish(self, model: nn.Module, index: bool, configs: bool) -> list[str]:
        """The files written (``[]`` after a failure)."""
        if self.stream is None:
            return []
        try:
            files = self.stream.finish(index)
            return files + (_write_hugging_face_configs(model, self.out_dir) if configs else [])
        except Exception as error:
            self.stream, self.failure = None, error
            return []

    def joint_index(self, seat: PipelineSeat) -> list[str]:
        """[Note: an export of pipeline stages]
        Each stage's writer (rank 0 of its data-parallel ranks) writes its part under a
        name of its own (``model-stage001-00001-of-00002.safetensors``); the writers, one
        per stage, are the ranks of one pipeline group, and they send each other which file
        holds each name: the first stage writes the joint index (and the model's
        ``config.json``), so that ``from_pretrained`` reads the whole model. A writer that
        failed sends nothing, and ``_agree_written`` raises on every rank."""
        mine = None if self.stream is None else weight_map(self.stream.files)
        maps = cast(list[tuple[dict[str, str], int] | None], all_gather_object(mine, seat.group))
        parts = [m for m in maps if m is not None]
        if seat.stage != 0 or self.stream is None or len(parts) < len(maps):
            return []
        names = {name: file for part in parts for name, file in part[0].items()}
        try:
            write_index(self.out_dir, names, sum(part[1] for part in parts))
        except Exception as error:
            self.stream, self.failure = None, error
            return []
        return [INDEX]


def _agree_written(model: nn.Module, out_dir: Path, failure: Exception | None) -> None:
    """Return on every rank only once the files are written: a rank that reads ``out_dir``
    right after (``from_pretrained`` on every rank) must not find it half written, or an
    older export's files. A failed write is raised on every rank."""
    group = checkpoint_group(model)
    if group is None:
        if failure is not None:
            raise failure
        return
    outcome = None if failure is None else f"{type(failure).__name__}: {failure}"
    outcomes = all_gather_object(outcome, group)
    if failure is not None:
        raise failure
    for rank, text in enumerate(outcomes):
        if text is not None:
            raise RuntimeError(
                f"flatshard.export_safetensors: rank {rank} of the model's group could not "
                f"write '{out_dir}' ({text}); this is rank {global_rank()}. Nothing there is a "
                "complete export: fix that rank's problem and export again."
            )


def _write_hugging_face_configs(model: nn.Module, out_dir: Path) -> list[str]:
    """``config.json`` and ``generation_config.json`` of a transformers model, if it is one."""
    written = []
    for attribute, file in (
        ("config", "config.json"),
        ("generation_config", "generation_config.json"),
    ):
        config = getattr(model, attribute, None)
        if callable(getattr(config, "save_pretrained", None)):
            config.save_pretrained(out_dir)  # type: ignore[union-attr]
            written.append(str(out_dir / file))
    return written


def _write_order(model: nn.Module, state: dict[str, torch.Tensor]) -> list[str]:
    """State-dict keys in the order their tensors become available: units first."""
    position: dict[int, int] = {}
    for flat in flat_params(model):
        for orig in flat.originals:
            position[id(orig.param)] = len(position)
    keys = list(state)
    last = len(position)
    return sorted(keys, key=lambda k: (position.get(id(state[k]), last), keys.index(k)))


def _full_shape(value: torch.Tensor, places: dict[int, HeldRows]) -> torch.Size:
    place = places.get(id(value))
    return place.global_shape if place is not None else value.shape


def _out_dtype(stored: torch.dtype, wanted: torch.dtype | None) -> torch.dtype:
    return wanted if wanted is not None and stored.is_floating_point else stored


def export_checkpoint(
    checkpoint_dir: str | os.PathLike[str],
    out_dir: str | os.PathLike[str],
    *,
    max_shard_bytes: int = DEFAULT_SHARD_BYTES,
    dtype: torch.dtype | None = None,
) -> list[str]:
    """Convert a ``save_checkpoint`` directory's model weights to safetensors, on CPU.

    No process group needed; reads and writes one output file's worth at a time.
    """
    source = Path(checkpoint_dir)
    verify_files(source, read_manifest(source), None)
    saved = checkpoint_metadata(source).state_dict_metadata
    adapter = next((k[len(MODEL) :] for k in saved if k.startswith(MODEL) and ".lora_" in k), None)
    if adapter is not None:  # [Note: exporting a LoRA model]: merging needs the model
        raise CheckpointError(
            f"flatshard: {source} holds LoRA adapters (peft names such as {adapter!r}): "
            "written as saved they would not load with from_pretrained, and merging them "
            "needs peft's model. Load the checkpoint into the sharded peft model "
            "(flatshard.load_checkpoint(path, peft_model)) and export that: "
            "flatshard.export_safetensors(peft_model, dir) writes the base model with the "
            "adapters merged (flatshard train --lora writes it to <out-dir>/hf_model)."
        )
    tensors = {
        key[len(MODEL) :]: md
        for key, md in saved.items()
        if key.startswith(MODEL) and is_tensor_entry(md)
    }
    entries = [
        Entry(name, _out_dtype(md.properties.dtype, dtype), tuple(md.size))
        for name, md in tensors.items()
    ]
    writer = StreamWriter(Path(out_dir), entries, max_shard_bytes)
    for _, group in writer.files:
        batch = {
            MODEL + e.name: torch.empty(
                tensors[e.name].size, dtype=tensors[e.name].properties.dtype
            )
            for e in group
        }
        load_raw(source, batch)
        for entry in group:
            writer.write(entry.name, batch[MODEL + entry.name].to(entry.dtype))
    return writer.finish()
