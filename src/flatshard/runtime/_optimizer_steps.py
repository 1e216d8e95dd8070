"""What an optimizer step means to the sharded models of the process.

[Note: the model's optimizer step]
An optimizer "of a model" is one that holds any of the model's original parameters; every
rank builds it alike, so every rank agrees on which steps are the model's. Before such a
step (torch's global step pre-hook):
- the step is refused, on every rank alike, where the gradients are not whole yet: a
  unit whose backward passes ran with gradient sync off (``no_sync`` around every
  micro-batch, ``set_requires_gradient_sync(False)`` left on) holds their sum unreduced,
  and ``.grad`` has none of it; one whose replicas' all-reduce is owed
  (``set_requires_all_reduce(False)`` left on) likewise. Without the refusal the step
  would silently use nothing (or the last reduced gradient), and the kept sum would join
  the next synchronized step;
- every gathered buffer of the model becomes stale ([Note: stale gathers]): the step
  writes the shards, so nothing gathered before it is used after it (a held unit, a unit
  kept gathered by ``set_reshard_after_backward(False)``, a replica's region);
- the step joins the ledger the ranks compare ([Note: steps in the ledger]), and each unit
  whose parameters the optimizer holds counts it: a backward of a forward that ran before
  it is refused (``Unit._refuse_write_since_forward``).
An optimizer of another model, on one rank or all, changes nothing here. An optimizer that
holds parameters on the meta device was built before ``fully_shard`` materialized a
meta-built model: it would step tensors no forward reads, so it is refused too. Matrix
optimizers refuse row shards here as well ([Note: matrix optimizers on row shards]).

[Note: matrix optimizers on row shards]
Optimizers that update each parameter as a whole matrix refuse row shards. Between steps a
parameter is this rank's rows of it. That is all a vector-wise optimizer (SGD, Adam,
AdamW, Adagrad, RMSprop, Lion) needs: its update of an element reads that element's
gradient and state only. A matrix optimizer reads the whole matrix: Muon orthogonalizes
each weight (Newton-Schulz), Adafactor factors its second moment into row and column
statistics. On a row shard each rank would compute another update than an unsharded run,
without a word (Muon), or divide by zero on a rank that holds no rows
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
(``before_step``): one ``isinstance`` per step for other optimizers.
"""

from __future__ import annotations

import hashlib
import weakref
from collections.abc import Collection
from typing import Any

import torch
from torch import nn

from flatshard.comm._agreement import global_rank
from flatshard.flat._partition import OriginalParam
from flatshard.flat._reduction import Owed
from flatshard.runtime._step import StepContext, sharded_contexts


def before_step(
    optimizer: torch.optim.Optimizer, args: tuple[Any, ...], kwargs: dict[str, Any]
) -> tuple[tuple[Any, ...], dict[str, Any]] | None:
    """torch's global optimizer step pre-hook, while a sharded model lives (see the note).

    A step given a ``closure`` (Lightning's, LBFGS's) runs the closure's forward and
    backward inside the step: the checks and the marks then follow each call of the
    closure, which is wrapped for that, and come before the update that follows it.
    """
    params = [p for group in optimizer.param_groups for p in group["params"]]
    contexts = sharded_contexts()
    _refuse_meta(optimizer, params, contexts)
    refuse_row_shards(optimizer, params)
    held = {id(p) for p in params}
    owned = [c for c in contexts if any(id(o.param) in held for o in c.originals())]
    if not owned:
        return None
    # ``args`` starts with the optimizer itself; a closure, if any, comes next.
    closure = kwargs.get("closure", args[1] if len(args) > 1 else None)
    settings = _settings(optimizer)
    if closure is None:
        _about_to_update(owned, held, settings)
        return None

    def checked_closure() -> Any:
        loss = closure()
        _about_to_update(owned, held, settings)
        return loss

    if "closure" in kwargs:
        return args, {**kwargs, "closure": checked_closure}
    return (args[0], checked_closure, *args[2:]), kwargs


def _about_to_update(contexts: list[StepContext], held: set[int], settings: str) -> None:
    """The models' shards are about to be written by their optimizer (``held``: the ids
    of the parameters it holds; ``settings``: its hyper-parameters)."""
    for context in contexts:
        _refuse_owed(context)
        context.optimizer_steps(held, settings)


