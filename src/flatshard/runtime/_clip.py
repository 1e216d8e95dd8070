"""``clip_grad_norm_`` across shards (paper mechanism 12)."""

from __future__ import annotations

import math

import torch
import torch.distributed as dist
from torch import nn

from flatshard.comm._collectives import all_reduce
from flatshard.runtime._step import every_rank_calls
from flatshard.runtime._unit import units_of


@every_rank_calls("clip_grad_norm_")
def clip_grad_norm_(model: nn.Module, max_norm: float, norm_type: float = 2.0) -> torch.Tensor:
    """Clip the gradients of ``model`` in place by their global norm; return that norm.

    The norm is taken over the whole (unsharded) gradient, as
    ``torch.nn.utils.clip_grad_norm_`` would on the unsharded model, for any mix of
    sharding strategies. A collective: call it on every rank, after backward (and after
    unscaling, with a grad scaler).
    """
    norm_type = float(norm_type)
    if not norm_type > 0:
        raise ValueError(f"flatshard.clip_grad_norm_: norm_type must be > 0, got {norm_type}")
    total = _global_norm(model, norm_type)
    coef = torch.clamp(max_norm / (total + 1e-6), max=1.0)
    for param in model.parameters():
        if param.grad is not None:
            param.grad.mul_(coef.to(param.grad.device, param.grad.dtype))
    return total


def _global_norm(model: nn.Module, norm_type: float) -> torch.Tensor:
    """Each element of the gradient counted once: per shard group, then across them.

    A shard group's ranks hold disjoint rows, so their partial sums (or maxima) add up over
    that group; replicas hold the same rows, so nothing is reduced across them. Parameters
    split by tensor parallelism add up over their TP group too (replicated ones do not).
    Parameters flatshard does not manage are replicated and counted locally.
    """
    inf = math.isinf(norm_type)
    buckets: dict[tuple[int, int], tuple[list[dist.ProcessGroup], list[torch.Tensor]]] = {}
    managed: set[int] = set()
    for unit in units_of(model, "clip_grad_norm_"):
        for flat in unit.trainable:
            for orig in flat.originals:
                managed.add(id(orig.param))
                tp = orig.tp.group if orig.tp is not None and orig.tp.sharded else None
                groups = [g for g in (flat.groups.shard, tp) if g is not None]
                _, grads = buckets.setdefault((id(flat.groups.shard), id(tp)), (groups, []))
                if orig.param.grad is not None:
                    grads.append(orig.param.grad)
    local = [p.grad for p in model.parameters() if id(p) not in managed and p.grad is not None]
    buckets.setdefault((id(None), id(None)), ([], []))[1].extend(local)
    device = next(model.parameters()).device
    partials = []
    for groups, grads in buckets.values():  # the same order on every rank
        partial = _partial(grads, norm_type, device)
        for group in groups:
            all_reduce(partial, group, op=dist.ReduceOp.MAX if inf else dist.ReduceOp.SUM)
        partials.append(partial)
    stacked = torch.stack([p.to(device) for p in partials])  # offloaded norms: on the CPU
    return stacked.max() if inf else stacked.sum() ** (1.0 / norm_type)


def _partial(grads: list[torch.Tensor], norm_type: float, device: torch.device) -> torch.Tensor:
    """Max of |g| (inf norm) or sum of |g|^p over ``grads``, in fp32 or wider."""
    if not grads:
        return torch.zeros((), device=device)
    values = [g.detach().to(torch.promote_types(g.dtype, torch.float32)) for g in grads]
    if math.isinf(norm_type):
        return torch.stack([v.abs().max() if v.numel() else v.new_zeros(()) for v in values]).max()
    return torch.stack([v.abs().pow(norm_type).sum() for v in values]).sum()
