"""TRL's ``SFTTrainer`` on a model sharded by flatshard (``pip install 'flatshard[trl]'``).

model = flatshard.fully_shard(model, auto_wrap_policy={LlamaDecoderLayer})
trainer = FlatshardSFTTrainer(model=model, args=SFTConfig(...), train_dataset=...,
                              processing_class=tokenizer)
trainer.train(); trainer.save_model(out)   # out loads with from_pretrained

``SFTTrainer`` is a ``transformers.Trainer``: what ``FlatshardTrainer`` changes for a
sharded model (no DDP around it, no move, accumulation under ``no_sync``, ``save_model``
and checkpoints through flatshard; [Note: what the Trainer must not do to a sharded
model]) applies as it is, and everything TRL adds (dataset preparation, its collator,
completion-only loss, its metrics) is TRL's. docs/transformers.md has the example.

What TRL would do to the model itself is refused by name: ``peft_config`` (TRL would
wrap the sharded model in peft; apply ``get_peft_model`` before ``fully_shard``), and a
model given by name (TRL would load it unsharded).
"""

from __future__ import annotations

from typing import Any

from torch import nn
from trl.trainer.sft_trainer import SFTTrainer

from flatshard.integrations.transformers import FlatshardTrainer


class FlatshardSFTTrainer(FlatshardTrainer, SFTTrainer):
    """``trl.SFTTrainer`` for a model already sharded with ``flatshard.fully_shard``."""

    def __init__(self, model: nn.Module | None = None, args: Any = None, **kwargs: Any) -> None:
        if kwargs.get("peft_config") is not None:
            raise ValueError(
                "flatshard.integrations.trl: peft_config would make TRL wrap the already "
                "sharded model in peft, which changes its parameters behind flatshard. "
                "Apply peft.get_peft_model(model, config) before flatshard.fully_shard, "
                "and pass no peft_config."
            )
        super().__init__(model=model, args=args, **kwargs)
