"""A peft model's LoRA adapters merged into what an export writes.

[Note: exporting a LoRA model]
peft wraps each target layer: its weight becomes ``<layer>.base_layer.weight`` under a
``base_model.model.`` prefix, beside the adapters' ``lora_A``/``lora_B``. Written under
those names, a model that ``from_pretrained`` of the base class loads would match no
entry and start from random weights, with only transformers' table of missing keys to
say so. So ``export_safetensors`` of a peft model writes what the model computes: each
base weight plus its active adapters' products (peft's ``get_delta_weight`` for a linear
layer: ``B @ A`` times the adapter's scaling, transposed for a layer stored input-major
such as GPT-2's ``Conv1D``), under the base model's names, the adapters left out. The
live model is not changed (peft's own ``merge`` would change the trained weights, and its
``unmerge`` restores them only to rounding). The adapters are small: they are gathered
first, whole, on the writing rank; each base weight gets its sum as it is written.
Adapters that are not a product of two linear maps (DoRA, embedding and convolution
adapters, an adapter with a bias) are refused by name.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

_PREFIX = "base_model.model."


class LoraMerge:
    """The LoRA layers of a peft model, and the sums that turn its entries into the base
    model's."""

    def __init__(self, layers: list[tuple[str, Any]]) -> None:
        self.layers = layers  # (name in the model, peft's LoRA layer)
        self._adapters = {
            id(param)
            for _, layer in layers
            for part in (layer.lora_A, layer.lora_B)
            for param in part.parameters()
        }
        self._base = {id(layer.base_layer.weight): layer for _, layer in layers}
        self.full: dict[int, torch.Tensor] = {}  # adapter parameter -> its full value (kept)

    @staticmethod
    def of(model: nn.Module, caller: str) -> LoraMerge | None:
        """The model's LoRA layers (None without any); unsupported adapters refused."""
        layers = [(n, m) for n, m in model.named_modules() if _is_lora_layer(m)]
        if not layers:
            return None
        for name, layer in layers:
            _check_mergeable(name, layer, caller)
        return LoraMerge(layers)

    def is_adapter(self, param: torch.Tensor) -> bool:
        return id(param) in self._adapters

    def keep(self, param: torch.Tensor, full: torch.Tensor) -> None:
        """``param``'s full value, gathered for the sums."""
        self.full[id(param)] = full

    def merged(self, param: torch.Tensor, full: torch.Tensor) -> torch.Tensor:
        """``full`` (``param``'s gathered value) with its layer's active adapters added."""
        layer = self._base.get(id(param))
        if layer is None:
            return full
        merged = full.clone()
        for adapter in _active(layer):
            a = self.full[id(layer.lora_A[adapter].weight)]
            b = self.full[id(layer.lora_B[adapter].weight)]
            delta = (b.to(torch.float32) @ a.to(torch.float32)) * layer.scaling[adapter]
            if getattr(layer, "fan_in_fan_out", False):
                delta = delta.T
            merged += delta.to(merged.dtype)
        return merged


def base_name(key: str) -> str | None:
    """A peft model entry's name in the base model (None for an adapter's)."""
    if ".lora_" in key:
        return None
    return key.removeprefix(_PREFIX).replace(".base_layer.", ".")


def _is_lora_layer(module: nn.Module) -> bool:
    return all(hasattr(module, a) for a in ("lora_A", "lora_B", "base_layer", "scaling"))


def _active(layer: Any) -> list[str]:
    """The adapters the layer's forward adds (none where peft merged them already)."""
    if getattr(layer, "merged_adapters", None):
        return []
    active = layer.active_adapters
    names = [active] if isinstance(active, str) else list(active)
    return [name for name in names if name in layer.lora_A]


def _check_mergeable(name: str, layer: Any, caller: str) -> None:
    unsupported = ""
    if any(getattr(layer, "use_dora", {}).get(a, False) for a in _active(layer)):
        unsupported = "DoRA (a magnitude per column)"
    elif len(getattr(layer, "lora_embedding_A", {})):
        unsupported = "an embedding adapter"
    elif getattr(layer.base_layer, "weight", None) is None or layer.base_layer.weight.dim() != 2:
        unsupported = f"an adapter on a {type(layer.base_layer).__name__}"
    elif any(layer.lora_B[a].bias is not None for a in _active(layer)):
        unsupported = "an adapter with a bias (lora_bias)"
    if unsupported:
        raise ValueError(
            f"flatshard.{caller}: '{name}' holds {unsupported}, which this export does not "
            "merge into the base weights. Merge it with peft first (inside "
            "flatshard.summon_full_params(model): model.merge_adapter()) and pass names= "
            "to write the base model's names, or save the adapters with peft."
        )
