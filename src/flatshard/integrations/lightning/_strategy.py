"""``FlatshardStrategy``: the Lightning ``Trainer`` trains a model sharded by flatshard.

What each part of Lightning's loop becomes:
- ``setup``: the ``LightningModule`` (after ``configure_model``, which may build on meta
  under ``trainer.init_module(empty_init=True)``) is sharded in place with
  ``flatshard.fully_shard`` and the strategy's options; then ``configure_optimizers``
  runs, so the optimizers see the sharded parameters.
- the steps: ``training_step`` and the other step methods the module defines are
  registered as entry points (``flatshard.register_entry_point``), so the parameters the
  ``LightningModule`` holds itself are gathered around the step as around ``forward``.
- ``accumulate_grad_batches``: the micro-batches before the last run under
  ``flatshard.no_sync`` (Lightning's ``block_backward_sync``).
- ``gradient_clip_val``: the norm over every rank's rows (``FlatshardPrecision``).
- checkpoints: ``_checkpoints.py``; sharded directories by default, one full file with
  ``state_dict_type="full"``. ``trainer.fit(ckpt_path=...)`` resumes either, at any world
  size.
- ``replica_groups`` (``flatshard.integrations.torchft.ReplicaGroups``): this Trainer is
  one replica group of a fault-tolerant run on torchft. Its ranks read their part of each
  group's share of the data; each training batch starts the step's quorum (where a group
  that comes back heals: the model, the optimizer and Lightning's step count from a live
  group, with the learning-rate schedulers); the optimizer steps only what torchft commits
  (a step it does not commit still counts as Lightning's step, its batch unused, on every
  group of that quorum alike).

Lightning's own helpers for the process group and launcher are used as its strategies use
them, so ``devices=N`` spawns the ranks and ``torchrun`` works as for ``strategy="ddp"``.
"""

from __future__ import annotations

from collections.abc import Generator
from contextlib import contextmanager, nullcontext
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from lightning_utilities.core.rank_zero import rank_zero_only as utilities_rank_zero_only
from torch import nn

import flatshard

from . import _checkpoints
from . import _process_group as process_group
from ._packages import lightning_for
from ._precision import FlatshardPrecision, from_lightning

# The Lightning package of this copy of the module ([Note: one integration, two Lightning
# packages] in _packages.py).
if TYPE_CHECKING:
    import lightning.pytorch as pl
    from lightning.fabric.utilities.optimizer import _optimizers_to_device
    from lightning.fabric.utilities.seed import reset_seed
    from lightning.pytorch.plugins.io import AsyncCheckpointIO
    from lightning.pytorch.strategies import ParallelStrategy
    from lightning.pytorch.strategies.launchers.subprocess_script import (
        _SubprocessScriptLauncher,
    )
    from lightning.pytorch.trainer.states import TrainerFn
    from lightning.pytorch.utilities import rank_zero_only
    from lightning.pytorch.utilities.model_helpers import is_overridden
else:
    _lightning = lightning_for(__name__)
    pl = _lightning.trainer()
    _optimizers_to_device = _lightning.fabric("utilities.optimizer")._optimizers_to_device
    reset_seed = _lightning.fabric("utilities.seed").reset_seed
    ParallelStrategy = _lightning.trainer("strategies").ParallelStrategy
    AsyncCheckpointIO = _lightning.trainer("plugins.io").AsyncCheckpointIO
    _SubprocessScriptLauncher = _lightning.trainer(
        "strategies.launchers.subprocess_script"
    )._SubprocessScriptLauncher
    TrainerFn = _lightning.trainer("trainer.states").TrainerFn
    rank_zero_only = _lightning.trainer("utilities").rank_zero_only
    is_overridden = _lightning.trainer("utilities.model_helpers").is_overridden

from flatshard.integrations.torchft import ReplicaGroup, ReplicaGroups

from ._sharding import (
    ShardOptions,
    holds_parameters_itself,
    is_sharded,
)

STEP_METHODS = ("training_step", "validation_step", "test_step", "predict_step")


