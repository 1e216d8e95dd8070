"""flatshard: fully sharded data parallel training for PyTorch.

model = flatshard.fully_shard(model, auto_wrap_policy={Block})
optim = torch.optim.AdamW(model.parameters(), lr=3e-4)  # built after sharding
"""

from flatshard._checkpoint import CheckpointError, load_checkpoint, save_checkpoint
from flatshard._clip import clip_grad_norm_
from flatshard._export import export_checkpoint, export_safetensors
from flatshard._flat_param import CommHook
from flatshard._grad_scaler import ShardedGradScaler
from flatshard._init import init_weights
from flatshard._layout import FlatLayout, plan_layout
from flatshard._mesh import ShardGroups, ShardingStrategy
from flatshard._mixed_precision import CPUOffload, DtypePlan, MixedPrecision
from flatshard._no_sync import no_sync
from flatshard._optim_state import (
    full_optim_state_dict,
    load_optim_state_dict,
    sharded_optim_state_dict,
)
from flatshard._policy import SizePolicy
from flatshard._prefetch import BackwardPrefetch
from flatshard._runtime import register_entry_point, set_prefetch
from flatshard._state_dict import (
    RowShard,
    full_state_dict,
    load_state_dict,
    sharded_state_dict,
)
from flatshard._summary import FlatParamSummary, ShardingSummary, dtype_plan, sharding_summary
from flatshard._summon import summon_full_params
from flatshard.api import fully_shard
from flatshard.comm_hooks import LowPrecisionHook, register_comm_hook

__all__ = [
    "BackwardPrefetch",
    "CPUOffload",
    "CheckpointError",
    "CommHook",
    "DtypePlan",
    "FlatLayout",
    "FlatParamSummary",
    "LowPrecisionHook",
    "MixedPrecision",
    "RowShard",
    "ShardGroups",
    "ShardedGradScaler",
    "ShardingStrategy",
    "ShardingSummary",
    "SizePolicy",
    "clip_grad_norm_",
    "dtype_plan",
    "export_checkpoint",
    "export_safetensors",
    "full_optim_state_dict",
    "full_state_dict",
    "fully_shard",
    "init_weights",
    "load_checkpoint",
    "load_optim_state_dict",
    "load_state_dict",
    "no_sync",
    "plan_layout",
    "register_comm_hook",
    "register_entry_point",
    "save_checkpoint",
    "set_prefetch",
    "sharded_optim_state_dict",
    "sharded_state_dict",
    "sharding_summary",
    "summon_full_params",
]
