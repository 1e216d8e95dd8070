"""What flatshard installs in torch while a sharded model lives, with its handles.

torch's gradient norm is made global for flatshard's gradients, and its clipping by a given
norm agreed across the ranks ([Note: torch's clip_grad_norm_ on sharded gradients] below),
a step pre-hook of every optimizer sees the model's optimizer steps
(``_optimizer_steps.py``), torch's ``zero_grad`` functions also drop the gradients kept
unreduced ([Note: zero_grad drops kept gradients] below), and torch's module registration
hooks mark each sharded model to be checked for changes (``_changes.py``). All are
installed once, by the first ``fully_shard``, and removed when the last sharded model is
gone (garbage-collected): then the process runs plain torch again (torch's own functions,
no hook).

[Note: zero_grad drops kept gradients]
``zero_grad`` on a sharded model: the gradients kept unreduced go with ``.grad``.
Backward passes with gradient sync off (``no_sync``, ``set_requires_gradient_sync(False)``)
sum a unit's gradient into its unsharded flat gradient, not into ``.grad``; with
``set_requires_all_reduce(False)`` (hybrid) the reduce-scattered chunk waits for the
replicas' all-reduce. Under DDP the same gradients accumulate into ``.grad``, and
``zero_grad`` (the optimizer's or the module's) clears them: a loop written for DDP that
zeroes a discarded accumulation (a step skipped on overflow, a warm-up batch) relies on
it. Left alone, flatshard's kept sum would join the next synchronized step, silently.

So while a sharded model lives, torch's ``Optimizer.zero_grad`` and ``Module.zero_grad``
are wrapped (``ZeroGrads``, owned by ``TorchReach``): after torch's own, every parameter
it zeroed drops its rows of what its group keeps (the whole group at once where all of
its parameters were zeroed; two optimizers over one unit each drop their own). A module's
``zero_grad`` drops every unit inside it, held ones included (their parameters are then
the gathered views, not the originals). Nothing here is a collective, and no decision of
which collectives follow changes: a rank that zeroes on its own changes values only.

An optimizer class that overrides ``zero_grad`` without calling torch's is not seen.

[Note: torch's clip_grad_norm_ on sharded gradients]
``torch.nn.utils.clip_grad_norm_`` on a sharded model: the global norm, not a rank's.
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
like every flatshard call a program may make on some ranks only. Where the norm is taken
first and the gradients clipped by it after (accelerate, and so the Hugging Face Trainer:
``get_total_norm``, then ``clip_grads_with_norm_``), each rank scales its own rows by its
own ``max_norm``: torch's public ``clip_grads_with_norm_`` is replaced too, to agree on
``max_norm`` first where it is given flatshard's parameters (torch's ``clip_grad_norm_``
calls its private one, agreed with the norm). ``clip_grad_value_`` clamps each element on
its own and is right as it is.

The replacement is process-wide, installed by the first ``fully_shard`` and undone when
the last sharded model is gone (``TorchReach``); the models it looks in are held weakly
(``_step.py``).
"""

from __future__ import annotations

import functools
import inspect
import math
import sys
import weakref
from collections.abc import Callable, Iterable

import torch
import torch.nn.utils
import torch.nn.utils.clip_grad
from torch import nn
from torch.nn.modules.module import (
    register_module_module_registration_hook,
    register_module_parameter_registration_hook,
)
from torch.optim.optimizer import register_optimizer_step_pre_hook
from torch.utils.hooks import RemovableHandle

from flatshard.runtime._clip import clip_call, sharded_norm
from flatshard.runtime._join import note_unreplayable
from flatshard.runtime._optimizer_steps import before_step
from flatshard.runtime._step import (
    StepContext,
    agree,
    collective_call,
    sharded_contexts,
    watch,
    watched_contexts,
)

# ---------------------------------------------------------------- zero_grad
_ZeroGrad = Callable[..., None]


class ZeroGrads:
    """torch's two ``zero_grad`` functions, wrapped while installed and put back by ``remove``."""

    def __init__(self) -> None:
        self._torch: tuple[_ZeroGrad, _ZeroGrad] | None = None  # (optimizer's, module's)

    def install(self) -> None:
        if self._torch is not None:
            return
        optimizer_zero_grad = torch.optim.Optimizer.zero_grad
        module_zero_grad = nn.Module.zero_grad
        self._torch = (optimizer_zero_grad, module_zero_grad)

        @functools.wraps(optimizer_zero_grad)
        def zero_optimizer(optimizer: torch.optim.Optimizer, set_to_none: bool = True) -> None:
            optimizer_zero_grad(optimizer, set_to_none)
            if _anything_kept():
                drop_kept([p for group in optimizer.param_groups for p in group["params"]])

        @functools.wraps(module_zero_grad)
        def zero_module(module: nn.Module, set_to_none: bool = True) -> None:
            module_zero_grad(module, set_to_none)
            if _anything_kept():
                drop_kept(module.parameters(), inside=module)

        torch.optim.Optimizer.zero_grad = zero_optimizer  # type: ignore[method-assign,assignment]
        nn.Module.zero_grad = zero_module  # type: ignore[method-assign,assignment]

    def remove(self) -> None:
        if self._torch is not None:
            optimizer_zero_grad, module_zero_grad = self._torch
            torch.optim.Optimizer.zero_grad = optimizer_zero_grad  # type: ignore[method-assign]
            nn.Module.zero_grad = module_zero_grad  # type: ignore[method-assign]
            self._torch = None


