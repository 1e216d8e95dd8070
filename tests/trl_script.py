"""TRL SFTTrainer runs for test_trl.py.

``python trl_script.py reference OUT``: the unsharded ``SFTTrainer``, one process, the
global batch. ``torchrun --nproc-per-node 2 trl_script.py sharded OUT``: the same
training with ``FlatshardSFTTrainer`` (half the batch on each rank) and its
``save_model``; then the same global batch as 2 accumulated micro-batches per rank. The
sequences differ in length (padding, and labels masked by TRL's collator), activation
checkpointing is on (SFTConfig's default) and the gradient is clipped. Results go to OUT.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch
from datasets import Dataset
from safetensors.torch import save_file
from tokenizers import Tokenizer
from tokenizers.models import WordLevel
from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast, Trainer
from transformers.models.llama.modeling_llama import LlamaDecoderLayer
from trl import SFTConfig, SFTTrainer

import flatshard
from flatshard.integrations.trl import FlatshardSFTTrainer
from flatshard.testing.models import TINY_LLAMA

GLOBAL_BATCH, STEPS = 4, 4


def tokenizer() -> PreTrainedTokenizerFast:
    """A word-level tokenizer over the tiny vocabulary ("t0" pads, "t2" ends a sequence)."""
    vocab = {f"t{i}": i for i in range(TINY_LLAMA["vocab_size"])}
    made = PreTrainedTokenizerFast(tokenizer_object=Tokenizer(WordLevel(vocab, unk_token="t1")))
    made.pad_token, made.eos_token = "t0", "t2"
    return made


def dataset() -> Dataset:
    """Token ids of 4 to 8 tokens (TRL pads each batch to its longest)."""
    g = torch.Generator().manual_seed(0)
    rows = []
    for _ in range(GLOBAL_BATCH * STEPS):
        length = int(torch.randint(4, 9, (1,), generator=g))
        rows.append(torch.randint(3, TINY_LLAMA["vocab_size"], (length,), generator=g).tolist())
    return Dataset.from_dict({"input_ids": rows})


def arguments(out: Path, ranks: int, accumulate: int = 1) -> SFTConfig:
    return SFTConfig(
        output_dir=str(out),
        per_device_train_batch_size=GLOBAL_BATCH // ranks // accumulate,
        gradient_accumulation_steps=accumulate,
        max_steps=STEPS,
        learning_rate=1e-2,
        warmup_steps=1,
        max_grad_norm=0.5,
        logging_steps=1,
        save_strategy="no",
        train_sampling_strategy="sequential",
        report_to=[],
        use_cpu=True,
        bf16=False,
        disable_tqdm=True,
        seed=0,
    )


def model() -> LlamaForCausalLM:
    torch.manual_seed(0)
    return LlamaForCausalLM(LlamaConfig(**TINY_LLAMA))


def losses(trainer: Trainer) -> list[float]:
    return [entry["loss"] for entry in trainer.state.log_history if "loss" in entry]


def reference(out: Path) -> None:
    trainer = SFTTrainer(
        model=model(), args=arguments(out / "run", 1), train_dataset=dataset(),
        processing_class=tokenizer(),
    )  # fmt: skip
    trainer.train()
    weights = {k: v.contiguous() for k, v in trainer.model.state_dict().items()}
    save_file(weights, str(out / "reference.safetensors"))
    (out / "reference.json").write_text(json.dumps({"losses": losses(trainer)}))


def sharded_trainer(out: Path, accumulate: int = 1) -> FlatshardSFTTrainer:
    args = arguments(out, 2, accumulate)  # first: under torchrun it starts the group
    sharded = flatshard.fully_shard(model(), auto_wrap_policy={LlamaDecoderLayer})
    return FlatshardSFTTrainer(
        model=sharded, args=args, train_dataset=dataset(), processing_class=tokenizer()
    )


def sharded(out: Path) -> None:
    trainer = sharded_trainer(out / "run")
    trainer.train()
    trainer.save_model(str(out / "saved"))
    accumulating = sharded_trainer(out / "accumulate", accumulate=2)
    accumulating.train()
    accumulating.save_model(str(out / "accumulated"))
    refused = ""
    try:
        from peft import LoraConfig

        FlatshardSFTTrainer(
            model=trainer.model, args=arguments(out / "peft", 2),
            train_dataset=dataset(), processing_class=tokenizer(),
            peft_config=LoraConfig(r=4, target_modules=["q_proj"]),
        )  # fmt: skip
    except ValueError as error:
        refused = str(error)
    if torch.distributed.get_rank() == 0:
        results = {"losses": losses(trainer), "accumulated_losses": losses(accumulating)}
        (out / "sharded.json").write_text(json.dumps(results | {"peft_refused": refused}))


if __name__ == "__main__":
    {"reference": reference, "sharded": sharded}[sys.argv[1]](Path(sys.argv[2]))
