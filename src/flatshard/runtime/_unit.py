"""One FSDP unit: a module whose parameters are sharded, unsharded and reduced together.

A ``Unit`` owns its configuration, its flat parameter groups, its per-step state and the
bodies of its hooks (paper section "autograd integration"); ``_hooks.py`` registers them:
- pre-forward: unshard (all-gather; the modules then hold views of the unsharded buffer);
  prefetch the next unit; wrap the inputs so that autograd tells us when their gradients
  are done (units with frozen groups only).
- post-forward: register the pre-backward hook on the outputs; reshard (the modules get the
  original parameters back), except the root and the last unit of forward when a backward
  will follow (they would all-gather again at once) and except during checkpoint
  recomputation inside backward.
- pre-backward (first gradient reaching any output): unshard again; prefetch; queue the
  end-of-backward callback once per pass (``StepContext``).
- post-backward (autograd accumulated a group's flat gradient): start its reduction and
  free the unsharded buffer.
What is shared by the units of one root (execution order, the reduction in flight, the
end-of-backward callback, ``no_sync``) is the ``StepContext`` (``_step.py``).

[Note: kept for backward]
Some units keep their gathered buffers from forward to backward (the root, the last unit
of forward, SHARD_GRAD_OP and HYBRID_SHARD_ZERO2 units). Their modules get the original
parameters back at the end of their forward all the same, and the pre-backward hook
registers fresh views of the kept buffer (no all-gather): autograd only needs the views it
saved, not the modules' entries. So between forward and backward, and for good when no
backward comes (an evaluation forward without ``torch.no_grad()``), ``model.parameters()``
are the sharded leaves: an optimizer can be built, ``state_dict`` hooks see a sharded unit,
and a module called outside its unit's forward is refused as at any time between steps.
Whether a backward will come cannot be known, so the kept buffers are freed at the next
deterministic point: the next forward of the root (``StepContext._free_kept``) or
``summon_full_params``; a backward that still comes gathers them again.

[Note: held units]
``flatshard.unshard(module)`` keeps a unit's buffers gathered until ``flatshard.reshard``
(generation without an all-gather per token; hand-made prefetch). Only the buffers stay:
outside the unit's forward and backward its modules hold the original parameters, as for
any unit. So ``model.parameters()``, state dicts, checkpoints, clipping and the optimizer
see the sharded leaves and their gradients, exactly as without ``unshard``. A module of
the unit called on its own between steps (``model.head(x)``) gets the views for that call.
The buffers follow the shard's writes like any gathered buffer ([Note: stale gathers]):
after the model's optimizer steps, the next use gathers again.

[Note: a unit backward does not read]
``flatshard.set_unshard_in_backward(module, False)`` says that no backward op of the unit
reads its parameters (an embedding table: its backward needs only the indices). Its
forward then frees the gathered buffer even where it would keep it (the root, the last
unit of forward, ZeRO-2 strategies), and backward gathers nothing: autograd holds the
views forward made, and a gradient needs only their shapes, so the flat gradient still
arrives and is reduced as always. Were the claim wrong, the backward op reading a view of
the freed buffer fails in torch ("setStorage: ... out of bounds for storage of size 0"),
as FSDP2's does. A recomputation inside backward (activation checkpointing) still gathers:
that forward does read the parameters.

What the hooks do to a unit's inputs and outputs: find tensors, cast, watch gradients.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable, Collection, Sequence
from dataclasses import replace
from enum import Enum, auto
from typing import Any, Protocol, cast

import torch
from torch import nn
from torch.autograd.graph import register_multi_grad_hook
from torch.utils import _pytree as pytree

from flatshard.comm._agreement import StepLedger, global_rank, join_name
from flatshard.comm._watchdog import Tag
from flatshard.flat._flat_param import FlatParamGroup
from flatshard.flat._mixed_precision import MixedPrecision
from flatshard.measure._accounting import traced
from flatshard.runtime._changes import (
    check_in_shards,
    check_loaded,
    check_no_parameter_hooks,
    check_requires_grad,
)
from flatshard.runtime._configuration import UnitConfig
from flatshard.runtime._prefetch import (
    BackwardPrefetch,
    ExecutionOrder,
    Prefetch,
    Prefetchable,
    RateLimiter,
    backward_targets,
    forward_targets,
    issue,
)

UNIT_ATTR = "_flatshard_unit"  # attribute of a unit's module holding its Unit
OWNER_ATTR = "_flatshard_owner"  # attribute of the other modules a unit owns: (Unit, name)


class TrainingState(Enum):
    """Where a unit is in the step. Only the unit's hooks change it."""

    IDLE = auto()  # outside forward and backward: parameters are shard views
    FORWARD = auto()  # between the unit's pre-forward and post-forward hooks
    BACKWARD = auto()  # the unit's pre-backward ran in the current backward pass


