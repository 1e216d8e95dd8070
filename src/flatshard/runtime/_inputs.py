"""What the hooks do to a unit's inputs and outputs: find tensors, cast, watch gradients."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, cast

import torch
from torch.utils import _pytree as pytree


def tensors_in(tree: Any) -> list[torch.Tensor]:
    """Every tensor in a (nested) container, as ``torch.utils._pytree`` finds them."""
    return [x for x in pytree.tree_leaves(tree) if isinstance(x, torch.Tensor)]


def cast_floats(tree: Any, dtype: torch.dtype) -> Any:
    """``tree`` with every floating-point tensor cast to ``dtype`` (autograd-visible)."""
    return pytree.tree_map(
        lambda x: x.to(dtype) if isinstance(x, torch.Tensor) and x.is_floating_point() else x,
        tree,
    )


class _InputGradWatch(torch.autograd.Function):
    """Identity on a unit's inputs whose backward reports that their gradients are done."""

    @staticmethod
    def forward(ctx: Any, done: Callable[[], None], *inputs: torch.Tensor) -> Any:
        ctx.done = done
        return inputs

    @staticmethod
    def backward(ctx: Any, *grads: torch.Tensor | None) -> Any:
        ctx.done()
        return (None, *grads)


def watch_input_grads(
    args: tuple[Any, ...], kwargs: dict[str, Any], done: Callable[[], None]
) -> tuple[tuple[Any, ...], dict[str, Any], bool]:
    """Route the inputs that need grad through a node calling ``done()`` in backward.

    Returns the new inputs and whether any input is watched (``done`` will be called).
    """
    leaves, spec = pytree.tree_flatten((args, kwargs))
    positions = [i for i, x in enumerate(leaves) if isinstance(x, torch.Tensor) and x.requires_grad]
    if not positions:
        return args, kwargs, False
    apply = cast(Callable[..., tuple[torch.Tensor, ...]], _InputGradWatch.apply)  # untyped stub
    watched = apply(done, *(leaves[i] for i in positions))
    for i, tensor in zip(positions, watched, strict=True):
        leaves[i] = tensor
    new_args, new_kwargs = pytree.tree_unflatten(leaves, spec)
    return new_args, new_kwargs, True
