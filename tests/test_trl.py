"""FlatshardSFTTrainer: TRL's SFTTrainer on a sharded tiny Llama at 2 ranks, against the
unsharded SFTTrainer on the same global batch (``trl_script.py``)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

pytest.importorskip("trl")
from safetensors.torch import load_file

from flatshard.testing.scripts import against_reference, run_results

SCRIPT = Path(__file__).with_name("trl_script.py")
TOLERANCE = 1e-5  # as tests/test_transformers_trainer.py


@pytest.fixture(scope="module")
def out(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("trl")
    against_reference(SCRIPT, out)
    return out


def _assert_close(mine: list[float], theirs: list[float]) -> None:
    assert len(mine) == len(theirs) == 4
    assert all(abs(a - b) <= TOLERANCE for a, b in zip(mine, theirs, strict=True)), (mine, theirs)


def test_sft_trainer_matches_the_unsharded_run(out: Path) -> None:
    """Sequences of different lengths (padding), TRL's collator, activation checkpointing
    and clipping: the losses and the saved model are the unsharded SFTTrainer's."""
    results = run_results(out)
    _assert_close(results["sharded"]["losses"], results["reference"]["losses"])
    reference = load_file(str(out / "reference.safetensors"))
    saved = load_file(str(out / "saved" / "model.safetensors"))
    assert saved.keys() == reference.keys()
    for name, value in saved.items():
        torch.testing.assert_close(value, reference[name], atol=TOLERANCE, rtol=0, msg=name)


def test_accumulated_micro_batches_match_the_whole_batch(out: Path) -> None:
    """2 micro-batches of 1 per rank (the first under flatshard.no_sync): the same global
    batch, so the same losses (TRL averages over the window's tokens on every rank)."""
    results = run_results(out)
    _assert_close(results["sharded"]["accumulated_losses"], results["reference"]["losses"])


def test_saved_model_loads_with_from_pretrained(out: Path) -> None:
    from transformers import LlamaForCausalLM

    loaded = LlamaForCausalLM.from_pretrained(out / "saved")
    reference = load_file(str(out / "reference.safetensors"))
    for name, value in loaded.state_dict().items():
        torch.testing.assert_close(value, reference[name], atol=TOLERANCE, rtol=0, msg=name)


def test_peft_config_is_refused_by_name(out: Path) -> None:
    """TRL would wrap the sharded model in peft: the error says to apply it before."""
    refused = run_results(out)["sharded"]["peft_refused"]
    assert refused.startswith("flatshard.integrations.trl: peft_config"), refused
    assert "before flatshard.fully_shard" in refused
