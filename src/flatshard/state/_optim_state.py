"""Optimizer state dicts keyed by original parameter names: full and sharded.

Form (both kinds)::

    {"state": {name: {key: value}}, "param_groups": [{**hyperparameters, "params": [name]}]}

A state value shaped like its parameter's rows on this rank (Adam's moments, SGD's momentum)
is a "row value": gathered to the full shape (full form) or kept as a ``RowShard`` (sharded
form), and cut to the loading rank's rows on load. Anything else (``step``, Python scalars)
is the same on every rank and kept as it is. For a 0-dim parameter a 0-dim value is a row
value unless it is ``step``, the one per-parameter scalar torch's optimizers keep.

A parameter of a whole-parameter layout (placement ``Whole()``) has state on its owner
only, and every value there is whole, whatever its shape (Adafactor's row and column
statistics too): the full form takes it from the owner, the sharded form and the loads
keep it on the owner alone ([Note: whole-parameter layout]).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, cast

import torch
import torch.distributed as dist
from torch import nn

from flatshard.comm._agreement import checked_on_rank0, global_rank, rank_in
from flatshard.comm._collectives import all_gather_object, broadcast
from flatshard.runtime._by_hand import copy_out, gather_copies, pack_rows
from flatshard.runtime._configuration import checksum
from flatshard.runtime._step import context_of, every_rank_calls
from flatshard.state._state_dict import (
    HeldRows,
    RowShard,
    flat_params,
    is_plain_value,
    model_group,
    param_places,
    same_full_dict_on_all_ranks,
)

OptimStateDict = dict[str, Any]


def is_row_value(key: str, value: object, local_shape: torch.Size, full_dim: int) -> bool:
    """Whether a state value is shaped like its parameter's rows (see the module note)."""
    return isinstance(value, torch.Tensor) and is_row_shape(key, value.shape, local_shape, full_dim)


def is_row_shape(key: str, shape: torch.Size, local_shape: torch.Size, full_dim: int) -> bool:
    """``is_row_value`` by shape alone."""
    return shape == local_shape and (full_dim > 0 or len(shape) > 0 or key != "step")


def named_param_groups(
    model: nn.Module, optim: torch.optim.Optimizer, caller: str
) -> list[list[tuple[str, nn.Parameter]]]:
    """The optimizer's parameter groups as (original name, parameter) pairs."""
    names = {id(p): n for n, p in model.named_parameters()}
    groups: list[list[tuple[str, nn.Parameter]]] = []
    for index, group in enumerate(optim.param_groups):
        named = []
        for param in group["params"]:
            if id(param) not in names:
                raise ValueError(
                    f"flatshard.{caller} (rank {global_rank()}): parameter group {index} of "
                    f"the optimizer holds a tensor of shape {tuple(param.shape)} that is not a "
                    "parameter of the model. Build the optimizer from model.parameters() "
                    "after fully_shard."
                )
            named.append((names[id(param)], param))
        groups.append(named)
    return groups


