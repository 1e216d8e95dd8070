"""Hugging Face Trainer runs for test_transformers_trainer.py.

``python transformers_script.py reference OUT``: the unsharded Trainer, one process, the
global batch. ``torchrun --nproc-per-node 2 transformers_script.py sharded OUT``: the same
training with ``FlatshardTrainer`` (half the batch on each rank), its ``save_model``, and
a second run resumed from the first's step-2 checkpoint. Results go to OUT as JSON and
safetensors.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import torch
from safetensors.torch import save_file
from transformers import LlamaConfig, LlamaForCausalLM, Trainer, TrainingArguments
from transformers.models.llama.modeling_llama import LlamaDecoderLayer

import flatshard
from flatshard.integrations.transformers import FlatshardTrainer

LLAMA = {
    "vocab_size": 64,
    "hidden_size": 32,
    "intermediate_size": 64,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "max_position_embeddings": 64,
}
GLOBAL_BATCH, STEPS = 4, 4


class Tokens(torch.utils.data.Dataset[dict[str, torch.Tensor]]):
    def __init__(self) -> None:
        g = torch.Generator().manual_seed(0)
        self.ids = torch.randint(0, LLAMA["vocab_size"], (GLOBAL_BATCH * STEPS, 8), generator=g)

    def __len__(self) -> int:
        return len(self.ids)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return {"input_ids": self.ids[i], "labels": self.ids[i]}


def arguments(out: Path, ranks: int) -> TrainingArguments:
    return TrainingArguments(
        output_dir=str(out),
        per_device_train_batch_size=GLOBAL_BATCH // ranks,
        max_steps=STEPS,
        learning_rate=1e-2,
        warmup_steps=1,
        max_grad_norm=0.5,
        logging_steps=1,
        save_strategy=os.environ.get("SAVE", "steps"),
        save_steps=2,
        train_sampling_strategy="sequential",
        report_to=[],
        use_cpu=True,
        disable_tqdm=True,
        seed=0,
        optim=os.environ.get("OPTIM", "adamw_torch_fused"),
    )


def model() -> LlamaForCausalLM:
    torch.manual_seed(0)
    return LlamaForCausalLM(LlamaConfig(**LLAMA))


def losses(trainer: Trainer) -> list[float]:
    return [entry["loss"] for entry in trainer.state.log_history if "loss" in entry]


def reference(out: Path) -> None:
    trainer = Trainer(model=model(), args=arguments(out / "run", 1), train_dataset=Tokens())
    trainer.train()
    weights = {k: v.contiguous() for k, v in trainer.model.state_dict().items()}
    save_file(weights, str(out / "reference.safetensors"))
    (out / "reference.json").write_text(json.dumps({"losses": losses(trainer)}))


def sharded_trainer(out: Path) -> FlatshardTrainer:
    args = arguments(out, 2)  # first: under torchrun, TrainingArguments starts the group
    sharded = flatshard.fully_shard(model(), auto_wrap_policy={LlamaDecoderLayer})
    return FlatshardTrainer(model=sharded, args=args, train_dataset=Tokens())


def sharded(out: Path) -> None:
    trainer = sharded_trainer(out / "run")
    trainer.train()
    trainer.save_model(str(out / "saved"))
    probe = torch.arange(12).reshape(2, 6)
    with torch.no_grad():
        live = trainer.model(probe).logits  # through flatshard's hooks, on every rank
    resumed = sharded_trainer(out / "run")  # the same output_dir: checkpoint-2 is there
    resumed.train(resume_from_checkpoint=str(out / "run" / "checkpoint-2"))
    resumed.save_model(str(out / "resumed"))
    if torch.distributed.get_rank() == 0:
        torch.save(live, out / "live_logits.pt")
        (out / "sharded.json").write_text(
            json.dumps({"losses": losses(trainer), "resumed_losses": losses(resumed)})
        )


if __name__ == "__main__":
    {"reference": reference, "sharded": sharded}[sys.argv[1]](Path(sys.argv[2]))
