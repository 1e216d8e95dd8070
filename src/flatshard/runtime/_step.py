"""StepContext: what the units of one root share during a training step.

One per ``fully_shard`` call on a root (bottom-up calls merge into the outermost): the
units, the execution order prefetch predicts from, the one gradient reduction in flight,
the end-of-backward callback and the ``no_sync`` flag.
"""

from __future__ import annotations

import atexit
import functools
import inspect
import itertools
import os
import weakref
from collections.abc import Callable, Collection, Iterator
from contextlib import contextmanager
from contextvars import ContextVar
from dataclasses import dataclass, field, replace
from typing import Any, TypeVar, cast

import torch
import torch.distributed as dist
from torch import nn
from torch.autograd import Variable

from flatshard.comm._agreement import StepLedger, check_same_on_all_ranks, global_rank
from flatshard.comm._collectives import on_device
from flatshard.comm._mesh import ShardGroups
from flatshard.comm._watchdog import Tag, tagged, watchdog
from flatshard.flat._flat_param import FlatParamGroup
from flatshard.flat._mixed_precision import MixedPrecision
from flatshard.flat._partition import OriginalParam
from flatshard.flat._reduction import GradientReduction
from flatshard.measure._accounting import traced
from flatshard.runtime._changes import ChangeWatch, check_parameters
from flatshard.runtime._configuration import Switches, describe, model_lines
from flatshard.runtime._prefetch import ExecutionOrder, RateLimiter
from flatshard.runtime._unit import Hold, Unit, unit_of, units_of

CONTEXT_ATTR = "_flatshard_context"  # attribute of a module fully_shard was called on
_CREATED = itertools.count()


@dataclass(frozen=True)
class PipelineSeat:
    """A model that is stage ``stage`` of ``stages`` of a pipeline over ``group``."""

    group: dist.ProcessGroup
    stage: int
    stages: int


@dataclass
class ScheduledStep:
    """A pipeline schedule runs this step's forward and backward passes, and turns the
    sync switches itself ([Note: a schedule runs the step] in ``_pipeline.py``)."""

    owner: str  # who runs it, in errors: "flatshard PipelineStage 1 of 4"
    user: Switches  # the switches the user set, back at the end of the step
    actions: list[str] = field(default_factory=list)  # "F0", "B0", "I0", "W0": ranks compare