class FlatshardStrategy(ParallelStrategy):
    """Shard the ``LightningModule`` with ``flatshard.fully_shard`` and train it.

    Args:
        auto_wrap_policy: which submodules become units (as for ``fully_shard``: a set of
            classes such as ``{Block}``, a callable, ``flatshard.SizePolicy``, None).
        sharding_strategy: ``flatshard.ShardingStrategy`` or its name (FULL_SHARD,
            SHARD_GRAD_OP, NO_SHARD, HYBRID_SHARD, HYBRID_SHARD_ZERO2, HYBRID_SHARD_OPTIM;
            "zero3" and the other names ``fully_shard`` takes).
        mixed_precision: a ``flatshard.MixedPrecision``; by default what
            ``Trainer(precision=...)`` says (``FlatshardPrecision``). Give one or the other.
        cpu_offload: ``flatshard.CPUOffload(params=True)``: shards and optimizer on the CPU.
        activation_checkpointing_policy: module classes whose forward is recomputed in
            backward (non-reentrant ``torch.utils.checkpoint``).
        state_dict_type: ``"sharded"`` (each rank writes its rows; the default) or
            ``"full"`` (rank 0 writes one file with full tensors).
        process_group_backend: "gloo", "nccl", ...; by default the device's.
        replica_groups: ``flatshard.integrations.torchft.ReplicaGroups(count, index,
            lighthouse, ...)``: train as replica group ``index`` of a fault-tolerant run
            on torchft (one optimizer, automatic optimization, no fp16 scaler).
        fully_shard_options: the other ``flatshard.fully_shard`` keywords
            (``sharding_factor``, ``param_init_fn``, ``prefetch``, ``init``, ``placement``).
    """

    strategy_name = "flatshard"

    def __init__(
        self,
        auto_wrap_policy: Any = None,
        sharding_strategy: flatshard.ShardingStrategy | str = "FULL_SHARD",
        *,
        mixed_precision: flatshard.MixedPrecision | None = None,
        cpu_offload: flatshard.CPUOffload | None = None,
        activation_checkpointing_policy: set[type[nn.Module]] | None = None,
        state_dict_type: str = "sharded",
        process_group_backend: str | None = None,
        replica_groups: ReplicaGroups | None = None,
        **fully_shard_options: Any,
    ) -> None:
        super().__init__()
        self._pending: flatshard.CheckpointSave | None = None
        self._doomed: list[Path] = []  # removals waiting for the pending save to commit
        self.options = ShardOptions(
            auto_wrap_policy,
            sharding_strategy,
            mixed_precision,
            cpu_offload,
            activation_checkpointing_policy,
            state_dict_type,
            fully_shard_options,
        )
        self._process_group_backend = process_group_backend
        self.num_nodes = 1
        self.replica_groups = replica_groups
        self._replica: ReplicaGroup | None = None  # this rank's part, from setup on

    # ---------------------------------------------------------------- Lightning's plumbing
    @property
    def precision_plugin(self) -> FlatshardPrecision:
        plugin = self._precision_plugin
        return plugin if isinstance(plugin, FlatshardPrecision) else FlatshardPrecision()

    @precision_plugin.setter
    def precision_plugin(self, plugin: Any) -> None:
        # Lightning makes its own plugin from Trainer(precision=...): flatshard carries it out
        self._precision_plugin = None if plugin is None else from_lightning(plugin)

    @property
    def _module(self) -> pl.LightningModule:
        module = self.lightning_module
        if module is None:
            raise RuntimeError(
                "flatshard.integrations.lightning: FlatshardStrategy has no LightningModule "
                "yet; it gets one from Trainer.fit/validate/test/predict."
            )
        return module

    @property
    def root_device(self) -> torch.device:
        assert self.parallel_devices is not None
        device: torch.device = self.parallel_devices[self.local_rank]
        return device

    @property
    def num_processes(self) -> int:
        return len(self.parallel_devices) if self.parallel_devices is not None else 0

    @property
    def is_distributed(self) -> bool:
        # Lightning gives each rank its own batches (a DistributedSampler) only where its
        # strategy says so; without it every rank would train on the same data.
        return True

    @property
    def distributed_sampler_kwargs(self) -> dict[str, Any]:
        return process_group.sampler_kwargs(self, self.global_rank, self.replica_groups)

    @property
    def restore_checkpoint_after_setup(self) -> bool:
        return True  # the model must be sharded and the optimizers built first

    @property
    def lightning_restore_optimizer(self) -> bool:
        return False  # load_checkpoint restores them

    def _configure_launcher(self) -> None:
        assert self.cluster_environment is not None
        if not self.cluster_environment.creates_processes_externally:
            self._launcher = _SubprocessScriptLauncher(
                self.cluster_environment, self.num_processes, self.num_nodes
            )

    def setup_environment(self) -> None:
        super().setup_environment()
        reset_seed()
        self._set_world_ranks()
        assert self.cluster_environment is not None
        self._process_group_backend = process_group.connect(
            self.cluster_environment, self._process_group_backend, self.root_device
        )

    def _set_world_ranks(self) -> None:
        process_group.set_world_ranks(self)
        # Lightning's rank-zero-only logging reads the rank from both of its decorators
        for decorator in (rank_zero_only, utilities_rank_zero_only):
            decorator.rank = self.global_rank  # type: ignore[attr-defined]

    def barrier(self, name: str | None = None) -> None:
        process_group.barrier(self.model, name)

    def broadcast(self, obj: Any, src: int = 0) -> Any:
        return process_group.broadcast(obj, src, self.model)

    def reduce(self, tensor: Any, group: Any = None, reduce_op: Any = "mean") -> Any:
        return process_group.reduce(tensor, group, reduce_op)

    def model_to_device(self) -> None:
        pass  # fully_shard places the shards (and materializes meta modules) on root_device

    @contextmanager
    def tensor_init_context(self, empty_init: bool | None = None) -> Generator[None, None, None]:
        # empty_init: build on meta; fully_shard materializes one unit at a time in setup
        where = torch.device("meta") if empty_init else nullcontext()
        with where, self.precision_plugin.tensor_init_context():
            yield

    # ---------------------------------------------------------------- sharding
    def setup(self, trainer: pl.Trainer) -> None:
        assert self.accelerator is not None
        self.accelerator.setup(trainer)
        module = self._module
        if not is_sharded(module):  # validate/test after fit: already sharded
            self.model = self.precision_plugin.convert_module(module)
            plugin = self.precision_plugin
            mixed = self.options.policy(plugin.precision, plugin.mixed_precision)
            self.options.shard(module, self.root_device, mixed)
            if holds_parameters_itself(module):
                # Gather what the module holds itself around each step it defines
                for name in STEP_METHODS:
                    if is_overridden(name, module):
                        flatshard.register_entry_point(module, name)
        self.precision_plugin.model = module
        self.barrier()
        if trainer.state.fn == TrainerFn.FITTING:
            self._reset_optimizers_and_schedulers()
            self.setup_optimizers(trainer)
        self.setup_precision_plugin()
        if trainer.state.fn == TrainerFn.FITTING:
            _optimizers_to_device(self.optimizers, self.root_device)
            if self.replica_groups is not None and self._replica is None:
                self._replica = _joined(self.replica_groups, trainer, self)

    # ---------------------------------------------------------------- replica groups
    @property
    def replica_group(self) -> ReplicaGroup | None:
        """With ``replica_groups``, this rank's part while fitting (its ``quorum``,
        ``change``, ``fewer``, ``step``); None otherwise."""
        return self._replica

    def on_train_batch_start(self, batch: Any, batch_idx: int) -> None:
        if self._replica is not None:  # the step's quorum (once per optimizer step)
            self._replica.start_quorum()

    def optimizer_step(self, optimizer: Any, closure: Any, model: Any = None, **kwargs: Any) -> Any:
        if self._replica is None:
            return super().optimizer_step(optimizer, closure, model, **kwargs)
        # Steps only what torchft commits (after the closure's backward and clipping)
        committing = self._replica.wrap(_unwrapped(optimizer))
        return super().optimizer_step(committing, closure, model, **kwargs)

    # ---------------------------------------------------------------- the step
    @contextmanager
    def block_backward_sync(self) -> Generator[None, None, None]:
        """Lightning's accumulation: the micro-batches before the last keep their
        gradients unreduced (``flatshard.no_sync``)."""
        with flatshard.no_sync(self._module):
            yield

    # ---------------------------------------------------------------- checkpoints
    def lightning_module_state_dict(self) -> dict[str, Any]:
        if self.options.state_dict_type == "sharded":
            return {}  # save_checkpoint writes each rank's rows itself
        return flatshard.full_state_dict(self._module)

    def optimizer_state(self, optimizer: Any) -> dict[str, Any]:
        if self.options.state_dict_type == "sharded":
            return {}
        return flatshard.full_optim_state_dict(self._module, _unwrapped(optimizer))

    def save_checkpoint(
        self, checkpoint: dict[str, Any], filepath: Any, storage_options: Any = None
    ) -> None:
        if storage_options is not None:
            raise TypeError(
                "flatshard.integrations.lightning: FlatshardStrategy.save_checkpoint takes no "
                "storage_options (it writes through flatshard, not a CheckpointIO plugin)."
            )
        path = Path(self.broadcast(str(filepath)))  # rank 0's name for every rank
        if self.options.state_dict_type == "sharded":
            self._settle_saves()
            optimizers = [_unwrapped(o) for o in self.optimizers]
            self._pending = _checkpoints.save_sharded(
                checkpoint, path, self._module, optimizers, async_op=self.saves_in_background
            )
        elif self.is_global_zero:
            if _checkpoints.is_sharded_checkpoint(path):
                _checkpoints.remove(path)
            self.checkpoint_io.save_checkpoint(checkpoint, path)

    def load_checkpoint(self, checkpoint_path: Any, weights_only: bool | None = None) -> Any:
        path = Path(self.broadcast(str(checkpoint_path)))
        self._settle_saves()
        return _checkpoints.load(
            path,
            self._module,
            [_unwrapped(o) for o in self.optimizers],
            strict=self._module.strict_loading,
            weights_only=weights_only,
        )

    def load_model_state_dict(self, checkpoint: Any, strict: bool = True) -> None:
        pass  # load_checkpoint loaded the model

    def load_optimizer_state_dict(self, checkpoint: Any) -> None:
        pass  # load_checkpoint loaded the optimizers

    @property
    def saves_in_background(self) -> bool:
        """``Trainer(plugins=[AsyncCheckpointIO()])``, Lightning's asynchronous checkpoints:
        sharded ones go through ``flatshard.save_checkpoint(..., async_op=True)`` (the
        plugin's own thread writes the full ones)."""
        return isinstance(self.checkpoint_io, AsyncCheckpointIO)

    def remove_checkpoint(self, filepath: Any) -> None:
        if self._pending is not None and not self._pending.done():
            self._doomed.append(Path(filepath))  # kept until the newer one is whole
        elif self.is_global_zero:
            _checkpoints.remove(Path(filepath))

    def _settle_saves(self) -> None:
        """Wait for the background save (raising its failure on every rank), then remove
        the checkpoints it replaces; a failed save keeps them."""
        pending, self._pending = self._pending, None
        doomed, self._doomed = self._doomed, []
        if pending is not None:
            pending.wait()
        if self.is_global_zero:
            for path in doomed:
                _checkpoints.remove(path)

    def teardown(self) -> None:
        self._settle_saves()
        if self._replica is not None:
            self._replica.close()
            self._replica = None
        assert self.cluster_environment is not None
        assert self.accelerator is not None
        self.cluster_environment.teardown()
        self.precision_plugin.teardown()
        self.accelerator.teardown()


