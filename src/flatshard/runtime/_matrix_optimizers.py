"""Optimizers that update each parameter as a whole matrix refuse row shards.

[Note: matrix optimizers on row shards]
Between steps a parameter is this rank's rows of it. That is all a vector-wise optimizer
(SGD, Adam, AdamW, Adagrad, RMSprop, Lion) needs: its update of an element reads that
element's gradient and state only. A matrix optimizer reads the whole matrix: Muon
orthogonalizes each weight (Newton-Schulz), Adafactor factors its second moment into row
and column statistics. On a row shard each rank would compute another update than an
unsharded run, without a word (Muon), or divide by zero on a rank that holds no rows
(Adafactor). So such an optimizer's step refuses a parameter a shard group cuts into rows,
at its first step, on every rank alike (the layout decides, not the rows a rank happens to
hold), naming the optimizer, the parameter and the fix. The fix is
``fully_shard(..., placement=flatshard.Whole())``: every parameter lies whole in one rank's shard
([Note: whole-parameter layout]), its owner steps it with the whole gradient and the other
ranks leave it alone (``.grad`` None), so the update is the unsharded one. NO_SHARD units
(whole matrices on every rank, gradients averaged) are exact too, at data parallel's
memory.
``register_matrix_optimizer`` declares another such class (Shampoo, SOAP).

The check runs in flatshard's step pre-hook of every optimizer of the process
(``_optimizer_steps.py``): one ``isinstance`` per step for other optimizers.
"""

from __future__ import annotations

import weakref
from collections.abc import Collection

import torch
from torch import nn

from flatshard.comm._ranks import global_rank
from flatshard.flat._original_param import OriginalParam
from flatshard.runtime._step import sharded_contexts

# The optimizer classes that update whole matrices (register_matrix_optimizer adds).
_MATRIX_OPTIMIZERS: set[type[torch.optim.Optimizer]] = {torch.optim.Muon, torch.optim.Adafactor}
# Optimizers found clean, with how many parameters they held then (a group added later
# is checked again).
_CHECKED: weakref.WeakKeyDictionary[torch.optim.Optimizer, int] = weakref.WeakKeyDictionary()


def register_matrix_optimizer(optimizer_class: type[torch.optim.Optimizer]) -> None:
    """Declare ``optimizer_class`` an optimizer that updates each parameter as a whole
    matrix (e.g. Shampoo, SOAP): its step then refuses row-sharded parameters, as
    ``torch.optim.Muon`` and ``torch.optim.Adafactor`` do (see the note)."""
    if not (
        isinstance(optimizer_class, type) and issubclass(optimizer_class, torch.optim.Optimizer)
    ):
        raise TypeError(
            "flatshard.register_matrix_optimizer: expected a torch.optim.Optimizer subclass, "
            f"got {optimizer_class!r}"
        )
    _MATRIX_OPTIMIZERS.add(optimizer_class)


def muon_matrices(model: nn.Module, blocks: Collection[type[nn.Module]] | None) -> set[int]:
    """``id``s of the parameters Muon steps as it is used: the trainable 2-D weights inside
    the ``blocks`` modules (with None: every trainable 2-D weight but embeddings'); AdamW
    takes the rest. ``flatshard train --optimizer muon`` and the planner split so."""
    if blocks is None:
        embeddings = {id(m.weight) for m in model.modules() if isinstance(m, nn.Embedding)}
        return {
            id(p)
            for p in model.parameters()
            if p.requires_grad and p.dim() == 2 and id(p) not in embeddings
        }
    kinds = tuple(blocks)
    return {
        id(p)
        for module in model.modules()
        if isinstance(module, kinds)
        for p in module.parameters()
        if p.requires_grad and p.dim() == 2
    }


def refuse_row_shards(optimizer: torch.optim.Optimizer, params: list[torch.Tensor]) -> None:
    """A matrix optimizer about to step ``params``: an error if a shard cuts one of them."""
    if not isinstance(optimizer, tuple(_MATRIX_OPTIMIZERS)):
        return
    if _CHECKED.get(optimizer) == len(params):
        return
    split = {
        id(orig.param): (orig.fqn, tuple(full), unit.label, _how_cut(flat.factor, orig))
        for context in sharded_contexts()
        for unit in context.units
        for flat in unit.flat_params
        for orig, full in zip(flat.originals, flat.full_shapes, strict=True)
        if (flat.factor * flat.splits > 1 and not flat.layout.whole)
        or (orig.tp is not None and orig.tp.sharded)
    }
    first = next((split[id(p)] for p in params if id(p) in split), None)
    if first is not None:  # the first in the optimizer's own order, the same on every rank
        _refuse(optimizer, *first)
    _CHECKED[optimizer] = len(params)


def _how_cut(factor: int, orig: OriginalParam) -> str:
    parts = [f"into rows across {factor} ranks"] if factor > 1 else []
    if orig.tp is not None and orig.tp.sharded:
        parts.append(orig.tp.how)
    return " and ".join(parts)


def _refuse(
    optimizer: torch.optim.Optimizer, name: str, shape: tuple[int, ...], unit: str, how: str
) -> None:
    kind = type(optimizer)
    where = "torch.optim" if kind.__module__.startswith("torch.optim") else kind.__module__
    raise RuntimeError(
        f"flatshard: {where}.{kind.__name__} updates each parameter as a whole matrix, but "
        f"'{name}' {shape} is cut {how} (unit '{unit}', rank "
        f"{global_rank()}): each rank would update a slice of it differently from an "
        "unsharded run. Pass fully_shard(..., placement=flatshard.Whole()) (each parameter "
        "whole on one rank, which steps it), or shard the units it updates with "
        "strategy=flatshard.ShardingStrategy.NO_SHARD (whole matrices on every rank, "
        "gradients averaged), or update row-sharded parameters with a vector-wise "
        "optimizer such as AdamW (docs/guide.md, 'Matrix optimizers')."
    )