class StepContext:
    """The per-root state of a step, shared by the units of one ``fully_shard`` call."""

    def __init__(
        self,
        root: nn.Module,
        process_group: dist.ProcessGroup,
        rate_limiter: RateLimiter,
    ) -> None:
        self.root = root
        # Made in program order, so the same on every rank: the order torch's clipping
        # visits the models in (``sharded_contexts``), whatever the weak set's order
        self.created = next(_CREATED)
        # All the ranks that train the model together (None after interpreter exit began).
        self.process_group: dist.ProcessGroup | None = process_group
        self.rate_limiter = rate_limiter  # Prefetch.limit_all_gathers (see _prefetch.py)
        self.units: list[Unit] = []  # inner units first; forward order is not assumed
        # Parameters the placement rule left alone (Unmanaged()): in no flat group, by design
        self.left_alone: list[nn.Parameter] = []
        self.order = ExecutionOrder()
        self.ledger = StepLedger()  # collectives issued since the ranks last compared them
        self.changes = ChangeWatch()  # parameters registered since the last check
        # The step's switches, agreed on every rank ([Note: the agreed configuration])
        self.switches = Switches()
        # A pipeline schedule running this step (``_pipeline.py``), or None
        self.schedule: ScheduledStep | None = None
        # Where the model sits in a pipeline, if it is a stage (``_pipeline.join_pipeline``)
        self.pipeline: PipelineSeat | None = None
        # Steps of optimizers holding the model's parameters: they mark the shards
        # written; before the first, each synchronized backward does (a hand-written
        # update through p.data may follow). See [Note: stale gathers].
        self.optimizer_steps_taken = 0
        self.forward_depth = 0  # units whose forward runs now (nested calls)
        # Whether the last outermost forward could train ([Note: a forward only some ranks
        # run]); True before the first, so that a first evaluation agrees too
        self.last_forward_trains = True
        self.step = 0  # backward passes completed (the ledger's and the reports' step)
        self.phase = "forward"  # what the units do now, in the reports' words
        # Per backward pass:
        self.callback_queued = False  # the end-of-backward callback is queued
        # The one gradient reduction left in flight: each waits for the one before, so at
        # most one unsharded gradient waits on communication (see ``reduce``).
        self.in_flight: GradientReduction | None = None
        atexit.register(_release_at_exit, weakref.ref(self))

    @property
    def sync_gradients(self) -> bool:
        """False inside no_sync: keep unsharded gradients."""
        return self.switches.requires_gradient_sync

    @property
    def reshard_after_backward(self) -> bool:
        return self.switches.reshard_after_backward

    @property
    def reshard_after_forward(self) -> bool | None:
        value = self.switches.reshard_after_forward
        return None if value is None else bool(value)

    @property
    def all_reduce_replicas(self) -> bool:
        return self.switches.requires_all_reduce

    def configuration(self) -> list[str]:
        """The model's agreed configuration as lines ([Note: the agreed configuration])."""
        return model_lines(self.switches, ((u.label, u.config) for u in self.units))

    def release_process_groups(self) -> None:
        """Drop every reference this root holds to a process group (interpreter exit).

        A gloo process group joins its worker threads only when its last Python reference
        dies. Held here, that would be during interpreter finalization, after
        ``destroy_process_group``; a worker still finishing its last collective then needs
        the GIL and the process dies with SIGABRT ("terminate called without an active
        exception"). Dropped at exit, while the interpreter is whole, the group is torn
        down then.
        """
        self.process_group = None
        self.in_flight = None  # (its work holds the group too)
        for unit in self.units:
            for flat in unit.flat_params:
                flat.groups = ShardGroups(shard=None, replicate=None)
                flat.transport = replace(flat.transport, reduce_group=None)
                flat.post_forward_group = None

    def tag(self, unit: str = "", phase: str | None = None) -> Tag:
        """What a collective issued now is for (see ``comm/_watchdog.py``)."""
        return Tag(phase or self.phase, unit, self.step)

    def add(self, unit: Unit) -> None:
        unit.context = self
        self.units.append(unit)

    def adopt(
        self, other: StepContext, prefix: str, mixed_precision: MixedPrecision | None
    ) -> None:
        """Take over the units of an earlier call on the submodule named ``prefix``.

        Units sharded without a mixed-precision policy inherit ``mixed_precision`` (all but
        ``keep_full_precision``, which needs its own groups).
        """
        for unit in other.units:
            unit.rename(prefix)
            if unit.config.mixed_precision is None and mixed_precision is not None:
                unit.inherit(replace(mixed_precision, keep_full_precision=frozenset()))
            self.add(unit)
        other.units = []
        self.left_alone += other.left_alone

    def originals(self) -> Iterator[OriginalParam]:
        """Every original parameter of the model's units."""
        for unit in self.units:
            for flat in unit.flat_params:
                yield from flat.originals

    @property
    def stepped_by_optimizer(self) -> bool:
        return self.optimizer_steps_taken > 0

    def optimizer_steps(self, held: Collection[int], settings: str) -> None:
        """An optimizer holding the model's parameters (``held``: their ids) is about to
        step (every rank alike), with its hyper-parameters ``settings``: nothing gathered
        before it may be used after it, and the ranks compare their steps with their
        collectives ([Note: the model's optimizer step] in _optimizer_steps.py)."""
        self.optimizer_steps_taken += 1
        self.ledger.record_step(self.root_label, settings)
        for unit in self.units:
            unit.optimizer_steps(held)

    def check_unchanged(self) -> None:
        """An error if parameters were added, removed or replaced since ``fully_shard``."""
        if self.changes.to_check:
            flats = [f for u in self.units for f in u.flat_params]
            check_parameters(self.root, flats, {id(p) for p in self.left_alone})
            self.changes.to_check = False

    def reduce(self, flat: FlatParamGroup) -> None:
        """A group's gradient is complete in backward: start reducing it (or keep it).

        The previous reduction had this unit's whole backward to finish; waiting for it
        now frees its unsharded gradient before the next one is held.
        """
        if not self.sync_gradients:
            flat.reduction.keep_unreduced()
            return
        self.in_flight = flat.placement.start_reduction(self.all_reduce_replicas, self.in_flight)

    def forward_started(self, unit: Unit) -> None:
        if unit.is_root or not self.forward_depth:
            # The last step's digests, before this one issues anything: a mismatch there
            # would mispair this step's collectives too ([Note: the digest without a host
            # sync]; its event completed while the host ran optimizer.step()).
            self.ledger.settle()
            self._agree_mode_change()
        if unit.is_root:
            # (A schedule runs several forwards before their backward passes, on purpose.)
            if self.schedule is None and any(u.expects_backward for u in self.units):
                self._agree_backward_skipped()
                if not self.stepped_by_optimizer:
                    # What that forward kept (the root, the last unit, a part cut for N
                    # ranks) was gathered after the last backward's "written" mark, and a
                    # hand-written update may have followed it: nothing may be reused.
                    self.gradients_delivered()
            self.forward_depth = 0  # a new iteration: forget a forward that raised
            self._free_kept(but=unit)
        self.forward_depth += 1
        self.phase = "forward"

    def _agree_mode_change(self) -> None:
        """[Note: a forward only some ranks run]
        An evaluation or a generation on some ranks only (``if rank == 0: with
        torch.no_grad(): model(sample)``) is a common slip: its all-gathers pair with the
        others' training collectives, and the end-of-forward check's all-gather with a
        collective of another size, which makes gloo abort the process. So where a model
        goes from forwards that can train (grad on, a trainable parameter) to ones that
        cannot, or back, the ranks first agree on it through the store (one round trip,
        ``Watchdog.entry``): a rank that evaluates alone waits there while the others wait
        in a collective, and the diagnosis names both on every rank within seconds. Only
        the change agrees, so a model that only ever evaluates (a teacher, a reference
        model) or only trains pays nothing per step; the first forward counts as a change
        from training, so an evaluation before training on one rank is named too. A
        schedule runs its own forwards on every stage alike, unagreed."""
        trains = torch.is_grad_enabled() and any(u.trainable for u in self.units)
        changed, self.last_forward_trains = trains != self.last_forward_trains, trains
        dog = watchdog()
        if not changed or self.schedule is not None or dog is None or self.process_group is None:
            return
        what = "a training forward (grad on)" if trains else "an evaluation forward (no grad)"
        dog.entry(self.process_group, self.tag(self.root_label, what))

    def _agree_backward_skipped(self) -> None:
        """[Note: a backward one rank skipped]
        The last forward recorded a graph and no backward followed it on this rank: an
        evaluation forward with grad on, forwards whose losses are summed before one
        backward, or a backward this rank skipped alone (a NaN guard that fired here only).
        In the last case the other ranks are in that backward's collectives, and this
        forward's all-gathers would pair with them: same sizes mix wrong data, others make
        gloo abort the process. So the ranks first agree, out of band (the c10d store,
        ``Watchdog.entry``), that all of them start a forward here. Where all did, that is
        one store round trip; where one skipped, it waits there while the others wait in
        their backward, and the timeout's diagnosis names what each rank was doing, on every
        rank, instead of an abort."""
        dog = watchdog()
        if dog is not None and self.process_group is not None:
            dog.entry(self.process_group, self.tag(self.root_label, "forward after no backward"))

    @property
    def root_label(self) -> str:
        root = unit_of(self.root)
        return root.label if root is not None else "<root>"

    def _free_kept(self, but: Unit) -> None:
        """A new forward: free what an earlier forward kept for a backward that has not
        come (it may never: see [Note: kept for backward]), except ``but``, used at once.

        The same on every rank, at the same point of the program. A backward of the earlier
        forward that does come later gathers these units again.
        """
        if not self.reshard_after_backward:
            return  # kept on purpose, for this forward
        for unit in self.units:
            if unit is not but and unit.kept_for_backward and unit.reshard():
                self.rate_limiter.resharded()

    def forward_ended(self) -> None:
        """After the outermost forward: free what no backward will use.

        Without a backward to come (``no_grad``, eval, one unit called alone), a prefetch
        that guessed wrong would otherwise stay gathered until some later use, and could be
        read after the optimizer wrote its shards (see [Note: stale gathers]).
        """
        self.forward_depth = max(0, self.forward_depth - 1)
        if self.forward_depth or any(u.expects_backward for u in self.units):
            return
        for unit in self.units:
            if unit.hold is Hold.NONE and unit.reshard():
                self.rate_limiter.resharded()
        self.wait_host_copies()
        self.check_ledger("forward without backward", "end-of-forward check")

    def queue_finish_backward(self) -> None:
        """Queue ``finish_backward`` to run once autograd is done with this pass."""
        if not self.callback_queued:
            self.callback_queued = True
            self.phase = "backward"
            Variable._execution_engine.queue_callback(self.finish_backward)

    def finish_backward(self) -> None:
        """The end of a backward pass: reduce what did not reach the hook, wait, reshard.

        A unit that ran forward with grad on this rank may get no gradient here (its output
        did not reach this rank's loss); it still reduces (zeros), as every rank must.
        """
        with traced("finish_backward"):
            for unit in self.units:
                if not unit.expects_backward:
                    continue
                for flat in unit.trainable:
                    if self.sync_gradients:
                        self._finish_reduction(flat)
                    else:  # kept, also where nothing reached the hook (a table's rows)
                        flat.reduction.keep_unreduced()
            for unit in self.units:
                unit.end_backward()
            if self.sync_gradients and not self.stepped_by_optimizer:
                self.gradients_delivered()
            self.wait_host_copies()
            self.in_flight = None
            self.callback_queued = False
            # Before optimizer.step() can apply what a mismatch produced.
            self.check_ledger("backward pass", "end-of-backward check")
            self.step += 1
            self.phase = "between steps"
            if (dog := watchdog()) is not None:
                dog.step_ended()  # how long steps take: when a wait is worth a warning

    def check_ledger(self, what: str, phase: str) -> None:
        """Compare the collectives issued since the last check across the ranks
        (``comm/_agreement.py``): ``what`` was issuing them."""
        self.ledger.check(self.process_group, self._device, what, self.tag(phase=phase))

    def gradients_delivered(self) -> None:
        """Gradients reached ``.grad`` and no torch optimizer steps this model: an update
        written by hand (``p.data.add_(...)``) may follow, which nothing can see, so the
        trainable shards count as written ([Note: stale gathers])."""
        for unit in self.units:
            for flat in unit.trainable:
                flat.shards_written()

    def _finish_reduction(self, flat: FlatParamGroup) -> None:
        """What the group's placement still reduces at the end of backward (a gradient
        that did not reach its hook, as zeros; a row-sparse table's lookup rows)."""
        flat.placement.finish_reduction(self.all_reduce_replicas)

    def wait_host_copies(self) -> None:
        """[Note: offload without a stall per unit]
        With CPUOffload on an accelerator, shards go to the device and reduced gradients
        come back with asynchronous copies on the compute stream: the host issues them and
        runs on (waiting for each gradient's copy would stall it at every unit). Before the host
        touches that memory itself (the optimizer reads the gradients and writes the shards
        a copy to the device may still be reading; so may the user's code), it waits once,
        here, at the end of a backward pass or of a forward without backward: one host sync
        per step, for offload only."""
        device = self._device
        if device.type in ("cpu", "meta"):
            return
        if any(flat.offloaded for unit in self.units for flat in unit.flat_params):
            copied = torch.Event(device=device)
            copied.record()  # after every copy issued on the compute stream so far
            copied.synchronize()

    @property
    def _device(self) -> torch.device:
        """Where a collective over the whole model group runs (NCCL: the accelerator)."""
        return self.units[0].compute_device if self.units else torch.device("cpu")


