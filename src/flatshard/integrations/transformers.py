"""The Hugging Face ``Trainer`` on a model sharded by flatshard (``pip install 'flatshard[hf]'``).

model = flatshard.fully_shard(model, auto_wrap_policy={LlamaDecoderLayer})
trainer = FlatshardTrainer(model=model, args=TrainingArguments(...), train_dataset=...)
trainer.train(); trainer.save_model(out)   # out loads with from_pretrained

docs/transformers.md shows a complete example and the limits.

[Note: what the Trainer must not do to a sharded model]
The ``Trainer`` trains through Accelerate, which would wrap the model in
``DistributedDataParallel`` (a second, wrong gradient all-reduce over the shards) and
whose checkpoints save one rank's optimizer state as if it were everyone's. So:
- the model must be sharded before the ``Trainer`` is built (the optimizer it builds then
  sees the sharded parameters); the ``Trainer`` does not move it (``model.to`` would copy
  the parameters out of their shards), and Accelerate prepares it as for evaluation:
  autocast only, no DDP;
- the micro-batches of an accumulation window but the last run under
  ``flatshard.no_sync`` (Accelerate's ``no_sync`` finds none on the model);
- ``save_model`` is a collective: ``flatshard.export_safetensors`` writes the full model
  with its config, so ``from_pretrained`` loads the result (of a peft model, the LoRA
  adapters as peft writes them: ``PeftModel.from_pretrained`` loads those);
- a checkpoint's optimizer (and the exact sharded weights) go to a flatshard checkpoint
  directory ``flatshard/`` inside the Trainer's ``checkpoint-N``; resuming loads it, at
  any world size. The scheduler, RNG and trainer state are the Trainer's own files.
Gradient clipping (``max_grad_norm``) goes through torch's ``get_total_norm`` and
``clip_grads_with_norm_`` (Accelerate's way), which flatshard makes global over the shards
and agreed ([Note: torch's clip_grad_norm_ on sharded gradients]). The hooks overridden
are the ``Trainer``'s own (``_save``, ``_save_optimizer_and_scheduler``,
``_load_from_checkpoint``, ``_load_optimizer_and_scheduler``, ``_load_best_model``,
``_move_model_to_device``, ``evaluation_loop``, ``train``); the tests pin them to the
installed transformers.
"""

from __future__ import annotations

import os
from contextlib import AbstractContextManager
from pathlib import Path
from typing import Any

import torch
from torch import nn
from transformers import Trainer

import flatshard
from flatshard.runtime import agree

CHECKPOINT_DIR = "flatshard"  # inside each checkpoint-N: model and optimizer, sharded
SCHEDULER_NAME = "scheduler.pt"  # the Trainer's name for it
TRAINING_ARGS_NAME = "training_args.bin"


