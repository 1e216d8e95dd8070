"""The runtime: the only place flatshard registers hooks (paper section "autograd integration").

Per unit:
- pre-forward: unshard (all-gather; the modules then hold views of the unsharded buffer);
  wrap the inputs so that autograd tells us when their gradients are done.
- post-forward: register the pre-backward hook on the outputs; reshard (the modules get the
  original parameters back), except the root when a backward will follow (it would
  all-gather again at once) and except during checkpoint recomputation inside backward.
- pre-backward (first gradient reaching any output): unshard again; queue the final callback
  once per backward pass.
- post-backward (autograd accumulated a FlatParameter's flat gradient): start its
  reduce-scatter and free the unsharded buffer.
- final callback (end of the backward pass): reduce what did not reach the hook, wait for
  every reduction, put the sharded gradients in ``.grad``, reshard everything.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable
from contextlib import AbstractContextManager, nullcontext
from dataclasses import replace
from functools import partial, wraps
from typing import Any, cast

import torch
import torch.distributed as dist
from torch import nn
from torch.autograd import Variable
from torch.autograd.graph import register_multi_grad_hook
from torch.profiler import record_function
from torch.utils import _pytree as pytree

from flatshard._flat_param import FlatParameter
from flatshard._mixed_precision import MixedPrecision
from flatshard._prefetch import BackwardPrefetch, following
from flatshard._rate_limiter import RateLimiter
from flatshard._unit import TrainingState, Unit

STATE_ATTR = "_flatshard_unit"  # attribute of a unit's module holding its UnitRuntime
TREE_ATTR = "_flatshard_tree"  # attribute of a module fully_shard was called on


# Whether a profiler is recording (torch exposes no public query; without this private
# one, ranges are always entered).
_profiling: Callable[[], bool] = getattr(torch._C._autograd, "_profiler_enabled", lambda: True)


def _traced(what: str) -> AbstractContextManager[object]:
    """A profiler range ``flatshard::<what>`` while a profiler records, else nothing.

    Entering a range costs CPU time even when nothing records (about 20 us here), and a
    step enters several per unit: on a GPU, launch time the device may wait for.
    """
    return record_function(f"flatshard::{what}") if _profiling() else nullcontext()


class ShardTree:
    """The units sharded together under one ``fully_shard`` call (bottom-up calls merge)."""

    def __init__(self, root: nn.Module, process_group: dist.ProcessGroup) -> None:
        self.root = root
        self.process_group = process_group  # all the ranks that train the model together
        self.rate_limiter = RateLimiter()  # limit_all_gathers (see _rate_limiter.py)
        self.units: list[UnitRuntime] = []  # inner units first; forward order is not assumed
        self.callback_queued = False  # the final callback of this backward pass is queued
        self.sync_gradients = True  # False inside no_sync: keep unsharded gradients
        # The one gradient reduction left in flight: each waits for the one before, so at
        # most one unsharded gradient waits on communication (see _post_backward).
        self.in_flight: FlatParameter | None = None
        # Units in the order their forward started: this iteration's and the last one's.
        self.forward_order: list[UnitRuntime] = []
        self.previous_forward_order: list[UnitRuntime] = []

    def record_forward(self, runtime: UnitRuntime) -> None:
        """Note that ``runtime``'s forward started; the root's starts a new iteration."""
        if runtime.is_root:
            if self.forward_order:
                self.previous_forward_order = self.forward_order
            self.forward_order = []
        if not any(r is runtime for r in self.forward_order):
            self.forward_order.append(runtime)

    def ends_forward(self, runtime: UnitRuntime) -> bool:
        """Whether ``runtime``'s unit ran last in the previous iteration's forward.

        A guess from the last iteration; a wrong one keeps a unit gathered a little longer.
        """
        order = self.previous_forward_order
        return bool(order) and order[-1] is runtime

    def adopt(self, other: ShardTree, prefix: str, mixed_precision: MixedPrecision | None) -> None:
        """Take over the units of an earlier call on the submodule named ``prefix``.

        Units sharded without a mixed-precision policy inherit ``mixed_precision`` (all but
        ``keep_full_precision``, which needs its own FlatParameters).
        """
        for runtime in other.units:
            runtime.tree = self
            runtime.unit.rename(prefix)
            if runtime.unit.mixed_precision is None and mixed_precision is not None:
                runtime.unit.inherit(replace(mixed_precision, keep_full_precision=frozenset()))
            self.units.append(runtime)
        other.units = []


class UnitRuntime:
    """A unit as the hooks see it: the unit and the tree it belongs to now."""

    def __init__(self, unit: Unit, tree: ShardTree) -> None:
        self.unit = unit
        self.tree = tree
        # Explicit prefetch targets (set_prefetch); None: predicted from forward order.
        self.forward_targets: list[UnitRuntime] | None = None
        self.backward_targets: list[UnitRuntime] | None = None

    def next_in_forward(self) -> list[UnitRuntime]:
        """Units to gather when this one's forward starts (forward prefetch)."""
        if self.forward_targets is not None:
            return self.forward_targets
        if not self.unit.forward_prefetch:
            return []
        found = following(self.tree.previous_forward_order, self, +1)
        return [found] if found is not None else []

    def next_in_backward(self) -> list[UnitRuntime]:
        """Units to gather around this one's backward (backward prefetch)."""
        if self.backward_targets is not None:
            return self.backward_targets
        if self.unit.backward_prefetch is None:
            return []
        found = following(self.tree.forward_order, self, -1)
        return [found] if found is not None else []

    @property
    def is_root(self) -> bool:
        return self.unit.module is self.tree.root


