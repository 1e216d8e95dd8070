"""DeepSpeed ZeRO-3 as a bench system ("deepspeed"; ``pip install deepspeed``, or the
``deepspeed`` extra).

The same GPT, data and AdamW as every other system, run as DeepSpeed's users run it: one
engine over the model and a torch optimizer (nothing compiled), ZeRO stage 3 with
DeepSpeed's default bucket, prefetch and persistence settings, the engine's own
``backward`` and ``step``. On CPUs DeepSpeed's accelerator is its CPU one, which
communicates over gloo where oneCCL is absent. ZeRO-3 keeps no unsharded gradient: every
micro-batch's gradients are reduce-scattered, as flatshard's ``--accum reduce`` does.
"""

from __future__ import annotations

import importlib.util
import logging
import os
import warnings
from typing import Any

import torch
from torch import nn

from flatshard.cli.lm.optimizers import build_optimizers
from flatshard.models import GPTBlock

SYSTEM = "deepspeed"


def missing() -> str:
    """Why the "deepspeed" system cannot run here, or "" when it can."""
    if importlib.util.find_spec("deepspeed") is None:
        return (
            "--systems deepspeed needs DeepSpeed: make extras EXTRAS=deepspeed "
            "(or pip install deepspeed)"
        )
    return ""


def zero3_engine(
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    micro_batch: int,
    micro_batches: int,
    device: torch.device,
) -> Any:
    """A DeepSpeed ZeRO-3 engine over ``model`` and ``optimizer`` (its parameters'), with
    DeepSpeed's defaults but for clipping; in a process that has joined its group."""
    # The accelerator is chosen at import, from the environment; the engine reads its
    # device from LOCAL_RANK (the bench's process group exists already: it is reused).
    os.environ.setdefault("DS_ACCELERATOR", "cpu" if device.type == "cpu" else device.type)
    os.environ.setdefault("LOCAL_RANK", str(device.index or 0))
    import deepspeed
    import deepspeed.ops

    # Its CPU backend compiles a shared-memory all-reduce at startup (40-80 s of a 2-core
    # machine, again for every new environment path) that only inference_all_reduce
    # (tensor-parallel inference) calls; ZeRO-3 training never does. Marked unbuildable,
    # as DeepSpeed does itself where a compiler is missing: nothing else changes.
    deepspeed.ops.__compatible_ops__["deepspeed_shm_comm"] = False
    logging.getLogger("DeepSpeed").setLevel(logging.WARNING)
    config = {
        "train_micro_batch_size_per_gpu": micro_batch,
        "gradient_accumulation_steps": micro_batches,
        "zero_optimization": {"stage": 3},
        "zero_allow_untested_optimizer": True,  # a torch optimizer: nothing compiled
        # DeepSpeed clips the gradient norm at 1.0 unless told: the same update as the
        # other systems (none clips) is no clipping.
        "gradient_clipping": 0.0,
        "steps_per_print": 2**31 - 1,
    }
    with warnings.catch_warnings():  # its all_gather_into_tensor's deprecation
        warnings.simplefilter("ignore", FutureWarning)
        engine, *_ = deepspeed.initialize(model=model, optimizer=optimizer, config=config)
    return engine


class ZeRO3(nn.Module):
    """A DeepSpeed engine over one GPT: ``step`` is one optimizer step of the bench."""

    def __init__(
        self,
        gpt: nn.Module,
        batch: int,
        micro_batches: int,
        device: torch.device,
        optimizer: torch.optim.Optimizer | None = None,
    ) -> None:
        """``optimizer`` over ``gpt``'s parameters; None: the bench's AdamW."""
        super().__init__()
        if optimizer is None:
            (optimizer,) = build_optimizers(gpt, {GPTBlock}, "adamw", 1e-4, 0.0)
        engine = zero3_engine(gpt, optimizer, batch // micro_batches, micro_batches, device)
        self.engine: Any = engine
        self.micro_batches = micro_batches

    def step(self, idx: torch.Tensor) -> torch.Tensor:
        """One optimizer step over ``idx`` in --grad-accum micro-batches; the mean loss."""
        losses = []
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", FutureWarning)
            for part in idx.chunk(self.micro_batches):
                logits = self.engine(part[:, :-1]).flatten(0, 1)
                loss = nn.functional.cross_entropy(logits, part[:, 1:].flatten())
                self.engine.backward(loss)  # scaled by 1 / micro-batches inside
                self.engine.step()  # steps the optimizer after the last micro-batch
                losses.append(loss.detach())
        return torch.stack(losses).mean()

    def local_numel(self) -> int:
        """Elements of the parameters this rank holds (its ZeRO-3 partitions)."""
        return sum(p.ds_tensor.numel() for p in self.engine.module.parameters())
