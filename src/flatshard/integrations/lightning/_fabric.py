"""``FlatshardFabricStrategy``: Lightning Fabric with a model sharded by flatshard.

fabric = Fabric(strategy=FlatshardFabricStrategy(auto_wrap_policy={Block}), devices=2)
fabric.launch()
model = fabric.setup_module(model)            # shards it
optimizer = fabric.setup_optimizers(torch.optim.AdamW(model.parameters()))

Fabric's calls become flatshard's: ``setup_module`` shards in place (after
``fabric.init_module(empty_init=True)`` the model may be on meta), ``clip_gradients``
takes the norm over every rank's rows, ``no_backward_sync`` is ``flatshard.no_sync``, and
``fabric.save/load`` write and read flatshard checkpoint directories with Fabric's other
state inside ([Note: Lightning's part of a sharded checkpoint]). The model must be set up
before its optimizer is built, as for Fabric's FSDP: the optimizer must hold the sharded
parameters.
"""

from __future__ import annotations

from collections.abc import Callable, Generator
from contextlib import AbstractContextManager, contextmanager, nullcontext
from pathlib import Path
from typing import TYPE_CHECKING, Any, cast

import torch
from torch import nn

import flatshard
from flatshard.integrations.torchft import ReplicaGroup, ReplicaGroups

from . import _checkpoints
from . import _process_group as process_group
from ._packages import lightning_for
from ._precision import TrueDtypes, check_precision, supported_name
from ._sharding import ShardOptions

# This copy's Lightning package ([Note: one integration, two Lightning packages]).
if TYPE_CHECKING:
    from lightning.fabric.plugins.precision import Precision
    from lightning.fabric.strategies.launchers.subprocess_script import _SubprocessScriptLauncher
    from lightning.fabric.strategies.parallel import ParallelStrategy
    from lightning.fabric.strategies.strategy import _BackwardSyncControl
    from lightning.fabric.utilities.rank_zero import rank_zero_only
else:
    _lightning = lightning_for(__name__)
    Precision = _lightning.fabric("plugins.precision").Precision
    _SubprocessScriptLauncher = _lightning.fabric(
        "strategies.launchers.subprocess_script"
    )._SubprocessScriptLauncher
    ParallelStrategy = _lightning.fabric("strategies.parallel").ParallelStrategy
    _BackwardSyncControl = _lightning.fabric("strategies.strategy")._BackwardSyncControl
    rank_zero_only = _lightning.fabric("utilities.rank_zero").rank_zero_only


class FlatshardFabricPrecision(TrueDtypes, Precision):
    """Fabric's ``precision=`` under ``FlatshardFabricStrategy`` (the same table as
    ``FlatshardPrecision``'s: mixed settings are flatshard ``MixedPrecision`` policies)."""

    def __init__(self, precision: str = "32-true") -> None:
        check_precision(precision)
        self.precision = cast(Any, precision)  # one of Lightning's literals, checked above
        self.scaler = flatshard.ShardedGradScaler() if precision == "16-mixed" else None

    def backward(
        self, tensor: torch.Tensor, model: nn.Module | None, *args: Any, **kwargs: Any
    ) -> None:
        if self.scaler is not None:
            tensor = self.scaler.scale(tensor)
        tensor.backward(*args, **kwargs)  # type: ignore[no-untyped-call]

    def optimizer_step(self, optimizer: Any, **kwargs: Any) -> Any:
        if self.scaler is None:
            return optimizer.step(**kwargs)
        result = self.scaler.step(optimizer, **kwargs)
        self.scaler.update()
        return result

    def unscale_gradients(self, optimizer: Any) -> None:
        if self.scaler is not None:
            self.scaler.unscale_(optimizer)

    def state_dict(self) -> dict[str, Any]:
        return self.scaler.state_dict() if self.scaler is not None else {}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        if self.scaler is not None and state_dict:
            self.scaler.load_state_dict(state_dict)


class _NoSync(_BackwardSyncControl):
    """``fabric.no_backward_sync(model)``: ``flatshard.no_sync``."""

    def no_backward_sync(self, module: nn.Module, enabled: bool) -> AbstractContextManager[Any]:
        return flatshard.no_sync(module) if enabled else nullcontext()


