"""Checkpoint directories: model, optimizer and extra state via torch.distributed.checkpoint.

[Note: checkpoint directory]
``save_checkpoint(path, ...)`` writes ``<path>.partial/`` with DCP (each rank writes its own
rows, in parallel; replicated values once), then a manifest ``flatshard.json`` with the size
and CRC32 of every file, then renames it to ``<path>``. A previous checkpoint at ``<path>`` is
moved to ``<path>.previous`` just before and deleted just after, so a crash at any moment
leaves a complete checkpoint: ``<path>`` (old or new), or ``<path>.previous`` if the crash
fell between the two renames (the loader says so). Loading checks the manifest first, so a
truncated, corrupted or foreign directory gives an error naming the file instead of
garbage weights. Keys inside DCP: ``model/<name>``, ``optim/<name>/<state key>``,
``optim/param_groups``, ``extra/<rank>``. Several optimizers over disjoint parameters (Muon
for the matrices, AdamW for the rest) share the state keys; the parameter groups of the
second and later ones are ``optim/param_groups.<i>``.
"""

from __future__ import annotations

import errno
import functools
import json
import os
import shutil
import zlib
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal, TypeGuard, cast, overload

import torch
import torch.distributed as dist
from torch import nn

from flatshard.comm._agreement import rank_in
from flatshard.comm._collectives import all_gather_object, barrier
from flatshard.runtime._changes import (
    agree_on_differed,
    differed,
    mark_loaded,
    refuse_differed,
)
from flatshard.runtime._step import context_of, every_rank_calls
from flatshard.state._async_save import CheckpointSave, Exchange, settle_pending, start_save
from flatshard.state._directory import (
    FORMAT,
    MANIFEST,
    VERSION,
    check_keep,
    prune_older,
    read_manifest,
)
from flatshard.state._errors import CheckpointError
from flatshard.state._optim_state import (
    OptimStateDict,
    every_stages_groups,
    is_row_shape,
    load_optim_state_dict,
    sharded_optim_state_dict,
)
from flatshard.state._resume_state import KEY as RESUME
from flatshard.state._resume_state import ResumeState
from flatshard.state._state_dict import (
    RowShard,
    check_keys,
    checkpoint_group,
    model_group,
    param_places,
    plain_state_dict,
    reshard_for_load,
    rows_of,
)

if TYPE_CHECKING:  # torch.distributed.checkpoint takes ~1 s to import: only when used
    from torch.distributed.checkpoint.metadata import Metadata, TensorStorageMetadata

MODEL, OPTIM, GROUPS, EXTRA = "model/", "optim/", "optim/param_groups", "extra/"
CLASSES = "optimizer_classes"  # the saved optimizers' class names, in order


Optimizers = torch.optim.Optimizer | Sequence[torch.optim.Optimizer] | None


def _listed(optimizer: Optimizers) -> list[torch.optim.Optimizer]:
    if optimizer is None:
        return []
    return [optimizer] if isinstance(optimizer, torch.optim.Optimizer) else list(optimizer)


def _groups_key(index: int) -> str:
    return GROUPS if index == 0 else f"{GROUPS}.{index}"


# ---------------------------------------------------------------- saving
def exchange_over(group: dist.ProcessGroup | None) -> Exchange:
    """flatshard's collectives (watched, tagged) over ``group`` (None: a process alone)."""
    if group is None:
        return Exchange(lambda obj: [obj], lambda: None)
    return Exchange(lambda obj: all_gather_object(obj, group), lambda: barrier(group))


@overload
def save_checkpoint(
    path: str | os.PathLike[str],
    model: nn.Module,
    optimizer: Optimizers = None,
    *,
    extra: dict[str, Any] | None = None,
    async_op: Literal[False] = False,
    keep: int | None = None,
    resume_state: ResumeState | None = None,
) -> None: ...


@overload
def save_checkpoint(
    path: str | os.PathLike[str],
    model: nn.Module,
    optimizer: Optimizers = None,
    *,
    extra: dict[str, Any] | None = None,
    async_op: Literal[True],
    keep: int | None = None,
    resume_state: ResumeState | None = None,
) -> CheckpointSave: ...


