"""State in and out of a sharded model: state dicts, optimizer state, checkpoint
directories (DCP), safetensors export and sharded loading.

Layer 6: imports ``flatshard.sharding`` and below. The names below are the documented
API; the checkpoint directory's reading side (manifest, entries, raw loads) that
``flatshard ckpt`` needs comes through ``flatshard.cli.internals``.
"""

from flatshard.state._async_save import CheckpointSave
from flatshard.state._checkpoint import load_checkpoint, save_checkpoint
from flatshard.state._directory import latest_checkpoint
from flatshard.state._errors import CheckpointError
from flatshard.state._export import export_checkpoint, export_safetensors
from flatshard.state._load import load_safetensors
from flatshard.state._optim_state import (
    full_optim_state_dict,
    load_optim_state_dict,
    sharded_optim_state_dict,
)
from flatshard.state._resume_state import ResumeState
from flatshard.state._state_dict import (
    RowShard,
    full_state_dict,
    load_state_dict,
    sharded_state_dict,
)

__all__ = [
    "CheckpointError",
    "CheckpointSave",
    "ResumeState",
    "RowShard",
    "export_checkpoint",
    "export_safetensors",
    "full_optim_state_dict",
    "full_state_dict",
    "latest_checkpoint",
    "load_checkpoint",
    "load_optim_state_dict",
    "load_safetensors",
    "load_state_dict",
    "save_checkpoint",
    "sharded_optim_state_dict",
    "sharded_state_dict",
]
