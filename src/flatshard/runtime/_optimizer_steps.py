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
  it is refused (``Unit._refuse_step_since_forward``).
An optimizer of another model, on one rank or all, changes nothing here. An optimizer that
holds parameters on the meta device was built before ``fully_shard`` materialized a
meta-built model: it would step tensors no forward reads, so it is refused too. Matrix
optimizers refuse row shards here as well (``_matrix_optimizers.py``).
"""

from __future__ import annotations

import hashlib
from typing import Any

import torch

from flatshard.comm._ranks import global_rank
from flatshard.flat._reduction import Owed
from flatshard.runtime._matrix_optimizers import refuse_row_shards
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
    """The optimizer's class and each parameter group's numeric hyper-parameters (``lr``,
    ``betas``, ``weight_decay``, ...), as the ranks compare them ([Note: steps in the
    ledger]); a long list is cut, with a digest of the whole so that a difference past the
    cut still shows."""
    groups = [
        " ".join(f"{key}={group[key]!r}" for key in sorted(group) if _number(group[key]))
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


def _number(value: object) -> bool:
    """A float or int (not a bool, not a tensor), or a tuple of them (``betas``)."""
    if isinstance(value, tuple):
        return all(_number(v) for v in value)
    return type(value) in (float, int)