@overload
def save_checkpoint(
    path: str | os.PathLike[str],
    model: nn.Module,
    optimizer: Optimizers = None,
    *,
    extra: dict[str, Any] | None = None,
    async_op: bool,
    keep: int | None = None,
    resume_state: ResumeState | None = None,
) -> CheckpointSave | None: ...


@every_rank_calls(
    "save_checkpoint",
    1,
    ("path", "optimizer", "async_op", "keep", "resume_state"),
    over_stages=True,  # one directory of every stage ([Note: checkpoints of pipeline stages])
)
def save_checkpoint(
    path: str | os.PathLike[str],
    model: nn.Module,
    optimizer: Optimizers = None,
    *,
    extra: dict[str, Any] | None = None,
    async_op: bool = False,
    keep: int | None = None,
    resume_state: ResumeState | None = None,
) -> CheckpointSave | None:
    """Write model, optimizer and ``extra`` state to the directory ``path``, atomically.

    A collective over the model's ranks (every rank calls it with the same ``path`` on a
    file system they share). Loadable at any world size and strategy, and with no process
    group at all (see ``load_checkpoint``). ``extra``: anything ``torch.load`` reads with
    ``weights_only=True`` (numbers, strings, tensors such as RNG states, lists, dicts); each
    rank's own ``extra`` is kept and given back to the same rank on load. A model without
    flatshard units is saved by the calling process alone: call it from one process only.
    ``optimizer`` may be a list of optimizers over disjoint parameters (Muon and AdamW);
    load it with the same list.

    ``async_op=True``: copy the state to host memory (a staging buffer kept for the next
    save) and return a ``CheckpointSave`` at once; a background thread writes and commits
    it. Training may change the model and optimizer meanwhile: the checkpoint holds the
    state of this call. One asynchronous save at a time per process: the next
    ``save_checkpoint`` or ``load_checkpoint`` waits for it first. A failed write raises
    ``CheckpointError`` on every rank from ``wait()`` and from the next
    ``save_checkpoint``/``load_checkpoint``; ``<path>`` appears only when whole, so a
    crash meanwhile leaves the previous checkpoint the newest whole one. Call ``wait()``
    before ``dist.destroy_process_group()``; at exit, and on SIGTERM, a pending save is
    finished first.

    ``resume_state``: a ``flatshard.ResumeState`` (RNG states, LR schedulers, the data
    position) kept with each rank's ``extra``; ``load_checkpoint(..., resume_state=...)``
    puts it back.

    ``keep=N``: once this checkpoint is committed, remove the older ones of its series (the
    same name up to a trailing number: ``step_000120``), so that the N newest stay; a save
    that fails removes nothing. ``flatshard.latest_checkpoint(directory)`` finds the newest.
    """
    settle_pending("save_checkpoint")
    target = Path(path)
    check_keep(target, keep)
    group = checkpoint_group(model)
    partial = target.with_name(target.name + ".partial")
    if resume_state is not None:
        extra = {**(extra or {}), RESUME: resume_state.state_dict()}
    state = _collect_state(model, _listed(optimizer), extra, group)
    write = functools.partial(write_or_clean_up, keep=keep)
    if async_op:
        return start_save(target, partial, state, group, write)
    write(target, partial, state, group, exchange_over(group))
    return None


def write_or_clean_up(
    target: Path,
    partial: Path,
    state: dict[str, Any],
    group: dist.ProcessGroup | None,
    exchange: Exchange,
    keep: int | None = None,
) -> None:
    """Write ``state`` to ``partial`` and swap it in as ``target``; on failure remove
    ``partial`` and say a full disk in words. ``keep``: then prune the series."""
    try:
        _write_and_commit(target, partial, state, group, exchange)
    except Exception as error:
        # Or it keeps the disk full. Every rank, each after its own failure: where the
        # group was destroyed under the writers they fail apart, and a rank's directory
        # made after another's removal is removed by its own.
        shutil.rmtree(partial, ignore_errors=True)
        if _out_of_space(error):
            raise CheckpointError(
                f"flatshard.save_checkpoint: no space left on the device of {target.parent} "
                f"while writing '{target.name}'; the partial save was removed, the checkpoint "
                "already there (if any) is untouched. Free space or keep fewer checkpoints."
            ) from error
        raise
    if keep is not None and rank_in(group) == 0:
        prune_older(target, keep)


