"""``flatshard train --lora``: LoRA adapters (peft) on a Hugging Face model, sharded.

[Note: LoRA in the CLI]
peft wraps each target module: its weight becomes ``<module>.base_layer.weight`` under a
``base_model.model.`` prefix, next to new ``lora_A``/``lora_B`` weights. The adapters are
added before ``fully_shard`` (after it, flatshard refuses the changed model), so the frozen
base and the trainable adapters of a block land in one unit, in separate FlatParameters.
With ``--init pretrained`` the model is on meta: the base is left for the sharded load,
whose ``names=`` maps peft's names back to the checkpoint's; the adapters are initialized as
peft does (A: Kaiming-uniform, B: zeros, so training starts from the pretrained function).
At the end each block is gathered in turn, its adapters merged into the base weights
(peft's own ``merge``) and written back, and the model is exported under the base names
without the adapters: ``from_pretrained`` loads a plain model with the fine-tuned weights.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from torch import nn

import flatshard
from flatshard.cli.config import ConfigError

_PREFIX = "base_model.model."
_ADAPTER = re.compile(r"(^|\.)lora_[A-Za-z_]+(\.|$)")  # lora_A, lora_B, lora_embedding_A, ...


@dataclass(frozen=True)
class LoraSpec:
    """``--lora r=8,alpha=16,targets=q_proj,v_proj,dropout=0.05``."""

    r: int
    alpha: int
    targets: tuple[str, ...]
    dropout: float = 0.0


def parse_lora(text: str) -> LoraSpec:
    """'r=8,alpha=16,targets=q_proj,v_proj': names after ``targets=`` without '=' are targets."""
    values: dict[str, str] = {}
    targets: list[str] = []
    last = ""
    for item in filter(None, (part.strip() for part in text.split(","))):
        key, sep, raw = item.partition("=")
        if not sep and last == "targets":
            targets.append(item)
            continue
        if not sep or key not in ("r", "alpha", "targets", "dropout"):
            raise ConfigError(
                f"--lora: expected r=, alpha=, targets= or dropout=, got {item!r} "
                "(e.g. --lora r=8,alpha=16,targets=q_proj,v_proj)"
            )
        last = key
        if key == "targets":
            targets.append(raw)
        else:
            values[key] = raw
    return _checked(values, [t for t in targets if t])


def _checked(values: dict[str, str], targets: list[str]) -> LoraSpec:
    try:
        r = int(values.get("r", "8"))
        alpha = int(values.get("alpha", str(2 * r)))
        dropout = float(values.get("dropout", "0"))
    except ValueError as error:
        raise ConfigError(f"--lora: {error}") from None
    if r < 1 or alpha <= 0 or not 0 <= dropout < 1:
        raise ConfigError(
            f"--lora: needs r >= 1, alpha > 0 and 0 <= dropout < 1, got r={r}, "
            f"alpha={alpha}, dropout={dropout:g}"
        )
    if not targets:
        raise ConfigError("--lora: name the modules to adapt, e.g. targets=q_proj,v_proj")
    return LoraSpec(r, alpha, tuple(targets), dropout)


def add_adapters(model: nn.Module, spec: LoraSpec) -> nn.Module:
    """The peft model: ``model`` frozen, with LoRA adapters on the target modules."""
    try:
        from peft import LoraConfig, get_peft_model
    except ImportError:
        raise ConfigError("--lora needs the peft package: pip install peft") from None
    config = LoraConfig(
        r=spec.r,
        lora_alpha=spec.alpha,
        target_modules=list(spec.targets),
        lora_dropout=spec.dropout,
    )
    try:
        adapted: nn.Module = get_peft_model(model, config)
    except ValueError as error:  # e.g. a target that matches no module
        first = str(error).strip().splitlines()[0]
        raise ConfigError(f"--lora: {first}") from None
    return adapted


def checkpoint_name(key: str) -> str | None:
    """A peft model entry's name in the base checkpoint; None for the adapters."""
    if _ADAPTER.search(key):
        return None
    key = key.removeprefix(_PREFIX)
    return key.replace(".base_layer.", ".")


def adapter_init(
    model: nn.Module, base_init: Callable[[nn.Module], None]
) -> Callable[[nn.Module], None]:
    """A ``param_init_fn``: adapters as peft initializes them, the rest by ``base_init``."""
    a_modules = {id(m) for n, m in model.named_modules() if ".lora_A." in f".{n}."}
    b_modules = {id(m) for n, m in model.named_modules() if ".lora_B." in f".{n}."}

    def init(module: nn.Module) -> None:
        if id(module) in a_modules:
            module.reset_parameters()  # type: ignore[operator]  # Kaiming-uniform, a=sqrt(5)
        elif id(module) in b_modules:
            for param in module.parameters(recurse=False):
                nn.init.zeros_(param)
        else:
            base_init(module)

    return init


def merge_adapters(model: nn.Module, unit_classes: set[type[nn.Module]]) -> None:
    """Fold every adapter into its base weight, one block gathered at a time (a collective).

    Adapters outside the blocks (e.g. on the LM head) need the whole model gathered once.
    """
    blocks = [m for m in model.modules() if type(m) in unit_classes]
    for block in blocks:
        with flatshard.summon_full_params(block):
            for layer in _adapted_layers(block):
                layer.merge()
    inside = {id(m) for block in blocks for m in block.modules()}
    if any(id(layer) not in inside for layer in _adapted_layers(model)):
        with flatshard.summon_full_params(model):
            for layer in _adapted_layers(model):
                if id(layer) not in inside:
                    layer.merge()


def _adapted_layers(part: nn.Module) -> list[Any]:
    """peft's LoRA layers (they hold ``lora_A`` and know how to ``merge``)."""
    return [
        m for m in part.modules() if hasattr(m, "lora_A") and callable(getattr(m, "merge", None))
    ]
