"""FlatshardTrainer: the Hugging Face Trainer on a sharded tiny Llama at 2 ranks, against
the unsharded Trainer on the same global batch (``transformers_script.py``)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

pytest.importorskip("transformers")
from safetensors.torch import load_file

from flatshard.testing.scripts import against_reference, run_ranks, run_results

SCRIPT = Path(__file__).with_name("transformers_script.py")
TOLERANCE = 1e-5


@pytest.fixture(scope="module")
def out(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("trainer")
    against_reference(SCRIPT, out)
    return out


def _assert_same_weights(mine: dict[str, torch.Tensor], theirs: dict[str, torch.Tensor]) -> None:
    assert mine.keys() == theirs.keys()
    for name, value in mine.items():
        torch.testing.assert_close(value, theirs[name], atol=TOLERANCE, rtol=0, msg=name)


def test_trainer_matches_the_unsharded_run(out: Path) -> None:
    results = run_results(out)
    mine, theirs = results["sharded"]["losses"], results["reference"]["losses"]
    assert len(mine) == len(theirs) == 4
    assert all(abs(a - b) <= TOLERANCE for a, b in zip(mine, theirs, strict=True)), (mine, theirs)
    # The saved model holds the unsharded run's final weights (clipping included).
    _assert_same_weights(
        load_file(str(out / "saved" / "model.safetensors")),
        load_file(str(out / "reference.safetensors")),
    )


def test_accumulation_and_evaluation_match_the_unsharded_run(out: Path) -> None:
    results = run_results(out)
    mine, theirs = results["sharded"]["accumulated_losses"], results["reference"]["losses"]
    assert mine == pytest.approx(theirs, abs=TOLERANCE)
    _assert_same_weights(
        load_file(str(out / "accumulated" / "model.safetensors")),
        load_file(str(out / "reference.safetensors")),
    )
    assert results["sharded"]["eval_loss"] == pytest.approx(
        results["reference"]["eval_loss"], abs=TOLERANCE
    )
    # The same data as an IterableDataset (no number of batches to agree on): the same loss
    assert results["sharded"]["iterable_eval_loss"] == pytest.approx(
        results["reference"]["eval_loss"], abs=TOLERANCE
    )


def test_save_model_loads_with_from_pretrained(out: Path) -> None:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(out / "saved"))
    with torch.no_grad():
        logits = model(torch.arange(12).reshape(2, 6)).logits
    torch.testing.assert_close(logits, torch.load(out / "live_logits.pt"), atol=TOLERANCE, rtol=0)


def test_resume_from_a_trainer_checkpoint_continues_identically(out: Path) -> None:
    results = run_results(out)["sharded"]
    assert results["resumed_losses"] == pytest.approx(results["losses"], abs=1e-6)
    assert (out / "run" / "checkpoint-2" / "flatshard" / "flatshard.json").is_file()
    _assert_same_weights(
        load_file(str(out / "resumed" / "model.safetensors")),
        load_file(str(out / "saved" / "model.safetensors")),
    )


def test_lora_adapters_train_and_save_as_peft_does(out: Path) -> None:
    # save_model of a peft model writes the adapters only, under peft's names
    mine = out / "lora-adapter"
    assert (mine / "adapter_config.json").is_file()
    adapters = load_file(str(mine / "adapter_model.safetensors"))
    _assert_same_weights(
        adapters, load_file(str(out / "reference-lora" / "adapter_model.safetensors"))
    )
    assert all(v.abs().sum() > 0 for k, v in adapters.items() if "lora_B" in k)  # trained
    assert not any("base_layer" in k for k in adapters)


def test_an_unsharded_model_is_a_named_error() -> None:
    from transformers import LlamaConfig, LlamaForCausalLM

    from flatshard.integrations.transformers import FlatshardTrainer

    model = LlamaForCausalLM(
        LlamaConfig(
            vocab_size=8,
            hidden_size=8,
            num_hidden_layers=1,
            num_attention_heads=2,
            intermediate_size=8,
        )
    )
    with pytest.raises(ValueError, match=r"takes a model sharded by flatshard, got LlamaFor"):
        FlatshardTrainer(model=model)
    with pytest.raises(ValueError, match=r"got a model name \('Qwen/Qwen3-0.6B'\); build"):
        FlatshardTrainer(model="Qwen/Qwen3-0.6B")  # type: ignore[arg-type]


def test_a_rank_that_differs_is_named_on_every_rank(tmp_path: Path) -> None:
    """Before: with logging_steps differing, Accelerate's gather of the loss met the other
    rank's all-gather (gloo's "Received data size doesn't match", SIGABRT); with another
    eval batch size, the loss printed was wrong, then SIGABRT; evaluate() on rank 0 alone:
    its gather of the losses, before any forward, met rank 1's all-gather (SIGABRT)."""
    for status, output in run_ranks(SCRIPT, "one_rank_differs", str(tmp_path), cwd=tmp_path):
        assert status != 0, output[-3000:]
        assert "logging_steps: ValueError" in output, output[-3000:]
        assert "rank 0 only: TrainingArguments.logging_steps=1" in output, output[-3000:]
        assert "rank 1 only: TrainingArguments.logging_steps=2" in output, output[-3000:]
        said = "per_device_eval_batch_size: CollectiveMismatchError"
        assert said in output and "evaluation (evaluate, predict) of 8 batches" in output
        assert "evaluation (evaluate, predict) of 4 batches" in output, output[-3000:]
        assert "Every rank called FlatshardTrainer evaluation at the same point" in output
        assert "evaluation alone: CollectiveMismatchError" in output, output[-3000:]
        assert "FlatshardTrainer evaluation (evaluate, predict)" in output, output[-3000:]


def test_every_trainer_method_overridden_is_the_installed_trainers() -> None:
    """The hooks FlatshardTrainer overrides are the Trainer's own: a rename in transformers
    would leave an override that is never called."""
    import inspect

    from transformers import Trainer

    from flatshard.integrations.transformers import FlatshardTrainer

    overridden = [
        name
        for name, value in vars(FlatshardTrainer).items()
        if inspect.isfunction(value) and name != "__init__"
    ]
    assert {"evaluation_loop", "train", "_save"} <= set(overridden), overridden
    assert not [name for name in overridden if not hasattr(Trainer, name)], overridden
