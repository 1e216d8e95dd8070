"""``flatshard.ResumeState``: what a resume needs besides the model and the optimizer.

[Note: the resume state]
An exact resume needs each rank's random number generators (dropout, data shuffling),
the learning-rate schedule's position and the data position, besides weights and
moments. Users put them into ``extra`` by hand, and forget one (the Python RNG that a
shuffling sampler draws from, NumPy's that an augmentation uses). ``ResumeState`` names
them once: ``save_checkpoint(..., resume_state=state)`` keeps them with each rank's ``extra``
and ``load_checkpoint(..., resume_state=state)`` puts them back into the same objects. The
RNG states are torch's (CPU, and the accelerator's when there is one), Python's
``random`` and NumPy's (when NumPy is installed), each as a tensor or a tuple of ints so
that the checkpoint loads with ``weights_only=True``. A scheduler and a data loader or
sampler are anything with ``state_dict()`` / ``load_state_dict()`` (torch's
``LRScheduler``, torchdata's ``StatefulDataLoader``).
"""

from __future__ import annotations

import random
from dataclasses import dataclass
from typing import Any, Protocol

import torch

KEY = "flatshard.resume_state"  # its entry in each rank's extra


class Stateful(Protocol):
    def state_dict(self) -> dict[str, Any]: ...

    def load_state_dict(self, state: dict[str, Any]) -> None: ...


@dataclass
class ResumeState:
    """What ``save_checkpoint(..., resume_state=...)`` keeps and ``load_checkpoint`` restores.

    Args:
        scheduler: a learning-rate scheduler (or a list of them), or None.
        data: a stateful data loader or sampler (``state_dict`` / ``load_state_dict``), or
            None when the data position follows from the step.
        rng: keep each rank's RNG states: torch's (CPU and accelerator), Python's
            ``random`` and NumPy's.
    """

    scheduler: Stateful | list[Stateful] | None = None
    data: Stateful | None = None
    rng: bool = True

    def __post_init__(self) -> None:
        for name, value in (("scheduler", self.scheduler), ("data", self.data)):
            for item in value if isinstance(value, list) else [value]:
                if item is not None and not (
                    callable(getattr(item, "state_dict", None))
                    and callable(getattr(item, "load_state_dict", None))
                ):
                    raise TypeError(
                        f"flatshard.ResumeState: {name} must have state_dict() and "
                        f"load_state_dict() (an LR scheduler, a StatefulDataLoader), got "
                        f"{type(item).__name__}"
                    )

    def agreed_as(self) -> str:
        """What every rank's resume state must share when saved or loaded: the schedulers
        and the RNG it keeps (their states are each rank's own). Not the data position:
        a pipeline's middle stage reads no data, while its first and last do."""
        schedulers = self.scheduler if isinstance(self.scheduler, list) else [self.scheduler]
        kinds = [type(s).__name__ for s in schedulers if s is not None]
        return f"ResumeState(scheduler={kinds}, rng={self.rng})"

    def state_dict(self) -> dict[str, Any]:
        """This rank's state, as ``torch.load(weights_only=True)`` reads it."""
        state: dict[str, Any] = {}
        if self.rng:
            state["rng"] = _rng_states()
        if self.scheduler is not None:
            schedulers = self.scheduler if isinstance(self.scheduler, list) else [self.scheduler]
            state["scheduler"] = [s.state_dict() for s in schedulers]
        if self.data is not None:
            state["data"] = self.data.state_dict()
        return state

    def load_state_dict(self, state: dict[str, Any], path: str) -> None:
        """Put ``state`` back; a part this object asks for but the checkpoint lacks is an
        error naming it."""
        wanted = {"rng": self.rng, "scheduler": self.scheduler, "data": self.data}
        missing = [k for k, v in wanted.items() if v not in (None, False) and k not in state]
        if missing:
            raise ValueError(
                f"flatshard.load_checkpoint: {path} was saved without the resume state's "
                f"{', '.join(missing)}; load it with a ResumeState that leaves "
                f"{'them' if len(missing) > 1 else 'it'} out (None / rng=False)."
            )
        if self.rng:
            _set_rng_states(state["rng"])
        if self.scheduler is not None:
            schedulers = self.scheduler if isinstance(self.scheduler, list) else [self.scheduler]
            if len(schedulers) != len(state["scheduler"]):
                raise ValueError(
                    f"flatshard.load_checkpoint: {path} holds {len(state['scheduler'])} "
                    f"schedulers, this ResumeState {len(schedulers)}"
                )
            for scheduler, saved in zip(schedulers, state["scheduler"], strict=True):
                scheduler.load_state_dict(saved)
        if self.data is not None:
            self.data.load_state_dict(state["data"])


def _rng_states() -> dict[str, Any]:
    version, internal, gauss = random.getstate()
    states: dict[str, Any] = {
        "torch": torch.get_rng_state(),
        "python": [version, list(internal), gauss],
    }
    accelerator = torch.accelerator.current_accelerator()
    if accelerator is not None:
        module = torch.get_device_module(accelerator)
        states["accelerator"] = list(module.get_rng_state_all())
    try:
        import numpy as np
    except ImportError:
        return states
    numpy_state: Any = np.random.get_state(legacy=True)
    kind, keys, pos, has_gauss, cached = numpy_state
    states["numpy"] = [kind, torch.from_numpy(keys.astype("int64")), pos, has_gauss, cached]
    return states


def _set_rng_states(states: dict[str, Any]) -> None:
    torch.set_rng_state(states["torch"])
    version, internal, gauss = states["python"]
    random.setstate((version, tuple(internal), gauss))
    accelerator = torch.accelerator.current_accelerator()
    if accelerator is not None and "accelerator" in states:
        torch.get_device_module(accelerator).set_rng_state_all(states["accelerator"])
    if "numpy" in states:
        import numpy as np

        kind, keys, pos, has_gauss, cached = states["numpy"]
        np.random.set_state((kind, keys.numpy().astype("uint32"), pos, has_gauss, cached))


ResumeState.__module__ = "flatshard"
