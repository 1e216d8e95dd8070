"""``torch.nn.utils.clip_grad_norm_`` on a sharded model: the global norm, not a rank's.

[Note: torch's clip_grad_norm_ on sharded gradients]
FSDP2 users clip with ``torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm)``:
there the gradients are DTensors, whose norm is reduced across ranks. flatshard's
gradients are plain tensors of this rank's rows, so torch's function would take each
rank's own norm and scale each rank's rows by a different factor: a silently wrong step,
and one no later check can always see (where every rank's own norm is under
``max_norm`` and the global one is not, no rank scales anything).

So once a model is sharded, torch's norm (``torch.nn.utils.get_total_norm``, which
``clip_grad_norm_`` looks up when it is called, however the caller imported it) is
replaced by one that recognizes the gradients of flatshard's original parameters and
takes their norm over the shard and tensor-parallel groups, as ``flatshard.clip_grad_norm_``
does; tensors flatshard does not manage count locally, so on anything else the result is
torch's. Given flatshard's gradients it is a collective, agreed on through the store first
like every flatshard call a program may make on some ranks only. ``clip_grad_value_``
clamps each element on its own and is right as it is.

The replacement is process-wide, installed by the first ``fully_shard`` and undone when
the last sharded model is gone (``_torch_utilities.py``); the models it looks in are held
weakly (``_step.py``).
"""

from __future__ import annotations

import inspect
import math
import sys
from collections.abc import Callable, Iterable

import torch
import torch.nn.utils
import torch.nn.utils.clip_grad

from flatshard.runtime._clip import clip_call, sharded_norm
from flatshard.runtime._join import note_unreplayable
from flatshard.runtime._step import StepContext, collective_call, sharded_contexts

_TotalNorm = Callable[..., torch.Tensor]


class TorchNorms:
    """torch's norm functions, replaced while installed and put back by ``remove``."""

    def __init__(self) -> None:
        self._torch: tuple[_TotalNorm, _TotalNorm] | None = None  # (private, public)

    def install(self) -> None:
        if self._torch is None:
            self._torch = (torch.nn.utils.clip_grad._get_total_norm, torch.nn.utils.get_total_norm)
            torch.nn.utils.clip_grad._get_total_norm = _total_norm
            torch.nn.utils.get_total_norm = _total_norm

    def remove(self) -> None:
        if self._torch is not None:
            private, public = self._torch
            torch.nn.utils.clip_grad._get_total_norm = private
            torch.nn.utils.get_total_norm = public
            self._torch = None


# The code of torch's clip_grad_norm_ (under its decorators): see _clipped_parameters.
_CLIP_CODE = inspect.unwrap(torch.nn.utils.clip_grad.clip_grad_norm_).__code__
# torch's own function, called for tensors flatshard does not manage.
_TORCH_TOTAL_NORM: _TotalNorm = torch.nn.utils.clip_grad._get_total_norm


def _total_norm(
    tensors: torch.Tensor | Iterable[torch.Tensor],
    norm_type: float | str = 2.0,
    error_if_nonfinite: bool = False,
    foreach: bool | None = None,
) -> torch.Tensor:
    """``torch.nn.utils.get_total_norm``, over every rank's rows of flatshard's gradients."""
    note_unreplayable(
        "torch.nn.utils.clip_grad_norm_ (or get_total_norm)",
        "clip with flatshard.clip_grad_norm_(model, max_norm) inside flatshard.join",
    )
    tensors = [tensors] if isinstance(tensors, torch.Tensor) else list(tensors)
    given = {id(t) for t in tensors}
    grads = {c: _grads(c) for c in sharded_contexts()}  # each sharded model's gradients
    params, max_norm = _clipped_call()
    if params is not None:  # which models: by the parameters, the same on every rank
        contexts = [c for c in grads if any(id(o.param) in params for o in c.originals())]
    else:
        contexts = [c for c, found in grads.items() if any(id(g) in given for g in found)]
    if not contexts:
        return _TORCH_TOTAL_NORM(tensors, norm_type, error_if_nonfinite, foreach)
    units = [u for c in contexts for u in c.units]
    managed = {id(g) for c in contexts for g in grads[c]}
    local = [t for t in tensors if id(t) not in managed]
    order = float(norm_type)
    call = "torch.nn.utils.clip_grad_norm_"
    if max_norm is not None:  # the values are agreed too (see clip_call)
        call = clip_call(call, max_norm, order)
    with collective_call(contexts[0].root, call):
        total = sharded_norm(
            units, given, local, order, units[0].compute_device, "torch.nn.utils.clip_grad_norm_"
        )
    if error_if_nonfinite and not math.isfinite(float(total)):
        raise RuntimeError(
            f"The total norm of order {order} for gradients from `parameters` is non-finite, "
            "so it cannot be clipped (flatshard: the norm over every rank's rows). To scale "
            "the gradients by the non-finite norm anyway, set `error_if_nonfinite=False`"
        )
    return total


def _clipped_call() -> tuple[set[int] | None, object]:
    """``id``s of the parameters torch's ``clip_grad_norm_`` was given, and its
    ``max_norm``, when it is the caller of the norm (two frames up); else (None, None).

    torch passes the norm only the gradients it found. A rank that holds no gradient of the
    parameters given (placement ``Whole()``: each matrix on one rank; a subset such as Muon's
    matrices may have none on this rank) would see no sharded gradient, compute its own
    0.0 with no collective, and leave the others waiting in theirs. The parameters are the
    same on every rank.
    """
    frame = sys._getframe(2)
    if frame.f_code is not _CLIP_CODE:
        return None, None
    parameters = frame.f_locals.get("parameters")
    if not isinstance(parameters, list):
        return None, None
    return {id(p) for p in parameters}, frame.f_locals.get("max_norm")


def _grads(context: StepContext) -> list[torch.Tensor]:
    """The gradients of the trainable original parameters of ``context``'s units."""
    return [
        o.param.grad
        for u in context.units
        for f in u.trainable
        for o in f.originals
        if o.param.grad is not None
    ]
