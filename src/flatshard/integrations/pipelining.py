"""A flatshard-sharded module as a stage of ``torch.distributed.pipelining``.

    from flatshard.integrations.pipelining import PipelineStage
    stage_model = flatshard.fully_shard(stage_model, auto_wrap_policy={Block},
                                        process_group=dp_group)   # the stage's DP ranks
    stage = PipelineStage(stage_model, stage_index, num_stages, device, group=pp_group)
    schedule = ScheduleInterleavedZeroBubble([stage, ...], n_microbatches, loss_fn=...)
    schedule.step(x, target=y); optimizer.step(); optimizer.zero_grad()

torch's ``PipelineStage`` treats FSDP2 modules specially (sync off for every micro-batch,
one reduction after the last); this subclass does the same for a flatshard model through
the runtime's schedule interface ([Note: a schedule runs the step] in
``runtime/_pipeline.py``), and runs zero-bubble schedules' split backward on flatshard's
flat gradient leaves ([Note: splitting a backward pass] in ``_split_backward.py``). The
schedules are torch's, unchanged.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.pipelining import PipelineStage as TorchPipelineStage

from flatshard.integrations._split_backward import WeightPass, input_pass, weight_pass
from flatshard.runtime import pipeline_steps, unit_modules

__all__ = ["PipelineStage"]


class PipelineStage(TorchPipelineStage):
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
        if not unit_modules(submodule):
            raise ValueError(
                f"flatshard PipelineStage: stage {stage_index}'s module "
                f"({type(submodule).__name__}) is not sharded; call flatshard.fully_shard on "
                "it first (over the stage's data-parallel group), or use torch's "
                "PipelineStage for a module flatshard does not shard."
            )
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
        self.owner = f"flatshard PipelineStage {stage_index} of {num_stages}"
        pipeline = group if group is not None else dist.group.WORLD
        assert pipeline is not None
        self.pipeline_group: dist.ProcessGroup = pipeline  # (torch's ``group``: None = world)
        pipeline_steps.join_pipeline(submodule, pipeline, stage_index, num_stages, self.owner)

    # ------------------------------------------------------------------ the step
    def _prepare_forward_infra(self, num_microbatches: int, *args: Any, **kwargs: Any) -> Any:
        pipeline_steps.agree_microbatches(self.pipeline_group, self.device, num_microbatches)
        # torch infers the shapes from a real forward and input-gradient pass on the first
        # step: part of that step, so its backward reduces nothing
        pipeline_steps.begin_step(self.submod, self.owner)
        return super()._prepare_forward_infra(num_microbatches, *args, **kwargs)

    def forward_one_chunk(self, fwd_chunk_id: int, *args: Any, **kwargs: Any) -> Any:
        pipeline_steps.schedule_runs(self.pipeline_group)
        pipeline_steps.begin_step(self.submod, self.owner)
        pipeline_steps.note(self.submod, f"F{fwd_chunk_id}")
        return super().forward_one_chunk(fwd_chunk_id, *args, **kwargs)

    def backward_maybe_with_nosync(
        self, backward_type: str, bwd_kwargs: dict[str, Any], last_backward: bool = False
    ) -> tuple[tuple[torch.Tensor | None, ...], Any]:
        model = self.submod
        if backward_type == "full":
            pipeline_steps.note(model, "B")
            if last_backward:
                with pipeline_steps.last_backward(model):
                    return super().backward_maybe_with_nosync("full", bwd_kwargs, last_backward)
            return super().backward_maybe_with_nosync("full", bwd_kwargs, last_backward)
        if backward_type == "input":
            pipeline_steps.note(model, "I")
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
            pipeline_steps.note(model, "W")
            plan = bwd_kwargs["param_groups"]
            assert isinstance(plan, WeightPass)
            leaves = pipeline_steps.weight_leaves(model)
            with pipeline_steps.weights_gathered(model):
                grads = weight_pass(plan, leaves)
            pipeline_steps.add_weight_grads(model, grads)
            return (), None
        raise ValueError(f"flatshard PipelineStage: unknown backward type {backward_type!r}")

    def scale_grads(self, grad_scale_factor: int) -> None:
        """The step's end (torch calls it after the last backward): reduce, then divide
        by the micro-batch count, as torch's ``scale_grads``."""
        pipeline_steps.end_step(self.submod)
        if grad_scale_factor != 1 and pipeline_steps.keeps_gradients(self.submod):
            raise RuntimeError(
                f"{self.owner}: the step's gradients stay unreduced (no_sync around "
                "schedule.step()), and the schedule divides each step's gradients by its "
                "micro-batch count once reduced, which would mix steps divided and not. "
                "Build the schedule with scale_grads=False and divide the loss by the "
                "total micro-batch count in loss_fn, or accumulate with more micro-batches "
                "per step."
            )
        super().scale_grads(grad_scale_factor)

    def perform_reduce_grad(self, grad_scale_factor: int) -> None:
        self.scale_grads(grad_scale_factor)
