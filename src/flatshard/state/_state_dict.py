"""Model state dicts keyed by the original names: full (gathered) and sharded (row ranges).

[Note: sharded state dicts are row ranges]
Every original parameter's data on a rank is whole rows of the full parameter (the
row-aligned layout), so a rank's part of a parameter is described by three facts: the full
shape, the first row it holds and the rows themselves (``RowShard``). That is enough for
torch.distributed.checkpoint to reshard: each rank writes its rows as a chunk at offset
``(first_row, 0, ...)``; a loader at another world size or strategy asks for the rows it
holds and DCP reads the overlapping parts of the saved chunks. A 0-dim parameter is one
row: the rank holding it has shape (), the others shape (0,).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from typing import cast

import torch
import torch.distributed as dist
from torch import nn

from flatshard.comm._agreement import (
    check_same_on_all_ranks,
    checked_on_rank0,
    global_rank,
    rank_in,
)
from flatshard.comm._collectives import broadcast
from flatshard.flat._flat_param import FlatParamGroup
from flatshard.flat._layout import rows_shape
from flatshard.flat._tensor_parallel import SplitParam, spanning_group
from flatshard.runtime._by_hand import copy_out, gather_copies
from flatshard.runtime._changes import (
    agree_on_differed,
    differed,
    mark_loaded,
    refuse_differed,
)
from flatshard.runtime._configuration import checksum
from flatshard.runtime._pipeline import stages_spanning
from flatshard.runtime._step import context_of, every_rank_calls
from flatshard.runtime._unit import unit_of


@dataclass(frozen=True)
class RowShard:
    """This rank's rows ``[first_row, first_row + rows)`` of a tensor of ``full_shape``."""

    local: torch.Tensor  # shape [rows, *full_shape[1:]]; () or (0,) for a 0-dim tensor
    first_row: int
    full_shape: torch.Size
    # A tensor-parallel parameter: where this rank's TP shard starts in the global tensor
    # (``full_shape``); rows count from there. Empty: not tensor parallel.
    base: tuple[int, ...] = ()

    @property
    def rows(self) -> int:
        if len(self.full_shape) == 0:
            return 1 if self.local.dim() == 0 else 0
        return self.local.shape[0]

    def describe(self) -> str:
        return _rows_of(self.first_row, self.rows, self.base, self.full_shape)


def _rows_of(first: int, rows: int, base: tuple[int, ...], shape: torch.Size) -> str:
    """Rows ``first..first + rows``, counted from ``base`` (a TP shard or expert slice)."""
    where = f" of the part at {base}" if any(base) else ""
    return f"rows {first}..{first + rows}{where} of {tuple(shape)}"


@dataclass(frozen=True)
class HeldRows:
    """Where this rank's part of one original parameter lies (see the note above)."""

    full_shape: torch.Size
    first_row: int
    rows: int
    flat: FlatParamGroup | None = None  # None: not sharded, every rank holds all of it
    index: int = 0  # the parameter's position in ``flat``
    tp: SplitParam | None = None  # a DTensor or expert parameter: full_shape is its local part's

    @property
    def global_shape(self) -> torch.Size:
        """The shape of the whole tensor (the TP shard's shape on its own)."""
        return self.tp.shape if self.tp is not None else self.full_shape

    def take_global(self, full: torch.Tensor) -> torch.Tensor:
        """This rank's rows of the whole tensor ``full`` (a view)."""
        return self.take(self.tp.local_part(full) if self.tp is not None else full)

    @property
    def local_shape(self) -> torch.Size:
        return rows_shape(self.full_shape, self.rows)

    def take(self, full: torch.Tensor) -> torch.Tensor:
        """This rank's rows of ``full`` (a view)."""
        if len(self.full_shape) == 0:
            return full if self.rows else full.reshape(1)[:0]
        return full[self.first_row : self.first_row + self.rows]

    @property
    def owned_elsewhere(self) -> bool:
        """A whole-parameter layout put it in another rank's shard: nothing of it, its
        gradient or its optimizer state is here ([Note: whole-parameter layout])."""
        return self.flat is not None and not self.flat.owned[self.index]

    def row_shard(self, local: torch.Tensor) -> RowShard:
        base = self.tp.offset if self.tp is not None else ()
        return RowShard(local, self.first_row, self.global_shape, base)

    def matches(self, shard: RowShard) -> bool:
        return (
            shard.full_shape == self.global_shape
            and shard.base == (self.tp.offset if self.tp is not None else ())
            and shard.first_row == self.first_row
            and shard.rows == self.rows
        )