def unit_runtime(module: nn.Module) -> UnitRuntime | None:
    """The runtime of the unit rooted at ``module``, if any."""
    found = module.__dict__.get(STATE_ATTR)
    return found if isinstance(found, UnitRuntime) else None


def units_of(model: nn.Module, caller: str) -> list[UnitRuntime]:
    """Every unit inside ``model``; an error if ``fully_shard`` never touched it."""
    runtimes = [r for m in model.modules() if (r := unit_runtime(m)) is not None]
    if not runtimes:
        raise ValueError(
            f"flatshard.{caller}: {type(model).__name__} holds no flatshard unit; call "
            "flatshard.fully_shard(model, ...) first."
        )
    return runtimes


def shard_tree(module: nn.Module) -> ShardTree | None:
    """The tree of the ``fully_shard`` call made on ``module``, if any."""
    found = module.__dict__.get(TREE_ATTR)
    return found if isinstance(found, ShardTree) else None


def install(unit: Unit, tree: ShardTree) -> UnitRuntime:
    """Register the hooks of ``unit``; the only place flatshard registers hooks."""
    runtime = UnitRuntime(unit, tree)
    tree.units.append(runtime)
    unit.module.__dict__[STATE_ATTR] = runtime
    unit.module.register_forward_pre_hook(partial(_pre_forward, runtime), with_kwargs=True)
    unit.module.register_forward_hook(partial(_post_forward, runtime))
    for flat in unit.trainable:
        flat.register_post_accumulate_hook(partial(_post_backward, runtime, flat))
    for name, inner in unit.inner_modules:
        inner.register_forward_pre_hook(partial(_check_gathered, runtime, name))
    if any(m is unit.module for f in unit.flat_params for o in f.originals for m, _ in o.usages):
        _guard_direct_forward(runtime)  # no inner module would notice a bypass
    policy = unit.mixed_precision
    if policy is not None and policy.param_dtype is not None:
        for module in unit.full_precision_modules():
            master = next(module.parameters()).dtype
            module.register_forward_pre_hook(partial(_cast_inputs, master), with_kwargs=True)
            module.register_forward_hook(partial(_cast_output, policy.param_dtype))
    return runtime


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
    owner = _runtime_or_error(module, "set_prefetch")
    if forward is not None:
        owner.forward_targets = [_runtime_or_error(m, "set_prefetch") for m in forward]
    if backward is not None:
        owner.backward_targets = [_runtime_or_error(m, "set_prefetch") for m in backward]


