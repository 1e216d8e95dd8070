"""``no_sync``: accumulate gradients locally, reduce once (paper mechanism 7)."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

from torch import nn

from flatshard._runtime import ShardTree, shard_tree
from flatshard._summon import units_of


@contextmanager
def no_sync(model: nn.Module) -> Iterator[None]:
    """Backward passes inside keep their gradients unsharded and unreduced.

    The first backward outside the context adds its gradient to the kept ones and reduces
    the sum once per FlatParameter. It costs a full-size (unsharded) gradient per
    FlatParameter between those backward passes, and saves all their communication.
    Enter it on every rank alike.
    """
    units_of(model, "no_sync")  # an error if the model is not sharded
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
    """The distinct trees of every unit inside ``model``."""
    trees: dict[int, ShardTree] = {}
    for runtime in units_of(model, "no_sync"):
        trees[id(runtime.tree)] = runtime.tree
    found = shard_tree(model)
    if found is not None:
        trees[id(found)] = found
    return list(trees.values())