class Hold(Enum):
    """Who keeps a unit gathered beyond what its hooks decide. Changed by the public calls
    named here only (docs/design.md, "Unit state")."""

    NONE = auto()  # the hooks gather and free it
    # flatshard.unshard: the buffer stays gathered until flatshard.reshard; between uses the
    # modules hold the original parameters all the same ([Note: held units]).
    USER = auto()
    SUMMONED = auto()  # inside summon_full_params: the originals are full-size themselves


class UnitStep(Protocol):
    """What a unit needs of the step its root runs (``StepContext``).

    A unit gets its step when its root's ``StepContext`` adds it, and a new one when a
    later ``fully_shard`` call on an enclosing module adopts it (bottom-up sharding).
    """

    root: nn.Module
    order: ExecutionOrder  # units in forward order, this iteration and the last
    rate_limiter: RateLimiter
    ledger: StepLedger  # collectives issued since the ranks last compared them

    @property
    def reshard_after_backward(self) -> bool: ...  # False: stay gathered for the next micro-batch

    @property
    def reshard_after_forward(self) -> bool | None: ...  # None: as the unit's strategy says

    def tag(self, unit: str = "", phase: str | None = None) -> Tag: ...

    def check_unchanged(self) -> None: ...

    def forward_started(self, unit: Unit) -> None: ...

    def forward_ended(self) -> None: ...

    def queue_finish_backward(self) -> None: ...

    def reduce(self, flat: FlatParamGroup) -> None: ...