class FlatshardFabricStrategy(ParallelStrategy):
    """Shard the module Fabric sets up with ``flatshard.fully_shard``.

    The options are ``FlatshardStrategy``'s (``flatshard.integrations.lightning``);
    checkpoints are always sharded directories. ``replica_groups``
    (``flatshard.integrations.torchft.ReplicaGroups``): this Fabric is one replica group
    on torchft; ``fabric.setup_optimizers`` (one optimizer) joins the groups and forms the
    first quorum, the optimizer it returns starts each next one at ``zero_grad`` and steps
    only what torchft commits; ``replica_group.step`` is the committed step count (a
    recovering group's first quorum copies a live group's state, the step count with it).
    """

    def __init__(
        self,
        auto_wrap_policy: Any = None,
        sharding_strategy: flatshard.ShardingStrategy | str = "FULL_SHARD",
        *,
        mixed_precision: flatshard.MixedPrecision | None = None,
        cpu_offload: flatshard.CPUOffload | None = None,
        activation_checkpointing_policy: set[type[nn.Module]] | None = None,
        process_group_backend: str | None = None,
        replica_groups: ReplicaGroups | None = None,
        **fully_shard_options: Any,
    ) -> None:
        super().__init__()
        self.options = ShardOptions(
            auto_wrap_policy,
            sharding_strategy,
            mixed_precision,
            cpu_offload,
            activation_checkpointing_policy,
            "sharded",
            fully_shard_options,
        )
        self._process_group_backend = process_group_backend
        self._backward_sync_control = _NoSync()
        self.num_nodes = 1
        self.replica_groups = replica_groups
        self.replica_group: ReplicaGroup | None = None  # this rank's part, once joined
        self._module: nn.Module | None = None  # the module setup_module sharded

    # ---------------------------------------------------------------- Fabric's plumbing
    @property
    def precision(self) -> FlatshardFabricPrecision:
        plugin = self._precision
        return (
            plugin if isinstance(plugin, FlatshardFabricPrecision) else FlatshardFabricPrecision()
        )

    @precision.setter
    def precision(self, plugin: Any) -> None:
        if plugin is not None and not isinstance(plugin, FlatshardFabricPrecision):
            plugin = FlatshardFabricPrecision(supported_name(plugin))
        self._precision = plugin

    @property
    def root_device(self) -> torch.device:
        assert self.parallel_devices is not None
        device: torch.device = self.parallel_devices[self.local_rank]
        return device

    @property
    def num_processes(self) -> int:
        return len(self.parallel_devices) if self.parallel_devices is not None else 0

    @property
    def distributed_sampler_kwargs(self) -> dict[str, Any]:
        return process_group.sampler_kwargs(self, self.global_rank, self.replica_groups)

    def _configure_launcher(self) -> None:
        assert self.cluster_environment is not None
        if not self.cluster_environment.creates_processes_externally:
            self._launcher = _SubprocessScriptLauncher(
                self.cluster_environment, self.num_processes, self.num_nodes
            )

    def setup_environment(self) -> None:
        super().setup_environment()
        assert self.cluster_environment is not None
        process_group.set_world_ranks(self)
        rank_zero_only.rank = self.global_rank  # type: ignore[attr-defined]
        process_group.connect(
            self.cluster_environment, self._process_group_backend, self.root_device
        )

    def barrier(self, *args: Any, **kwargs: Any) -> None:
        process_group.barrier(self._module)

    def broadcast(self, obj: Any, src: int = 0) -> Any:
        return process_group.broadcast(obj, src, self._module)

    def all_reduce(self, tensor: Any, group: Any = None, reduce_op: Any = "mean") -> Any:
        return process_group.reduce(tensor, group, reduce_op)

    def module_to_device(self, module: nn.Module) -> None:
        pass  # fully_shard places the shards on root_device

    @contextmanager
    def module_init_context(self, empty_init: bool | None = None) -> Generator[None, None, None]:
        where = torch.device("meta") if empty_init else nullcontext()
        with where, self.precision.module_init_context():
            yield

    # ---------------------------------------------------------------- sharding
    def setup_module_and_optimizers(
        self, module: nn.Module, optimizers: list[Any], scheduler: Any = None
    ) -> tuple[nn.Module, list[Any], Any]:
        if optimizers:
            raise RuntimeError(
                "flatshard.integrations.lightning: set the model up before building its "
                "optimizer: model = fabric.setup_module(model), then "
                "optimizer = fabric.setup_optimizers(torch.optim.AdamW(model.parameters())); "
                "the optimizer must hold the sharded parameters."
            )
        return self.setup_module(module), [], scheduler

    def setup_module(self, module: nn.Module) -> nn.Module:
        module = self.precision.convert_module(module)
        mixed = self.options.policy(self.precision.precision, self.precision.mixed_precision)
        self.options.shard(module, self.root_device, mixed)
        self._module = module
        return module

    def setup_optimizer(self, optimizer: Any) -> Any:
        if self.replica_groups is None:
            return optimizer
        if self.replica_group is not None or self._module is None:
            raise RuntimeError(
                "flatshard.integrations.lightning: with replica_groups, set up the model, "
                "then one optimizer (one commit decision steps it); "
                + ("a second optimizer was set up." if self._module else "no model yet.")
            )
        if self.precision.scaler is not None:
            raise ValueError(
                "flatshard.integrations.lightning: replica_groups does not combine with "
                "fp16's gradient scaler (its skipped steps) yet"
            )
        self.replica_group = self.replica_groups.join(self._module, [optimizer])
        self.replica_group.start_quorum()  # the first step's (a recovering group heals)
        return self.replica_group.wrap(optimizer)

    def teardown(self) -> None:
        if self.replica_group is not None:
            self.replica_group.close()
            self.replica_group = None
        super().teardown()

    def clip_gradients_norm(
        self,
        module: nn.Module,
        optimizer: Any,
        max_norm: float | int,
        norm_type: float | int = 2.0,
        error_if_nonfinite: bool = True,
    ) -> torch.Tensor:
        self.precision.unscale_gradients(optimizer)
        return flatshard.clip_grad_norm_(module, float(max_norm), float(norm_type))

    # ---------------------------------------------------------------- checkpoints
    def save_checkpoint(
        self,
        path: Any,
        state: dict[str, Any],
        storage_options: Any = None,
        filter: dict[str, Callable[[str, Any], bool]] | None = None,
    ) -> None:
        if storage_options is not None or filter:
            raise TypeError(
                "flatshard.integrations.lightning: fabric.save(...) under flatshard takes no "
                "storage_options or filter (it writes every rank's rows through flatshard)."
            )
        module, optimizers, rest = _split(state)
        path = Path(self.broadcast(str(path)))
        _checkpoints.write(path, module, optimizers, _stateful_rest(rest))

    def load_checkpoint(
        self,
        path: Any,
        state: Any = None,
        strict: bool = True,
        weights_only: bool | None = None,
    ) -> dict[str, Any]:
        if not isinstance(state, dict) or not state:
            raise TypeError(
                "flatshard.integrations.lightning: fabric.load(path, state) under flatshard "
                "needs the state dict holding the set-up model (and optimizers) to load into."
            )
        module, optimizers, _ = _split(state)
        path = Path(self.broadcast(str(path)))
        rest = _checkpoints.read(path, module, optimizers, strict=strict, weights_only=weights_only)
        for name, value in list(rest.items()):
            if name in state:
                target = state[name]
                if hasattr(target, "load_state_dict") and isinstance(value, dict):
                    target.load_state_dict(value)
                else:
                    state[name] = value
                del rest[name]
        return rest


def _split(state: dict[str, Any]) -> tuple[nn.Module, list[Any], dict[str, Any]]:
    modules = [v for v in state.values() if isinstance(v, nn.Module)]
    if len(modules) != 1:
        raise TypeError(
            "flatshard.integrations.lightning: the checkpoint state must hold exactly one "
            f"model (the one fabric.setup_module sharded); found {len(modules)}."
        )
    optimizers = [v for v in state.values() if isinstance(v, torch.optim.Optimizer)]
    rest = {k: v for k, v in state.items() if not isinstance(v, nn.Module | torch.optim.Optimizer)}
    return modules[0], optimizers, rest


def _stateful_rest(rest: dict[str, Any]) -> dict[str, Any]:
    """Other objects with state (a scheduler, a sampler) saved as their state dicts."""
    return {k: v.state_dict() if hasattr(v, "state_dict") else v for k, v in rest.items()}