def context_of(module: nn.Module) -> StepContext | None:
    """The step context of the ``fully_shard`` call made on ``module``, if any."""
    found = module.__dict__.get(CONTEXT_ATTR)
    return found if isinstance(found, StepContext) else None


def contexts_under(model: nn.Module, caller: str) -> list[StepContext]:
    """The distinct step contexts of every unit inside ``model`` (an error if none)."""
    return distinct_contexts(units_of(model, caller))


def distinct_contexts(units: list[Unit]) -> list[StepContext]:
    """The step contexts of ``units``, each once (a unit sees its own as a ``UnitStep``)."""
    found: dict[int, StepContext] = {}
    for unit in units:
        context = unit.context
        if not isinstance(context, StepContext):
            raise TypeError(f"flatshard: unit '{unit.label}' is in no StepContext")
        found[id(context)] = context
    return list(found.values())


def _release_at_exit(ref: weakref.ref[StepContext]) -> None:
    """At exit, once ``destroy_process_group`` ran: while the groups live, an exit handler
    of the user's (they run in reverse order of registration) may still use the model."""
    context = ref()
    if context is None:
        return
    context.ledger.settle_at_exit()  # a mismatch in the very last step ([Note: the digest
    if not dist.is_initialized():  # without a host sync])
        context.release_process_groups()


