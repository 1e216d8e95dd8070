"""A flatshard-sharded module as a stage of ``torch.distributed.pipelining``.

    from flatshard.integrations.pipelining import PipelineStage
    stage_model = flatshard.fully_shard(stage_model, auto_wrap_policy={Block},
                                        process_group=dp_group)   # the stage's DP ranks
    stage = PipelineStage(stage_model, stage_index, num_stages, device, group=pp_group)
    schedule = ScheduleInterleavedZeroBubble([stage, ...], n_microbatches, loss_fn=...)
    schedule.step(x, target=y); optimizer.step(); optimizer.zero_grad()

Stages cut by torch's tracer (``pipeline(model, ...)``) come from ``build_stage``, with
torch's arguments. torch's stages treat FSDP2 modules specially (sync off for every
micro-batch, one reduction after the last); these do the same for a flatshard model
through the runtime's schedule interface ([Note: a schedule runs the step] in
``runtime/_pipeline.py``), and run zero-bubble schedules' split backward on flatshard's
flat gradient leaves ([Note: splitting a backward pass] in ``_split_backward.py``). The
schedules are torch's, unchanged.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.pipelining import PipelineStage as TorchPipelineStage
from torch.distributed.pipelining.stage import _PipelineStage as TorchTracedStage

from flatshard.comm import CollectiveError
from flatshard.integrations._split_backward import WeightPass, input_pass, weight_pass
from flatshard.runtime import pipeline_steps, unit_modules

__all__ = ["PipelineStage", "build_stage"]


class _ShardedStage:
    """What a flatshard stage does differently from torch's, over either of torch's stage
    classes (the manual ``PipelineStage`` and the traced one): the methods torch's
    schedules call at each integration point."""

    submod: nn.Module
    device: torch.device
    has_backward: bool
    owner: str
    first_step: bool  # no step ended yet: each action is agreed before it runs
    pipeline_group: dist.ProcessGroup

    def _attach(
        self, module: nn.Module, stage: int, stages: int, group: dist.ProcessGroup | None
    ) -> None:
        self.owner = f"flatshard PipelineStage {stage} of {stages}"
        self.first_step = True
        pipeline = group if group is not None else dist.group.WORLD  # torch's None: the world
        assert pipeline is not None
        self.pipeline_group = pipeline
        pipeline_steps.join_pipeline(module, pipeline, stage, stages, self.owner)

    def clear_runtime_states(self) -> None:
        """A schedule step (or evaluation) begins: every rank of the pipeline agrees on it
        before any activation moves ([Note: a pipeline step starts on every rank])."""
        pipeline_steps.step_starts(self.pipeline_group)
        super().clear_runtime_states()  # type: ignore[misc]

    def _prepare_forward_infra(self, num_microbatches: int, *args: Any, **kwargs: Any) -> Any:
        pipeline_steps.agree_microbatches(self.pipeline_group, self.device, num_microbatches)
        # torch infers the shapes from a real forward and input-gradient pass on the first
        # step: part of that step, so its backward reduces nothing
        if kwargs.get("has_backward", False):
            pipeline_steps.begin_step(self.submod, self.owner)
        return super()._prepare_forward_infra(num_microbatches, *args, **kwargs)  # type: ignore[misc]

    def forward_one_chunk(self, fwd_chunk_id: int, *args: Any, **kwargs: Any) -> Any:
        pipeline_steps.schedule_runs(self.pipeline_group)
        if self.has_backward:  # (schedule.eval(): forwards only, no step to run)
            pipeline_steps.begin_step(self.submod, self.owner)
            pipeline_steps.note(self.submod, f"F{fwd_chunk_id}", self.first_step)
        try:
            return super().forward_one_chunk(fwd_chunk_id, *args, **kwargs)  # type: ignore[misc]
        except RuntimeError as error:
            # torch wraps what the stage's forward raised in "[Stage 0] failed to run
            # forward"; flatshard's named errors come out as themselves, so that a program's
            # ``except flatshard.CollectiveError`` sees them as it would without a pipeline.
            if isinstance(error.__cause__, CollectiveError):
                raise error.__cause__ from None
            raise

    def backward_maybe_with_nosync(
        self, backward_type: str, bwd_kwargs: dict[str, Any], last_backward: bool = False
    ) -> tuple[tuple[torch.Tensor | None, ...], Any]:
        model = self.submod
        whole = super().backward_maybe_with_nosync  # type: ignore[misc]
        if backward_type == "full":
            pipeline_steps.note(model, "B", self.first_step)
            if last_backward:
                with pipeline_steps.last_backward(model):
                    return whole("full", bwd_kwargs, last_backward)  # type: ignore[no-any-return]
            return whole("full", bwd_kwargs, last_backward)  # type: ignore[no-any-return]
        if backward_type == "input":
            pipeline_steps.note(model, "I", self.first_step)
            outputs = bwd_kwargs["stage_output"]
            outputs = (outputs,) if isinstance(outputs, torch.Tensor) else tuple(outputs)
            grads = bwd_kwargs["output_grads"]
            return input_pass(
                outputs,
                None if grads is None else tuple(grads),
                bwd_kwargs["input_values"],
                pipeline_steps.weight_leaves(model),
            )
        if backward_type == "weight":
            pipeline_steps.note(model, "W", self.first_step)
            plan = bwd_kwargs["param_groups"]
            assert isinstance(plan, WeightPass)
            leaves = pipeline_steps.weight_leaves(model)
            with pipeline_steps.weights_gathered(model):
                found = weight_pass(plan, leaves)
            pipeline_steps.add_weight_grads(model, found)
            return (), None
        raise ValueError(f"{self.owner}: unknown backward type {backward_type!r}")

    def scale_grads(self, grad_scale_factor: int) -> None:
        """The step's end (torch calls it after the last backward): reduce, then divide
        by the micro-batch count, as torch's ``scale_grads``."""
        pipeline_steps.end_step(self.submod)
        self.first_step = False
        if grad_scale_factor != 1 and pipeline_steps.keeps_gradients(self.submod):
            raise RuntimeError(
                f"{self.owner}: the step's gradients stay unreduced (no_sync around "
                "schedule.step()), and the schedule divides each step's gradients by its "
                "micro-batch count once reduced, which would mix steps divided and not. "
                "Build the schedule with scale_grads=False and divide the loss by the "
                "total micro-batch count in loss_fn, or accumulate with more micro-batches "
                "per step."
            )
        super().scale_grads(grad_scale_factor)  # type: ignore[misc]

    def perform_reduce_grad(self, grad_scale_factor: int) -> None:
        self.scale_grads(grad_scale_factor)