def _runtime_or_error(module: nn.Module, caller: str) -> UnitRuntime:
    runtime = unit_runtime(module)
    if runtime is None:
        raise ValueError(
            f"flatshard.{caller}: {type(module).__name__} is not a flatshard "
            "unit; pass the module fully_shard made a unit (the model itself, or a "
            "submodule chosen by auto_wrap_policy)."
        )
    return runtime


def register_entry_point(module: nn.Module, method_name: str) -> None:
    """Make ``module.<method_name>(...)`` gather and free the unit like ``module(...)`` does.

    For methods other than ``forward`` that use the unit's parameters (``generate``, a
    decoding step, an auxiliary head). ``module`` must be a unit's module; the wrapper is
    an attribute of this instance only.
    """
    runtime = _runtime_or_error(module, "register_entry_point")
    method = getattr(module, method_name, None)
    if not callable(method):
        raise AttributeError(
            f"flatshard.register_entry_point: {type(module).__name__} has no method '{method_name}'"
        )

    @wraps(method)
    def entry_point(*args: Any, **kwargs: Any) -> Any:
        args, kwargs = _pre_forward(runtime, module, args, kwargs)
        return _post_forward(runtime, module, args, method(*args, **kwargs))

    module.__dict__[method_name] = entry_point


def _guard_direct_forward(runtime: UnitRuntime) -> None:
    """Make ``unit_module.forward(...)`` an error while the unit is sharded.

    Calling ``forward`` directly skips the module's hooks, so nothing gathers the unit's
    parameters. For a unit whose module registers parameters itself (a leaf such as an
    ``nn.Linear``), no inner module's check would notice either: the call would compute on
    this rank's rows. The guard is an attribute of this instance only; ``module(...)``
    passes through it after its hooks have gathered.
    """
    module = runtime.unit.module
    forward = module.forward

    @wraps(forward)
    def guarded(*args: Any, **kwargs: Any) -> Any:
        unit = runtime.unit
        if not (unit.params_are_full or all(f.is_unsharded for f in unit.flat_params)):
            raise RuntimeError(
                f"flatshard: {type(module).__name__}.forward() of unit '{unit.label}' was "
                f"called directly while the unit is sharded (rank {dist.get_rank()}): its "
                "parameters hold only this rank's rows and forward() skips the hooks that "
                "gather them. Call the module itself (module(...)), or run inside "
                "flatshard.summon_full_params(model)."
            )
        return forward(*args, **kwargs)

    module.__dict__["forward"] = guarded


def _check_gathered(runtime: UnitRuntime, name: str, module: nn.Module, args: Any) -> None:
    """A module inside a unit runs only while the unit's parameters are gathered."""
    unit = runtime.unit
    if unit.params_are_full or all(f.is_unsharded for f in unit.flat_params):
        return
    held = [
        o.fqn for f in unit.flat_params for o in f.originals for m, _ in o.usages if m is module
    ]
    raise RuntimeError(
        f"flatshard: module '{name}' ran while its unit '{unit.label}' is sharded (rank "
        f"{dist.get_rank()}): its parameters ({', '.join(repr(n) for n in held)}) hold only "
        f"this rank's rows. Call the unit's module ('{unit.label}') rather than "
        f"'{name}' directly or through .forward(), run it inside "
        "flatshard.summon_full_params(model), or register the method that calls it with "
        "flatshard.register_entry_point(unit_module, 'method')."
    )