def _out_of_space(error: BaseException | None, depth: int = 0) -> bool:
    """Whether a full disk caused ``error`` or its causes: ENOSPC, or its text (torch.save's
    "unexpected pos"; DCP's exception carries each rank's failure as text)."""
    if error is None or depth > 16:
        return False
    if (isinstance(error, OSError) and error.errno == errno.ENOSPC) or any(
        text in str(error) for text in ("No space left", "unexpected pos")
    ):
        return True
    return _out_of_space(error.__cause__ or error.__context__, depth + 1)


def _collect_state(
    model: nn.Module,
    optimizers: list[torch.optim.Optimizer],
    extra: dict[str, Any] | None,
    group: dist.ProcessGroup | None,
) -> dict[str, Any]:
    """This rank's entries of the checkpoint (its rows; the live tensors, not copies)."""
    refuse_differed(model, "save_checkpoint")
    state: dict[str, Any] = {MODEL + k: v for k, v in rows_of(model).items()}
    for index, optimizer in enumerate(optimizers):
        osd = sharded_optim_state_dict(model, optimizer)
        osd["param_groups"] = every_stages_groups(model, osd["param_groups"])
        entries = _optim_entries(osd, index)
        _check_disjoint(state, entries, index)
        state.update(entries)
    if optimizers:
        state[CLASSES] = [type(optimizer).__name__ for optimizer in optimizers]
    state[f"{EXTRA}{rank_in(group)}"] = extra if extra is not None else {}
    return state


def _write_and_commit(
    target: Path,
    partial: Path,
    state: dict[str, Any],
    group: dist.ProcessGroup | None,
    exchange: Exchange,
) -> None:
    """DCP's write into ``partial``, the manifest, the swap: raises on every rank or none
    (DCP agrees on its failures; the checksums and the commit are exchanged)."""
    rank = rank_in(group)
    if rank == 0:
        shutil.rmtree(partial, ignore_errors=True)
    exchange.barrier()
    from flatshard.state._dcp import write  # DCP: imported when first used

    write(partial, state, group)
    files = _share_of_checksums(partial, group, exchange)
    failed = None
    if rank == 0:
        manifest = {
            "format": FORMAT,
            "version": VERSION,
            "world_size": dist.get_world_size(group) if group is not None else 1,
            "torch": torch.__version__,
            "has_optimizer": GROUPS in state,
            "optimizers": sum(_groups_key(i) in state for i in range(len(state))),
            "files": files,
        }
        try:
            (partial / MANIFEST).write_text(json.dumps(manifest, indent=1, sort_keys=True))
            _swap_in(partial, target)
        except OSError as error:
            failed = error
    outcome = exchange.gather(None if failed is None else str(failed))
    if failed is not None:
        raise failed
    if outcome[0] is not None:
        raise CheckpointError(
            f"flatshard.save_checkpoint: rank 0 could not commit {target}: {outcome[0]}"
        )


def _optim_entries(osd: OptimStateDict, index: int) -> dict[str, Any]:
    entries: dict[str, Any] = {_groups_key(index): osd["param_groups"]}
    for name, values in osd["state"].items():
        for key, value in values.items():
            entries[f"{OPTIM}{name}/{key}"] = value
    return entries


