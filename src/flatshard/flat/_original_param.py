"""``OriginalParam``: one of the user's parameters, as a flat group and its placement see it."""

from __future__ import annotations

from dataclasses import dataclass, field

from torch import nn

from flatshard.flat._tensor_parallel import TensorParallel, tensor_parallel


@dataclass
class OriginalParam:
    """One of the user's parameters, with every place a module registers it (ties)."""

    param: nn.Parameter
    fqn: str  # its first name in the model
    usages: list[tuple[nn.Module, str]] = field(default_factory=list)

    @property
    def tp(self) -> TensorParallel | None:
        """Set when it was a DTensor parameter (see [Note: DTensor parameters])."""
        return tensor_parallel(self.param)