def param_places(model: nn.Module) -> dict[int, HeldRows]:
    """``id(parameter) -> HeldRows`` for every parameter of ``model`` (sharded or not)."""
    places: dict[int, HeldRows] = {}
    for flat in flat_params(model):
        held_rows = flat.param_views.held
        for index, (orig, held) in enumerate(zip(flat.originals, held_rows, strict=True)):
            full_shape = flat.full_shapes[index]
            place = HeldRows(full_shape, held.first_row, held.rows, flat, index, orig.tp)
            places[id(orig.param)] = place
    for param in model.parameters():
        if id(param) not in places:
            rows = param.shape[0] if param.dim() else 1
            places[id(param)] = HeldRows(param.shape, 0, rows)
    return places


def flat_params(model: nn.Module) -> Iterator[FlatParamGroup]:
    """Every flat parameter group in ``model``, in the same order on every rank."""
    for module in model.modules():
        unit = unit_of(module)
        if unit is not None:
            yield from unit.flat_params


def reshard_for_load(model: nn.Module, caller: str) -> None:
    """Free every unit's unsharded buffer before the shards are overwritten.

    A unit kept unsharded between steps (e.g. the root after a ``no_grad`` forward) would
    otherwise run its next forward on the old values.
    """
    for module in model.modules():
        unit = unit_of(module)
        if unit is None:
            continue
        unit.require_idle(caller, "load between steps, not inside forward or backward.")
        unit.reshard()
        unit.user_wrote(caller)  # a pending backward of an earlier forward is refused
        for flat in unit.flat_params:
            flat.shards_written()  # gathers after the load see it (and replicas refresh)


def plain_state_dict(model: nn.Module) -> dict[str, torch.Tensor]:
    """``model.state_dict(keep_vars=True)``, the rows as they are: flatshard's own call.

    The keys and the live tensors (this rank's rows of sharded parameters) that the
    functions here turn into full or sharded state dicts. A plain call by the user is an
    error on a sharded model (``_hooks._refuse_partial_state_dict``).
    """
    units = [u for m in model.modules() if (u := unit_of(m)) is not None]
    for unit in units:
        unit.own_state_dict_call = True
    try:
        return model.state_dict(keep_vars=True)
    finally:
        for unit in units:
            unit.own_state_dict_call = False


Names = Callable[[str], str | None]
"""Maps a model entry's name (``state_dict()`` key) to its name in a file; None: not in it."""


def renamed(
    state: dict[str, torch.Tensor], names: Names | None, caller: str
) -> dict[str, torch.Tensor]:
    """``state`` under the file's names (see ``Names``); entries mapped to None dropped."""
    if names is None:
        return state
    out: dict[str, torch.Tensor] = {}
    source: dict[str, str] = {}
    for key, tensor in state.items():
        new = names(key)
        if new is None:
            continue
        if new in out and out[new] is not tensor:
            raise ValueError(
                f"flatshard.{caller}: names= maps both {source[new]!r} and {key!r} to {new!r}; "
                "each file entry must come from one tensor. Fix the names function."
            )
        out[new], source[new] = tensor, key
    return out


def agree_on_names(model: nn.Module, names: Names | None, caller: str) -> None:
    """Where ``names`` is given, the ranks compare what it makes of the model's entries:
    each rank reads or gathers its own rows under the names it computes, so a rank whose
    function differs (a map built from a per-rank setting) would load another tensor's
    values into its rows, or write under names its peers do not. One digest all-gather."""
    group = model_group(model)
    if names is None or group is None or group.size() == 1:
        return
    lines = [f"{key} -> {names(key)}" for key in plain_state_dict(model)]
    device = model_device(model)
    fix = "Pass every rank the same names function (the same name for every entry)."
    check_same_on_all_ranks(lines, group, device, "map entries to other names", fix, caller)