def _check_disjoint(state: dict[str, Any], entries: dict[str, Any], index: int) -> None:
    """Two optimizers of one checkpoint must not step the same parameter."""
    names = {n for g in entries[_groups_key(index)] for n in g["params"]}
    for earlier in range(index):
        both = names & {n for g in state[_groups_key(earlier)] for n in g["params"]}
        if both:
            raise CheckpointError(
                f"flatshard.save_checkpoint: optimizers {earlier} and {index} both hold "
                f"{sorted(both)[:3]}; give each parameter to one optimizer."
            )


def _swap_in(partial: Path, target: Path) -> None:
    """Rename ``partial`` to ``target``, keeping the old one until the new one is in place."""
    previous = target.with_name(target.name + ".previous")
    if target.exists():
        shutil.rmtree(previous, ignore_errors=True)
        os.replace(target, previous)
    os.replace(partial, target)
    _fsync_dir(target.parent)
    shutil.rmtree(previous, ignore_errors=True)


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _share_of_checksums(
    directory: Path, group: dist.ProcessGroup | None, exchange: Exchange
) -> dict[str, Any]:
    """Size and CRC32 of every file, each rank reading a share of them; an error on every
    rank if any rank could not read its share."""
    names = sorted(p.name for p in directory.iterdir() if p.is_file() and p.name != MANIFEST)
    mine: dict[str, Any] | str
    try:
        world = dist.get_world_size(group) if group is not None else 1
        mine = {name: _file_facts(directory / name) for name in names[rank_in(group) :: world]}
    except OSError as error:
        mine = str(error)
    shares = exchange.gather(mine)
    problems = [f"rank {r}: {share}" for r, share in enumerate(shares) if isinstance(share, str)]
    if problems:
        raise CheckpointError(
            f"flatshard.save_checkpoint: could not read back {directory}: " + "; ".join(problems)
        )
    return {k: v for share in cast(list[dict[str, Any]], shares) for k, v in share.items()}


def _file_facts(path: Path) -> dict[str, int]:
    crc, size = 0, 0
    with path.open("rb") as handle:
        while block := handle.read(1 << 22):
            crc = zlib.crc32(block, crc)
            size += len(block)
    return {"bytes": size, "crc32": crc}


# ---------------------------------------------------------------- loading
@every_rank_calls(
    "load_checkpoint", 1, ("path", "optimizer", "strict", "resume_state"), over_stages=True
)
def load_checkpoint(
    path: str | os.PathLike[str],
    model: nn.Module,
    optimizer: Optimizers = None,
    *,
    strict: bool = True,
    resume_state: ResumeState | None = None,
) -> dict[str, Any]:
    """Load a ``save_checkpoint`` directory into ``model`` (and ``optimizer``); return extra.

    Works at any world size and strategy, resharding as needed, and on a plain
    (non-sharded) model without a process group. A collective over the model's ranks.
    The optimizer may be fresh (no state yet): every moment is restored. Returns this
    rank's ``extra`` as saved (rank 0's when the saving run had fewer ranks). A list of
    optimizers loads what ``save_checkpoint`` saved from the same list. ``resume_state``:
    the ``flatshard.ResumeState`` to restore (saved with ``save_checkpoint(...,
    resume_state=)``).
    """
    settle_pending("load_checkpoint")  # the path may be the one being written
    optimizers = _listed(optimizer)
    target = Path(path)
    group = checkpoint_group(model)
    rank = rank_in(group)
    manifest = read_manifest(target)
    verify_files(target, manifest, group)
    saved = checkpoint_metadata(target).state_dict_metadata
    reshard_for_load(model, "load_checkpoint")
    before = bool(differed(model))
    state: dict[str, Any] = _model_targets(model, saved, strict)
    if optimizers:
        state.update(_optim_targets(model, saved, target, len(optimizers)))
        if CLASSES in saved:  # before any weight is read: a refused load changes nothing
            _check_same_optimizers(target, optimizers)
    extra_key = f"{EXTRA}{rank}" if f"{EXTRA}{rank}" in saved else f"{EXTRA}0"
    state[extra_key] = None
    _read(target, state, group)
    for key, tensor in plain_state_dict(model).items():
        if MODEL + key in saved:
            mark_loaded(tensor)  # [Note: tensors awaiting a load]
    agree_on_differed(model, model_group(model), before)
    for index, optimizer in enumerate(optimizers):
        load_optim_state_dict(model, optimizer, _optim_state(state, index))
    extra = state[extra_key]
    extra = dict(extra) if isinstance(extra, dict) else {}
    saved_resume = extra.pop(RESUME, None)
    if resume_state is not None:
        resume_state.load_state_dict(saved_resume or {}, str(target))
    return extra


