"""The only place flatshard registers hooks; their bodies are ``Unit`` methods.

Also the guards that turn "a module ran while its unit is sharded" into an error, and the
public helpers that change what a unit's hooks do (``register_entry_point``,
``set_prefetch``).
"""

from __future__ import annotations

import weakref
from collections.abc import Callable
from functools import partial, wraps
from typing import Any, TypeVar, cast

import torch
from torch import nn

from flatshard.comm._agreement import global_rank
from flatshard.flat._flat_param import FlatParamGroup
from flatshard.flat._lookup_options import LOOKUPS
from flatshard.runtime._unit import (
    OWNER_ATTR,
    UNIT_ATTR,
    Hold,
    TrainingState,
    Unit,
    cast_floats,
    unit_or_error,
)

F = TypeVar("F", bound=Callable[..., Any])


def install(unit: Unit) -> None:
    """Register every hook of ``unit``."""
    module = unit.module
    module.__dict__[UNIT_ATTR] = unit
    for name, owned in unit.owned_modules:
        owned.__dict__[OWNER_ATTR] = (unit, name)
    # Outside any compiled region: see [Note: hooks and torch.compile].
    module.register_forward_pre_hook(_eager(unit.pre_forward), with_kwargs=True)
    module.register_forward_hook(_eager(unit.post_forward))
    for flat in unit.trainable:  # held by autograd's C++ side: weakly (see _weakly)
        flat.register_post_accumulate_hook(_weakly(unit.post_backward, flat))
    for name, inner in unit.inner_modules:
        inner.register_forward_pre_hook(partial(_check_gathered, unit, name))
        inner.register_forward_hook(partial(_held_module_returned, unit))
    for flat in unit.flat_params:
        for orig in flat.originals:
            for lookup in [m for m, _ in orig.usages if isinstance(m, LOOKUPS)]:
                check = partial(_refuse_lookup_options, orig.fqn, flat)
                lookup.register_forward_pre_hook(check)
    for flat in unit.flat_params:  # what its placement runs first (a tied table's head)
        for user, call in flat.placement.forward_pre_hooks():
            user.register_forward_pre_hook(_eager(partial(_call_first, call)))
    if any(m is module for f in unit.flat_params for o in f.originals for m, _ in o.usages):
        _guard_direct_forward(unit)  # no inner module would notice a bypass
    # torch's stubs leave these two unannotated; the casts state their real signatures.
    for register, hook in [
        (module.register_state_dict_pre_hook, _refuse_partial_state_dict),
        (module.register_load_state_dict_pre_hook, _refuse_partial_load),
    ]:
        cast(Callable[[Callable[..., None]], object], register)(partial(hook, unit))
    policy = unit.config.mixed_precision
    if policy is not None and policy.param_dtype is not None:
        for kept in unit.full_precision_modules():
            master = next(kept.parameters()).dtype
            kept.register_forward_pre_hook(partial(_cast_inputs, master), with_kwargs=True)
            kept.register_forward_hook(partial(_cast_output, policy.param_dtype))


def _weakly(
    method: Callable[[FlatParamGroup, torch.Tensor], None], flat: FlatParamGroup
) -> Callable[[torch.Tensor], None]:
    """``method(flat, tensor)``, holding the unit and the group weakly.

    A leaf tensor's post-accumulate hooks are referenced from autograd's C++ side, where
    Python's garbage collector cannot see the cycle back to the model: a hook holding its
    unit kept every sharded model alive until the process ended, and with it what
    flatshard installs in torch (runtime/_torch_utilities.py).
    """
    owner, group = weakref.WeakMethod(method), weakref.ref(flat)

    def call(tensor: torch.Tensor) -> None:
        bound, target = owner(), group()
        if bound is not None and target is not None:
            bound(target, tensor)

    return call


