"""One FSDP unit: a module whose parameters are sharded, unsharded and reduced together."""

from __future__ import annotations

from enum import Enum, auto

import torch
from torch import nn

from flatshard._flat_param import FlatParameter
from flatshard._mesh import ShardingStrategy
from flatshard._mixed_precision import MixedPrecision
from flatshard._prefetch import BackwardPrefetch


class TrainingState(Enum):
    """Where a unit is in the step. Only the runtime's hooks change it."""

    IDLE = auto()  # outside forward and backward: parameters are shard views
    FORWARD = auto()  # between the unit's pre-forward and post-forward hooks
    BACKWARD = auto()  # the unit's pre-backward ran in the current backward pass


class Unit:
    """A module plus the FlatParameters that hold the parameters assigned to it."""

    def __init__(
        self,
        module: nn.Module,
        fqn: str,
        flat_params: list[FlatParameter],
        strategy: ShardingStrategy,
        modules: list[tuple[str, nn.Module]],
        mixed_precision: MixedPrecision | None = None,
        backward_prefetch: BackwardPrefetch | None = None,
        forward_prefetch: bool = False,
    ) -> None:
        self.module = module
        self.fqn = fqn  # the module's name in the model passed to fully_shard ("" = root)
        self.flat_params = flat_params
        self.strategy = strategy
        # Modules inside the unit (not inner units) that register its parameters directly:
        # calling one of them while the unit is sharded is an error (see _runtime).
        owned = {id(m) for _, f in enumerate(flat_params) for o in f.originals for m, _ in o.usages}
        self.inner_modules = [(n, m) for n, m in modules if id(m) in owned and m is not module]
        self.params_are_full = False  # inside summon_full_params
        self.mixed_precision = mixed_precision
        self.backward_prefetch = backward_prefetch
        self.forward_prefetch = forward_prefetch
        self.state = TrainingState.IDLE
        # Per backward pass, reset by the final callback:
        self.expects_backward = False  # a forward with grad ran: every rank must reduce
        self.pending_input_grads = 0  # forwards whose inputs' gradients are still to come

    @property
    def label(self) -> str:
        """The unit's name for messages and profiler ranges."""
        return self.fqn or "<root>"

    def rename(self, prefix: str) -> None:
        """Name the unit and its parameters as seen from a parent ``prefix`` module."""
        self.fqn = f"{prefix}.{self.fqn}" if self.fqn else prefix
        for flat in self.flat_params:
            for orig in flat.originals:
                orig.fqn = f"{prefix}.{orig.fqn}"

    def inherit(self, policy: MixedPrecision) -> None:
        """Adopt the mixed-precision policy of the call that shards the enclosing model."""
        self.mixed_precision = policy
        for flat in self.flat_params:
            compute = policy.compute_dtype(flat.shard.dtype, full_precision_module=False)
            flat.set_compute_dtype(compute, policy.gradient_reduce_dtype(compute))

    def full_precision_modules(self) -> list[nn.Module]:
        """Modules inside the unit whose parameters compute in the master dtype."""
        policy = self.mixed_precision
        if policy is None or policy.param_dtype is None or not policy.keep_full_precision:
            return []
        keep = tuple(policy.keep_full_precision)
        return [
            m for m in [self.module, *(m for _, m in self.inner_modules)] if isinstance(m, keep)
        ]

    @property
    def trainable(self) -> list[FlatParameter]:
        return [f for f in self.flat_params if f.requires_grad]

    @property
    def frozen(self) -> list[FlatParameter]:
        return [f for f in self.flat_params if not f.requires_grad]

    def unshard(self) -> None:
        """All-gather every FlatParameter; the modules then hold views of the buffers."""
        self.start_unshard()  # every gather in flight before the first wait
        for flat in self.flat_params:
            flat.unshard()

    def start_unshard(self) -> None:
        """Start every FlatParameter's all-gather (prefetch); the unit's hook waits."""
        for flat in self.flat_params:
            flat.start_unshard()

    @property
    def gathering(self) -> bool:
        return any(flat.gathering for flat in self.flat_params)

    def finish_unshard(self) -> None:
        """Wait for the all-gathers a prefetch started (views come with ``unshard``)."""
        for flat in self.flat_params:
            flat.finish_unshard()

    @property
    def compute_device(self) -> torch.device:
        return self.flat_params[0].compute_device if self.flat_params else torch.device("cpu")

    @property
    def unshard_allocates(self) -> bool:
        """Whether unsharding now would allocate memory (F = 1 in the master dtype: never)."""
        return any(flat.unshard_allocates for flat in self.flat_params)

    def reshard(self) -> bool:
        """Free the unsharded buffers; the modules then hold the original parameters.

        Returns whether any memory was freed.
        """
        freed = [flat.reshard() for flat in self.flat_params]
        return any(freed)

    def frozen_safe_to_reshard(self) -> bool:
        """Whether backward can no longer read the frozen FlatParameters.

        Any backward op that reads a frozen parameter computes a gradient for something:
        this unit's inputs or its trainable parameters. Once both are done, none is left.
        """
        trainable_done = all(f.grad_done_in_backward for f in self.trainable)
        return trainable_done and self.pending_input_grads == 0

    def reset_backward_state(self) -> None:
        self.state = TrainingState.IDLE
        self.expects_backward = False
        self.pending_input_grads = 0
        for flat in self.flat_params:
            flat.grad_done_in_backward = False
