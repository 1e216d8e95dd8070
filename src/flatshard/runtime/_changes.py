"""What a unit's forward refuses to run on: a model changed after ``fully_shard``, or tensors
still awaiting a load. Either would train silently wrong; both are errors at the next forward.

``fully_shard`` flattens the parameters it finds into flat groups split by
``requires_grad``. A parameter added afterwards (peft's ``get_peft_model`` applied after
sharding, a new head) belongs to no group: it is never reduced, so ranks drift apart. A
parameter frozen afterwards still sits in a trainable group and still gets gradients; one
unfrozen afterwards never does. A parameter replaced (``module.weight = nn.Parameter(...)``)
is both. A model moved or cast after sharding (``model.to(device)`` to a device that
compares unequal, even ``cpu:0`` against ``cpu``; ``.half()``; ``.cuda()``) gets copies
for its parameters: the optimizer then steps the copies while forward keeps gathering the
untouched shards, and training silently stops. None of this raises anywhere in torch.

[Note: cheap change detection]
``requires_grad`` has no hook, so every unit's pre-forward compares its originals' flags
with their group's: one attribute read per parameter. Additions, removals and replacements
go through ``nn.Module`` registration, which torch reports to process-wide hooks; those
(installed once, ``runtime/_torch_utilities.py``) only mark every sharded model's
``ChangeWatch`` as "to check", and the root's next pre-forward
then compares the parameters the model holds with the ones it sharded (one traversal, only
after something was registered somewhere in the process).

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

[Note: weights that differ across ranks]
Under FULL_SHARD each rank keeps only its own rows, so ranks that built different weights
(a per-rank seed; a DDP habit, weights loaded on rank 0 only, where DDP broadcasts rank
0's) would shard a model nobody built, silently. But building anyhow and then loading a
checkpoint into the sharded model is a correct program. So ``fully_shard`` compares the
parameters' checksums (one digest all-gather per unit) and marks those that differ as
awaiting a load, on every rank alike; any load clears the marks, and a forward before one
raises on every rank. Where ranks hold replicas the difference raises at once, as it
always did.
"""

from __future__ import annotations

from typing import cast

import torch
import torch.distributed as dist
from torch import nn

from flatshard.comm._agreement import global_rank, join_name
from flatshard.comm._collectives import all_gather_object
from flatshard.flat._flat_param import FlatParamGroup

_SHOWN = 8  # names quoted per kind of change

_FIX = (
    "fully_shard flattens the parameters it finds, split by requires_grad, when it runs: "
    "make such changes before calling it (e.g. apply peft's get_peft_model, add heads and "
    "freeze or unfreeze parameters, then call flatshard.fully_shard)."
)


class ChangeWatch:
    """Whether a parameter or module was registered anywhere in the process since the
    model's last check: set by the registration hooks ``TorchReach`` installs once for
    every sharded model (see [Note: cheap change detection])."""

    def __init__(self) -> None:
        self.to_check = False


def check_requires_grad(flat_params: list[FlatParamGroup]) -> None:
    """An error if an original parameter's ``requires_grad`` differs from its group's."""
    flipped = [
        f"'{orig.fqn}' (now {orig.param.requires_grad})"
        for flat in flat_params
        for orig in flat.originals
        if orig.param.requires_grad is not flat.requires_grad
    ]
    if flipped:
        raise RuntimeError(
            f"flatshard: requires_grad changed after fully_shard (rank {global_rank()}): "
            f"{_listed(flipped)}. Their flat parameter groups were made for the old value, "
            f"so frozen parameters would still get gradients and unfrozen ones none. {_FIX}"
        )


def check_no_parameter_hooks(flat_params: list[FlatParamGroup]) -> None:
    """An error if a trainable original parameter has a gradient hook of its own
    (``register_post_accumulate_grad_hook``, ``register_hook``): autograd never runs it.
    Forward computes with views of the gathered buffer, not with the parameter, and the
    parameter's ``.grad`` is this rank's rows of the reduced flat gradient, written at the
    end of backward. Silently skipped, torch's optimizer-in-backward recipe (a step per
    parameter in its post-accumulate hook) trained nothing."""
    hooked = [
        f"'{orig.fqn}'"
        for flat in flat_params
        if flat.requires_grad
        for orig in flat.originals
        if orig.param._post_accumulate_grad_hooks or orig.param._backward_hooks
    ]
    if hooked:
        raise RuntimeError(
            f"flatshard: gradient hooks on sharded parameters (rank {global_rank()}): "
            f"{_listed(hooked)}. A hook registered on a parameter with "
            "register_post_accumulate_grad_hook or register_hook never runs on a sharded "
            "model: forward computes with gathered copies, and each parameter's .grad "
            "(this rank's rows, reduced) is written at the end of backward. Step the "
            "optimizer after loss.backward(), and change gradients there, on .grad (or "
            "with flatshard.comm_hooks.register_comm_hook for the reduction itself)."
        )


def check_in_shards(flat_params: list[FlatParamGroup]) -> None:
    """An error if an original parameter no longer views its group's shard (one storage
    pointer per parameter: see [Note: cheap change detection])."""
    moved = [f"'{name}'" for flat in flat_params for name in flat.moved_originals()]
    if moved:
        raise RuntimeError(
            f"flatshard: parameters were moved or cast after fully_shard (rank "
            f"{global_rank()}): {_listed(moved)} no longer hold their rows of the shard, "
            "so the optimizer would update copies that forward never reads (model.to(...), "
            ".cuda(), .half() or .float() on a sharded model replace each parameter's "
            "data). Move or cast the model before flatshard.fully_shard, or pass it "
            "device= and mixed_precision=; a trainer that moves the model itself must "
            "skip that step for a sharded model."
        )