# The groups the call being made agreed on (none outside a call): a call reached inside
# it is agreed already, and a collective of one of these groups needs no entry of its own.
_IN_CALL: ContextVar[frozenset[int]] = ContextVar("flatshard_in_call", default=frozenset())
# Calls made inside a training step (between backward and optimizer.step(), or between
# its micro-batches): they leave the last backward's digests pending, for the next forward
# ([Note: the digest without a host sync]); comparing them there would wait for the device.
# Every other call, between steps, compares them first.
_IN_THE_STEP = frozenset(
    {
        "clip_grad_norm_",
        "torch.nn.utils.clip_grad_norm_",
        "set_requires_gradient_sync",
        "set_reshard_after_backward",
        "set_reshard_after_forward",
        "set_requires_all_reduce",
        "no_sync",
        "train_step",
        "unshard",
        "reshard",
    }
)
F = TypeVar("F", bound=Callable[..., Any])


@contextmanager
def collective_call(model: nn.Module, caller: str, over_stages: bool = False) -> Iterator[None]:
    """A call every rank of the model's group must make (``caller``: summon, state dicts,
    ``clip_grad_norm_``, checkpoints), which a program may well make on some ranks only.

    The ranks first agree on it through the c10d store (``Watchdog.entry``), so a rank
    that calls it alone waits there, and is reported, instead of sending its collectives to
    a backend that would pair them with another rank's (gloo aborts on a size mismatch).
    Its collectives are tagged with ``caller`` and the model's step.

    [Note: calls over every stage]
    A pipeline stage is a model of its own, its group the ranks of its stage. Most calls
    stay inside a stage (a stage's full state dict, a summon), but some act for the whole
    pipeline: a checkpoint or an export is one directory every stage writes its part of,
    and a gradient norm adds up over the stages. ``over_stages``: such a call; the ranks
    of the pipeline group agree on it too, its values with it (the ``max_norm`` a stage
    clips by, a checkpoint's path), so that a stage that calls it alone or with other
    values is named on every rank instead of clipping by another limit or committing a
    checkpoint without a stage.
    """
    units = [u for m in model.modules() if (u := unit_of(m)) is not None]
    contexts = distinct_contexts(units)
    if _IN_CALL.get() or not contexts:  # agreed on already; or not sharded (the call says)
        yield
        return
    tag = contexts[0].tag(phase=caller)
    dog = watchdog()
    groups = {id(c.process_group): c.process_group for c in contexts}
    if over_stages:  # (after the stage's own: the same order on every rank)
        for context in contexts:
            if context.pipeline is not None:
                groups.setdefault(id(context.pipeline.group), context.pipeline.group)
    for group in groups.values():
        if dog is not None and group is not None:
            dog.entry(group, tag)
    token = _IN_CALL.set(frozenset(groups))
    try:
        with tagged(tag), on_device(units[0].compute_device):  # see on_device
            if caller.split("(")[0] not in _IN_THE_STEP:  # pending digests: compare first
                for context in contexts:
                    context.ledger.settle()
            yield
    finally:
        _IN_CALL.reset(token)


