"""torch's own utilities on a sharded model: made right, or made to refuse, by the first
``fully_shard`` (see ``_torch_norm.py`` and ``_matrix_optimizers.py``)."""

from __future__ import annotations

from flatshard.runtime._matrix_optimizers import check_matrix_optimizers
from flatshard.runtime._sharded_models import watch
from flatshard.runtime._step import StepContext
from flatshard.runtime._torch_norm import make_torch_norms_global


def watch_torch_utilities(context: StepContext) -> None:
    """``context``'s model is sharded: torch's gradient norm counts every rank's rows of its
    gradients, and matrix optimizers refuse its row shards. Idempotent."""
    watch(context)
    make_torch_norms_global()
    check_matrix_optimizers()