class Unit:
    """A module plus the flat parameter groups holding the parameters assigned to it."""

    def __init__(
        self,
        module: nn.Module,
        fqn: str,
        flat_params: list[FlatParamGroup],
        modules: list[tuple[str, nn.Module]],
        config: UnitConfig,
    ) -> None:
        # Fixed at construction (``fqn`` and ``config`` change once if a later call adopts it)
        self.module = module
        self.fqn = fqn  # the module's name in the model passed to fully_shard ("" = root)
        self.flat_params = flat_params
        self.config = config
        # Modules inside the unit (not inner units) that register its parameters directly:
        # calling one of them while the unit is sharded is an error (see _hooks.py).
        owned = {id(m) for f in flat_params for o in f.originals for m, _ in o.usages}
        self.owned_modules = [(n, m) for n, m in modules if m is not module]  # all of them
        self.inner_modules = [(n, m) for n, m in self.owned_modules if id(m) in owned]
        for flat in flat_params:
            flat.on_collective = self._record
        self.context: UnitStep  # set when a StepContext adds the unit (see UnitStep)
        self.hold = Hold.NONE  # flatshard.unshard, summon_full_params
        self.held_calls = 0  # modules of a held unit running outside its forward
        # True while flatshard itself calls state_dict() (see _hooks._refuse_partial_state_dict)
        self.own_state_dict_call = False
        # Entry-point methods of this unit now running, and the calls of the module itself
        # they made, passed through ([Note: a unit called inside its own entry point])
        self.entry_depth = 0
        self.passed_through = 0
        # Per step, changed by the hooks; reset by the end of each backward pass:
        self.state = TrainingState.IDLE
        self.expects_backward = False  # a forward with grad ran: every rank must reduce
        self.pending_input_grads = 0  # forwards whose inputs' gradients are still to come
        # Writes of the unit's shards a user made (steps of optimizers holding its
        # parameters, loads, summon write-backs), in all and when its last forward with
        # grad ran, and the last one's name: one between a forward and its backward is
        # refused (``_refuse_write_since_forward``)
        self.writes = 0
        self.forward_at_write = 0
        self.last_write = ""
        # (name, tensor) left to flatshard.load_safetensors by skip_init (runtime/_changes.py)
        self.awaiting_load: list[tuple[str, torch.Tensor]] = []

    def __deepcopy__(self, memo: dict[int, Any]) -> Unit:
        """A sharded model copied (``copy.deepcopy``: an EMA model, torch's
        ``AveragedModel``, a frozen reference) reaches its units: named here, where the
        copy of the unit's process group would fail with pickle's bare error."""
        raise TypeError(
            f"flatshard: a sharded model cannot be deep-copied (unit '{self.label}', rank "
            f"{global_rank()}): each rank holds only its rows of the parameters, and the "
            "copy would need the model's process groups and hooks. Build the copy before "
            "flatshard.fully_shard (and shard it too), or load flatshard.full_state_dict("
            "model, rank0_only=False) into a fresh model; save with "
            "flatshard.save_checkpoint."
        )

    # ------------------------------------------------------------------ identity
    @property
    def label(self) -> str:
        """The unit's name for messages and profiler ranges."""
        return self.fqn or "<root>"

    @property
    def prefetch(self) -> Prefetch:
        """How far ahead of use this unit's neighbours are gathered."""
        return self.config.prefetch

    @property
    def prefetch_forward(self) -> Sequence[Prefetchable] | None:
        """The units ``set_prefetch`` named for this unit's forward; None: predicted."""
        return self.config.prefetch_forward

    @property
    def prefetch_backward(self) -> Sequence[Prefetchable] | None:
        """The units ``set_prefetch`` named for this unit's backward; None: predicted."""
        return self.config.prefetch_backward

    @property
    def is_root(self) -> bool:
        return self.module is self.context.root

    def rename(self, prefix: str) -> None:
        """Name the unit and its parameters as seen from a parent ``prefix`` module."""
        self.fqn = join_name(prefix, self.fqn)
        for flat in self.flat_params:
            for orig in flat.originals:
                orig.fqn = join_name(prefix, orig.fqn)

    def configure(self, **changes: Any) -> None:
        """Change the unit's agreed configuration (only through ``change_units``, after
        every rank agreed: [Note: the agreed configuration]) and what derives from it."""
        self.config = config = replace(self.config, **changes)
        for flat in self.trainable:
            flat.reduction.divide_factor = config.gradient_divide_factor
            flat.reduction.comm_hook = config.comm_hook
            flat.reduction.all_reduce_hook = config.all_reduce_hook
        for flat in self.flat_params:
            flat.transport = replace(
                flat.transport,
                all_gather=config.custom_all_gather,
                reduce_scatter=config.custom_reduce_scatter,
            )

    @property
    def unshard_in_backward(self) -> bool:
        """False: backward does not gather the unit (set_unshard_in_backward; [Note: a unit
        backward does not read])."""
        return self.config.unshard_in_backward

    def inherit(self, policy: MixedPrecision) -> None:
        """Adopt the mixed-precision policy of the call that shards the enclosing model."""
        self.config = replace(self.config, mixed_precision=policy)
        for flat in self.flat_params:
            compute = policy.compute_dtype(flat.shard.dtype, full_precision_module=False)
            flat.set_compute_dtype(compute, policy.gradient_reduce_dtype(compute))
            if flat.shard.is_floating_point():
                flat.set_gather_dtype(flat.placement_value.gathered_in(policy.gather_dtype))

    def full_precision_modules(self) -> list[nn.Module]:
        """Modules inside the unit whose parameters compute in the master dtype."""
        policy = self.config.mixed_precision
        if policy is None or policy.param_dtype is None or not policy.keep_full_precision:
            return []
        keep = tuple(policy.keep_full_precision)
        return [
            m for m in [self.module, *(m for _, m in self.inner_modules)] if isinstance(m, keep)
        ]

    def require_idle(self, caller: str, advice: str) -> None:
        """An error unless the unit is between steps (not inside forward or backward)."""
        if self.state is not TrainingState.IDLE:
            raise RuntimeError(
                f"flatshard.{caller}: unit '{self.label}' is in its "
                f"{self.state.name.lower()} pass (rank {global_rank()}); {advice}"
            )

    # ------------------------------------------------------------------ groups
    @property
    def trainable(self) -> list[FlatParamGroup]:
        return [f for f in self.flat_params if f.requires_grad]

    @property
    def frozen(self) -> list[FlatParamGroup]:
        return [f for f in self.flat_params if not f.requires_grad]

    @property
    def compute_device(self) -> torch.device:
        return self.flat_params[0].compute_device if self.flat_params else torch.device("cpu")

    @property
    def is_sharded(self) -> bool:
        """Whether the originals hold only this rank's rows: some group is cut across
        F > 1 ranks, or its optimizer state across the replicas (HYBRID_SHARD_OPTIM, even
        at F = 1)."""
        return any(flat.factor * flat.splits > 1 for flat in self.flat_params)

    @property
    def is_gathered(self) -> bool:
        """Whether the unit's modules hold full-size parameters right now: views of the
        gathered buffers, or the originals where the shard is the whole buffer."""
        return self.hold is Hold.SUMMONED or all(
            f.views_registered or f.originals_are_full for f in self.flat_params
        )

    # ------------------------------------------------------------------ unshard / reshard
    def unshard(self) -> None:
        """All-gather every group; the modules then hold views of the buffers."""
        self.start_unshard()  # every gather in flight before the first wait
        backward = self.state is TrainingState.BACKWARD
        held = self.hold is Hold.USER
        for flat in self.flat_params:
            flat.placement.unshard(backward, held)

    def start_unshard(self) -> None:
        """Start every group's all-gather (prefetch); the unit's hook waits. Each group's
        placement decides (a row-sparse table is left to its lookups)."""
        held = self.hold is Hold.USER
        for flat in self.flat_params:
            flat.placement.start_unshard(held)

    def finish_unshard(self) -> None:
        """Wait for the all-gathers a prefetch started (views come with ``unshard``)."""
        for flat in self.flat_params:
            flat.finish_unshard()

    @property
    def gather_in_flight(self) -> bool:
        return any(flat.gather_in_flight for flat in self.flat_params)

    @property
    def unshard_allocates(self) -> bool:
        """Whether unsharding now would allocate memory (F = 1 in the master dtype: never)."""
        return any(flat.unshard_allocates for flat in self.flat_params)

    def hide_views(self) -> None:
        """Keep the unsharded buffers for backward, but give the modules back the original
        parameters: outside forward and backward the model holds its sharded leaves, also
        when no backward follows a forward with gradients (see [Note: kept for backward])."""
        for flat in self.flat_params:
            flat.register_views(None)

    @property
    def kept_for_backward(self) -> bool:
        """Unsharded buffers kept after forward for a backward, the modules holding the
        originals (not a held unit's: ``unshard`` keeps those on purpose)."""
        return self.hold is Hold.NONE and any(
            f.is_unsharded and not f.views_registered and not f.aliases_shard
            for f in self.flat_params
        )

    def hold_gathered(self) -> None:
        """``flatshard.unshard``: gather now and keep the buffers until ``release``."""
        self.hold = Hold.USER
        self.unshard()
        if self.state is TrainingState.IDLE:  # (inside its own forward: views in use)
            self.hide_views()

    def release(self) -> bool:
        """``flatshard.reshard``: free the buffers; returns whether memory was freed."""
        self.hold = Hold.NONE
        self.held_calls = 0
        return self.reshard()

    def held_module_called(self) -> None:
        """A module of a held unit runs between steps (``model.head(x)``): it sees the
        gathered buffer, gathered again if the shard was written since."""
        if not self.held_calls:
            self.unshard()
        self.held_calls += 1

    def held_module_returned(self) -> None:
        self.held_calls -= 1
        if not self.held_calls:
            self.hide_views()

    def reshard(self) -> bool:
        """Free the unsharded buffers; the modules then hold the original parameters.

        Returns whether any memory was freed.
        """
        freed = [flat.reshard() for flat in self.flat_params]
        return any(freed)

    # ------------------------------------------------------------------ hooks
    def pre_forward(
        self, module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]
    ) -> tuple[tuple[Any, ...], dict[str, Any]]:
        if self.hold is Hold.SUMMONED:  # inside summon_full_params: nothing to gather
            self._check_inference_only()
            return args, kwargs
        if self.entry_depth and self.state is TrainingState.FORWARD:
            self.passed_through += 1  # see [Note: a unit called inside its own entry point]
            return args, kwargs
        with traced(f"pre_forward {self.label}"):
            if self.state is not TrainingState.BACKWARD:
                if self.awaiting_load:
                    check_loaded(self.label, self.awaiting_load)
                if torch.is_grad_enabled():  # without, no gradient goes anywhere: peft's
                    check_requires_grad(self.flat_params)  # disable_adapter() flips them
                    check_no_parameter_hooks(self.flat_params)
                check_in_shards(self.flat_params)
                if self.is_root:
                    self.context.check_unchanged()
                self.state = TrainingState.FORWARD
                self.context.forward_started(self)
                self.context.order.record_forward(self, self.is_root)
            self.unshard()
            if self.state is TrainingState.FORWARD:
                issue(forward_targets(self, self.context.order), self.context.rate_limiter)
            policy = self.config.mixed_precision
            if policy is not None and policy.param_dtype is not None and policy.cast_forward_inputs:
                args, kwargs = cast_floats((args, kwargs), policy.param_dtype)
            # Only frozen groups wait for the inputs' gradients (_reshard_frozen_if_done).
            if self.frozen and torch.is_grad_enabled() and self.state is TrainingState.FORWARD:
                args, kwargs, watched = watch_input_grads(args, kwargs, self._inputs_grad_done)
                self.pending_input_grads += watched
        return args, kwargs

    def post_forward(self, module: nn.Module, args: Any, output: Any) -> Any:
        if self.hold is Hold.SUMMONED:
            return output
        if self.passed_through:
            self.passed_through -= 1
            return output
        with traced(f"post_forward {self.label}"):
            # A parameter registered during this forward (a hook of the user's replacing
            # one of the unit's): named now, before the unit's own entries go back over it
            self.context.check_unchanged()
            needs_grad = [t for t in tensors_in(output) if t.requires_grad]
            if needs_grad:
                self.expects_backward = True
                register_multi_grad_hook(needs_grad, self.pre_backward, mode="any")
            if self.state is TrainingState.BACKWARD:
                return output  # recomputation inside backward: keep the parameters
            self.state = TrainingState.IDLE
            if needs_grad:
                self.forward_at_write = self.writes
            # Kept until backward: the root and the last unit of the forward order
            # (backward starts with them, they would be gathered again at once, with no
            # compute to hide the wait), and units whose strategy keeps parameters from
            # forward to backward (SHARD_GRAD_OP, ZERO2) or set_reshard_after_forward(False).
            keep = (
                needs_grad
                and self.unshard_in_backward
                and (
                    self.is_root
                    or self.context.order.ended_last_forward(self)
                    or not self.reshards_after_forward
                )
            )
            hidden_graph = not needs_grad and self._may_hide_graph(output)
            self.expects_backward |= hidden_graph  # its gradient may still come
            if keep or self.hold is Hold.USER:  # held: gathered until reshard()
                self.hide_views()
            elif hidden_graph:
                pass  # no pre-backward hook could gather again: stays as it is until backward
            elif any([flat.reshard_after_forward(bool(needs_grad)) for flat in self.flat_params]):
                self.context.rate_limiter.resharded()
            self.context.forward_ended()
        return output

    @property
    def reshards_after_forward(self) -> bool:
        """Whether forward frees the gathered parameters (backward gathers them again):
        ``set_reshard_after_forward``, else the strategy."""
        chosen = self.context.reshard_after_forward
        return self.config.strategy.reshard_after_forward if chosen is None else chosen

    def pre_backward(self, *unused: Any) -> None:
        with traced(f"pre_backward {self.label}"):
            self._refuse_write_since_forward()
            self._refuse_graph_over_freed()
            self.context.queue_finish_backward()
            self.state = TrainingState.BACKWARD
            # Autograd runs hooks with grad disabled; views made so would not require grad,
            # and checkpoint recomputation reading them would save other tensors than
            # forward did.
            with torch.enable_grad():
                if self.unshard_in_backward:
                    self.unshard()
                if self.config.prefetch.backward is BackwardPrefetch.BACKWARD_PRE:
                    self._prefetch_backward()

    def post_backward(self, flat: FlatParamGroup, *unused: Any) -> None:
        with traced(f"post_backward {self.label}"):
            self.context.queue_finish_backward()  # in case no pre-backward hook could fire
            self.context.reduce(flat)
            self._done_in_backward(flat)
            self._reshard_frozen_if_done()
            last = all(f.reduction.done_in_backward for f in self.trainable)
            if last and self.config.prefetch.backward is BackwardPrefetch.BACKWARD_POST:
                with torch.enable_grad():
                    self._prefetch_backward()

    def end_backward(self) -> None:
        """The end of a backward pass: every reduction waited for, every group done with
        (resharded, unless kept: set_reshard_after_backward, unshard)."""
        for flat in self.flat_params:
            flat.reduction.finish()
            self._done_in_backward(flat)
        self.state = TrainingState.IDLE
        self.expects_backward = False
        self.pending_input_grads = 0
        for flat in self.flat_params:
            flat.reduction.pass_ended()

    def optimizer_steps(self, held: Collection[int]) -> None:
        """An optimizer holding the parameters ``held`` (ids) is about to step: the
        unit's shards are written if it holds any of them (then, and only then, a backward
        of a forward before it is refused: ``_refuse_write_since_forward``)."""
        if any(id(o.param) in held for f in self.flat_params for o in f.originals):
            self.user_wrote("optimizer.step()")
        for flat in self.flat_params:
            flat.shards_written()

    def user_wrote(self, what: str) -> None:
        """``what`` (a call of the user's) wrote the unit's shards: a backward of a forward
        before it would mix the old activations with the new weights."""
        self.writes += 1
        self.last_write = what

    # ------------------------------------------------------------------ hook helpers
    def _refuse_write_since_forward(self) -> None:
        """An optimizer step, a load or a summon's write-back between a forward and its
        backward: refused here, on the rank that wrote, before this backward issues
        anything.

        Unsharded, torch refuses it too (the write changed weights the graph saved:
        "modified by an inplace operation"). Sharded, the backward would gather the new
        weights beside the old activations (a gradient of neither), and a rank that wrote
        alone would gather again where its peers reuse what forward kept: collectives of
        different sizes, an abort.
        """
        writes = self.writes - self.forward_at_write
        if writes == 0:
            return
        last = self.last_write
        fix = (
            "Call optimizer.step() after loss.backward() (forward, backward, step)"
            if last == "optimizer.step()"
            else f"Call {last} between steps (after optimizer.step(), before the next forward)"
        )
        raise RuntimeError(
            f"flatshard: backward of unit '{self.label}' on rank {global_rank()} after "
            f"{last} wrote its shards since its forward ({writes} write(s) between them): "
            f"the gradient would mix the old activations with the new weights. {fix}, on "
            "every rank."
        )

    def _refuse_graph_over_freed(self) -> None:
        """A backward that builds a graph (``create_graph=True``: a gradient penalty, a
        Hessian-vector product) saves the unit's gathered parameters in that graph, and the
        unit frees them when its backward ends: the second backward would read freed
        storage (torch's "out of bounds for storage of size 0"). Refused here, on every
        rank alike (the same backward runs everywhere), before this backward issues
        anything. Kept gathered after backward (``set_reshard_after_backward(model,
        False)``, agreed on every rank), or NO_SHARD, the graph stays valid."""
        if not torch.is_grad_enabled():  # autograd runs hooks with grad off, but for this
            return
        kept = not self.context.reshard_after_backward or self.hold is not Hold.NONE
        if kept or all(flat.aliases_shard for flat in self.flat_params):
            return
        raise RuntimeError(
            f"flatshard: a backward with create_graph=True (e.g. torch.autograd.grad(..., "
            f"create_graph=True) for a gradient penalty) reached unit '{self.label}' on "
            f"rank {global_rank()}: the graph it builds reads the unit's gathered "
            "parameters, which are freed when the unit's backward ends. Call "
            "flatshard.set_reshard_after_backward(model, False) before such steps (the "
            "units stay gathered until the next forward, at the cost of their memory), or "
            "shard with strategy NO_SHARD."
        )

    def _check_inference_only(self) -> None:
        """Inside summon_full_params a forward may not record a graph: its backward would
        write full-size gradients no reduction would see."""
        refusals = [
            f"'{o.fqn}' ({why})"
            for f in self.flat_params
            for o in f.originals
            if o.tp is not None and (why := o.tp.summon_refusal()) is not None
        ]
        if refusals:
            raise RuntimeError(
                f"flatshard: unit '{self.label}' ran forward inside summon_full_params "
                f"(rank {global_rank()}), and it holds {refusals[0]}: a plain local tensor "
                "there, not what its layers expect. Run the forward outside "
                "summon_full_params."
            )
        if torch.is_grad_enabled() and any(f.requires_grad for f in self.flat_params):
            raise RuntimeError(
                f"flatshard: unit '{self.label}' ran forward with gradients inside "
                f"summon_full_params (rank {global_rank()}); its backward would not be "
                "reduced. Run it under torch.no_grad() (e.g. generate: every unit stays "
                "gathered, no all-gather per token), or train outside summon_full_params."
            )

    def _record(self, kind: str, numel: int) -> Tag:
        """A collective for this unit: in the step's ledger; its tag (see comm/_watchdog.py)."""
        self.context.ledger.record(kind, self.label, numel)
        return self.context.tag(self.label)

    def _prefetch_backward(self) -> None:
        targets = backward_targets(self, self.context.order)
        issue([u for u in targets if u.unshard_in_backward], self.context.rate_limiter)

    def _inputs_grad_done(self) -> None:
        self.pending_input_grads -= 1
        self._reshard_frozen_if_done()

    def _reshard_frozen_if_done(self) -> None:
        """Free the frozen groups once backward can no longer read them.

        Any backward op that reads a frozen parameter computes a gradient for something:
        this unit's inputs or its trainable parameters. Once both are done, none is left.
        """
        if not self.frozen:
            return
        trainable_done = all(f.reduction.done_in_backward for f in self.trainable)
        if trainable_done and self.pending_input_grads == 0:
            for flat in self.frozen:
                self._done_in_backward(flat)

    def _done_in_backward(self, flat: FlatParamGroup) -> None:
        """Backward no longer reads ``flat``: free it, or (set_reshard_after_backward(False),
        a held unit) keep the buffer for the next forward, the modules holding the
        originals."""
        if self.context.reshard_after_backward and self.hold is Hold.NONE:
            flat.reshard()
        else:
            flat.finish_unshard()
            flat.register_views(None)

    def _may_hide_graph(self, output: Any) -> bool:
        """Whether the output may carry a graph through tensors flatshard cannot find.

        Without them there is no pre-backward hook to unshard again, so the unit must stay
        unsharded until its gradient is reduced (or the backward pass ends).
        """
        if not (torch.is_grad_enabled() and self.trainable) or tensors_in(output):
            return False
        warnings.warn(
            f"flatshard: unit '{self.label}' returned {type(output).__name__} with no tensor "
            "flatshard can find, so it stays unsharded until its backward. Return tensors in "
            "tuples, lists or dicts, or register the type with torch.utils._pytree.",
            stacklevel=3,
        )
        return True