def _anything_kept() -> bool:
    return any(
        flat.reduction.keeps_gradients
        for context in sharded_contexts()
        for unit in context.units
        for flat in unit.trainable
    )


def drop_kept(zeroed: Iterable[torch.Tensor], inside: nn.Module | None = None) -> None:
    """The parameters ``zeroed`` (and, given a module, every unit in it) had their ``.grad``
    zeroed: what their groups keep unreduced for them goes too (see the note)."""
    ids = {id(p) for p in zeroed}
    modules = {id(m) for m in inside.modules()} if inside is not None else set()
    for context in sharded_contexts():
        for unit in context.units:
            whole = id(unit.module) in modules
            for flat in unit.trainable:
                if whole:
                    flat.drop_kept_gradients(range(len(flat.originals)))
                    continue
                flat.drop_kept_gradients(
                    [i for i, o in enumerate(flat.originals) if id(o.param) in ids]
                )


# ---------------------------------------------------------------- the gradient norm
_TotalNorm = Callable[..., torch.Tensor]


class TorchNorms:
    """torch's norm functions, and its clipping by a given norm, replaced while installed
    and put back by ``remove``."""

    def __init__(self) -> None:
        self._torch: tuple[_TotalNorm, _TotalNorm, _ClipWithNorm] | None = None

    def install(self) -> None:
        if self._torch is None:
            utils, clip = torch.nn.utils, torch.nn.utils.clip_grad
            with_norm = getattr(utils, _WITH_NORM)
            self._torch = (clip._get_total_norm, utils.get_total_norm, with_norm)
            clip._get_total_norm = _total_norm
            utils.get_total_norm = _total_norm
            setattr(utils, _WITH_NORM, _clip_grads_with_norm)  # (clip_grad_norm_ keeps its own)

    def remove(self) -> None:
        if self._torch is not None:
            utils, clip = torch.nn.utils, torch.nn.utils.clip_grad
            private, public, with_norm = self._torch
            clip._get_total_norm = private
            utils.get_total_norm = public
            setattr(utils, _WITH_NORM, with_norm)
            self._torch = None


_ClipWithNorm = Callable[..., None]
# torch's public clipping by a given norm (its private function under a public name, which
# torch's own clip_grad_norm_ does not look up): replaced, called once the ranks agreed.
_WITH_NORM = "clip_grads_with_norm_"
_TORCH_CLIP_WITH_NORM: _ClipWithNorm = getattr(torch.nn.utils, _WITH_NORM)


def _clip_grads_with_norm(
    parameters: torch.Tensor | Iterable[torch.Tensor],
    max_norm: float,
    total_norm: torch.Tensor,
    foreach: bool | None = None,
) -> None:
    """``torch.nn.utils.clip_grads_with_norm_``, with ``max_norm`` agreed across the ranks
    first where it scales flatshard's gradients (see the note): accelerate (and so the
    Hugging Face Trainer) clips by ``get_total_norm`` and then this, never through
    ``clip_grad_norm_``, and each rank scales its own rows by its own ``max_norm``."""
    params = [parameters] if isinstance(parameters, torch.Tensor) else list(parameters)
    given = {id(p) for p in params}
    for context in sharded_contexts():
        if any(id(o.param) in given for o in context.originals()):
            call = clip_call("torch.nn.utils.clip_grads_with_norm_", max_norm)
            agree(context.root, call, over_stages=True)
            break
    _TORCH_CLIP_WITH_NORM(params, max_norm, total_norm, foreach)


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
    with collective_call(contexts[0].root, call, over_stages=True):
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


# ---------------------------------------------------------------- installing, removing
class TorchReach:
    """Owns every change flatshard makes to torch's process-wide state."""

    def __init__(self) -> None:
        self._hooks: list[RemovableHandle] = []
        self._norms = TorchNorms()
        self._zero_grads = ZeroGrads()

    @property
    def installed(self) -> bool:
        return bool(self._hooks)

    def install(self) -> None:
        if not self._hooks:
            self._hooks = [
                register_optimizer_step_pre_hook(before_step),
                register_module_parameter_registration_hook(_registered),
                register_module_module_registration_hook(_registered),
            ]
            self._norms.install()
            self._zero_grads.install()

    def remove(self) -> None:
        if self._hooks:
            for hook in self._hooks:
                hook.remove()
            self._hooks = []
            self._norms.remove()
            self._zero_grads.remove()

    def remove_if_unused(self) -> None:
        """Remove everything once no sharded model is alive, counting one whose
        ``fully_shard`` is still building it (it has no unit yet: a collection of an older
        model then must not take the hooks from under it)."""
        if not watched_contexts():
            self.remove()


TORCH_REACH = TorchReach()


def _registered(*unused: object) -> None:
    """A parameter or module was registered somewhere: every sharded model checks itself
    at its next forward ([Note: cheap change detection] in _changes.py)."""
    for context in watched_contexts():
        context.changes.to_check = True


def watch_torch_utilities(context: StepContext) -> None:
    """``context``'s model is sharded: torch's gradient norm counts every rank's rows of its
    gradients, its optimizer steps are seen and ``zero_grad`` drops what it keeps
    unreduced, until the last such model is gone."""
    watch(context)
    TORCH_REACH.install()
    weakref.finalize(context, TORCH_REACH.remove_if_unused)