def _require_sharded(module: nn.Module, stage: int) -> None:
    if not unit_modules(module):
        raise ValueError(
            f"flatshard PipelineStage: stage {stage}'s module ({type(module).__name__}) is "
            "not sharded; call flatshard.fully_shard on it first (over the stage's "
            "data-parallel group), or use torch's PipelineStage for a module flatshard "
            "does not shard."
        )


def _refuse_a_cut_tie(module: nn.Module, stage: int) -> None:
    """A model that declares its input embedding and output head tied (Hugging Face's
    ``tie_word_embeddings``, on it or its ``config``) but holds only one of them: the cut
    separated one weight into two copies that would train apart."""
    config = getattr(module, "config", None)
    tied = getattr(module, "tie_word_embeddings", getattr(config, "tie_word_embeddings", False))
    if tied is not True or not hasattr(module, "get_output_embeddings"):
        return
    parts = {}
    for side in ("input", "output"):
        try:
            found = getattr(module, f"get_{side}_embeddings")()
        except (AttributeError, NotImplementedError):
            found = None
        parts[side] = (
            found
            if isinstance(found, nn.Module) and any(True for _ in found.parameters())
            else None
        )
    if (parts["input"] is None) == (parts["output"] is None):
        return
    held = "input embedding" if parts["input"] is not None else "output head"
    missing = "output head" if held == "input embedding" else "input embedding"
    names = {id(m): name for name, m in module.named_modules()}
    name = names.get(id(parts["input"] or parts["output"]), "?")
    raise ValueError(
        f"flatshard PipelineStage: stage {stage} holds the {held} ({name!r}) but not the "
        f"{missing}, and its model declares them tied (tie_word_embeddings=True: one "
        "weight). torch's pipelining cannot share a parameter between stages: each stage "
        "would train a copy of its own, no longer the tied model. Untie them before "
        "cutting (a head with a weight of its own: config.tie_word_embeddings=False for "
        "Hugging Face models, GPT(..., tied=False)), or keep the embedding and the head "
        "on one stage."
    )


class PipelineStage(_ShardedStage, TorchPipelineStage):
    """torch's ``PipelineStage`` for a module sharded with ``flatshard.fully_shard``.

    Takes torch's arguments. The module's ``process_group`` is the stage's data-parallel
    group (or a mesh of it, hybrid); ``group`` is the pipeline group, as in torch. Every
    schedule of ``torch.distributed.pipelining`` runs it: per optimizer step each gradient
    is reduced once, after its last micro-batch's weight gradient exists.
    """

    def __init__(
        self,
        submodule: nn.Module,
        stage_index: int,
        num_stages: int,
        device: torch.device,
        input_args: torch.Tensor | tuple[torch.Tensor, ...] | None = None,
        output_args: torch.Tensor | tuple[torch.Tensor, ...] | None = None,
        group: dist.ProcessGroup | None = None,
        **kwargs: Any,
    ) -> None:
        _require_sharded(submodule, stage_index)
        _refuse_a_cut_tie(submodule, stage_index)
        super().__init__(
            submodule,
            stage_index,
            num_stages,
            device,
            input_args=input_args,
            output_args=output_args,
            group=group,
            **kwargs,
        )
        self._attach(submodule, stage_index, num_stages, group)


class _TracedStage(_ShardedStage, TorchTracedStage):
    """torch's stage of a traced pipeline (``build_stage``), for a sharded stage module."""


def build_stage(
    stage_module: nn.Module,
    stage_index: int,
    pipe_info: Any,
    device: torch.device,
    group: dist.ProcessGroup | None = None,
) -> TorchTracedStage:
    """torch's ``build_stage`` for a stage module of ``pipeline(model, ...)`` that
    ``flatshard.fully_shard`` sharded (the traced stage's submodules are torch's
    ``InterpreterModule``s: pick units by name or size, ``SizePolicy``)."""
    _require_sharded(stage_module, stage_index)
    stage = _TracedStage(stage_module, stage_index, pipe_info, device, group)
    stage._attach(stage_module, stage_index, pipe_info.num_stages, group)
    return stage
