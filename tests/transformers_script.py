"""Hugging Face Trainer runs for test_transformers_trainer.py.

``python transformers_script.py reference OUT``: the unsharded Trainer, one process, the
global batch. ``torchrun --nproc-per-node 2 transformers_script.py sharded OUT``: the same
training with ``FlatshardTrainer`` (half the batch on each rank), its ``save_model``, a
second run resumed from the first's step-2 checkpoint, and a third that accumulates the
same global batch over 2 micro-batches, then evaluates; and both train peft's LoRA.
Results go to OUT as JSON and safetensors. ``one_rank_differs OUT`` (each rank started
alone): a training argument, then an evaluation's batches differ on one rank, then rank 0
evaluates while rank 1 trains.
"""

from __future__ import annotations

import json
import os
import sys
from collections.abc import Iterator
from pathlib import Path

import torch
from safetensors.torch import save_file
from torch import nn
from transformers import LlamaConfig, LlamaForCausalLM, Trainer, TrainingArguments
from transformers.models.llama.modeling_llama import LlamaDecoderLayer

import flatshard
from flatshard.integrations.transformers import FlatshardTrainer
from flatshard.testing.models import TINY_LLAMA

LLAMA = TINY_LLAMA
GLOBAL_BATCH, STEPS = 4, 4


class Tokens(torch.utils.data.Dataset[dict[str, torch.Tensor]]):
    def __init__(self) -> None:
        g = torch.Generator().manual_seed(0)
        self.ids = torch.randint(0, LLAMA["vocab_size"], (GLOBAL_BATCH * STEPS, 8), generator=g)

    def __len__(self) -> int:
        return len(self.ids)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return {"input_ids": self.ids[i], "labels": self.ids[i]}


class IterTokens(torch.utils.data.IterableDataset[dict[str, torch.Tensor]]):
    """``Tokens`` as an iterable dataset: no length."""

    def __iter__(self) -> Iterator[dict[str, torch.Tensor]]:
        tokens = Tokens()
        return (tokens[i] for i in range(len(tokens)))


def arguments(out: Path, ranks: int, accumulate: int = 1) -> TrainingArguments:
    return TrainingArguments(
        output_dir=str(out),
        per_device_train_batch_size=GLOBAL_BATCH // ranks // accumulate,
        gradient_accumulation_steps=accumulate,
        per_device_eval_batch_size=GLOBAL_BATCH // ranks,
        max_steps=STEPS,
        learning_rate=1e-2,
        warmup_steps=1,
        max_grad_norm=0.5,
        logging_steps=1,
        save_strategy="steps",
        save_steps=2,
        train_sampling_strategy="sequential",
        report_to=[],
        use_cpu=True,
        disable_tqdm=True,
        seed=0,
    )


def model() -> LlamaForCausalLM:
    torch.manual_seed(0)
    return LlamaForCausalLM(LlamaConfig(**LLAMA))


def lora_model() -> nn.Module:
    from peft import LoraConfig, get_peft_model

    return get_peft_model(model(), LoraConfig(r=4, target_modules=["q_proj", "v_proj"]))


def losses(trainer: Trainer) -> list[float]:
    return [entry["loss"] for entry in trainer.state.log_history if "loss" in entry]


def reference(out: Path) -> None:
    trainer = Trainer(model=model(), args=arguments(out / "run", 1), train_dataset=Tokens())
    trainer.train()
    weights = {k: v.contiguous() for k, v in trainer.model.state_dict().items()}
    save_file(weights, str(out / "reference.safetensors"))
    evaluated = trainer.evaluate(Tokens())["eval_loss"]
    lora = Trainer(model=lora_model(), args=arguments(out / "lora", 1), train_dataset=Tokens())
    lora.train()
    lora.save_model(str(out / "reference-lora"))
    (out / "reference.json").write_text(
        json.dumps({"losses": losses(trainer), "eval_loss": evaluated})
    )


def sharded_trainer(
    out: Path, accumulate: int = 1, lora: bool = False, **differing: int
) -> FlatshardTrainer:
    args = arguments(out, 2, accumulate)  # first: under torchrun it starts the group
    for name, value in differing.items():
        setattr(args, name, value)
    plain = lora_model() if lora else model()
    sharded = flatshard.fully_shard(plain, auto_wrap_policy={LlamaDecoderLayer})
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
    # The same global batch as 2 micro-batches of 1 per rank: flatshard.no_sync for the first
    accumulating = sharded_trainer(out / "accumulate", accumulate=2)
    accumulating.train()
    accumulating.save_model(str(out / "accumulated"))
    evaluated = accumulating.evaluate(Tokens())["eval_loss"]
    iterable = accumulating.evaluate(IterTokens())["eval_loss"]  # (no number of batches)
    lora = sharded_trainer(out / "lora", lora=True)  # peft's LoRA, sharded after get_peft_model
    lora.train()
    lora.save_model(str(out / "lora-adapter"))
    if torch.distributed.get_rank() == 0:
        torch.save(live, out / "live_logits.pt")
        results = {"losses": losses(trainer), "resumed_losses": losses(resumed)}
        results |= {"accumulated_losses": losses(accumulating), "eval_loss": evaluated}
        results["iterable_eval_loss"] = iterable
        (out / "sharded.json").write_text(json.dumps(results))


def one_rank_differs(out: Path) -> None:
    """Each rank started alone; one rank differs three times in turn, and each rank prints
    the error each time ends with: ``logging_steps`` (train), ``per_device_eval_batch_size``
    (evaluate alone: another number of batches), then rank 0 evaluates while rank 1 trains.
    """
    flatshard.set_checks(flatshard.Checks(timeout=30.0))
    rank = int(os.environ["RANK"])
    for name in ("logging_steps", "per_device_eval_batch_size"):
        differing = sharded_trainer(out, **{name: 1 + rank})
        try:
            differing.train() if name == "logging_steps" else differing.evaluate(Tokens())
        except (ValueError, flatshard.CollectiveError) as error:
            print(f"{name}: {type(error).__name__}: {error}", flush=True)
    trainer = sharded_trainer(out)
    try:
        if rank == 0:
            trainer.evaluate(Tokens())
        else:
            trainer.model(torch.arange(12).reshape(2, 6)).logits.sum().backward()
    except flatshard.CollectiveError as error:
        print(f"evaluation alone: {type(error).__name__}: {error}", flush=True)
        sys.exit(3)


if __name__ == "__main__":
    runs = {"reference": reference, "sharded": sharded, "one_rank_differs": one_rank_differs}
    runs[sys.argv[1]](Path(sys.argv[2]))
