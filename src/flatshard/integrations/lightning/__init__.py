"""flatshard as a PyTorch Lightning strategy (``pip install 'flatshard[lightning]'``).

trainer = lightning.Trainer(strategy=FlatshardStrategy(auto_wrap_policy={Block}), ...)
fabric = lightning.Fabric(strategy=FlatshardFabricStrategy(auto_wrap_policy={Block}), ...)

docs/lightning.md shows a complete example and what each Lightning feature does here.
"""

from ._fabric import FlatshardFabricPrecision, FlatshardFabricStrategy
from ._precision import FlatshardPrecision
from ._strategy import FlatshardStrategy

__all__ = [
    "FlatshardFabricPrecision",
    "FlatshardFabricStrategy",
    "FlatshardPrecision",
    "FlatshardStrategy",
]