def agreed_in_this_call(group: dist.ProcessGroup) -> bool:
    """Whether the ``collective_call`` being made agreed on ``group`` already (a norm over
    the pipeline inside ``clip_grad_norm_``, agreed over every stage at its entry)."""
    return id(group) in _IN_CALL.get()


def agree(
    model: nn.Module,
    caller: str,
    values: list[str] | None = None,
    fix: str = "",
    over_stages: bool = False,
) -> None:
    """Every rank of the model's group made the call ``caller`` (short values in the name):
    agreed through the store before what follows changes which collectives are issued.
    Then, where given, the ``values`` (one line each, e.g. ``name=value``) are compared: a
    ValueError on every rank names the lines that differ, and ``fix``. ``over_stages``:
    the call is the whole pipeline's ([Note: calls over every stage])."""
    with collective_call(model, caller, over_stages):
        if values is None:
            return
        units = [u for m in model.modules() if (u := unit_of(m)) is not None]
        contexts = distinct_contexts(units)
        groups = {id(c.process_group): c.process_group for c in contexts}  # each once
        for group in groups.values():
            if group is not None and group.size() > 1:
                what = f"called {caller} with other values"
                # (on the units' device: where the group communicates, NCCL's the GPU)
                check_same_on_all_ranks(values, group, units[0].compute_device, what, fix, caller)


