"""``OriginalParam``: one of the user's parameters, as a flat group and its placement see it."""

from __future__ import annotations

from dataclasses import dataclass, field

from torch import nn

from flatshard.flat._tensor_parallel import SplitParam, tensor_parallel


@dataclass
class OriginalParam:
    """One of the user's parameters, with every place a module registers it (ties)."""

    param: nn.Parameter
    fqn: str  # its first name in the model
    usages: list[tuple[nn.Module, str]] = field(default_factory=list)

    @property
    def tp(self) -> SplitParam | None:
        """Set when its local tensor is a part of a global one: a DTensor parameter ([Note:
        DTensor parameters]) or experts ([Note: expert parallelism])."""
        return tensor_parallel(self.param)
