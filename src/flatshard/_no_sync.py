"""``no_sync``: accumulate gradients locally, reduce once (paper mechanism 7)."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

from torch import nn

from flatshard._runtime import ShardTree, units_of


@contextmanager
def no_sync(model: nn.Module) -> Iterator[None]:
    """Backward passes inside keep their gradients unsharded and unreduced.

    The first backward outside the context adds its gradient to the kept ones and reduces
    the sum once per FlatParameter. It costs a full-size (unsharded) gradient per
    FlatParameter between those backward passes, and saves all their communication.
    Enter it on every rank alike.
    """
    trees = _trees_under(model)
    previous = [tree.sync_gradients for tree in trees]
    for tree in trees:
        tree.sync_gradients = False
    try:
        yield
    finally:
        for tree, value in zip(trees, previous, strict=True):
            tree.sync_gradients = value


def _trees_under(model: nn.Module) -> list[ShardTree]:
    """The distinct trees of every unit inside ``model`` (an error if there is none)."""
    trees = {id(runtime.tree): runtime.tree for runtime in units_of(model, "no_sync")}
    return list(trees.values())