def _joined(
    groups: ReplicaGroups, trainer: pl.Trainer, strategy: FlatshardStrategy
) -> ReplicaGroup:
    """This rank's part of the replica groups; a recovering group receives Lightning's
    step count and its learning-rate schedulers with the model and the optimizer."""
    module = strategy.lightning_module
    assert module is not None
    optimizers = [_unwrapped(o) for o in strategy.optimizers]
    refused = {
        "more than one optimizer (one commit decision steps them all)": len(optimizers) != 1,
        "manual optimization": not module.automatic_optimization,
        "fp16's gradient scaler (its skipped steps)": strategy.precision_plugin.scaler is not None,
    }
    for what, found in refused.items():
        if found:
            raise ValueError(
                f"flatshard.integrations.lightning: replica_groups does not combine with {what} yet"
            )
    loop = trainer.fit_loop.epoch_loop
    progress = loop.automatic_optimization.optim_progress
    schedulers = [config.scheduler for config in strategy.lr_scheduler_configs]

    def get() -> dict[str, Any]:
        return {
            "optim": progress.state_dict(),
            "stepped": loop._batches_that_stepped,
            "schedulers": [scheduler.state_dict() for scheduler in schedulers],
        }

    def put(state: dict[str, Any]) -> None:
        progress.load_state_dict(state["optim"])
        loop._batches_that_stepped = state["stepped"]
        for scheduler, saved in zip(schedulers, state["schedulers"], strict=True):
            scheduler.load_state_dict(saved)

    return groups.join(module, optimizers, extra=(get, put))


def _unwrapped(optimizer: Any) -> Any:
    """The torch optimizer inside Lightning's ``LightningOptimizer``."""
    return getattr(optimizer, "_optimizer", optimizer)