def _pre_forward(
    runtime: UnitRuntime, module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]
) -> tuple[tuple[Any, ...], dict[str, Any]]:
    unit = runtime.unit
    with _traced(f"pre_forward {unit.label}"):
        if unit.state is not TrainingState.BACKWARD:
            unit.state = TrainingState.FORWARD
            runtime.tree.record_forward(runtime)
        unit.unshard()
        if unit.state is TrainingState.FORWARD:
            _prefetch(runtime.next_in_forward())
        policy = unit.mixed_precision
        if policy is not None and policy.param_dtype is not None and policy.cast_forward_inputs:
            args, kwargs = _cast_floats((args, kwargs), policy.param_dtype)
        # Only frozen FlatParameters wait for the inputs' gradients (_reshard_frozen_if_done).
        if unit.frozen and torch.is_grad_enabled() and unit.state is TrainingState.FORWARD:
            args, kwargs = _watch_input_grads(runtime, args, kwargs)
    return args, kwargs


def _post_forward(runtime: UnitRuntime, module: nn.Module, args: Any, output: Any) -> Any:
    unit = runtime.unit
    with _traced(f"post_forward {unit.label}"):
        needs_grad = [t for t in _tensors(output) if t.requires_grad]
        if needs_grad:
            unit.expects_backward = True
            register_multi_grad_hook(needs_grad, partial(_pre_backward, runtime), mode="any")
        if unit.state is TrainingState.BACKWARD:
            return output  # recomputation inside backward: keep the parameters
        unit.state = TrainingState.IDLE
        # Kept until backward: the root and the last unit of the forward order (backward
        # starts with them, they would be gathered again at once, with no compute to hide
        # the wait), and units whose strategy keeps parameters from forward to backward
        # (SHARD_GRAD_OP, ZERO2).
        keep = needs_grad and (
            runtime.is_root
            or runtime.tree.ends_forward(runtime)
            or not unit.strategy.reshard_after_forward
        )
        hidden_graph = not needs_grad and _may_hide_graph(unit, output)
        if not (keep or hidden_graph) and unit.reshard():
            runtime.tree.rate_limiter.resharded(unit.compute_device)
    return output


def _may_hide_graph(unit: Unit, output: Any) -> bool:
    """Whether the output may carry a graph through tensors flatshard cannot find.

    Without them there is no pre-backward hook to unshard again, so the unit must stay
    unsharded until its gradient is reduced (or the backward pass ends).
    """
    if not (torch.is_grad_enabled() and unit.trainable) or _tensors(output):
        return False
    warnings.warn(
        f"flatshard: unit '{unit.label}' returned {type(output).__name__} with no tensor "
        "flatshard can find, so it stays unsharded until its backward. Return tensors in "
        "tuples, lists or dicts, or register the type with torch.utils._pytree.",
        stacklevel=3,
    )
    return True


def _pre_backward(runtime: UnitRuntime, *unused: Any) -> None:
    unit = runtime.unit
    with _traced(f"pre_backward {unit.label}"):
        _queue_finish_backward(runtime.tree)
        unit.state = TrainingState.BACKWARD
        # Autograd runs hooks with grad disabled; views made so would not require grad, and
        # checkpoint recomputation reading them would save other tensors than forward did.
        with torch.enable_grad():
            unit.unshard()
            if unit.backward_prefetch is BackwardPrefetch.BACKWARD_PRE:
                _prefetch(runtime.next_in_backward())


def _post_backward(runtime: UnitRuntime, flat: FlatParameter, *unused: Any) -> None:
    unit = runtime.unit
    with _traced(f"post_backward {unit.label}"):
        tree = runtime.tree
        _queue_finish_backward(tree)  # in case no pre-backward hook could fire
        if tree.sync_gradients:
            # The previous reduction had this unit's whole backward to finish; waiting for
            # it now frees its unsharded gradient before the next one is held.
            if tree.in_flight is not None:
                tree.in_flight.finish_reduction()
            flat.start_reduction()
            tree.in_flight = flat
        else:
            flat.keep_unreduced()
        flat.reshard()
        _reshard_frozen_if_done(unit)
        last = all(f.grad_done_in_backward for f in unit.trainable)
        if last and unit.backward_prefetch is BackwardPrefetch.BACKWARD_POST:
            with torch.enable_grad():
                _prefetch(runtime.next_in_backward())