class FlatshardTrainer(Trainer):
    """``transformers.Trainer`` for a model already sharded with ``flatshard.fully_shard``.

    Everything else is the ``Trainer``'s: arguments, datasets, collators, callbacks,
    evaluation, logging. See the module's note for what changes and why.
    """

    def __init__(self, model: nn.Module | None = None, args: Any = None, **kwargs: Any) -> None:
        _check_sharded(model)
        _check_arguments(args)
        super().__init__(model=model, args=args, **kwargs)
        _leave_sharding_to_flatshard(self.accelerator, self._sharded)

    @property
    def _sharded(self) -> nn.Module:
        assert self.model is not None  # checked in __init__
        return self.model

    def train(self, *args: Any, **kwargs: Any) -> Any:
        # [Note: the Trainer's arguments every rank must share] Some of them decide which of
        # Accelerate's collectives a step issues (a gather of the loss every logging_steps,
        # of the token count with average_tokens_across_devices) or how the data is split;
        # one rank with another value pairs its gather with a peer's flatshard all-gather
        # (gloo: "Received data size doesn't match", SIGABRT) or trains on other batches.
        # They are agreed before the first step, by name.
        agree(self._sharded, "FlatshardTrainer.train", _shared_arguments(self.args), _SAME_ARGS)
        return super().train(*args, **kwargs)

    def evaluation_loop(self, dataloader: Any, *args: Any, **kwargs: Any) -> Any:
        # [Note: an evaluation some ranks run] evaluate() and predict() issue Accelerate's
        # collectives (a gather of the losses) before any forward: on one rank alone they
        # would pair with another rank's flatshard all-gather, which gloo ends by aborting.
        # Agreed first, a rank that evaluates alone is named on every rank within seconds;
        # so is a rank with another number of batches (each batch's gather of the losses
        # would pair with another rank's forward, and the loss printed would be wrong).
        try:
            batches = f" of {len(dataloader)} batches"
        except TypeError:  # over an IterableDataset: no length to compare
            batches = ""
        agree(self._sharded, f"FlatshardTrainer evaluation (evaluate, predict){batches}")
        return super().evaluation_loop(dataloader, *args, **kwargs)

    def _move_model_to_device(self, model: nn.Module, device: torch.device) -> None:
        # fully_shard placed the shards; the Trainer's model.to(args.device) would copy
        # every parameter out of them (args.device is "cpu:0", unequal to "cpu")
        pass

    # ---------------------------------------------------------------- save_model
    def _save(
        self, output_dir: str | None = None, state_dict: dict[str, Any] | None = None
    ) -> None:
        """Every rank: the full model as safetensors plus its config (``from_pretrained``)."""
        if state_dict is not None:
            raise ValueError(
                "flatshard.integrations.transformers: save_model with a state_dict of "
                "your own is not supported: flatshard gathers the sharded model itself."
            )
        out = str(output_dir if output_dir is not None else self.args.output_dir)
        if hasattr(self._sharded, "peft_config"):
            _export_adapter(self._sharded, out)
        else:
            flatshard.export_safetensors(self._sharded, out)
        if not self.args.should_save:
            return
        if self.processing_class is not None:
            self.processing_class.save_pretrained(out)
        torch.save(self.args, os.path.join(out, TRAINING_ARGS_NAME))

    # ---------------------------------------------------------------- checkpoints
    def _save_optimizer_and_scheduler(self, output_dir: str) -> None:
        flatshard.save_checkpoint(
            Path(output_dir) / CHECKPOINT_DIR, self._sharded, _unwrapped(self.optimizer)
        )
        if self.args.should_save and self.lr_scheduler is not None:
            torch.save(self.lr_scheduler.state_dict(), os.path.join(output_dir, SCHEDULER_NAME))

    def _load_from_checkpoint(self, resume_from_checkpoint: str, model: Any = None) -> None:
        # Before the optimizer exists: the model's exact (sharded, full precision) weights
        flatshard.load_checkpoint(_checkpoint_dir(resume_from_checkpoint), self._sharded)

    def _load_optimizer_and_scheduler(self, checkpoint: str | None) -> None:
        if checkpoint is None:
            return
        optimizer = _unwrapped(self.optimizer)
        flatshard.load_checkpoint(_checkpoint_dir(checkpoint), self._sharded, optimizer)
        scheduler = os.path.join(checkpoint, SCHEDULER_NAME)
        if self.lr_scheduler is not None and os.path.isfile(scheduler):
            self.lr_scheduler.load_state_dict(torch.load(scheduler, weights_only=True))

    def _load_best_model(self) -> None:
        # load_best_model_at_end: the best checkpoint's exact weights, or its export
        best = str(self.state.best_model_checkpoint)
        if (Path(best) / CHECKPOINT_DIR).is_dir():
            flatshard.load_checkpoint(Path(best) / CHECKPOINT_DIR, self._sharded)
        else:
            flatshard.load_safetensors(self._sharded, best)


def _export_adapter(model: Any, out: str) -> None:
    """Every rank: a peft model's LoRA adapters as peft's ``save_pretrained`` writes them
    (``adapter_model.safetensors`` under peft's names, ``adapter_config.json``), with the
    trained copies of ``modules_to_save`` (a classifier head) under their module's name,
    so ``PeftModel.from_pretrained(base, out)`` loads them; the frozen base is not
    written."""
    adapter = model.active_adapter
    marker, copy = f".{adapter}.", f".modules_to_save.{adapter}."

    def saved_name(key: str) -> str | None:
        if copy in key:
            return key.replace(copy, ".")
        return key.replace(marker, ".") if "lora_" in key and marker in key else None

    if not any(saved_name(name) for name, _ in model.named_parameters()):
        raise ValueError(
            "flatshard.integrations.transformers: save_model writes LoRA adapters (lora_A, "
            f"lora_B, ...) of a peft model; adapter '{adapter}' has none. Merge it, or "
            "export the whole model with flatshard.export_safetensors(model, out)."
        )
    files = flatshard.export_safetensors(model, out, names=saved_name)
    if files:  # rank 0 wrote them
        written = Path(out) / "model.safetensors"
        if written.is_file():
            written.replace(Path(out) / "adapter_model.safetensors")
        model.peft_config[adapter].save_pretrained(out)


