"""``flatshard train --predict``: the run planned before it starts, then the prediction
next to what the run measured.

The plan is ``flatshard plan`` with the run's own options (model, sharding, batch; on
CPUs this machine measured, ``--cluster cpu``). The run measures what the plan predicts,
the way ``flatshard bench`` and the planner's tests do (one accounting): the steady-state
peak of live tensor storage on rank 0, the second step's, tracked at the dispatcher from
the model's construction on (``PeakStorage``, [Note: honest memory]) on CPUs, and the
allocator's peak of allocated bytes during that step on GPUs; and the median of the
steps after it (the dispatch mode slows the steps it watches). On GPUs no step time is
predicted: no preset is known to be the GPU at hand (``flatshard plan --cluster``
prices the presets).
"""

from __future__ import annotations

import statistics
from contextlib import ExitStack
from dataclasses import dataclass, field

import torch

from flatshard.cli.lm.config import GATHER_DTYPES, PRECISIONS, TrainConfig, unit_policy
from flatshard.cli.lm.data import VOCAB
from flatshard.cli.lm.optimizers import tables_placement
from flatshard.cli.lm.planned import language_model_loss, planned_model
from flatshard.cli.sizes import size
from flatshard.measure import PeakStorage
from flatshard.planner import plan


@dataclass(frozen=True)
class Prediction:
    peak_bytes: int  # rank 0's steady-state peak of live tensors
    step_s: float | None  # None on GPUs
    cluster: str


def predict_run(config: TrainConfig, world: int, local_ranks: int) -> Prediction:
    """The plan of this run (``config.device`` resolved: "cpu" or "cuda")."""
    model = planned_model(config.model, config, VOCAB, fit_to_bytes=True)
    cpu = config.device == "cpu"

    def inputs() -> tuple[torch.Tensor, ...]:
        return (torch.randint(0, VOCAB, (config.batch, config.seq_len)),)

    planned = plan(
        model.build(config.checkpoint_activations),
        inputs,
        loss=language_model_loss,
        auto_wrap_policy=unit_policy(model.unit_classes, config.units),
        cluster="cpu" if cpu else "h100-80gb",  # on GPUs only the memory is printed
        hosts=max(1, world // local_ranks),
        ranks_per_host=min(world, local_ranks),
        strategy=config.sharding_strategy,
        sharding_factor=config.sharding_factor or None,
        mixed_precision=PRECISIONS[config.mixed_precision],
        gather_dtype=GATHER_DTYPES[config.gather_dtype],
        grad_accum=config.grad_accum,
        accumulation="no_sync" if config.accum_no_sync else "reduce",
        optimizer=config.optimizer,
        clip=config.clip > 0,
        keep_gathered=config.keep_gathered,
        cpu_offload=config.cpu_offload,
        placement=tables_placement(config.row_sparse_tables),
    )
    if cpu:  # one memory: with --cpu-offload the host's tensors are in it too
        return Prediction(planned.total_peak_bytes, planned.step.seconds, planned.cluster.name)
    return Prediction(planned.peak_memory_bytes, None, planned.cluster.name)


def prediction_line(predicted: Prediction) -> str:
    step = "" if predicted.step_s is None else f", step {predicted.step_s:.3f} s"
    return (
        f"--predict ({predicted.cluster}): rank 0's steady-state peak of live tensors "
        f"{size(predicted.peak_bytes)}{step}"
    )


@dataclass
class Measurement:
    """Rank 0's measured peak and step times, next to ``predicted``; built before the
    model (see the module docstring), told of each step by ``stepped``."""

    device: torch.device
    predicted: Prediction
    tracker: PeakStorage | None = None
    scope: ExitStack = field(default_factory=ExitStack)  # the tracker's, while it runs
    peak_bytes: int | None = None
    steps_s: list[float] = field(default_factory=list)
    steps: int = 0

    @classmethod
    def start(cls, device: torch.device, predicted: Prediction) -> Measurement:
        measurement = cls(device, predicted)
        if device.type == "cpu":
            measurement.tracker = measurement.scope.enter_context(PeakStorage())
        return measurement

    def stepped(self, seconds: float) -> None:
        self.steps += 1
        if self.steps == 1:  # the gradients and optimizer state exist from here on
            self._reset_peak()
        elif self.steps == 2:
            self.peak_bytes = self._stop()
        else:
            self.steps_s.append(seconds)

    def _reset_peak(self) -> None:
        if self.tracker is not None:
            self.tracker.reset_peak()
        else:
            torch.accelerator.reset_peak_memory_stats(self.device)

    def _stop(self) -> int:
        if self.tracker is None:
            allocated: int = torch.accelerator.max_memory_allocated(self.device)
            return allocated
        peak: int = self.tracker.peak
        self.stop()
        return peak

    def stop(self) -> None:
        """Leave the dispatch mode (if still in it)."""
        if self.tracker is not None:
            self.scope.close()
            self.tracker = None

    def report(self) -> str:
        """The measured figures next to the predicted ones (leaving the dispatch mode if
        the run ended before its second step)."""
        self.stop()
        predicted = self.predicted
        if self.peak_bytes is None:
            return "--predict: the run ended before its second step: nothing measured"
        memory = (
            f"peak live tensors on rank 0: predicted {size(predicted.peak_bytes)}, measured "
            f"{size(self.peak_bytes)} ({self.peak_bytes / predicted.peak_bytes:.2f}x)"
        )
        if predicted.step_s is None:
            return f"--predict ({predicted.cluster}): {memory}"
        if not self.steps_s:
            return f"--predict ({predicted.cluster}): {memory}; no step after the second to time"
        measured = statistics.median(self.steps_s)
        return (
            f"--predict ({predicted.cluster}): {memory}; median step: predicted "
            f"{predicted.step_s:.3f} s, measured {measured:.3f} s "
            f"({measured / predicted.step_s:.2f}x, steps 3-{self.steps})"
        )