def owner_of(module: nn.Module) -> tuple[Unit, str] | None:
    """The unit that owns ``module`` without being rooted at it, and the module's name
    (as fully_shard saw it)."""
    found = module.__dict__.get(OWNER_ATTR)
    return found if isinstance(found, tuple) else None


def unit_of(module: nn.Module) -> Unit | None:
    """The unit rooted at ``module``, if any."""
    found = module.__dict__.get(UNIT_ATTR)
    return found if isinstance(found, Unit) else None


def units_of(model: nn.Module, caller: str) -> list[Unit]:
    """Every unit inside ``model``; an error if ``fully_shard`` never touched it."""
    units = [u for m in model.modules() if (u := unit_of(m)) is not None]
    if not units:
        raise ValueError(
            f"flatshard.{caller}: {type(model).__name__} holds no flatshard unit; call "
            "flatshard.fully_shard(model, ...) first."
        )
    return units


def unit_modules(model: nn.Module) -> list[tuple[str, nn.Module]]:
    """The units inside ``model``: (name relative to ``model``, module) in module order,
    ``model`` itself ("") if it is one; empty where ``fully_shard`` never ran. What a
    trainer integration asks to tell a sharded model (FSDP2: ``isinstance(m, FSDPModule)``)."""
    return [(name, m) for name, m in model.named_modules() if unit_of(m) is not None]


