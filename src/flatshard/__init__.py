"""flatshard: fully sharded data parallel training for PyTorch.

model = flatshard.fully_shard(model, auto_wrap_policy={Block})
optim = torch.optim.AdamW(model.parameters(), lr=3e-4)  # built after sharding

Every name below is importable as ``flatshard.<name>``; docs/guide.md shows them by task.
Submodules: ``flatshard.comm_hooks`` (custom gradient reduction), ``flatshard.report`` (the
types of layout and dtype reports), ``flatshard.planner`` (the planner's types),
``flatshard.measure`` (exact storage and collective accounting), ``flatshard.models.gpt``
(the GPT of ``flatshard train``), ``flatshard.testing`` (the parity harness, for tests:
``import flatshard`` does not load it).
"""

from flatshard.comm import (
    Checks,
    CollectiveError,
    CollectiveMismatchError,
    CollectiveTimeoutError,
    PeerLostError,
    ShardingStrategy,
    SlowCollectiveWarning,
    set_checks,
)
from flatshard.flat import CPUOffload, MixedPrecision, SizePolicy, SublayerPolicy
from flatshard.planner import Cluster, Plan, plan
from flatshard.runtime import (
    BackwardPrefetch,
    Prefetch,
    ShardedGradScaler,
    TableTraffic,
    UnshardHandle,
    clip_grad_norm_,
    dtype_plan,
    embedding_traffic,
    no_sync,
    register_entry_point,
    register_matrix_optimizer,
    reshard,
    set_prefetch,
    set_requires_all_reduce,
    set_requires_gradient_sync,
    set_reshard_after_backward,
    sharding_summary,
    summon_full_params,
    unshard,
)
from flatshard.sharding import InitOptions, fully_shard, init_weights, skip_init
from flatshard.state import (
    CheckpointError,
    RowShard,
    export_checkpoint,
    export_safetensors,
    full_optim_state_dict,
    full_state_dict,
    load_checkpoint,
    load_optim_state_dict,
    load_safetensors,
    load_state_dict,
    save_checkpoint,
    sharded_optim_state_dict,
    sharded_state_dict,
)

__all__ = [
    # sharding a model
    "fully_shard",
    "ShardingStrategy",
    "SizePolicy",
    "SublayerPolicy",
    "MixedPrecision",
    "CPUOffload",
    "Prefetch",
    "BackwardPrefetch",
    "InitOptions",
    "init_weights",
    # during training
    "no_sync",
    "set_requires_all_reduce",
    "set_requires_gradient_sync",
    "set_reshard_after_backward",
    "clip_grad_norm_",
    "ShardedGradScaler",
    "summon_full_params",
    "unshard",
    "reshard",
    "TableTraffic",
    "UnshardHandle",
    "register_entry_point",
    "register_matrix_optimizer",
    "set_prefetch",
    # when ranks disagree
    "Checks",
    "set_checks",
    "CollectiveError",
    "CollectiveMismatchError",
    "CollectiveTimeoutError",
    "PeerLostError",
    "SlowCollectiveWarning",
    # state dicts
    "full_state_dict",
    "sharded_state_dict",
    "load_state_dict",
    "RowShard",
    "full_optim_state_dict",
    "sharded_optim_state_dict",
    "load_optim_state_dict",
    # checkpoints and exports
    "save_checkpoint",
    "load_checkpoint",
    "CheckpointError",
    "export_safetensors",
    "export_checkpoint",
    # pretrained weights
    "load_safetensors",
    "skip_init",
    # planning (the planner's other types: flatshard.planner)
    "plan",
    "Plan",
    "Cluster",
    # reports (their types: flatshard.report)
    "sharding_summary",
    "dtype_plan",
    "embedding_traffic",
]