def load_raw(target: Path, state: dict[str, Any]) -> None:
    """Read the named entries of a checked checkpoint into ``state``, in this process."""
    _read(target, state, None)


def _read(target: Path, state: dict[str, Any], group: dist.ProcessGroup | None) -> None:
    """DCP's load of ``state`` (in place) from ``target``; one process if no group."""
    from flatshard.state._dcp import read

    read(target, state, group)


def _model_targets(model: nn.Module, saved: dict[str, Any], strict: bool) -> dict[str, Any]:
    """The model's shards as DCP load targets (read in place), after checking names/shapes."""
    mine = rows_of(model)  # a model awaiting a load may be loaded into
    saved_names = [k[len(MODEL) :] for k in saved if k.startswith(MODEL)]
    context = context_of(model)
    if context is not None and context.pipeline is not None:  # the other stages' entries
        saved_names = [k for k in saved_names if k in mine]
    check_keys("load_checkpoint", mine.keys(), saved_names, strict)
    problems = []
    for name, value in mine.items():
        md = saved.get(MODEL + name)
        shape = value.full_shape if isinstance(value, RowShard) else value.shape
        if is_tensor_entry(md) and md.size != shape:
            problems.append(f"'{name}': checkpoint {tuple(md.size)}, model {tuple(shape)}")
    if problems:
        raise CheckpointError(
            "flatshard.load_checkpoint: parameter shapes differ from the checkpoint (a "
            "different model config?):\n  " + "\n  ".join(problems)
        )
    return {MODEL + k: v for k, v in mine.items() if MODEL + k in saved}


def _optim_targets(
    model: nn.Module, saved: dict[str, Any], target: Path, count: int
) -> dict[str, Any]:
    """Fresh tensors for every saved optimizer value, cut to this rank's rows."""
    if GROUPS not in saved:
        raise CheckpointError(
            f"flatshard.load_checkpoint: {target} holds no optimizer state (saved without "
            "an optimizer); call load_checkpoint without one."
        )
    found = sum(1 for key in saved if key.startswith(GROUPS))
    if found != count:
        raise CheckpointError(
            f"flatshard.load_checkpoint: {target} holds the state of {found} optimizer(s), "
            f"{count} were given; pass the same optimizers, in the same order, as when saved."
        )
    params = dict(model.named_parameters())
    places = param_places(model)
    context = context_of(model)
    stage = context is not None and context.pipeline is not None
    targets: dict[str, Any] = {_groups_key(index): None for index in range(count)}
    for key, md in saved.items():
        if not key.startswith(OPTIM) or key.startswith(GROUPS):
            continue
        name, _, state_key = key[len(OPTIM) :].rpartition("/")
        if name not in params and stage:
            continue  # another stage's ([Note: checkpoints of pipeline stages])
        if name not in params:
            raise CheckpointError(
                f"flatshard.load_checkpoint: the checkpoint has optimizer state for "
                f"'{name}', which is not a parameter of this model."
            )
        param = params[name]
        place = places[id(param)]
        if place.owned_elsewhere:
            continue  # its owner alone reads it ([Note: whole-parameter layout])
        if not is_tensor_entry(md):
            targets[key] = None  # a Python value
        elif is_row_shape(state_key, md.size, place.global_shape, len(place.full_shape)):
            local = torch.empty(place.local_shape, dtype=md.properties.dtype, device=param.device)
            targets[key] = place.row_shard(local)
        else:
            targets[key] = torch.empty(md.size, dtype=md.properties.dtype, device=param.device)
    return targets