def unit_or_error(module: nn.Module, caller: str) -> Unit:
    """The unit rooted at ``module``; an error naming ``caller`` if there is none."""
    unit = unit_of(module)
    if unit is None:
        raise ValueError(
            f"flatshard.{caller}: {type(module).__name__} is not a flatshard "
            "unit; pass the module fully_shard made a unit (the model itself, or a "
            "submodule chosen by auto_wrap_policy)."
        )
    return unit


# ---------------------------------------------------------------- a forward's inputs
def tensors_in(tree: Any) -> list[torch.Tensor]:
    """Every tensor in a (nested) container, as ``torch.utils._pytree`` finds them."""
    return [x for x in pytree.tree_leaves(tree) if isinstance(x, torch.Tensor)]


def cast_floats(tree: Any, dtype: torch.dtype) -> Any:
    """``tree`` with every floating-point tensor cast to ``dtype`` (autograd-visible)."""
    return pytree.tree_map(
        lambda x: x.to(dtype) if isinstance(x, torch.Tensor) and x.is_floating_point() else x,
        tree,
    )


class _InputGradWatch(torch.autograd.Function):
    """Identity on a unit's inputs whose backward reports that their gradients are done."""

    @staticmethod
    def forward(ctx: Any, done: Callable[[], None], *inputs: torch.Tensor) -> Any:
        ctx.done = done
        return inputs

    @staticmethod
    def backward(ctx: Any, *grads: torch.Tensor | None) -> Any:
        ctx.done()
        return (None, *grads)


def watch_input_grads(
    args: tuple[Any, ...], kwargs: dict[str, Any], done: Callable[[], None]
) -> tuple[tuple[Any, ...], dict[str, Any], bool]:
    """Route the inputs that need grad through a node calling ``done()`` in backward.

    Returns the new inputs and whether any input is watched (``done`` will be called).
    """
    leaves, spec = pytree.tree_flatten((args, kwargs))
    positions = [i for i, x in enumerate(leaves) if isinstance(x, torch.Tensor) and x.requires_grad]
    if not positions:
        return args, kwargs, False
    apply = cast(Callable[..., tuple[torch.Tensor, ...]], _InputGradWatch.apply)  # untyped stub
    watched = apply(done, *(leaves[i] for i in positions))
    for i, tensor in zip(positions, watched, strict=True):
        leaves[i] = tensor
    new_args, new_kwargs = pytree.tree_unflatten(leaves, spec)
    return new_args, new_kwargs, True
