"""One optimizer step over micro-batches: the loop ``flatshard train``, the planner's
simulation, ``flatshard bench`` and the parity harness all run.

The sync switches are where accumulation goes wrong silently, so they are written once:
with ``accumulation="no_sync"`` every micro-batch but the last runs under ``no_sync``
(nothing reduced, the unsharded gradients kept); with ``"reduce"`` each micro-batch is
reduced, and hybrid strategies all-reduce across the replicas on the last one only
(``set_requires_all_reduce``). Then the gradients are unscaled (a ``ShardedGradScaler``),
clipped over every rank's rows, and each optimizer steps and zeroes its gradients.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from contextlib import nullcontext

import torch
from torch import nn

from flatshard.runtime._clip import clip_grad_norm_
from flatshard.runtime._grad_scaler import ShardedGradScaler
from flatshard.runtime._join import note_unreplayable
from flatshard.runtime._step import agree, contexts_under
from flatshard.runtime._switches import switch, sync_off
from flatshard.runtime._unit import unit_of

ACCUMULATIONS = ("no_sync", "reduce", "schedule")


def _hybrid(model: nn.Module) -> bool:
    """Whether a unit inside ``model`` replicates across groups (an all-reduce to defer)."""
    units = [unit_of(m) for m in model.modules()]
    return any(f.groups.replicate is not None for u in units if u for f in u.flat_params)


class StepObserver:
    """Told where a step is, for what watches it (the planner's recorder tags what each
    part makes; ``flatshard train`` sums the losses). Every method does nothing here."""

    def backward_done(self, loss: torch.Tensor) -> None:
        """A micro-batch's backward ran; ``loss`` is its (divided) loss."""

    def gradients_done(self) -> None:
        """Every micro-batch ran: the gradients are in ``.grad``, not yet clipped."""

    def optimizer_starts(self) -> None:
        """The optimizers step next."""


def train_step(
    model: nn.Module,
    optimizers: Sequence[torch.optim.Optimizer],
    micro_loss: Callable[[int], torch.Tensor],
    micro_batches: int = 1,
    *,
    accumulation: str = "no_sync",
    clip: float | None = None,
    scaler: ShardedGradScaler | None = None,
    observer: StepObserver | None = None,
) -> torch.Tensor | None:
    """One optimizer step of sharded ``model`` over ``micro_batches`` micro-batches.

    ``micro_loss(i)`` runs micro-batch ``i``'s forward and returns its loss; the loop
    divides it by ``micro_batches`` (the gradient of the mean over the step's batch) and
    runs its backward. ``accumulation`` says how micro-batches but the last are reduced:
    "no_sync" (not at all: unsharded gradients kept, one reduction per step) or "reduce"
    (each one: sharded gradients; hybrid strategies sum across the replicas once), or
    "schedule": ``micro_loss(0)`` runs a pipeline schedule's step, which runs its
    micro-batches' forward and backward passes and their reductions itself
    (``flatshard.integrations.pipelining``), and returns the step's loss; ``micro_batches``
    is then 1 and the loop only clips and steps. With
    ``clip`` the gradients are clipped to that global norm (``flatshard.clip_grad_norm_``);
    with a ``scaler`` the loss is scaled, the gradients unscaled before clipping and the
    steps skipped on overflow. Returns the gradients' total norm before clipping (None
    without ``clip``).
    """
    if accumulation not in ACCUMULATIONS:
        raise ValueError(
            f"flatshard.train_step: accumulation must be 'no_sync', 'reduce' or 'schedule', "
            f"got {accumulation!r}"
        )
    if accumulation == "schedule" and (micro_batches != 1 or scaler is not None):
        raise ValueError(
            "flatshard.train_step: accumulation='schedule' runs micro_loss(0) once (a "
            "pipeline schedule's step, its micro-batches inside) and takes no grad scaler; "
            f"got micro_batches={micro_batches}, scaler={scaler is not None}"
        )
    if micro_batches < 1:
        raise ValueError(f"flatshard.train_step: micro_batches must be >= 1, got {micro_batches}")
    note_unreplayable(
        "flatshard.train_step",
        "inside flatshard.join, write the loop's forward, backward and optimizer step",
    )
    watch = observer or StepObserver()
    once_across = accumulation == "reduce" and micro_batches > 1 and _hybrid(model)
    contexts = contexts_under(model, "train_step")
    options = (
        f"{micro_batches}, accumulation={accumulation}, clip={clip}, scaler={scaler is not None}"
    )
    agree(model, f"train_step({options})")  # once: the switches below follow from it
    if accumulation == "schedule":
        watch.backward_done(micro_loss(0).detach())  # the schedule ran the backward passes
        micro_batches = 0
    for micro in range(micro_batches):
        last = micro == micro_batches - 1
        quiet = accumulation == "no_sync" and not last
        if once_across:
            switch(contexts, requires_all_reduce=last)  # the replicas' sum once
        with sync_off(contexts) if quiet else nullcontext():
            loss = micro_loss(micro) / micro_batches
            torch.autograd.backward(scaler.scale(loss) if scaler is not None else loss)
        watch.backward_done(loss)
        del loss
    watch.gradients_done()
    norm = None
    if clip is not None:
        if scaler is not None:
            for optim in optimizers:
                scaler.unscale_(optim)
        norm = clip_grad_norm_(model, clip)
    watch.optimizer_starts()
    for optim in optimizers:  # each one's gradients freed before the next steps
        if scaler is not None:
            scaler.step(optim)
        else:
            optim.step()
        optim.zero_grad()
    if scaler is not None:
        scaler.update()
    return norm
