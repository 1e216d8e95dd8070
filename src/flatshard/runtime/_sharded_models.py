"""The models sharded in this process, held weakly, for what torch's own utilities do to
them: its gradient norm (``_torch_norm.py``) and its optimizers (``_matrix_optimizers.py``)
look their tensors up here. A model that dies leaves."""

from __future__ import annotations

import weakref

from flatshard.runtime._step import StepContext

_SHARDED: weakref.WeakSet[StepContext] = weakref.WeakSet()


def watch(context: StepContext) -> None:
    _SHARDED.add(context)


def sharded_contexts() -> list[StepContext]:
    """The step contexts of the models sharded in this process that are still alive."""
    return [c for c in list(_SHARDED) if c.units]


def watched_contexts() -> list[StepContext]:
    """Every sharded model's step context still alive, also one ``fully_shard`` is
    still building."""
    return list(_SHARDED)