def install_output_cast(module: nn.Module, dtype: torch.dtype) -> None:
    """``module``'s floating-point outputs cast to ``dtype`` (``MixedPrecision.output_dtype``)."""
    module.register_forward_hook(_eager(partial(_cast_output, dtype)))


def _eager(hook: F) -> F:
    """``hook`` run eagerly, never traced by torch.compile.

    [Note: hooks and torch.compile]
    ``module.compile()`` (or ``torch.compile(module)``) compiles the module's call,
    forward hooks included. Traced, flatshard's hooks break the graph inside it (the
    profiler check, the asynchronous all-gather, ``register_multi_grad_hook``: 5 breaks
    for a 2-block GPT compiled per block). Marked as not to be traced, they run eagerly
    around the compiled forward, which stays one graph.
    """
    return cast(F, torch._dynamo.disable(hook, recursive=True))  # type: ignore[no-untyped-call]


def register_entry_point(module: nn.Module, method_name: str) -> None:
    """Make ``module.<method_name>(...)`` gather and free the unit like ``module(...)`` does.

    For methods other than ``forward`` that use the unit's parameters (``generate``, a
    decoding step, an auxiliary head, Lightning's ``training_step``). ``module`` must be a
    unit's module; the wrapper is an attribute of this instance only. The method may call
    the module itself (``self(x)``): that call finds the unit gathered and passes through.

    [Note: a unit called inside its own entry point]
    An entry point gathers the unit around the whole method. When the method calls the
    module (Lightning's ``training_step`` calling ``self(batch)``), the module's hooks run a
    second time inside the first; as a new forward they would record the unit twice in the
    forward order and start a second step. So while an entry point of the unit runs and
    the unit is in forward, its own module's hooks pass through: the outer entry point
    already gathered the parameters and registers the pre-backward hook on the result.
    """
    unit = unit_or_error(module, "register_entry_point")
    method = getattr(module, method_name, None)
    if getattr(method, _ENTRY_POINT, None) is unit:
        return  # registered already (fully_shard registers a wrapper's generate)
    if not callable(method):
        raise AttributeError(
            f"flatshard.register_entry_point: {type(module).__name__} has no method '{method_name}'"
        )

    @wraps(method)
    def entry_point(*args: Any, **kwargs: Any) -> Any:
        args, kwargs = unit.pre_forward(module, args, kwargs)
        unit.entry_depth += 1
        try:
            output = method(*args, **kwargs)
        finally:
            unit.entry_depth -= 1
            if not unit.entry_depth:
                unit.passed_through = 0  # a call that raised left its count
        return unit.post_forward(module, args, output)

    setattr(entry_point, _ENTRY_POINT, unit)
    module.__dict__[method_name] = entry_point


_ENTRY_POINT = "_flatshard_entry_point_of"  # on a wrapper: the unit it gathers


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
    """A module inside a unit runs only while the unit's parameters are gathered (or the
    unit is held by ``flatshard.unshard``: it gets the views for the call)."""
    if unit.hold is Hold.USER and unit.state is TrainingState.IDLE:
        unit.held_module_called()
        return
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


def _held_module_returned(unit: Unit, module: nn.Module, args: Any, output: Any) -> None:
    """The end of a held unit's module called on its own: the originals come back."""
    if unit.held_calls:
        unit.held_module_returned()


def _refuse_lookup_options(
    name: str, flat: FlatParamGroup, embedding: nn.Embedding | nn.EmbeddingBag, args: Any
) -> None:
    """An option set after fully_shard (``model.tok.sparse = True``) is refused as at build."""
    flat.placement.check_lookup_options(name, embedding)


def _call_first(call: Callable[[], None], module: nn.Module, args: Any) -> None:
    call()


