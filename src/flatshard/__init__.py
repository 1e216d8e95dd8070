"""flatshard: fully sharded data parallel training for PyTorch.

model = flatshard.fully_shard(model, auto_wrap_policy={Block})
optim = torch.optim.AdamW(model.parameters(), lr=3e-4)  # built after sharding

Submodules: ``flatshard.comm_hooks`` (custom gradient reduction), ``flatshard.report``
(the types of layout and dtype reports), ``flatshard.testing`` (parity harness).
"""

from flatshard._checkpoint import CheckpointError, load_checkpoint, save_checkpoint
from flatshard._checks import Checks, set_checks
from flatshard._clip import clip_grad_norm_
from flatshard._collective_errors import (
    CollectiveError,
    CollectiveMismatchError,
    CollectiveTimeoutError,
    PeerLostError,
)
from flatshard._export import export_checkpoint, export_safetensors
from flatshard._grad_scaler import ShardedGradScaler
from flatshard._hooks import register_entry_point, set_prefetch
from flatshard._init import InitOptions, init_weights
from flatshard._load import load_safetensors
from flatshard._mesh import ShardingStrategy
from flatshard._mixed_precision import CPUOffload, MixedPrecision
from flatshard._no_sync import no_sync
from flatshard._optim_state import (
    full_optim_state_dict,
    load_optim_state_dict,
    sharded_optim_state_dict,
)
from flatshard._planner.cluster import Cluster
from flatshard._planner.plan import Plan, plan
from flatshard._policy import SizePolicy, SublayerPolicy
from flatshard._prefetch import BackwardPrefetch, Prefetch
from flatshard._skip_init import skip_init
from flatshard._state_dict import (
    RowShard,
    full_state_dict,
    load_state_dict,
    sharded_state_dict,
)
from flatshard._summary import dtype_plan, sharding_summary
from flatshard._summon import summon_full_params
from flatshard.api import fully_shard

__all__ = [
    "BackwardPrefetch",
    "CPUOffload",
    "CheckpointError",
    "Checks",
    "Cluster",
    "CollectiveError",
    "CollectiveMismatchError",
    "CollectiveTimeoutError",
    "InitOptions",
    "MixedPrecision",
    "PeerLostError",
    "Plan",
    "Prefetch",
    "RowShard",
    "ShardedGradScaler",
    "ShardingStrategy",
    "SizePolicy",
    "SublayerPolicy",
    "clip_grad_norm_",
    "dtype_plan",
    "export_checkpoint",
    "export_safetensors",
    "full_optim_state_dict",
    # state dicts
    "full_state_dict",
    # sharding a model
    "fully_shard",
    "init_weights",
    "load_checkpoint",
    "load_optim_state_dict",
    "load_safetensors",
    "load_state_dict",
    # during training
    "no_sync",
    # planning
    "plan",
    "register_entry_point",
    # checkpoints
    "save_checkpoint",
    "set_checks",
    "set_prefetch",
    "sharded_optim_state_dict",
    "sharded_state_dict",
    # reports (their types: flatshard.report)
    "sharding_summary",
    "skip_init",
    "summon_full_params",
]