def model_device(model: nn.Module) -> torch.device:
    """Where the model's group communicates (NCCL: the GPU): its flat groups' device."""
    flat = next(flat_params(model), None)
    return flat.compute_device if flat is not None else torch.device("cpu")


def model_group(model: nn.Module) -> dist.ProcessGroup | None:
    """The process group ``fully_shard`` was given for ``model`` (None: not sharded)."""
    context = context_of(model)
    return context.process_group if context is not None else None


def checkpoint_group(model: nn.Module) -> dist.ProcessGroup | None:
    """The ranks that write (and read) a checkpoint together: the model's group, or with
    tensor parallelism the ranks of dp x tp (see [Note: DTensor parameters]), and with
    pipeline stages those of every stage ([Note: checkpoints of pipeline stages])."""
    group = model_group(model)
    if group is None:
        return None
    group = spanning_group(group, tensor_parallel_of(model))
    context = context_of(model)
    seat = context.pipeline if context is not None else None
    return group if seat is None else stages_spanning(group, seat)


def tensor_parallel_of(model: nn.Module) -> list[SplitParam]:
    """What each of the model's DTensor parameters was (see [Note: DTensor parameters])."""
    return [orig.tp for flat in flat_params(model) for orig in flat.originals if orig.tp]


def entries_do_not_fit(caller: str, problems: list[str]) -> ValueError:
    """One error listing every state dict entry that does not fit the model."""
    return ValueError(
        f"flatshard.{caller} (rank {global_rank()}): {len(problems)} entries do not fit the "
        "model:\n  " + "\n  ".join(problems)
    )


# ---------------------------------------------------------------- producing state dicts
@every_rank_calls("full_state_dict")
def full_state_dict(
    model: nn.Module, *, rank0_only: bool = True, cpu_offload: bool = True
) -> dict[str, torch.Tensor]:
    """The model's ``state_dict()`` with full tensors, keyed by the original names.

    A collective over the model's ranks. flat parameter groups are gathered one at a time and
    copied out before the next, so at most one unit's parameters are unsharded at once.
    ``rank0_only``: only rank 0 of the model's group keeps the result (others get ``{}``).
    ``cpu_offload``: results are copied to CPU (otherwise they stay on the shard's device).
    """
    refuse_differed(model, "full_state_dict")
    keep = not rank0_only or rank_in(model_group(model)) == 0
    gathered: dict[int, torch.Tensor] = {}
    for flat in flat_params(model):
        copies = gather_copies(flat, flat.param_region, keep, cpu_offload)
        gathered.update({id(o.param): c for o, c in zip(flat.originals, copies, strict=keep)})
    if not keep:
        return {}
    result: dict[str, torch.Tensor] = {}
    for key, value in plain_state_dict(model).items():
        found = gathered.get(id(value))
        result[key] = found if found is not None else copy_out(value.detach(), cpu_offload)
    return result


@every_rank_calls("sharded_state_dict")
def sharded_state_dict(model: nn.Module) -> dict[str, RowShard | torch.Tensor]:
    """This rank's rows of every parameter (``RowShard``) and full buffers; no copies.

    The tensors are views of the live shards: save or copy them before training on.
    """
    refuse_differed(model, "sharded_state_dict")
    return rows_of(model)


def rows_of(model: nn.Module) -> dict[str, RowShard | torch.Tensor]:
    """``sharded_state_dict`` without its checks: the targets a load writes into."""
    places = param_places(model)
    result: dict[str, RowShard | torch.Tensor] = {}
    for key, value in plain_state_dict(model).items():
        place = places.get(id(value))
        if place is not None and place.flat is not None:
            result[key] = place.row_shard(value.detach())
        else:
            result[key] = value.detach()
    return result


