"""``clip_grad_norm_`` across shards (paper mechanism 12)."""

from __future__ import annotations

import math

import torch
import torch.distributed as dist
from torch import nn

from flatshard.comm._collectives import all_reduce
from flatshard.runtime._join import note_call
from flatshard.runtime._pipeline import pipeline_total
from flatshard.runtime._step import collective_call, distinct_contexts
from flatshard.runtime._unit import Unit, units_of


def clip_grad_norm_(model: nn.Module, max_norm: float, norm_type: float = 2.0) -> torch.Tensor:
    """Clip the gradients of ``model`` in place by their global norm; return that norm.

    The norm is taken over the whole (unsharded) gradient, as
    ``torch.nn.utils.clip_grad_norm_`` would on the unsharded model, for any mix of
    sharding strategies. A collective: call it on every rank, with the same ``max_norm``
    and ``norm_type`` (agreed: a rank that clips alone or with other values is named on
    every rank), after backward (and after unscaling, with a grad scaler).
    """
    norm_type = float(norm_type)
    if not norm_type > 0:
        raise ValueError(f"flatshard.clip_grad_norm_: norm_type must be > 0, got {norm_type}")
    call = clip_call("clip_grad_norm_", max_norm, norm_type)
    with collective_call(model, call, over_stages=True):  # a norm over every stage
        return _clip(model, max_norm, norm_type)


def clip_call(name: str, max_norm: object, norm_type: float | None = None) -> str:
    """The call the ranks agree on, with its values: each rank scales its own rows by
    ``max_norm / norm``, so a rank with another ``max_norm`` would scale its rows alone
    (``norm_type`` None: a call given the norm, which has none)."""
    limit = float(max_norm) if isinstance(max_norm, float | int) else max_norm
    order = "" if norm_type is None else f", norm_type={norm_type!r}"
    return f"{name}(max_norm={limit!r}{order})"


def _clip(model: nn.Module, max_norm: float, norm_type: float) -> torch.Tensor:
    note_call(lambda: clip_grad_norm_(model, max_norm, norm_type))  # (inside join)
    total = _global_norm(model, norm_type)
    coef = torch.clamp(max_norm / (total + 1e-6), max=1.0)
    for param in model.parameters():
        if param.grad is not None:
            param.grad.mul_(coef.to(param.grad.device, param.grad.dtype))
    return total


def _global_norm(model: nn.Module, norm_type: float) -> torch.Tensor:
    """The norm of every gradient of ``model``, each element counted once."""
    units = units_of(model, "clip_grad_norm_")
    managed = {id(o.param) for u in units for f in u.trainable for o in f.originals}
    local = [p.grad for p in model.parameters() if id(p) not in managed and p.grad is not None]
    device = next(model.parameters()).device
    return sharded_norm(units, None, local, norm_type, device)


def sharded_norm(
    units: list[Unit],
    only: set[int] | None,
    local: list[torch.Tensor],
    norm_type: float,
    device: torch.device,
    caller: str = "clip_grad_norm_",
) -> torch.Tensor:
    """The norm of the units' gradients (those whose ``id`` is in ``only``, or all) and of
    ``local`` tensors, each element counted once. A collective over the units' groups.

    A shard group's ranks hold disjoint rows, so their partial sums (or maxima) add up over
    that group; replicas hold the same rows, so nothing is reduced across them (except
    under HYBRID_SHARD_OPTIM, where they hold disjoint parts of them: ``grad_groups``). Parameters
    split by tensor parallelism add up over their TP group too (replicated ones do not).
    ``local`` tensors (parameters flatshard does not manage) are replicated: counted here.
    Every rank makes the same buckets in the same order, with or without gradients.
    """
    inf = math.isinf(norm_type)
    buckets: dict[tuple[int, ...], tuple[list[dist.ProcessGroup], list[torch.Tensor]]] = {}
    for unit in units:
        for flat in unit.trainable:
            for orig in flat.originals:
                tp = orig.tp.group if orig.tp is not None and orig.tp.sharded else None
                groups = [*flat.groups.grad_groups, *([tp] if tp is not None else [])]
                key = (*(id(g) for g in flat.groups.grad_groups), id(tp))
                _, grads = buckets.setdefault(key, (groups, []))
                grad = orig.param.grad
                if grad is not None and (only is None or id(grad) in only):
                    grads.append(grad)
    buckets.setdefault((id(None), id(None)), ([], []))[1].extend(local)
    partials = []
    for groups, grads in buckets.values():  # the same order on every rank
        partial = _partial(grads, norm_type, device)
        for group in groups:
            if inf:
                partial = _max_over(partial, group)
            else:
                all_reduce(partial, group, op=dist.ReduceOp.SUM)
        partials.append(partial)
    stacked = torch.stack([p.to(device) for p in partials])  # offloaded norms: on the CPU
    total = stacked.max() if inf else stacked.sum()
    total = pipeline_total(distinct_contexts(units), total, inf, caller)
    return total if inf else total ** (1.0 / norm_type)


def _max_over(partial: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
    """The largest of the ranks' ``partial`` maxima, NaN if any rank's is NaN, as torch's
    inf-norm of the unsharded gradient would be. A backend's MAX need not keep a NaN
    (gloo's drops one that comes from a later rank: the norm came out finite, and
    ``error_if_nonfinite`` passed a NaN gradient on to the optimizer), so a NaN goes as a
    flag of its own, in the same all-reduce."""
    nan = torch.isnan(partial)
    pair = torch.stack([torch.where(nan, torch.zeros_like(partial), partial), nan.to(partial)])
    all_reduce(pair, group, op=dist.ReduceOp.MAX)
    return torch.where(pair[1] > 0, torch.full_like(pair[0], math.nan), pair[0])


def _partial(grads: list[torch.Tensor], norm_type: float, device: torch.device) -> torch.Tensor:
    """Max of |g| (inf norm) or sum of |g|^p over ``grads``, in fp32 or wider."""
    if not grads:
        return torch.zeros((), device=device)
    values = [g.detach().to(torch.promote_types(g.dtype, torch.float32)) for g in grads]
    if math.isinf(norm_type):
        return torch.stack([v.abs().max() if v.numel() else v.new_zeros(()) for v in values]).max()
    return torch.stack([v.abs().pow(norm_type).sum() for v in values]).sum()
