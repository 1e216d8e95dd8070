"""The only place flatshard registers hooks; their bodies are ``Unit`` methods.

Also the guards that turn "a module ran while its unit is sharded" into an error, and the
public helpers that change what a unit's hooks do (``register_entry_point``,
``set_prefetch``).
"""

from __future__ import annotations

from functools import partial, wraps
from typing import Any

import torch
from torch import nn

from flatshard._inputs import cast_floats
from flatshard._ranks import global_rank
from flatshard._unit import UNIT_ATTR, Unit, unit_or_error


def install(unit: Unit) -> None:
    """Register every hook of ``unit``."""
    module = unit.module
    module.__dict__[UNIT_ATTR] = unit
    module.register_forward_pre_hook(unit.pre_forward, with_kwargs=True)
    module.register_forward_hook(unit.post_forward)
    for flat in unit.trainable:
        flat.register_post_accumulate_hook(partial(unit.post_backward, flat))
    for name, inner in unit.inner_modules:
        inner.register_forward_pre_hook(partial(_check_gathered, unit, name))
    if any(m is module for f in unit.flat_params for o in f.originals for m, _ in o.usages):
        _guard_direct_forward(unit)  # no inner module would notice a bypass
    policy = unit.config.mixed_precision
    if policy is not None and policy.param_dtype is not None:
        for kept in unit.full_precision_modules():
            master = next(kept.parameters()).dtype
            kept.register_forward_pre_hook(partial(_cast_inputs, master), with_kwargs=True)
            kept.register_forward_hook(partial(_cast_output, policy.param_dtype))


def register_entry_point(module: nn.Module, method_name: str) -> None:
    """Make ``module.<method_name>(...)`` gather and free the unit like ``module(...)`` does.

    For methods other than ``forward`` that use the unit's parameters (``generate``, a
    decoding step, an auxiliary head). ``module`` must be a unit's module; the wrapper is
    an attribute of this instance only.
    """
    unit = unit_or_error(module, "register_entry_point")
    method = getattr(module, method_name, None)
    if not callable(method):
        raise AttributeError(
            f"flatshard.register_entry_point: {type(module).__name__} has no method '{method_name}'"
        )

    @wraps(method)
    def entry_point(*args: Any, **kwargs: Any) -> Any:
        args, kwargs = unit.pre_forward(module, args, kwargs)
        return unit.post_forward(module, args, method(*args, **kwargs))

    module.__dict__[method_name] = entry_point


def set_prefetch(
    module: nn.Module,
    *,
    forward: list[nn.Module] | None = None,
    backward: list[nn.Module] | None = None,
) -> None:
    """Name the units to gather when ``module``'s unit starts forward / backward.

    Overrides the prediction from recorded order (``[]`` turns prefetch off for the unit;
    None keeps the prediction). All modules must be units of the same model.
    """
    owner = unit_or_error(module, "set_prefetch")
    if forward is not None:
        owner.prefetch_targets.forward = [unit_or_error(m, "set_prefetch") for m in forward]
    if backward is not None:
        owner.prefetch_targets.backward = [unit_or_error(m, "set_prefetch") for m in backward]


def _guard_direct_forward(unit: Unit) -> None:
    """Make ``unit_module.forward(...)`` an error while the unit is sharded.

    Calling ``forward`` directly skips the module's hooks, so nothing gathers the unit's
    parameters. For a unit whose module registers parameters itself (a leaf such as an
    ``nn.Linear``), no inner module's check would notice either: the call would compute on
    this rank's rows. The guard is an attribute of this instance only; ``module(...)``
    passes through it after its hooks have gathered.
    """
    module = unit.module
    forward = module.forward

    @wraps(forward)
    def guarded(*args: Any, **kwargs: Any) -> Any:
        if not unit.is_gathered:
            raise RuntimeError(
                f"flatshard: {type(module).__name__}.forward() of unit '{unit.label}' was "
                f"called directly while the unit is sharded (rank {global_rank()}): its "
                "parameters hold only this rank's rows and forward() skips the hooks that "
                "gather them. Call the module itself (module(...)), or run inside "
                "flatshard.summon_full_params(model)."
            )
        return forward(*args, **kwargs)

    module.__dict__["forward"] = guarded


def _check_gathered(unit: Unit, name: str, module: nn.Module, args: Any) -> None:
    """A module inside a unit runs only while the unit's parameters are gathered."""
    if unit.is_gathered:
        return
    held = [
        o.fqn for f in unit.flat_params for o in f.originals for m, _ in o.usages if m is module
    ]
    raise RuntimeError(
        f"flatshard: module '{name}' ran while its unit '{unit.label}' is sharded (rank "
        f"{global_rank()}): its parameters ({', '.join(repr(n) for n in held)}) hold only "
        f"this rank's rows. Call the unit's module ('{unit.label}') rather than "
        f"'{name}' directly or through .forward(), run it inside "
        "flatshard.summon_full_params(model), or register the method that calls it with "
        "flatshard.register_entry_point(unit_module, 'method')."
    )


def _cast_inputs(
    dtype: torch.dtype, module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]
) -> tuple[tuple[Any, ...], dict[str, Any]]:
    cast_args, cast_kwargs = cast_floats((args, kwargs), dtype)
    return cast_args, cast_kwargs


def _cast_output(dtype: torch.dtype, module: nn.Module, args: Any, output: Any) -> Any:
    return cast_floats(output, dtype)