# ---------------------------------------------------------------- loading
@every_rank_calls("load_state_dict", agreed=("strict", "from_rank0"))
def load_state_dict(
    model: nn.Module,
    state_dict: dict[str, RowShard | torch.Tensor],
    *,
    strict: bool = True,
    from_rank0: bool = False,
) -> None:
    """Copy a full or sharded state dict (or a mix) into the model's shards in place.

    Full tensors: every rank takes its own rows, so every rank needs the dict, unless
    ``from_rank0=True``: then only rank 0 of the model's group needs it (e.g. the default
    ``full_state_dict`` output; others pass ``{}``), and it is broadcast one tensor at a
    time. ``RowShard`` entries must hold exactly this rank's rows (the same layout);
    checkpoints saved at another world size or strategy reshard through
    ``flatshard.load_checkpoint``. ``strict``: missing, unexpected and mis-shaped entries
    are an error listing them all.
    """
    before = bool(differed(model))  # [Note: weights that differ across ranks]
    if from_rank0:
        _load_from_rank0(model, state_dict, strict)
        agree_on_differed(model, model_group(model), before)
        return
    reshard_for_load(model, "load_state_dict")
    targets = plain_state_dict(model)
    places = param_places(model)
    check_keys("load_state_dict", targets.keys(), state_dict.keys(), strict)
    _check_same_dict(model, state_dict, targets, places)
    problems: list[str] = []
    for key, target in targets.items():
        if key not in state_dict:
            continue
        place = places.get(id(target))
        problem = _load_one(key, target, state_dict[key], place)
        if problem:
            problems.append(problem)
        else:
            mark_loaded(target)
    if problems:
        raise entries_do_not_fit("load_state_dict", problems)
    agree_on_differed(model, model_group(model), before)


def _check_same_dict(
    model: nn.Module,
    state_dict: dict[str, RowShard | torch.Tensor],
    targets: dict[str, torch.Tensor],
    places: dict[int, HeldRows],
) -> None:
    """[Note: one full dict on every rank]
    From a full dict every rank takes only its own rows of each sharded parameter, so
    ranks given different dicts (another file on one host, a dict changed on one rank)
    would make one model of several, silently. So the ranks compare a digest of every full
    tensor they take rows from (``checksum``: one pass over the dict's sharded
    entries, one digest all-gather), and raise on every rank, naming the entries, before
    anything is copied. Replicated entries (buffers, parameters left whole) are each
    rank's own, as in torch's ``load_state_dict`` under DDP, and ``RowShard`` entries hold
    each rank's own rows: neither is compared."""

    def lines() -> list[str]:
        found = []
        for key, value in sorted(state_dict.items()):
            target = targets.get(key)
            place = None if target is None else places.get(id(target))
            if place is not None and place.flat is not None and is_plain_value(value):
                found.append(f"'{key}': digest {checksum(cast(torch.Tensor, value))}")
        return found

    same_full_dict_on_all_ranks(model, lines, "load_state_dict", "full state dict")


def is_plain_value(value: object) -> bool:
    """A tensor whose bytes the ranks can compare: not a subclass (a DTensor holds a
    part), not on meta (no bytes)."""
    return type(value) in (torch.Tensor, nn.Parameter) and not cast(torch.Tensor, value).is_meta


def same_full_dict_on_all_ranks(
    model: nn.Module, lines: Callable[[], list[str]], caller: str, what: str
) -> None:
    """Raise on every rank of ``model``'s group, naming the ``lines()`` (one per entry,
    with its digest; made only where the group spans ranks) that differ, unless every rank
    holds the same: see [Note: one full dict on every rank]."""
    group = model_group(model)
    if group is None or group.size() == 1:
        return
    device = model_device(model)
    fix = (
        f"Pass the same {what} on every rank (each rank takes its own rows of it), or load "
        "rank 0's with from_rank0=True."
    )
    check_same_on_all_ranks(lines(), group, device, f"hold different {what}s", fix, caller)


