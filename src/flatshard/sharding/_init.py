"""Deferred initialization and rank-0 loading, one unit at a time (paper mechanism 1).

[Note: deterministic initialization]
Units are materialized in an order that suits memory (inner units first), not in the
order a normal constructor would initialize modules. So that the result does not depend on
that order, every module is initialized under its own random state: torch's generators are
seeded with ``module_seed(seed, module_name)`` right before ``param_init_fn(module)`` (or
``module.reset_parameters()``) runs, and restored afterwards. ``flatshard.init_weights``
applies exactly this to an ordinary model, so a meta-built sharded model starts from the
same full weights as ``init_weights(model, param_init_fn, seed)`` on the unsharded model.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn

from flatshard.comm._agreement import join_name
from flatshard.comm._collectives import broadcast
from flatshard.comm._mesh import ShardGroups
from flatshard.flat._partition import UnitMembers
from flatshard.flat._tensor_parallel import carry

ParamInitFn = Callable[[nn.Module], None]


@dataclass(frozen=True)
class InitOptions:
    """How ``fully_shard`` initializes and checks each unit before sharding it.

    Attributes:
        seed: base seed of meta initialization (default ``torch.initial_seed()``); see
            [Note: deterministic initialization] and ``flatshard.init_weights``.
        sync_module_states: broadcast rank 0's parameters and buffers, unit by unit, before
            sharding: other ranks may build the model on meta, and only rank 0 needs to
            load weights.
        check_consistency: compare model structure, strategy and buffer values across
            ranks at startup and raise, on every rank, if they differ (one small all-gather
            per unit).
        check_weights: also compare parameter values across ranks before sharding (those
            the model held on a device; a meta-built unit's are equal by construction).
            None (the default): unless ``sync_module_states`` makes them equal. Where ranks
            hold replicas (NO_SHARD, the hybrid strategies), which would differ forever, a
            difference raises at once; where each rank keeps only its own rows
            (FULL_SHARD), it marks the parameters as awaiting a load: a load
            (``load_checkpoint``, ``load_state_dict``, ``load_safetensors``) makes them
            one model again, and the first forward before one raises ([Note: weights that
            differ across ranks]). True: raise at once under every strategy. False skips
            it (it reads every parameter once: docs/performance.md).
    """

    seed: int | None = None
    sync_module_states: bool = False
    check_consistency: bool = True
    check_weights: bool | None = None

    def compares_weights(self) -> bool:
        """Whether the consistency check compares parameter values."""
        if self.check_weights is None:  # broadcast from rank 0: equal by construction
            return self.check_consistency and not self.sync_module_states
        return self.check_weights

    def refuses_weights_now(self, groups: ShardGroups) -> bool:
        """Whether weights that differ raise at ``fully_shard`` rather than await a load."""
        return self.check_weights is True or groups.replicate_size > 1

    def __post_init__(self) -> None:
        if self.check_weights and not self.check_consistency:
            raise ValueError(
                "flatshard.InitOptions: check_weights=True needs check_consistency=True "
                "(parameter values are compared by the consistency check)."
            )


def default_device() -> torch.device:
    """The current accelerator if there is one, else the CPU."""
    if torch.accelerator.is_available():
        accelerator = torch.accelerator.current_accelerator()
        if accelerator is not None:
            return torch.device(accelerator.type, torch.accelerator.current_device_index())
    return torch.device("cpu")


def with_index(device: torch.device) -> torch.device:
    """``device`` with its index: ``cuda`` is the current ``cuda:N``.

    Devices compare equal only with the same index (``cuda`` != ``cuda:0``): a unit whose
    compute device lacked it would never let its shard serve as its unsharded buffer
    (F = 1), and would copy a full buffer at every unshard.
    """
    if device.index is not None or device.type in ("cpu", "meta"):
        return device
    if torch.accelerator.is_available():
        accelerator = torch.accelerator.current_accelerator()
        if accelerator is not None and accelerator.type == device.type:
            return torch.device(device.type, torch.accelerator.current_device_index())
    return device


def module_seed(seed: int, module_name: str) -> int:
    """The seed a module is initialized with: a hash of the base seed and its name."""
    digest = hashlib.sha256(f"{seed}:{module_name}".encode()).digest()
    return int.from_bytes(digest[:8], "little") & ((1 << 63) - 1)


def init_weights(
    model: nn.Module, param_init_fn: ParamInitFn | None = None, seed: int | None = None
) -> nn.Module:
    """Initialize every module of an ordinary model as ``fully_shard`` does a meta one.

    See [Note: deterministic initialization]. ``seed`` defaults to ``torch.initial_seed()``.
    """
    base = torch.initial_seed() if seed is None else seed
    for name, module in model.named_modules():
        init_module(module, name, param_init_fn, base)
    return model


def init_module(module: nn.Module, name: str, param_init_fn: ParamInitFn | None, seed: int) -> None:
    """Run ``param_init_fn(module)`` (else ``module.reset_parameters()``) under its own seed."""
    reset = getattr(module, "reset_parameters", None)
    if param_init_fn is None and not callable(reset):
        return
    with _seeded(module_seed(seed, name), _devices_of(module)):
        if param_init_fn is not None:
            param_init_fn(module)
        elif callable(reset):
            reset()


def materialize_unit(
    members: UnitMembers,
    device: torch.device | None,
    init: Callable[[str, nn.Module], None] | None,
    rank: int,
) -> None:
    """Give the unit's meta tensors real storage on ``device`` and initialize them.

    Tensors on another device than ``device`` are moved (their values kept). With ``init``
    None (values will come from rank 0), meta tensors are only allocated. Any parameter or
    buffer that was meta and that initialization did not write is an error.
    """
    fresh = _materialize_params(members, device) + _materialize_buffers(members, device)
    if init is None or not fresh:
        return
    versions = [tensor._version for _, tensor in fresh]
    # Only modules holding a tensor that came from meta: the others keep their values.
    fresh_ids = {id(tensor) for _, tensor in fresh}
    for name, module in members.modules:
        own = [*module._parameters.values(), *module._buffers.values()]
        if any(id(t) in fresh_ids for t in own if t is not None):
            init(name, module)
    _adopt_replaced_params(members)
    live = {id(o.param) for o in members.originals}
    live |= {id(b) for _, m in members.modules for b in m._buffers.values() if b is not None}
    # Written in place (version bumped) or replaced by a new tensor: initialized.
    untouched = [
        name
        for (name, tensor), version in zip(fresh, versions, strict=True)
        if tensor._version == version and id(tensor) in live
    ]
    if untouched:
        raise ValueError(
            f"flatshard.fully_shard: {', '.join(repr(n) for n in untouched)} came from the "
            f"meta device and nothing initialized it (rank {rank}): its module has no "
            "reset_parameters() and param_init_fn did not write it. Pass a param_init_fn "
            "that initializes it, or give the module a reset_parameters()."
        )


def broadcast_unit(members: UnitMembers, group: dist.ProcessGroup) -> None:
    """Copy rank 0's values of the unit's parameters and buffers to every rank.

    One broadcast per dtype of the unit: flattened together, then split back.
    """
    tensors = [o.param.data for o in members.originals]
    tensors += [b for _, m in members.modules for b in m._buffers.values() if b is not None]
    by_dtype: dict[torch.dtype, list[torch.Tensor]] = {}
    for tensor in tensors:
        by_dtype.setdefault(tensor.dtype, []).append(tensor)
    for group_tensors in by_dtype.values():
        flat = torch.cat([t.reshape(-1) for t in group_tensors])
        broadcast(flat, group_src=0, group=group)
        pieces = torch.split(flat, [t.numel() for t in group_tensors])
        for tensor, piece in zip(group_tensors, pieces, strict=True):
            tensor.copy_(piece.view_as(tensor))


def _materialize_params(
    members: UnitMembers, device: torch.device | None
) -> list[tuple[str, torch.Tensor]]:
    """Replace meta (or off-device) parameters in every module using them (ties kept)."""
    fresh: list[tuple[str, torch.Tensor]] = []
    for orig in members.originals:
        old = orig.param
        target = device if device is not None else old.device
        if not old.is_meta and old.device == target:
            continue
        data = (
            torch.empty(old.shape, dtype=old.dtype, device=target)
            if old.is_meta
            else old.detach().to(target)
        )
        orig.param = nn.Parameter(data, requires_grad=old.requires_grad)
        carry(old, orig.param)
        for module, name in orig.usages:
            module._parameters[name] = orig.param
        if old.is_meta:
            fresh.append((orig.fqn, orig.param))
    return fresh


def _materialize_buffers(
    members: UnitMembers, device: torch.device | None
) -> list[tuple[str, torch.Tensor]]:
    fresh: list[tuple[str, torch.Tensor]] = []
    for mname, module in members.modules:
        for bname, buf in module._buffers.items():
            if buf is None:
                continue
            target = device if device is not None else buf.device
            if buf.is_meta:
                new = torch.empty(buf.shape, dtype=buf.dtype, device=target)
                module._buffers[bname] = new
                fresh.append((join_name(mname, bname), new))
            elif buf.device != target:
                module._buffers[bname] = buf.to(target)
    return fresh


def _adopt_replaced_params(members: UnitMembers) -> None:
    """An init function may assign new Parameters; keep them, in every tied usage."""
    for orig in members.originals:
        module, name = orig.usages[0]
        current = module._parameters[name]
        if current is not None and current is not orig.param:
            carry(orig.param, current)
            orig.param = current
            for other, other_name in orig.usages[1:]:
                other._parameters[other_name] = current


def _devices_of(module: nn.Module) -> list[torch.device]:
    tensors = [*module.parameters(recurse=False), *module.buffers(recurse=False)]
    return sorted({t.device for t in tensors if t.device.type not in ("cpu", "meta")}, key=str)


@contextmanager
def _seeded(seed: int, devices: list[torch.device]) -> Iterator[None]:
    """Seed torch's generators (CPU and ``devices``) for a block; restore them after."""
    if not devices:
        with torch.random.fork_rng(devices=[]):
            torch.default_generator.manual_seed(seed)
            yield
        return
    indices = [d.index or 0 for d in devices]
    with torch.random.fork_rng(devices=indices, device_type=devices[0].type):
        torch.manual_seed(seed)
        yield