_SETTINGS_SHOWN = 160  # characters of an optimizer's settings quoted in an error


def _settings(optimizer: torch.optim.Optimizer) -> str:
    """The optimizer's class and, per parameter group, how many parameters it holds and
    the hyper-parameters that change the update (``lr``, ``betas``, ``weight_decay``,
    ``maximize``, ``nesterov``, ...), as the ranks compare them ([Note: steps in the
    ledger]); a long list is cut, with a digest of the whole so that a difference past the
    cut still shows. Not compared: how torch computes the same update (``foreach``,
    ``fused``, ...), which may differ between hosts."""
    groups = [
        f"params={len(group['params'])} "
        + " ".join(f"{key}={group[key]!r}" for key in sorted(group) if _setting(key, group[key]))
        for group in optimizer.param_groups
    ]
    text = f"{type(optimizer).__name__}: " + "; ".join(groups)
    if len(text) <= _SETTINGS_SHOWN:
        return text
    digest = hashlib.blake2b(text.encode(), digest_size=4).hexdigest()
    return f"{text[:_SETTINGS_SHOWN]}... (all: {digest})"


def _refuse_owed(context: StepContext) -> None:
    for unit in context.units:
        for flat in unit.trainable:
            owes = flat.reduction.owes
            if owes is Owed.REDUCTION:
                raise RuntimeError(
                    f"flatshard: optimizer.step() on rank {global_rank()} while unit "
                    f"'{unit.label}' holds gradients that were never reduced: every "
                    "backward since the last step ran with gradient sync off (inside "
                    "flatshard.no_sync, or with flatshard.set_requires_gradient_sync(model, "
                    "False) in force), so .grad holds none of them. Run the last "
                    "micro-batch's backward outside no_sync, or call "
                    "flatshard.set_requires_gradient_sync(model, True) before it."
                )
            if owes is Owed.ALL_REDUCE:
                raise RuntimeError(
                    f"flatshard: optimizer.step() on rank {global_rank()} while unit "
                    f"'{unit.label}' still owes its gradients' all-reduce across replicas "
                    "(set_requires_all_reduce(model, False) was in force for every backward "
                    "since the last step). Call flatshard.set_requires_all_reduce(model, "
                    "True) before the last micro-batch's backward."
                )


def _refuse_meta(
    optimizer: torch.optim.Optimizer, params: list[torch.Tensor], contexts: list[StepContext]
) -> None:
    """Meta parameters that no sharded model holds (a model sharded on meta, as the planner
    simulates one, holds its own)."""
    meta = [p for p in params if p.is_meta]
    if meta:
        sharded = {id(o.param) for context in contexts for o in context.originals()}
        meta = [p for p in meta if id(p) not in sharded]
    if not meta:
        return
    shapes = ", ".join(str(tuple(p.shape)) for p in meta[:3]) + (", ..." if len(meta) > 3 else "")
    raise RuntimeError(
        f"flatshard: {_name(optimizer)}.step() on rank {global_rank()}: the optimizer holds "
        f"{len(meta)} parameters on the meta device (shapes {shapes}). It was built "
        "before flatshard.fully_shard materialized a meta-built model, "
        "which replaced those parameters: the step would update tensors no forward reads. "
        "Build the optimizer after fully_shard, from model.parameters()."
    )


def _name(optimizer: torch.optim.Optimizer) -> str:
    kind = type(optimizer)
    where = "torch.optim" if kind.__module__.startswith("torch.optim") else kind.__module__
    return f"{where}.{kind.__name__}"


# How torch computes a step, not what it computes: free to differ between ranks.
_HOW = frozenset({"foreach", "fused", "capturable", "differentiable"})


def _setting(key: str, value: object) -> bool:
    """Whether a parameter group's entry is a setting the ranks must share: a number, a
    flag or a name (or a tuple of them, ``betas``), not how torch computes the update."""
    if key in _HOW:
        return False
    if isinstance(value, tuple):
        return all(_setting(key, v) for v in value)
    return type(value) in (float, int, bool, str)


# ---------------------------------------------------------------- matrix optimizers
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
