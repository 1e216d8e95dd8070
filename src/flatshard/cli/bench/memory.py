"""``flatshard bench``'s memory figure: the steady-state peak of tensor memory per rank.

[Note: honest memory]
Process peak RSS includes building the full model before sharding and whatever the C
allocator keeps after a free, so it hides what sharding saves (flatshard, FSDP2 and DDP
all read 910-1000 MB on the bench's model). Here every system builds its model afresh inside a
``PeakStorage`` dispatch mode, which tracks every tensor storage the process creates from
then on (parameters, gradients, optimizer state, gathered buffers, DDP's buckets,
activations, collective outputs) and the bytes alive after every operation. After one
step, which creates the gradients and optimizer state, the peak is reset to what is alive;
the peak of the next step is the steady-state tensor memory: the quantity FSDP exists to
cut. Not counted: memory a backend allocates outside torch (gloo's internal buffers),
and allocator overhead.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

from flatshard.measure import PeakStorage

Optimizers = list[torch.optim.Optimizer]
Step = Callable[[nn.Module, Optimizers], None]


def steady_state_peak(
    build: Callable[[], tuple[nn.Module, Optimizers]], step: Step
) -> tuple[int, int]:
    """Bytes of tensor storage alive between two steps ("at rest": the state a rank keeps,
    which sharding divides by W) and at the peak of a steady-state step (see the note)."""
    with PeakStorage() as tracker:
        model, optim = build()
        step(model, optim)  # creates gradients and optimizer state
        tracker.reset_peak()
        rest: int = tracker.peak
        step(model, optim)
    peak: int = tracker.peak
    return rest, peak