def _load_one(
    key: str, target: torch.Tensor, value: RowShard | torch.Tensor, place: HeldRows | None
) -> str | None:
    """Copy ``value`` into ``target``; a description of the mismatch instead, if any."""
    full_shape = place.global_shape if place is not None else target.shape
    if isinstance(value, RowShard):
        if place is None or not place.matches(value):
            base = place.tp.offset if place is not None and place.tp is not None else ()
            mine = (
                _rows_of(place.first_row, place.rows, base, full_shape)
                if place is not None
                else f"all of {tuple(full_shape)}"
            )
            return (
                f"'{key}': the entry holds {value.describe()}, this rank holds {mine}; a "
                "sharded state dict only loads into the same layout (reshard through "
                "flatshard.save_checkpoint / load_checkpoint)"
            )
        local = value.local
    elif isinstance(value, torch.Tensor):
        if value.shape != full_shape:
            return f"'{key}': expected shape {tuple(full_shape)}, found {tuple(value.shape)}"
        local = place.take_global(value) if place is not None else value
    else:
        return f"'{key}': expected a tensor, found {type(value).__name__}"
    with torch.no_grad():
        target.detach().copy_(local)
    return None


def _load_from_rank0(
    model: nn.Module, state_dict: dict[str, RowShard | torch.Tensor], strict: bool
) -> None:
    """Rank 0 checks its full dict and broadcasts it tensor by tensor; a collective."""
    group = model_group(model)
    if group is None:
        load_state_dict(model, state_dict, strict=strict)
        return
    targets = plain_state_dict(model)
    places = param_places(model)

    def keys_rank0_sends() -> list[str]:
        _check_full(targets, places, state_dict, strict)
        return [k for k in targets if k in state_dict]

    sent = checked_on_rank0(group, keys_rank0_sends)
    reshard_for_load(model, "load_state_dict")
    for key in sent:
        target = targets[key]
        place = places.get(id(target))
        shape = place.global_shape if place is not None else target.shape
        device = place.flat.compute_device if place and place.flat else target.device
        if dist.get_rank(group) == 0:
            full = cast(torch.Tensor, state_dict[key]).to(device, target.dtype).contiguous()
        else:
            full = torch.empty(shape, dtype=target.dtype, device=device)
        broadcast(full, group_src=0, group=group)
        with torch.no_grad():
            target.detach().copy_(place.take_global(full) if place is not None else full)
        mark_loaded(target)


def _check_full(
    targets: dict[str, torch.Tensor],
    places: dict[int, HeldRows],
    state_dict: dict[str, RowShard | torch.Tensor],
    strict: bool,
) -> None:
    """Names and full shapes of a full state dict against the model; one error for all."""
    check_keys("load_state_dict", targets.keys(), state_dict.keys(), strict)
    problems = []
    for key, value in state_dict.items():
        if key not in targets:
            continue
        place = places.get(id(targets[key]))
        shape = place.global_shape if place is not None else targets[key].shape
        if not isinstance(value, torch.Tensor) or value.shape != shape:
            found = tuple(value.shape) if isinstance(value, torch.Tensor) else type(value)
            problems.append(f"'{key}': expected a tensor of shape {tuple(shape)}, found {found}")
    if problems:
        raise entries_do_not_fit("load_state_dict", problems)


def check_keys(caller: str, expected: Iterable[str], given: Iterable[str], strict: bool) -> None:
    """Missing or unexpected names: one error listing all of them (when ``strict``)."""
    want, have = list(expected), list(given)
    missing = [k for k in want if k not in set(have)]
    unexpected = [k for k in have if k not in set(want)]
    if strict and (missing or unexpected):
        raise ValueError(
            f"flatshard.{caller} (rank {global_rank()}): the state dict does not match the "
            f"model. Missing: {_names(missing)}. Unexpected: {_names(unexpected)}. "
            "Pass strict=False to load the entries that match."
        )


def _names(keys: list[str], limit: int = 12) -> str:
    if not keys:
        return "none"
    shown = ", ".join(f"'{k}'" for k in keys[:limit])
    return shown + (f" and {len(keys) - limit} more" if len(keys) > limit else "")