def _check_same_optimizers(target: Path, optimizers: list[torch.optim.Optimizer]) -> None:
    """A checkpoint of another optimizer class that lacks this optimizer's own
    hyperparameters (AdamW's into SGD: no momentum) would load without a word, the first
    step then failing on the missing one (a bare ``KeyError: 'momentum'``). Where only the
    class name differs (a wrapper around the same optimizer, AdamW saved and Adam loaded),
    or the groups carry more (an LR scheduler's ``initial_lr``, ``max_lr``...), it loads.
    Each rank reads the saved classes and groups (small values) on its own."""
    state: dict[str, Any] = {CLASSES: None}
    state.update({_groups_key(index): None for index in range(len(optimizers))})
    load_raw(target, state)
    for index, (saved_class, optimizer) in enumerate(zip(state[CLASSES], optimizers, strict=True)):
        mine = type(optimizer).__name__
        saved_keys = {k for g in state[_groups_key(index)] for k in g}
        missing = set(getattr(optimizer, "defaults", {})) - saved_keys
        if saved_class != mine and missing:
            which = f"optimizer {index}" if len(optimizers) > 1 else "the optimizer"
            raise CheckpointError(
                f"flatshard.load_checkpoint: {target} holds the state of {saved_class}, and "
                f"{which} given is {mine}, whose {', '.join(sorted(missing))} it lacks: a "
                f"checkpoint of another optimizer. Build the {saved_class} it was saved "
                "with, or load the model alone (load_checkpoint(path, model)) and start "
                f"the {mine}'s state fresh."
            )


def _optim_state(state: dict[str, Any], index: int) -> OptimStateDict:
    """The state dict of optimizer ``index``: its groups, and the values of their names."""
    groups = state[_groups_key(index)]
    mine = {name for group in groups for name in group["params"]}
    values: dict[str, dict[str, Any]] = {}
    for key, value in state.items():
        if key.startswith(OPTIM) and not key.startswith(GROUPS):
            name, _, state_key = key[len(OPTIM) :].rpartition("/")
            if name in mine:
                values.setdefault(name, {})[state_key] = value
    return {"state": values, "param_groups": groups}


# ---------------------------------------------------------------- checking
def verify_files(target: Path, manifest: dict[str, Any], group: dist.ProcessGroup | None) -> None:
    """Compare every file's size and CRC32 with the manifest; each rank checks a share."""
    expected: dict[str, dict[str, int]] = manifest["files"]
    names = sorted(expected)
    world = dist.get_world_size(group) if group is not None else 1
    rank = rank_in(group)
    problems = [p for n in names[rank::world] if (p := _file_problem(target / n, expected[n]))]
    if group is not None:
        shares = cast(list[list[str] | None], all_gather_object(problems, group))
        problems = [p for share in shares if share for p in share]
    if problems:
        raise CheckpointError(
            f"flatshard: checkpoint {target} is damaged:\n  "
            + "\n  ".join(problems)
            + "\nRestore it from a copy, or load an older checkpoint."
        )


def _file_problem(path: Path, facts: dict[str, int]) -> str | None:
    if not path.exists():
        return f"{path.name} is missing"
    found = _file_facts(path)
    if found["bytes"] != facts["bytes"]:
        return (
            f"{path.name} is {found['bytes']} bytes, the manifest says {facts['bytes']} "
            "(truncated or overwritten)"
        )
    if found["crc32"] != facts["crc32"]:
        return f"{path.name} has the right size but the wrong checksum (corrupted)"
    return None


def is_tensor_entry(md: object) -> TypeGuard[TensorStorageMetadata]:
    """Whether a DCP metadata entry describes a tensor (else a Python value)."""
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    return isinstance(md, TensorStorageMetadata)


def checkpoint_metadata(target: Path) -> Metadata:
    """DCP's metadata of a checked checkpoint directory (no process group needed)."""
    read_manifest(target)
    from torch.distributed.checkpoint.filesystem import FileSystemReader

    return FileSystemReader(target).read_metadata()
