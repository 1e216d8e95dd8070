"""Tensors awaiting a load: the marks ``skip_init`` sets and ``load_safetensors`` clears.

[Note: tensors awaiting a load]
Fine-tuning starts from pretrained weights, so initializing them first is wasted work, and
some modules cannot initialize themselves on the meta device at all (transformers'
RMSNorm has no ``reset_parameters``). As ``param_init_fn``, ``skip_init`` zero-fills the
module's own parameters and persistent buffers (zeros, not garbage, so nothing reads
uninitialized memory) and marks each as awaiting a load. ``flatshard.load_safetensors``
clears the mark of every tensor it writes; a unit's forward raises while any tensor of it
is still marked, so a forgotten or partial load cannot train silently on zeros. A
non-persistent buffer (e.g. rotary frequencies) is in no checkpoint, so it cannot be left
for a load: ``skip_init`` computes it by building its module again from the ``config`` the
module keeps, and refuses a module that keeps none.
"""

from __future__ import annotations

import torch

_MARK = "_flatshard_awaits_load"


def mark_awaiting(tensor: torch.Tensor) -> None:
    setattr(tensor, _MARK, True)


def awaits_load(tensor: torch.Tensor) -> bool:
    return bool(getattr(tensor, _MARK, False))


def mark_loaded(tensor: torch.Tensor) -> None:
    if awaits_load(tensor):
        delattr(tensor, _MARK)


def check_loaded(unit_label: str, awaiting: list[tuple[str, torch.Tensor]]) -> None:
    """Drop loaded tensors from ``awaiting`` (in place); raise if any is left."""
    awaiting[:] = [(name, t) for name, t in awaiting if awaits_load(t)]
    if awaiting:
        names = ", ".join(repr(name) for name, _ in awaiting[:6])
        more = f" and {len(awaiting) - 6} more" if len(awaiting) > 6 else ""
        raise RuntimeError(
            f"flatshard: unit '{unit_label}' was sharded with param_init_fn=flatshard.skip_init "
            f"and {len(awaiting)} of its tensors were never loaded ({names}{more}): they hold "
            "zeros. Call flatshard.load_safetensors(model, path) before the first forward."
        )
