"""``flatshard.skip_init``: allocate a unit's tensors now, fill them from a checkpoint later.

See [Note: tensors awaiting a load] in ``runtime/_changes.py``.
"""

from __future__ import annotations

import torch
from torch import nn

from flatshard.runtime._changes import mark_awaiting


def skip_init(module: nn.Module) -> None:
    """A ``param_init_fn`` that leaves the module's values to ``flatshard.load_safetensors``.

    ``fully_shard(model, param_init_fn=flatshard.skip_init)`` on a model built under
    ``torch.device("meta")`` allocates each unit's shards without initializing them; the
    model refuses to run forward until ``load_safetensors`` has filled every tensor.
    Non-persistent buffers are in no checkpoint: a module that keeps the ``config`` it was
    built from (Hugging Face's rotary embeddings) is built again from it on the CPU to
    compute them; any other such module is an error.
    """
    transient = sorted(
        n for n in module._non_persistent_buffers_set if module._buffers.get(n) is not None
    )
    if transient:
        fresh = _rebuilt(module)
        if fresh is None:
            raise ValueError(
                f"flatshard.skip_init: {type(module).__name__} holds non-persistent buffer(s) "
                f"{', '.join(repr(n) for n in transient)}, which no checkpoint holds, so "
                "they cannot be left for load_safetensors, and it keeps no `config` to be "
                "built again from. Build that module outside the meta device (e.g. re-create "
                "it after building the model under meta), or pass a param_init_fn that "
                "computes them for it."
            )
        with torch.no_grad():
            for name in transient:
                module.get_buffer(name).copy_(fresh.get_buffer(name))
    leave_for_load(module)


def _rebuilt(module: nn.Module) -> nn.Module | None:
    """``module`` built again on the CPU from the config it keeps, or None if it keeps
    none or its class is not built that way."""
    config = getattr(module, "config", None)
    if config is None:
        return None
    try:
        with torch.device("cpu"):
            return type(module)(config=config)
    except (TypeError, ValueError, AttributeError, KeyError):
        return None


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
