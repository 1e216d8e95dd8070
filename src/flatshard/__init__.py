"""flatshard: fully sharded data parallel training for PyTorch.

model = flatshard.fully_shard(model, auto_wrap_policy={Block})
optim = torch.optim.AdamW(model.parameters(), lr=3e-4)  # built after sharding
"""

from flatshard._layout import FlatLayout, plan_layout
from flatshard._mesh import ShardingStrategy
from flatshard._policy import SizePolicy
from flatshard._summary import FlatParamSummary, ShardingSummary, sharding_summary
from flatshard._summon import summon_full_params
from flatshard.api import fully_shard

__all__ = [
    "FlatLayout",
    "FlatParamSummary",
    "ShardingStrategy",
    "ShardingSummary",
    "SizePolicy",
    "fully_shard",
    "plan_layout",
    "sharding_summary",
    "summon_full_params",
]