def every_rank_calls(
    caller: str, model_arg: int = 0, agreed: tuple[str, ...] = (), over_stages: bool = False
) -> Callable[[F], F]:
    """Decorate ``fn`` as a ``collective_call`` named ``caller`` on its argument
    ``model_arg`` (the model). The arguments named in ``agreed`` join the call's name, so
    the ranks agree on them too: a checkpoint's path, whether an optimizer is saved with
    it, a load's ``from_rank0``, an export's dtype (a rank that differs would write or
    read something else, silently, or wait in a collective its peers never issue).
    ``over_stages``: the call is the whole pipeline's ([Note: calls over every stage])."""

    def decorate(fn: F) -> F:
        signature = inspect.signature(fn)

        @functools.wraps(fn)
        def wrapper(*args: Any, **kwargs: Any) -> Any:
            model = args[model_arg] if len(args) > model_arg else kwargs["model"]
            if over_stages:  # a directory of the whole model: written by its ranks together
                _refuse_holder_of_sharded_models(model, caller)
            name = caller
            if agreed:
                bound = signature.bind(*args, **kwargs)
                bound.apply_defaults()
                values = ", ".join(f"{k}={_argument(bound.arguments[k])}" for k in agreed)
                name = f"{caller}({values})"
            with collective_call(model, name, over_stages):
                return fn(*args, **kwargs)

        return cast(F, wrapper)

    return decorate


def _refuse_holder_of_sharded_models(model: nn.Module, caller: str) -> None:
    """A ValueError for a module that holds sharded models without being one (an
    ``nn.ModuleList`` of a rank's pipeline stages, a wrapper around the model), given to
    a call that writes or reads a directory with the model's ranks together: it takes
    its group, and the rank that writes, from the model ``fully_shard`` made. Given a
    holder it found none, and every rank wrote as if alone (a checkpoint of rank 0's
    rows only; an export of half a pipeline, renames racing)."""
    if context_of(model) is not None:
        return
    inside = {id(m): name for name, m in model.named_modules()}
    units = [u for m in model.modules() if (u := unit_of(m)) is not None]
    roots = [
        inside[id(c.root)] or "<itself>" for c in distinct_contexts(units) if id(c.root) in inside
    ]
    if roots:
        raise ValueError(
            f"flatshard.{caller} (rank {global_rank()}): {type(model).__name__} holds "
            f"{len(roots)} sharded model(s) ({', '.join(roots[:4])}) and is not one; pass "
            "the module fully_shard returned, one at a time (a pipeline's stage module on "
            "every rank writes one checkpoint or export of every stage together)."
        )


def _argument(value: object) -> str:
    """An agreed argument as text: a path as the string it names, an optimizer by class
    (its settings are compared at its steps), anything else as the configuration is."""
    if isinstance(value, os.PathLike | bytes):
        return repr(os.fsdecode(value))
    agreed_as = getattr(value, "agreed_as", None)
    if callable(agreed_as):  # an object that says what about it ranks must share
        return str(agreed_as())
    if isinstance(value, torch.optim.Optimizer):
        return type(value).__name__
    if isinstance(value, list | tuple) and all(isinstance(v, torch.optim.Optimizer) for v in value):
        return "[" + ", ".join(type(v).__name__ for v in value) + "]"
    return describe(value)


# The models sharded in this process, held weakly, for what torch's own utilities do to them:
# its gradient norm (``_torch_utilities.py``) and its optimizers (``_optimizer_steps.py``) look
# their tensors up here. A model that dies leaves.
_SHARDED: weakref.WeakSet[StepContext] = weakref.WeakSet()


def watch(context: StepContext) -> None:
    _SHARDED.add(context)


def sharded_contexts() -> list[StepContext]:
    """The step contexts of the models sharded in this process that are still alive, in
    the order they were made (the same on every rank; a weak set's order is not)."""
    return sorted((c for c in list(_SHARDED) if c.units), key=lambda c: c.created)


def watched_contexts() -> list[StepContext]:
    """Every sharded model's step context still alive, also one ``fully_shard`` is
    still building."""
    return list(_SHARDED)