def _prefetch(runtimes: list[UnitRuntime]) -> None:
    """Start gathering units ahead of use; their own hooks wait and register views."""
    for runtime in runtimes:
        if not runtime.unit.unshard_allocates:
            continue  # nothing to gather or to hold: the limiter has nothing to bound
        with _traced(f"prefetch {runtime.unit.label}"):
            limiter = runtime.tree.rate_limiter
            limiter.before_prefetch()
            runtime.unit.start_unshard()
            limiter.prefetched(runtime.unit)


def _queue_finish_backward(tree: ShardTree) -> None:
    if not tree.callback_queued:
        tree.callback_queued = True
        Variable._execution_engine.queue_callback(partial(_finish_backward, tree))


def _inputs_grad_done(runtime: UnitRuntime) -> None:
    runtime.unit.pending_input_grads -= 1
    _reshard_frozen_if_done(runtime.unit)


def _reshard_frozen_if_done(unit: Unit) -> None:
    if unit.frozen and unit.frozen_safe_to_reshard():
        for flat in unit.frozen:
            flat.reshard()


def _finish_backward(tree: ShardTree) -> None:
    """The final callback of a backward pass; runs once autograd has done everything else."""
    with _traced("finish_backward"):
        for runtime in tree.units:
            unit = runtime.unit
            if unit.expects_backward and tree.sync_gradients:
                for flat in unit.trainable:
                    if not flat.grad_done_in_backward:
                        flat.start_reduction()
        for runtime in tree.units:
            for flat in runtime.unit.flat_params:
                flat.finish_reduction()
            runtime.unit.reshard()
            runtime.unit.reset_backward_state()
        tree.in_flight = None
        tree.callback_queued = False


class _InputGradWatch(torch.autograd.Function):
    """Identity on a unit's inputs whose backward reports that their gradients are done."""

    @staticmethod
    def forward(ctx: Any, runtime: UnitRuntime, *inputs: torch.Tensor) -> Any:
        ctx.runtime = runtime
        return inputs

    @staticmethod
    def backward(ctx: Any, *grads: torch.Tensor | None) -> Any:
        _inputs_grad_done(ctx.runtime)
        return (None, *grads)


def _watch_input_grads(
    runtime: UnitRuntime, args: tuple[Any, ...], kwargs: dict[str, Any]
) -> tuple[tuple[Any, ...], dict[str, Any]]:
    leaves, spec = pytree.tree_flatten((args, kwargs))
    positions = [i for i, x in enumerate(leaves) if isinstance(x, torch.Tensor) and x.requires_grad]
    if not positions:
        return args, kwargs
    runtime.unit.pending_input_grads += 1
    apply = cast(Callable[..., tuple[torch.Tensor, ...]], _InputGradWatch.apply)  # untyped stub
    watched = apply(runtime, *(leaves[i] for i in positions))
    for i, tensor in zip(positions, watched, strict=True):
        leaves[i] = tensor
    new_args, new_kwargs = pytree.tree_unflatten(leaves, spec)
    return new_args, new_kwargs


def _cast_floats(tree: Any, dtype: torch.dtype) -> Any:
    """``tree`` with every floating-point tensor cast to ``dtype`` (autograd-visible)."""
    return pytree.tree_map(
        lambda x: x.to(dtype) if isinstance(x, torch.Tensor) and x.is_floating_point() else x,
        tree,
    )


def _cast_inputs(
    dtype: torch.dtype, module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]
) -> tuple[tuple[Any, ...], dict[str, Any]]:
    cast_args, cast_kwargs = _cast_floats((args, kwargs), dtype)
    return cast_args, cast_kwargs


def _cast_output(dtype: torch.dtype, module: nn.Module, args: Any, output: Any) -> Any:
    return _cast_floats(output, dtype)


def _tensors(output: Any) -> list[torch.Tensor]:
    return [x for x in pytree.tree_leaves(output) if isinstance(x, torch.Tensor)]