def _hyperparameters(group: dict[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in group.items() if k != "params"}


# ---------------------------------------------------------------- producing
@every_rank_calls("sharded_optim_state_dict")
def sharded_optim_state_dict(model: nn.Module, optim: torch.optim.Optimizer) -> OptimStateDict:
    """This rank's rows of every row value (``RowShard``), other values as they are."""
    places = param_places(model)
    groups = named_param_groups(model, optim, "sharded_optim_state_dict")
    state: dict[str, dict[str, Any]] = {}
    for named in groups:
        for name, param in named:
            place = places[id(param)]
            if param not in optim.state or place.owned_elsewhere:
                continue
            state[name] = {
                key: (
                    place.row_shard(value)
                    if place.flat is not None
                    and is_row_value(key, value, place.local_shape, len(place.full_shape))
                    else value
                )
                for key, value in optim.state[param].items()
            }
    return {"state": state, "param_groups": _named_groups(optim, groups)}


@every_rank_calls("full_optim_state_dict")
def full_optim_state_dict(
    model: nn.Module,
    optim: torch.optim.Optimizer,
    *,
    rank0_only: bool = True,
    cpu_offload: bool = True,
) -> OptimStateDict:
    """Every row value gathered to its parameter's full shape; a collective.

    Gathered one flat parameter group and one state key at a time. ``rank0_only`` and
    ``cpu_offload`` as in ``full_state_dict``.
    """
    keep = not rank0_only or rank_in(model_group(model)) == 0
    groups = named_param_groups(model, optim, "full_optim_state_dict")
    gathered = _gather_row_values(model, optim, keep, cpu_offload)
    owned = _gather_owned_states(model, optim, cpu_offload)
    if not keep:
        return {}
    state: dict[str, dict[str, Any]] = {}
    for named in groups:
        for name, param in named:
            if id(param) in owned:
                if owned[id(param)] is not None:
                    state[name] = cast(dict[str, Any], owned[id(param)])
                continue
            if param not in optim.state:
                continue
            full = gathered.get(id(param), {})
            state[name] = {
                key: full[key] if key in full else _copy_value(value, cpu_offload)
                for key, value in optim.state[param].items()
            }
    return {"state": state, "param_groups": _named_groups(optim, groups)}


def _gather_row_values(
    model: nn.Module, optim: torch.optim.Optimizer, keep: bool, cpu_offload: bool
) -> dict[int, dict[str, torch.Tensor]]:
    """``id(param) -> {key: full tensor}`` for the row values of sharded parameters."""
    gathered: dict[int, dict[str, torch.Tensor]] = {}
    for flat in flat_params(model):
        if flat.layout.whole:
            continue  # _gather_owned_states
        states = [optim.state.get(orig.param, {}) for orig in flat.originals]
        keys = sorted(
            {
                key
                for index, (orig, st) in enumerate(zip(flat.originals, states, strict=True))
                for key, value in st.items()
                if is_row_value(key, value, orig.param.shape, len(flat.full_shapes[index]))
            }
        )
        for key in keys:
            local = [
                st[key] if key in st else torch.zeros_like(orig.param.detach())
                for orig, st in zip(flat.originals, states, strict=True)
            ]
            copies = gather_copies(flat, pack_rows(flat, local), keep, cpu_offload)
            for orig, st, copy in zip(flat.originals, states, copies, strict=keep):
                if key in st:
                    gathered.setdefault(id(orig.param), {})[key] = copy
    return gathered


def _gather_owned_states(
    model: nn.Module, optim: torch.optim.Optimizer, cpu_offload: bool
) -> dict[int, dict[str, Any] | None]:
    """``id(param) -> its owner's whole state`` (None: no state) for every parameter of a
    whole-parameter layout; one object all-gather per such group over its shard group."""
    owned: dict[int, dict[str, Any] | None] = {}
    for flat in flat_params(model):
        if not flat.layout.whole:
            continue
        mine = {
            index: {key: _copy_value(value, True) for key, value in optim.state[orig.param].items()}
            for index, orig in enumerate(flat.originals)
            if flat.owned[index] and orig.param in optim.state
        }
        every = [mine] if flat.groups.shard is None else all_gather_object(mine, flat.groups.shard)
        device = torch.device("cpu") if cpu_offload else flat.shard.device
        for index, orig in enumerate(flat.originals):
            found = [cast(dict[int, Any], states).get(index) for states in every]
            state = next((s for s in found if s is not None), None)
            owned[id(orig.param)] = None if state is None else _to_device(state, device)
    return owned


def _to_device(state: dict[str, Any], device: torch.device) -> dict[str, Any]:
    return {k: v.to(device) if isinstance(v, torch.Tensor) else v for k, v in state.items()}


def _copy_value(value: Any, cpu_offload: bool) -> Any:
    return copy_out(value, cpu_offload) if isinstance(value, torch.Tensor) else value


def _named_groups(
    optim: torch.optim.Optimizer, groups: list[list[tuple[str, nn.Parameter]]]
) -> list[dict[str, Any]]:
    return [
        {**_hyperparameters(group), "params": [name for name, _ in named]}
        for group, named in zip(optim.param_groups, groups, strict=True)
    ]


# ---------------------------------------------------------------- loading
@every_rank_calls("load_optim_state_dict", agreed=("from_rank0",))
def load_optim_state_dict(
    model: nn.Module,
    optim: torch.optim.Optimizer,
    state_dict: OptimStateDict,
    *,
    from_rank0: bool = False,
) -> None:
    """Load a full or sharded optimizer state dict; a fresh optimizer gets every moment.

    The optimizer's parameter groups must hold the same names in the same order as the
    saved ones; hyperparameters (learning rate, ...) come from the saved groups, as with
    ``torch.optim.Optimizer.load_state_dict``. ``from_rank0=True``: only rank 0 of the
    model's group holds the (full) dict, e.g. the default ``full_optim_state_dict``
    output, and the others pass ``{}``; it is broadcast one tensor at a time.
    """
    received = from_rank0 and model_group(model) is not None
    if received:
        state_dict = _receive_from_rank0(model, optim, state_dict)
    places = param_places(model)
    groups = named_param_groups(model, optim, "load_optim_state_dict")
    saved_groups = state_dict.get("param_groups")
    saved_state = state_dict.get("state")
    if not isinstance(saved_groups, list) or not isinstance(saved_state, dict):
        raise ValueError(
            f"flatshard.load_optim_state_dict (rank {global_rank()}): expected a dict with "
            "'state' and 'param_groups' as made by flatshard.full_optim_state_dict or "
            f"sharded_optim_state_dict, found keys {sorted(state_dict)}"
        )
    saved_groups = _this_stages_part(model, groups, saved_groups)
    _check_groups(groups, saved_groups)
    if not received:
        _check_same_state(model, groups, saved_state, places)
    torch_state: dict[int, dict[str, Any]] = {}
    torch_groups: list[dict[str, Any]] = []
    index = 0
    for named, saved in zip(groups, saved_groups, strict=True):
        ids = []
        for name, param in named:
            place = places[id(param)]
            if name in saved_state and not place.owned_elsewhere:
                torch_state[index] = {
                    key: _local_value(name, key, value, place)
                    for key, value in saved_state[name].items()
                }
            ids.append(index)
            index += 1
        torch_groups.append({**_hyperparameters(saved), "params": ids})
    optim.load_state_dict({"state": torch_state, "param_groups": torch_groups})


def every_stages_groups(
    model: nn.Module, saved_groups: list[dict[str, Any]]
) -> list[dict[str, Any]]:
    """A pipeline stage's parameter groups joined with the other stages' (in stage order),
    as one optimizer over the whole model would hold them: what a checkpoint of the
    pipeline keeps ([Note: checkpoints of pipeline stages]). A collective over the
    pipeline's ranks; the groups as given for a model that is not a stage."""
    context = context_of(model)
    seat = context.pipeline if context is not None else None
    if seat is None:
        return saved_groups
    every = cast(
        list[tuple[int, list[dict[str, Any]]]],
        all_gather_object((seat.stage, saved_groups), seat.group),
    )
    joined: list[dict[str, Any]] = [{**g, "params": []} for g in saved_groups]
    for _, theirs in sorted(every, key=lambda pair: pair[0]):
        if len(theirs) != len(joined):
            raise ValueError(
                f"flatshard.save_checkpoint (rank {global_rank()}): the pipeline's stages "
                f"have optimizers of {len(joined)} and {len(theirs)} parameter groups; build "
                "every stage's optimizer with the same groups."
            )
        for mine, group in zip(joined, theirs, strict=True):
            mine["params"] += list(group["params"])
    return joined


def _this_stages_part(
    model: nn.Module,
    groups: list[list[tuple[str, nn.Parameter]]],
    saved_groups: list[dict[str, Any]],
) -> list[dict[str, Any]]:
    """For a pipeline stage, the saved groups cut to its parameters (a checkpoint holds
    every stage's); the saved groups as they are for a model that is not a stage."""
    context = context_of(model)
    if context is None or context.pipeline is None:
        return saved_groups
    mine = {name for named in groups for name, _ in named}
    return [{**g, "params": [n for n in g.get("params", []) if n in mine]} for g in saved_groups]


def _check_groups(
    groups: list[list[tuple[str, nn.Parameter]]], saved_groups: list[dict[str, Any]]
) -> None:
    mine = [[name for name, _ in named] for named in groups]
    theirs = [list(g.get("params", [])) for g in saved_groups]
    # Within a group the state is looked up by name: only which parameters each group
    # holds matters, not their order (a pipeline's checkpoint keeps them stage by stage,
    # [Note: checkpoints of pipeline stages]; the model without a pipeline in its own).
    if [sorted(a) for a in mine] == [sorted(b) for b in theirs]:
        return
    detail = f"the optimizer has {len(mine)} parameter groups, the state dict {len(theirs)}"
    for index, (a, b) in enumerate(zip(mine, theirs, strict=False)):
        if a != b:
            only_here = [n for n in a if n not in b][:5]
            only_there = [n for n in b if n not in a][:5]
            detail = (
                f"parameter group {index} differs: only in the optimizer {only_here}, only "
                f"in the state dict {only_there}"
            )
            break
    raise ValueError(
        f"flatshard.load_optim_state_dict (rank {global_rank()}): {detail}. Build the "
        "optimizer with the same parameter groups as the run that saved it."
    )


def _check_same_state(
    model: nn.Module,
    groups: list[list[tuple[str, nn.Parameter]]],
    saved_state: dict[str, Any],
    places: dict[int, HeldRows],
) -> None:
    """[Note: one full optimizer dict on every rank] as [Note: one full dict on every
    rank] for a model: every rank takes its own rows of each full moment, so ranks given
    different full optimizer dicts (another file on one host, one rank's own optimizer's
    dict) would step one model with moments mixed from several, silently. The ranks
    compare a digest of each sharded parameter's full values, and its scalars (``step``,
    whose bias correction Adam applies to every row), before anything is loaded.
    ``RowShard`` values are each rank's own rows and a whole parameter's state its owner's
    alone ([Note: whole-parameter layout]): neither is compared; hyperparameters
    are compared at the next step, with the optimizer's (the step's ledger entry)."""

    def lines() -> list[str]:
        found = []
        for name, param in (pair for named in groups for pair in named):
            place = places[id(param)]
            values = saved_state.get(name)
            if place.flat is None or place.flat.layout.whole or not isinstance(values, dict):
                continue  # each rank's own; a whole parameter's state is its owner's alone
            for key, value in sorted(values.items()):
                if is_plain_value(value):
                    found.append(f"'{name}' {key}: digest {checksum(value)}")
                elif not isinstance(value, torch.Tensor | RowShard):
                    found.append(f"'{name}' {key}: {value!r:.80}")
        return found

    same_full_dict_on_all_ranks(model, lines, "load_optim_state_dict", "full optimizer state dict")


def _local_value(name: str, key: str, value: Any, place: HeldRows) -> Any:
    """This rank's part of one saved state value."""
    if isinstance(value, RowShard):
        if not place.matches(value):
            raise ValueError(
                f"flatshard.load_optim_state_dict (rank {global_rank()}): state '{key}' of "
                f"'{name}' holds {value.describe()}, this rank holds rows {place.first_row}.."
                f"{place.first_row + place.rows}; reshard through flatshard.load_checkpoint"
            )
        return value.local.clone()
    if place.flat is not None and place.flat.layout.whole:
        # Whole values of any shape, kept by the owner (loads skip the other ranks).
        return value.clone() if isinstance(value, torch.Tensor) else value
    if is_row_value(key, value, place.global_shape, len(place.full_shape)):
        return place.take_global(value).clone()
    if isinstance(value, torch.Tensor) and value.dim() > 0:
        raise ValueError(
            f"flatshard.load_optim_state_dict (rank {global_rank()}): state '{key}' of "
            f"'{name}' has shape {tuple(value.shape)}, expected the parameter's full shape "
            f"{tuple(place.global_shape)} or a scalar"
        )
    # A copy: the optimizer updates its state in place (``step`` too), and the caller's
    # state dict must not change with it.
    return value.clone() if isinstance(value, torch.Tensor) else value


# ---------------------------------------------------------------- loading from rank 0
@dataclass(frozen=True)
class _Sent:
    """Stands for a tensor of a state dict that rank 0 broadcasts on its own."""

    shape: torch.Size
    dtype: torch.dtype


def _receive_from_rank0(
    model: nn.Module, optim: torch.optim.Optimizer, state_dict: OptimStateDict
) -> OptimStateDict:
    """This rank's sharded optimizer state dict, from the full one rank 0 holds.

    Rank 0 checks the dict and sends its outline (scalars as they are, other tensors as
    shape and dtype); an error there is raised on every rank. Then each tensor is
    broadcast and every rank keeps its rows of the row values.
    """
    group = cast(dist.ProcessGroup, model_group(model))
    places = param_places(model)
    received = checked_on_rank0(group, lambda: _outline(model, optim, state_dict, places))
    named = dict(model.named_parameters())
    for name, entries in received["state"].items():
        place = places[id(named[name])]
        device = place.flat.compute_device if place.flat is not None else named[name].device
        for key, value in entries.items():
            if not isinstance(value, _Sent):
                continue
            if dist.get_rank(group) == 0:
                full = state_dict["state"][name][key].to(device, value.dtype).contiguous()
            else:
                full = torch.empty(value.shape, dtype=value.dtype, device=device)
            broadcast(full, group_src=0, group=group)
            if place.flat is not None and place.flat.layout.whole:  # whole, kept by its owner
                entries[key] = full.to(named[name].device, copy=True)
                continue
            local = place.take_global(full).to(named[name].device).clone()
            entries[key] = place.row_shard(local) if place.flat is not None else local
    return received


def _outline(
    model: nn.Module,
    optim: torch.optim.Optimizer,
    state_dict: OptimStateDict,
    places: dict[int, HeldRows],
) -> OptimStateDict:
    """Rank 0: check a full optimizer state dict; tensors of 1+ dims become ``_Sent``."""
    saved_state, saved_groups = state_dict.get("state"), state_dict.get("param_groups")
    if not isinstance(saved_groups, list) or not isinstance(saved_state, dict):
        raise ValueError(
            "flatshard.load_optim_state_dict(from_rank0=True): rank 0 expected a dict with "
            "'state' and 'param_groups' as made by flatshard.full_optim_state_dict, found "
            f"keys {sorted(state_dict)}"
        )
    _check_groups(named_param_groups(model, optim, "load_optim_state_dict"), saved_groups)
    named = dict(model.named_parameters())
    state: dict[str, dict[str, Any]] = {}
    for name, entries in saved_state.items():
        if name not in named:
            continue  # not in any group: _check_groups made sure it is not wanted
        place = places[id(named[name])]
        state[name] = {}
        for key, value in entries.items():
            if isinstance(value, RowShard):
                raise ValueError(
                    f"flatshard.load_optim_state_dict(from_rank0=True): state '{key}' of "
                    f"'{name}' is a RowShard; rank 0 must hold a full optimizer state dict"
                )
            if isinstance(value, torch.Tensor) and value.dim() > 0:
                _local_value(name, key, value, place)  # the shape check, on rank 0
                state[name][key] = _Sent(value.shape, value.dtype)
            else:
                state[name][key] = value
    return {"state": state, "param_groups": saved_groups}
