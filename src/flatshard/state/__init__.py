"""State in and out of a sharded model: state dicts, optimizer state, checkpoint
directories (DCP), safetensors export and sharded loading.

Layer 5: imports ``flatshard.sharding`` and below. Besides the public functions, the
checkpoint directory's reading side (manifest, entries, raw loads) is here for
``flatshard ckpt``.
"""

from flatshard.state._checkpoint import (
    EXTRA,
    GROUPS,
    MODEL,
    OPTIM,
    CheckpointError,
    checkpoint_metadata,
    is_tensor_entry,
    load_checkpoint,
    load_raw,
    read_manifest,
    save_checkpoint,
    verify_files,
)
from flatshard.state._export import DEFAULT_SHARD_BYTES, export_checkpoint, export_safetensors
from flatshard.state._load import load_safetensors
from flatshard.state._optim_state import (
    full_optim_state_dict,
    load_optim_state_dict,
    sharded_optim_state_dict,
)
from flatshard.state._state_dict import (
    RowShard,
    full_state_dict,
    load_state_dict,
    sharded_state_dict,
)

__all__ = [
    "DEFAULT_SHARD_BYTES",
    "EXTRA",
    "GROUPS",
    "MODEL",
    "OPTIM",
    "CheckpointError",
    "RowShard",
    "checkpoint_metadata",
    "export_checkpoint",
    "export_safetensors",
    "full_optim_state_dict",
    "full_state_dict",
    "is_tensor_entry",
    "load_checkpoint",
    "load_optim_state_dict",
    "load_raw",
    "load_safetensors",
    "load_state_dict",
    "read_manifest",
    "save_checkpoint",
    "sharded_optim_state_dict",
    "sharded_state_dict",
    "verify_files",
]
