"""flatshard as a PyTorch Lightning strategy (``pip install 'flatshard[lightning]'``).

trainer = lightning.Trainer(strategy=FlatshardStrategy(auto_wrap_policy={Block}), ...)

docs/lightning.md shows a complete example and what each Lightning feature does here.
"""

from flatshard.integrations.lightning._precision import FlatshardPrecision
from flatshard.integrations.lightning._strategy import FlatshardStrategy

__all__ = ["FlatshardPrecision", "FlatshardStrategy"]