def check_parameters(
    root: nn.Module, flat_params: list[FlatParamGroup], left_alone: set[int]
) -> None:
    """An error naming parameters added, removed or replaced in ``root`` since sharding
    (those the placement rule left alone, ``left_alone``, are the user's)."""
    sharded = {id(o.param): o.fqn for f in flat_params for o in f.originals}
    showing_views = {id(o.param) for f in flat_params if f.views_registered for o in f.originals}
    found: set[int] = set()
    added: list[str] = []
    for module_name, module in root.named_modules(remove_duplicate=False):
        for name, param in module._parameters.items():
            if param is None:
                continue
            if id(param) in sharded:
                found.add(id(param))
            elif (
                isinstance(param, nn.Parameter) and id(param) not in left_alone
            ):  # not a view flatshard registered
                added.append(f"'{join_name(module_name, name)}'")
    removed = [
        f"'{fqn}'" for key, fqn in sharded.items() if key not in found and key not in showing_views
    ]
    if not added and not removed:
        return
    parts = [f"added or replaced: {_listed(added)}"] if added else []
    parts += [f"no longer in the model: {_listed(removed)}"] if removed else []
    raise RuntimeError(
        f"flatshard: parameters changed after fully_shard (rank {global_rank()}): "
        f"{'; '.join(parts)}. Added parameters belong to no flat parameter group, so their "
        f"gradients would never be averaged across ranks and the ranks would drift apart. {_FIX}"
    )


def _listed(names: list[str]) -> str:
    shown = ", ".join(names[:_SHOWN])
    return shown + (f" and {len(names) - _SHOWN} more" if len(names) > _SHOWN else "")


_MARK = "_flatshard_awaits_load"  # [Note: tensors awaiting a load]: why, as below
SKIPPED = "skip_init"
DIFFERED = "differed across ranks"  # [Note: weights that differ across ranks]


def mark_awaiting(tensor: torch.Tensor, why: str = SKIPPED) -> None:
    setattr(tensor, _MARK, why)


def awaits_load(tensor: torch.Tensor) -> bool:
    return bool(getattr(tensor, _MARK, False))


def mark_loaded(tensor: torch.Tensor) -> None:
    if awaits_load(tensor):
        delattr(tensor, _MARK)


def refuse_differed(model: nn.Module, caller: str) -> None:
    """An error where the model's values are read (saved, exported, gathered) while some
    still differ across ranks ([Note: weights that differ across ranks]): what would be
    read is the model nobody built. Alike on every rank (the marks are)."""
    names = differed(model)
    if names:
        raise RuntimeError(
            f"flatshard.{caller}: the model was sharded from weights that differed across "
            f"ranks ({_listed([repr(n) for n in names])}; rank {global_rank()}), and these "
            "were not loaded since: each rank kept its own rows of its own weights. "
            f"{_DIFFERED_FIX}"
        )


def differed(model: nn.Module) -> list[str]:
    """The model's parameters that differed across ranks and await a load."""
    return [n for n, p in model.named_parameters() if getattr(p, _MARK, None) == DIFFERED]


def agree_on_differed(model: nn.Module, group: dist.ProcessGroup | None, before: bool) -> None:
    """After a load into a model whose weights differed across ranks (``before``: alike on
    every rank): a parameter still awaiting a load on any rank awaits it on every rank, so
    that they all refuse alike (a load of each rank's own rows, ``strict=False``, may have
    left different ones). A collective over ``group``, only where ``before``."""
    if not before or group is None or dist.get_world_size(group) == 1:
        return
    every: set[str] = set()
    for names in all_gather_object(differed(model), group):
        every.update(cast(list[str], names))
    for name, param in model.named_parameters():
        if name in every:
            mark_awaiting(param, DIFFERED)


_DIFFERED_FIX = (
    "Build every rank's model alike (seed every rank identically before building it, load "
    "the same weights on every rank, or pass init=flatshard.InitOptions("
    "sync_module_states=True) to broadcast rank 0's, as DDP does), or load weights into "
    "the sharded model first (flatshard.load_checkpoint, load_state_dict, load_safetensors)."
)


def check_loaded(unit_label: str, awaiting: list[tuple[str, torch.Tensor]]) -> None:
    """Drop loaded tensors from ``awaiting`` (in place); raise if any is left."""
    awaiting[:] = [(name, t) for name, t in awaiting if awaits_load(t)]
    if not awaiting:
        return
    names = ", ".join(repr(name) for name, _ in awaiting[:6])
    more = f" and {len(awaiting) - 6} more" if len(awaiting) > 6 else ""
    if all(getattr(t, _MARK) == DIFFERED for _, t in awaiting):
        raise RuntimeError(
            f"flatshard: unit '{unit_label}' was sharded from weights that differed across "
            f"ranks ({names}{more}; rank {global_rank()}), and these were not loaded since: "
            f"each rank kept its own rows of its own weights, a model nobody built. "
            f"{_DIFFERED_FIX}"
        )
    raise RuntimeError(
        f"flatshard: unit '{unit_label}' was sharded with param_init_fn=flatshard.skip_init "
        f"and {len(awaiting)} of its tensors were never loaded ({names}{more}): they hold "
        "zeros. Call flatshard.load_safetensors(model, path) (or load_checkpoint, "
        "load_state_dict) before the first forward."
    )