def _leave_sharding_to_flatshard(accelerator: Any, sharded: nn.Module) -> None:
    """See [Note: what the Trainer must not do to a sharded model]: Accelerate prepares the
    sharded model without DDP, and its ``no_sync`` is flatshard's."""
    prepare_model, no_sync = accelerator.prepare_model, accelerator.no_sync

    def prepare_sharded(
        module: nn.Module, device_placement: bool | None = None, evaluation_mode: bool = False
    ) -> nn.Module:
        if module is sharded:
            prepared: nn.Module = prepare_model(
                module, device_placement=False, evaluation_mode=True
            )
            return prepared
        return prepare_model(module, device_placement, evaluation_mode)  # type: ignore[no-any-return]

    def sharded_no_sync(model: nn.Module) -> AbstractContextManager[None]:  # Accelerate's name
        if model is sharded:
            return flatshard.no_sync(sharded)
        return no_sync(model)  # type: ignore[no-any-return]

    accelerator.prepare_model = prepare_sharded
    accelerator.no_sync = sharded_no_sync


def _check_sharded(model: object) -> None:
    if not (isinstance(model, nn.Module) and flatshard.unit_modules(model)):
        given = f"a model name ({model!r})" if isinstance(model, str) else f"{type(model).__name__}"
        raise ValueError(
            "flatshard.integrations.transformers: FlatshardTrainer takes a model sharded "
            f"by flatshard, got {given}; build the model, call flatshard.fully_shard(model, "
            "auto_wrap_policy={<decoder layer class>}), then build the Trainer with it, so "
            "that its optimizer sees the sharded parameters."
        )


def _check_arguments(args: Any) -> None:
    if args is None:
        return
    for name in ("fsdp", "deepspeed"):
        if getattr(args, name, None):
            raise ValueError(
                f"flatshard.integrations.transformers: TrainingArguments({name}=...) asks "
                "the Trainer to shard the model too; flatshard shards it: drop that option."
            )
    if getattr(args, "save_safetensors", True) is False:
        raise ValueError(
            "flatshard.integrations.transformers: save_model writes safetensors only; "
            "drop save_safetensors=False."
        )


# The TrainingArguments every rank must share ([Note: the Trainer's arguments every rank
# must share]); one that this transformers lacks is left out.
SHARED_ARGUMENTS = (
    "per_device_train_batch_size",
    "per_device_eval_batch_size",
    "gradient_accumulation_steps",
    "max_steps",
    "num_train_epochs",
    "max_grad_norm",
    "logging_strategy",
    "logging_steps",
    "logging_first_step",
    "eval_strategy",
    "eval_steps",
    "eval_on_start",
    "eval_accumulation_steps",
    "save_strategy",
    "save_steps",
    "save_only_model",
    "load_best_model_at_end",
    "average_tokens_across_devices",
    "include_num_input_tokens_seen",
    "dataloader_drop_last",
    "seed",
    "data_seed",
    "bf16",
    "fp16",
    # TRL's SFTConfig: how each rank's batches are built
    "packing",
    "packing_strategy",
    "padding_free",
    "max_length",
    "completion_only_loss",
)


_SAME_ARGS = (
    "Build the TrainingArguments alike on every rank: these decide which of Accelerate's "
    "collectives each step issues and which batches each rank trains on."
)


def _shared_arguments(args: Any) -> list[str]:
    """``TrainingArguments.name=value`` (the class's name) of each argument in
    ``SHARED_ARGUMENTS`` that ``args`` has."""
    missing = object()
    found = ((name, getattr(args, name, missing)) for name in SHARED_ARGUMENTS)
    kind = type(args).__name__
    return [f"{kind}.{name}={getattr(v, 'value', v)!r}" for name, v in found if v is not missing]


def _checkpoint_dir(checkpoint: str) -> Path:
    path = Path(checkpoint) / CHECKPOINT_DIR
    if not path.is_dir():
        raise flatshard.CheckpointError(
            f"flatshard.integrations.transformers: {checkpoint} has no {CHECKPOINT_DIR}/ "
            "directory: it was not saved by FlatshardTrainer (or with save_only_model=True, "
            "which cannot resume). Resume from a checkpoint FlatshardTrainer wrote."
        )
    return path


def _unwrapped(optimizer: Any) -> torch.optim.Optimizer:
    """The torch optimizer inside Accelerate's ``AcceleratedOptimizer``."""
    inner = getattr(optimizer, "optimizer", optimizer)
    if not isinstance(inner, torch.optim.Optimizer):
        raise TypeError(
            f"flatshard.integrations.transformers: the Trainer's optimizer is a "
            f"{type(inner).__name__}, not a torch.optim.Optimizer flatshard can checkpoint."
        )
    return inner
