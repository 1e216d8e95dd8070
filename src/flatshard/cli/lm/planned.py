"""The models ``flatshard plan`` can plan: the built-in GPT, a Hugging Face config, or a
``package.module:function`` that returns a model (called under the meta device)."""

from __future__ import annotations

import copy
import importlib
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Any, cast

import torch
from torch import nn

from flatshard.cli.config import ConfigError
from flatshard.cli.lm.config import TrainConfig
from flatshard.cli.lm.model import (
    block_class,
    checkpoint_hf_blocks,
    freeze,
    hf_config,
    transformers_module,
)
from flatshard.models import GPT, GPTBlock


@dataclass(frozen=True)
class PlannedModel:
    build: Callable[[bool], Callable[[], nn.Module]]  # checkpointing -> build()
    unit_classes: set[type[nn.Module]]
    vocab: int
    description: str


def planned_model(
    spec: str, train: TrainConfig, vocab: int, fit_to_bytes: bool = False, untied: bool = False
) -> PlannedModel:
    """``fit_to_bytes``: a Hugging Face model as ``flatshard train`` builds it (vocabulary
    of bytes), with its --freeze patterns applied. ``untied``: the GPT's head a weight of
    its own (as ``flatshard train --pp`` builds it)."""
    if spec == "gpt":
        return _frozen(_gpt(train, vocab, untied), train.freeze)
    if spec.startswith("hf:"):
        return _frozen(_hugging_face(train, fit_to_bytes), train.freeze)
    if ":" in spec:
        return _entry_point(spec, vocab)
    raise ConfigError(
        f"--model: expected gpt, hf:<config> or package.module:function, got {spec!r}"
    )


def _gpt(train: TrainConfig, vocab: int, untied: bool) -> PlannedModel:
    def build(checkpointing: bool) -> Callable[[], nn.Module]:
        def make() -> nn.Module:
            model = GPT(vocab, train.dim, train.heads, train.layers, train.seq_len, not untied)
            model.checkpoint_blocks = checkpointing
            return model

        return make

    description = f"GPT ({train.layers} blocks, width {train.dim}, vocabulary {vocab})"
    return PlannedModel(build, {GPTBlock}, vocab, description)


def _frozen(model: PlannedModel, patterns: str) -> PlannedModel:
    if not patterns:
        return model

    def build(checkpointing: bool) -> Callable[[], nn.Module]:
        def make() -> nn.Module:
            module = model.build(checkpointing)()
            freeze(module, patterns)
            return module

        return make

    return replace(model, build=build)


def _hugging_face(train: TrainConfig, fit_to_bytes: bool) -> PlannedModel:
    transformers = transformers_module()
    settings = hf_config(transformers, train, fit_to_bytes=fit_to_bytes)

    def build(checkpointing: bool) -> Callable[[], nn.Module]:
        def make() -> nn.Module:
            # A config of its own: a plan is the same whatever was planned before it in
            # the process (one build's changes to its config stay its own).
            model = transformers.AutoModelForCausalLM.from_config(copy.deepcopy(settings))
            if checkpointing:
                checkpoint_hf_blocks(model)
            return cast(nn.Module, model)

        return make

    with torch.device("meta"):
        block = block_class(build(False)())
    description = f"{train.model[3:]} (units: {block.__name__}, vocabulary {settings.vocab_size})"
    return PlannedModel(build, {block}, int(settings.vocab_size), description)


def _entry_point(spec: str, vocab: int) -> PlannedModel:
    module_name, _, name = spec.partition(":")
    try:
        factory = getattr(importlib.import_module(module_name), name)
    except (ImportError, AttributeError) as error:
        raise ConfigError(f"--model {spec}: {error}") from None

    def build(checkpointing: bool) -> Callable[[], nn.Module]:
        def make() -> nn.Module:
            model = cast(nn.Module, factory())
            if checkpointing:
                _checkpointing_on(model, spec)
            return model

        return make

    with torch.device("meta"):
        block = block_class(build(False)())
    return PlannedModel(build, {block}, vocab, f"{spec} (units: {block.__name__})")


def _checkpointing_on(model: Any, spec: str) -> None:
    if checkpoint_hf_blocks(model):
        return
    if hasattr(model, "checkpoint_blocks"):
        model.checkpoint_blocks = True
    else:
        raise ConfigError(
            f"--checkpoint-activations: {spec} returns a model with neither "
            "activation_checkpointing_enable() (gradient_checkpointing_enable()) nor a "
            "checkpoint_blocks attribute"
        )


def language_model_loss(model: nn.Module, batch: tuple[torch.Tensor, ...]) -> torch.Tensor:
    """Next-token cross-entropy of a model that maps ids (B, T) to logits (B, T, V)."""
    (ids,) = batch
    # A transformers model: without a key-value cache, as flatshard train calls it.
    takes_cache = getattr(getattr(model, "config", None), "use_cache", None) is not None
    out = model(ids, use_cache=False) if takes_cache else model(ids)
    logits = cast(torch.Tensor, getattr(out, "logits", out))
    return nn.functional.cross_entropy(logits.flatten(0, 1).float(), ids.flatten())


def stage_loss(logits: torch.Tensor, batch: tuple[torch.Tensor, ...]) -> torch.Tensor:
    """``language_model_loss`` as a pipeline's last stage computes it: the logits it
    returns against the ids the first stage took."""
    return nn.functional.cross_entropy(logits.flatten(0, 1).float(), batch[0].flatten())
