"""``flatshard.skip_init``: allocate a unit's tensors now, fill them from a checkpoint later.

See [Note: tensors awaiting a load] in ``flat/_awaiting_load.py``.
"""

from __future__ import annotations

import torch
from torch import nn

from flatshard.flat._awaiting_load import mark_awaiting


def skip_init(module: nn.Module) -> None:
    """A ``param_init_fn`` that leaves the module's values to ``flatshard.load_safetensors``.

    ``fully_shard(model, param_init_fn=flatshard.skip_init)`` on a model built under
    ``torch.device("meta")`` allocates each unit's shards without initializing them; the
    model refuses to run forward until ``load_safetensors`` has filled every tensor.
    """
    transient = [
        n for n in module._non_persistent_buffers_set if module._buffers.get(n) is not None
    ]
    if transient:
        raise ValueError(
            f"flatshard.skip_init: {type(module).__name__} holds non-persistent buffer(s) "
            f"{', '.join(repr(n) for n in sorted(transient))}, which no checkpoint holds, so "
            "they cannot be left for load_safetensors. Build that module outside the meta "
            "device (e.g. re-create it after building the model under meta), or pass a "
            "param_init_fn that computes them for it."
        )
    leave_for_load(module)


def leave_for_load(module: nn.Module) -> None:
    """Zero-fill the module's own parameters and persistent buffers, marked as awaiting a
    load (non-persistent buffers are the caller's to fill)."""
    transient = module._non_persistent_buffers_set
    persistent = [b for name, b in module._buffers.items() if name not in transient]
    for tensor in [*module._parameters.values(), *persistent]:
        if tensor is not None:
            with torch.no_grad():
                tensor.zero_()
            mark_awaiting(tensor)
