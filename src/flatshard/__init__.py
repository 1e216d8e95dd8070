"""flatshard: fully sharded data parallel training for PyTorch.

model = flatshard.fully_shard(model, auto_wrap_policy={Block})
optim = torch.optim.AdamW(model.parameters(), lr=3e-4)  # built after sharding

Every name below is importable as ``flatshard.<name>``; docs/guide.md shows them by task.
Submodules: ``flatshard.comm_hooks`` (custom gradient reduction), ``flatshard.report`` (the
types of layout and dtype reports), ``flatshard.planner`` (the planner's types),
``flatshard.measure`` (exact storage and collective accounting), ``flatshard.models.gpt``
(the GPT of ``flatshard train``), ``flatshard.testing`` (the parity harness, for tests:
``import flatshard`` does not load it). ``plan``, ``Plan`` and ``Cluster`` load the planner
(torch's flop counter, ``torch.export``) on first use: importing flatshard does not.
"""

from __future__ import annotations

import importlib
import warnings
from importlib.metadata import PackageNotFoundError, version
from typing import TYPE_CHECKING, Any

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
from flatshard.flat import (
    CPUOffload,
    MixedPrecision,
    Rows,
    ShardPlacement,
    SizePolicy,
    SublayerPolicy,
    TableTraffic,
    Unmanaged,
    Whole,
)
from flatshard.placements import Experts, RowSparse
from flatshard.runtime import (
    BackwardPrefetch,
    Prefetch,
    ShardedGradScaler,
    StepObserver,
    UnshardHandle,
    clip_grad_norm_,
    dtype_report,
    embedding_traffic,
    join,
    no_sync,
    register_entry_point,
    register_matrix_optimizer,
    reshard,
    set_all_reduce_hook,
    set_custom_all_gather,
    set_custom_reduce_scatter,
    set_gradient_divide_factor,
    set_prefetch,
    set_requires_all_reduce,
    set_requires_gradient_sync,
    set_reshard_after_backward,
    set_reshard_after_forward,
    set_separate_reduce_scatter_group,
    set_unshard_in_backward,
    sharding_summary,
    summon_full_params,
    train_step,
    unit_modules,
    unshard,
)
from flatshard.sharding import InitOptions, fully_shard, init_weights, skip_init
from flatshard.state import (
    CheckpointError,
    CheckpointSave,
    ResumeState,
    RowShard,
    export_checkpoint,
    export_safetensors,
    full_optim_state_dict,
    full_state_dict,
    latest_checkpoint,
    load_checkpoint,
    load_optim_state_dict,
    load_safetensors,
    load_state_dict,
    save_checkpoint,
    sharded_optim_state_dict,
    sharded_state_dict,
)

if TYPE_CHECKING:
    from flatshard.planner import Cluster, Plan, plan

try:
    __version__ = version("flatshard")
except PackageNotFoundError:  # a source tree on sys.path, not installed
    __version__ = "0+unknown"

# Names whose module is loaded on first use, not by ``import flatshard``.
_LAZY = {"plan": "flatshard.planner", "Plan": "flatshard.planner", "Cluster": "flatshard.planner"}


def __dir__() -> list[str]:
    return sorted([*globals(), *_LAZY])


# Old names, still answered for now with a FutureWarning that gives the new one.
_RENAMED = {"dtype_plan": "dtype_report"}


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        value = getattr(importlib.import_module(_LAZY[name]), name)
        globals()[name] = value
        return value
    if name in _RENAMED:
        new = _RENAMED[name]
        warnings.warn(f"flatshard.{name} is now flatshard.{new}", FutureWarning, stacklevel=2)
        return globals()[new]
    raise AttributeError(f"module 'flatshard' has no attribute {name!r}")


__all__ = [
    # sharding a model
    "fully_shard",
    "ShardingStrategy",
    "SizePolicy",
    "SublayerPolicy",
    "MixedPrecision",
    "CPUOffload",
    "Rows",
    "Unmanaged",
    "Whole",
    "RowSparse",
    "Experts",
    "ShardPlacement",
    "Prefetch",
    "BackwardPrefetch",
    "InitOptions",
    "init_weights",
    # during training
    "train_step",
    "StepObserver",
    "no_sync",
    "join",
    "set_requires_all_reduce",
    "set_requires_gradient_sync",
    "set_reshard_after_backward",
    "set_reshard_after_forward",
    "set_separate_reduce_scatter_group",
    "set_unshard_in_backward",
    "set_custom_all_gather",
    "set_custom_reduce_scatter",
    "set_gradient_divide_factor",
    "set_all_reduce_hook",
    "clip_grad_norm_",
    "ShardedGradScaler",
    "summon_full_params",
    "unshard",
    "reshard",
    "TableTraffic",
    "UnshardHandle",
    "register_entry_point",
    "unit_modules",
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
    "latest_checkpoint",
    "ResumeState",
    "CheckpointError",
    "CheckpointSave",
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
    "dtype_report",
    "embedding_traffic",
]
