"""``flatshard.join``: uneven inputs, DDP ``Join``'s semantics for a sharded model.

[Note: uneven inputs]
Ranks whose data runs out stop issuing collectives the others wait for. DDP's ``Join``
lets them shadow the others' all-reduces until all are done. A sharded rank must do more:
the others need its shards in every all-gather, and its shards must take every update,
since no other rank holds them. So a rank that leaves the loop inside ``join`` replays
its last iteration, as recorded on this rank, for as long as any rank still has data:
- each iteration every rank first all-gathers whether it still has data and its
  optimizers' float hyper-parameters (a learning rate a scheduler set); a rank that has
  run out takes those of the first rank that has not, so its shards step alike;
- the replay calls the model on the last inputs it saw, as recorded (grad mode,
  ``no_sync`` spans, ``flatshard.clip_grad_norm_`` with its arguments), runs each
  recorded backward with zero output gradients (so this rank adds nothing to the sums,
  as DDP's joined ranks do: the divide factor stays the world size, like
  ``Join(divide_by_initial_world_size=True)``), and steps its optimizers;
- when every rank has run out, every rank leaves ``join``.
The replay issues the collectives of this rank's own last iteration; where the others'
iterations differ (a loop whose shape depends on the data), the ranks' records differ and
the watchdog names it (``CollectiveMismatchError``), never a silent mix. What it cannot
replay is refused by name when it is reached: ``train_step`` and torch's own
``clip_grad_norm_`` (use ``flatshard.clip_grad_norm_``), and a grad scaler.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from contextlib import AbstractContextManager, ExitStack, contextmanager
from contextvars import ContextVar
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn
from torch.utils._pytree import tree_leaves

from flatshard.comm._agreement import global_rank
from flatshard.comm._collectives import all_gather_into
from flatshard.comm._watchdog import tagged
from flatshard.runtime._step import StepContext, agree, contexts_under


@dataclass
class _Forward:
    args: tuple[Any, ...]
    kwargs: dict[str, Any]
    grad: bool  # grad mode at the call
    steps_before: int  # backward passes the root had completed before it
    backward: bool = False  # a backward pass of the root followed it (known later)


@dataclass(frozen=True)
class _Call:
    """A flatshard call between forwards (``clip_grad_norm_``), to make again."""

    again: Callable[[], object]


@dataclass(frozen=True)
class _Span:
    """A ``no_sync`` span opened (``opening``: how to open it again) or closed (None)."""

    opening: Callable[[], AbstractContextManager[object]] | None


@dataclass
class _Join:
    """One ``join`` on this rank: the iteration being recorded, the last one whole."""

    model: nn.Module
    context: StepContext
    optimizers: list[torch.optim.Optimizer]
    recording: list[Any] = field(default_factory=list)
    last: list[Any] = field(default_factory=list)
    stepped: bool = True  # the next forward of the root starts an iteration
    replaying: bool = False  # the calls now are this module's replay: not recorded

    # ------------------------------------------------------------- recording (data left)
    def forward_called(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        self.note(_Forward(args, kwargs, torch.is_grad_enabled(), self.context.step))

    def note(self, event: Any) -> None:
        """Record ``event``; the first of an iteration (a forward, or a ``no_sync`` entered
        before it) first takes part in the iteration's all-gather, before any collective
        of its own, as the replay does."""
        if self.replaying:
            return
        if self.stepped:
            self._close_iteration()
            self._exchange(has_data=True)
        self._mark_backward()
        self.recording.append(event)

    def optimizer_stepped(self) -> None:
        self.stepped = self.stepped or not self.replaying

    def _mark_backward(self) -> None:
        """The last forward had a backward if the root completed one since."""
        forwards = [e for e in self.recording if isinstance(e, _Forward)]
        if forwards and self.context.step > forwards[-1].steps_before:
            forwards[-1].backward = True

    def _close_iteration(self) -> None:
        self._mark_backward()
        if self.recording:
            self.last, self.recording = self.recording, []
        self.stepped = False

    # ------------------------------------------------------------- shadowing (no data)
    def shadow(self) -> None:
        """Replay the last iteration until every rank has run out of data."""
        self._close_iteration()
        while True:
            hyper = self._exchange(has_data=False)
            if hyper is None:
                return
            if not any(isinstance(e, _Forward) for e in self.last):
                raise RuntimeError(
                    f"flatshard.join: rank {global_rank()} ran out of data before its first "
                    "iteration inside join, so it has no iteration to replay while the others "
                    "train; give every rank at least one batch."
                )
            self._set_hyperparameters(hyper)
            self.replaying = True
            try:
                self._replay()
            finally:
                self.replaying = False

    def _exchange(self, has_data: bool) -> list[float] | None:
        """All-gather (has data, hyper-parameters); those of the first rank with data (None
        when no rank has any)."""
        group = self.context.process_group
        assert group is not None
        device = self.context.units[0].compute_device
        values = [float(has_data), *self._hyperparameters()]
        mine = torch.tensor(values, dtype=torch.float64, device=device)
        every = mine.new_zeros(group.size() * mine.numel())
        with tagged(self.context.tag(phase="join: which ranks have data")):
            all_gather_into(every, mine, group)
        for row in every.view(group.size(), -1).cpu():
            if row[0] > 0:
                return [float(v) for v in row[1:].tolist()]
        return None

    def _hyperparameters(self) -> list[float]:
        return [value for _, value in _float_settings(self.optimizers)]

    def _set_hyperparameters(self, values: list[float]) -> None:
        for (group, key), value in zip(
            ((g, k) for g, k in _setting_keys(self.optimizers)), values, strict=True
        ):
            group[key] = value

    def _replay(self) -> None:
        with ExitStack() as spans:
            for event in self.last:
                if isinstance(event, _Span):
                    if event.opening is not None:
                        spans.enter_context(event.opening())
                    else:
                        spans.close()
                elif isinstance(event, _Call):
                    event.again()
                elif isinstance(event, _Refused):
                    raise RuntimeError(event.message)
                else:
                    self._replay_forward(event)
        for optimizer in self.optimizers:
            optimizer.step()
        for optimizer in self.optimizers:
            optimizer.zero_grad()

    def _replay_forward(self, forward: _Forward) -> None:
        with torch.set_grad_enabled(forward.grad):
            output = self.model(*forward.args, **forward.kwargs)
        if not forward.backward:
            return
        leaves = [
            t
            for t in tree_leaves(output)
            if isinstance(t, torch.Tensor) and t.requires_grad and t.is_floating_point()
        ]
        torch.autograd.backward(leaves, [torch.zeros_like(t) for t in leaves])


@dataclass(frozen=True)
class _Refused:
    message: str


_CURRENT: ContextVar[_Join | None] = ContextVar("flatshard_join", default=None)


def note_call(again: Callable[[], object]) -> None:
    """A flatshard call was made (``clip_grad_norm_``); inside ``join``, ``again`` makes
    it once more in a replay."""
    state = _CURRENT.get()
    if state is not None:
        state.note(_Call(again))


def note_span(opening: Callable[[], AbstractContextManager[object]] | None) -> None:
    """A ``no_sync`` span opens (``opening`` opens it again in a replay) or closes (None)."""
    state = _CURRENT.get()
    if state is not None:
        state.note(_Span(opening))


def note_unreplayable(what: str, instead: str) -> None:
    """A call inside ``join`` that a rank out of data cannot replay: refused if replayed."""
    state = _CURRENT.get()
    if state is not None:
        state.note(
            _Refused(
                f"flatshard.join: rank {global_rank()} ran out of data and must replay its "
                f"last iteration, which called {what}; that cannot be replayed: {instead}."
            )
        )


@contextmanager
def join(model: nn.Module, optimizers: Sequence[torch.optim.Optimizer]) -> Iterator[None]:
    """Train on uneven inputs: ranks that run out of batches keep pace until all have.

    Wrap the training loop; each rank iterates over its own batches, as many as it has::

        with flatshard.join(model, [optimizer]):
            for batch in loader:  # uneven across ranks
                loss_fn(model(batch)).backward()
                optimizer.step()
                optimizer.zero_grad()

    A rank that leaves the loop replays its last iteration (its last inputs, its backward
    with zero gradients, ``no_sync`` spans, ``flatshard.clip_grad_norm_``, an optimizer
    step with the learning rate of a rank that still has data) until every rank has run
    out: the result is DDP's ``Join`` (each rank's batch, gradients summed over the ranks
    with data and divided by the world size). Costs one small all-gather per iteration.
    See [Note: uneven inputs] for what a replay cannot do. A collective: every rank
    enters it, with the optimizers that hold its shards.
    """
    contexts = contexts_under(model, "join")
    if len(contexts) != 1 or contexts[0].root is not model:
        raise ValueError(
            "flatshard.join: pass the model fully_shard returned (its root), with the "
            "optimizers over its parameters"
        )
    if not optimizers:
        raise ValueError("flatshard.join: pass the optimizers that step the model's shards")
    agree(model, "join")
    state = _Join(model, contexts[0], list(optimizers))
    hooks = [
        # First among the root's hooks: the iteration's all-gather comes before the root
        # unit's, on the ranks with data as in a replay.
        model.register_forward_pre_hook(
            lambda _, args, kwargs: state.forward_called(args, kwargs),
            with_kwargs=True,
            prepend=True,
        ),
        *(o.register_step_post_hook(lambda *_: state.optimizer_stepped()) for o in optimizers),
    ]
    token = _CURRENT.set(state)
    try:
        yield
        state.shadow()
    finally:
        _CURRENT.reset(token)
        for hook in hooks:
            hook.remove()


def _setting_keys(optimizers: list[torch.optim.Optimizer]) -> Iterator[tuple[dict[str, Any], str]]:
    """(param group, key) of each float hyper-parameter, in a fixed order."""
    for optimizer in optimizers:
        for group in optimizer.param_groups:
            for key in sorted(group):
                if type(group[key]) is float:
                    yield group, key


def _float_settings(optimizers: list[torch.optim.Optimizer]) -> list[tuple[str, float]]:
    return [(key, float(group[key])) for group, key in _setting_keys(optimizers)]