def _refuse_partial_state_dict(unit: Unit, module: nn.Module, *unused: Any) -> None:
    """Plain ``state_dict()`` of a sharded unit is an error: it would hold this rank's rows.

    ``torch.save(model.state_dict())`` on one rank (or ``save_pretrained``) would write a
    truncated model without a word. Allowed where the result is whole: inside
    ``summon_full_params`` or forward, for NO_SHARD units, and for flatshard's own calls.
    """
    if not unit.own_state_dict_call:
        _refuse_tensor_parallel_parts(unit, module, "state_dict() would return")
    if unit.own_state_dict_call or unit.is_gathered or not unit.is_sharded:
        return
    raise RuntimeError(
        f"flatshard: {type(module).__name__}.state_dict() would return only this rank's rows "
        f"of unit '{unit.label}' (rank {global_rank()}), e.g. {_example_rows(unit)}; saving "
        "it would write a truncated model. Use flatshard.full_state_dict(model) (full "
        "tensors, kept on rank 0), flatshard.sharded_state_dict(model) or "
        "flatshard.save_checkpoint(path, model, optim), or call state_dict() inside "
        "flatshard.summon_full_params(model). For save_pretrained use "
        "flatshard.export_safetensors(model, dir): it writes the full model and its config "
        "for from_pretrained."
    )


def _refuse_partial_load(unit: Unit, module: nn.Module, *unused: Any) -> None:
    """Plain ``load_state_dict()`` of a sharded unit is an error (it would load rows)."""
    if not unit.own_state_dict_call:
        _refuse_tensor_parallel_parts(unit, module, "load_state_dict() would load into")
    if unit.own_state_dict_call or unit.is_gathered or not unit.is_sharded:
        return
    raise RuntimeError(
        f"flatshard: {type(module).__name__}.load_state_dict() would load into this rank's "
        f"rows of unit '{unit.label}' only (rank {global_rank()}), e.g. "
        f"{_example_rows(unit)}. Use flatshard.load_state_dict(model, state_dict) (full or "
        "sharded dicts; from_rank0=True when only rank 0 holds it) or "
        "flatshard.load_checkpoint(path, model, optim), or load inside "
        "flatshard.summon_full_params(model) (written back to the shards on exit)."
    )


def _refuse_tensor_parallel_parts(unit: Unit, module: nn.Module, what: str) -> None:
    """Inside ``summon_full_params`` a tensor-parallel parameter is this rank's TP part (its
    layers compute on it as a DTensor), not the global tensor: a plain state dict there
    would hold parts without a word."""
    if unit.hold is not Hold.SUMMONED:
        return
    refused = [
        (o, why)
        for f in unit.flat_params
        for o in f.originals
        if o.tp is not None and (why := o.tp.summon_refusal()) is not None
    ]
    if refused:
        orig, why = refused[0]
        assert orig.tp is not None
        raise RuntimeError(
            f"flatshard: {type(module).__name__}.{what} parameters that are {why} "
            f"inside summon_full_params (unit '{unit.label}', rank {global_rank()}), e.g. "
            f"'{orig.fqn}' {tuple(orig.param.shape)} of {tuple(orig.tp.shape)}. Use "
            "flatshard.full_state_dict(model) / flatshard.load_state_dict(model, sd) (global "
            "tensors), or flatshard.export_safetensors(model, dir)."
        )


def _example_rows(unit: Unit) -> str:
    """One parameter of ``unit`` as this rank holds it, against its full shape."""
    for flat in unit.flat_params:
        for orig, full in zip(flat.originals, flat.full_shapes, strict=True):
            if orig.param.shape != full:
                return f"'{orig.fqn}' {tuple(orig.param.shape)} of {tuple(full)}"
    return "no rows of some parameters"


def _cast_inputs(
    dtype: torch.dtype, module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]
) -> tuple[tuple[Any, ...], dict[str, Any]]:
    cast_args, cast_kwargs = cast_floats((args, kwargs), dtype)
    return cast_args, cast_kwargs


def _cast_output(dtype: torch.dtype, module: nn.Module, args: Any, output: Any) -> Any:
    return cast_floats(output, dtype)
