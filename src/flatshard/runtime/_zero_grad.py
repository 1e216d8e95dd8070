"""``zero_grad`` on a sharded model: the gradients kept unreduced go with ``.grad``.

[Note: zero_grad drops kept gradients]
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
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Iterable

import torch
from torch import nn

from flatshard.runtime._step import sharded_contexts

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
