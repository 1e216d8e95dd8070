"""A peft model's LoRA adapters merged into what an export writes.

[Note: exporting a LoRA model]
peft wraps each target layer: its weight becomes ``<layer>.base_layer.weight`` under a
``base_model.model.`` prefix, beside the adapters' ``lora_A``/``lora_B``. Written under
those names, a model that ``from_pretrained`` of the base class loads would match no
entry and start from random weights, with only transformers' table of missing keys to
say so. So ``export_safetensors`` of a peft model writes what the model computes: each
base weight plus its active adapters' products (peft's ``get_delta_weight`` for a linear
layer: ``B @ A`` times the adapter's scaling, transposed for a layer stored input-major
such as GPT-2's ``Conv1D``), under the base model's names, the adapters left out. Of a
module peft trains a copy of (``modules_to_save``: a classifier head), the copy its
forward uses is written under the module's name. The live model is not changed (peft's
own ``merge`` would change the trained weights, and its ``unmerge`` restores them only
to rounding). The adapters are small: they are gathered first, whole, on the writing
rank; each base weight gets its sum as it is written. Adapters that are not a product of
two linear maps (DoRA, embedding and convolution adapters, an adapter with a bias) are
refused by name, and so is an adapter on a weight tied to another (a head tied to the
token embedding): merged, both would change.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

_PREFIX = "base_model.model."


class LoraMerge:
    """The LoRA layers of a peft model, and the sums and names that turn its entries into
    the base model's."""

    def __init__(self, layers: list[tuple[str, Any]], copies: dict[str, str | None]) -> None:
        self.layers = layers  # (name in the model, peft's LoRA layer)
        # peft's trained copies (modules_to_save): wrapper name -> the copy forward uses
        self.copies = copies
        self._adapters = {
            id(param)
            for _, layer in layers
            for part in (layer.lora_A, layer.lora_B)
            for param in part.parameters()
        }
        self._base = {id(layer.base_layer.weight): layer for _, layer in layers}
        self.full: dict[int, torch.Tensor] = {}  # adapter parameter -> its full value (kept)

    @staticmethod
    def of(model: nn.Module) -> LoraMerge | None:
        """The model's LoRA layers and trained copies (None without either)."""
        layers = [(n, m) for n, m in model.named_modules() if _is_lora_layer(m)]
        copies = {n: _copy_in_use(m) for n, m in model.named_modules() if _is_copy(m)}
        return LoraMerge(layers, copies) if layers or copies else None

    def lines(self) -> list[str]:
        """What the export writes, one line per layer (the adapters merged, the copy in
        use): for the ranks to compare (``disable_adapter()`` or ``set_adapter`` on one
        rank would otherwise decide the file by rank 0's alone)."""
        merged = [f"'{name}' merges {sorted(_active(layer))}" for name, layer in self.layers]
        return merged + [f"'{name}' writes copy {use}" for name, use in self.copies.items()]

    def check(self, model: nn.Module, caller: str) -> None:
        """Adapters this export cannot merge, refused by name."""
        names: dict[int, list[str]] = {}
        for name, param in model.named_parameters(remove_duplicate=False):
            names.setdefault(id(param), []).append(name)
        for name, layer in self.layers:
            _check_mergeable(name, layer, caller)
            tied = names.get(id(layer.base_layer.weight), [])
            if len(tied) > 1:
                raise ValueError(
                    f"flatshard.{caller}: '{name}' holds a LoRA adapter on a weight tied to "
                    f"another ({', '.join(repr(n) for n in tied)}): merged, the tied weight "
                    "would change too, and the model reads it unmerged there (e.g. the "
                    "token embedding). Untie them before adding adapters "
                    "(tie_word_embeddings=False), or save the adapters with peft."
                )

    def base_name(self, key: str) -> str | None:
        """A peft model entry's name in the base model (None for what is not written: an
        adapter, a copy forward does not use)."""
        if ".lora_" in key:
            return None
        for wrapper, in_use in self.copies.items():
            original, trained = f"{wrapper}.original_module.", f"{wrapper}.modules_to_save."
            if key.startswith(original):
                if in_use is not None:
                    return None
                key = f"{wrapper}.{key[len(original) :]}"
            elif key.startswith(trained):
                adapter, _, rest = key[len(trained) :].partition(".")
                if adapter != in_use:
                    return None
                key = f"{wrapper}.{rest}"
        return key.removeprefix(_PREFIX).replace(".base_layer.", ".")

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


def _is_copy(module: nn.Module) -> bool:
    """peft's ``ModulesToSaveWrapper``: the original module and trained copies of it."""
    return hasattr(module, "original_module") and hasattr(module, "modules_to_save")


def _copy_in_use(wrapper: Any) -> str | None:
    """The trained copy the wrapper's forward uses (None: the original)."""
    if getattr(wrapper, "disable_adapters", False):
        return None
    active = wrapper.active_adapter
    name = active if isinstance(active, str) else (active[0] if active else None)
    return name if name in wrapper.modules_to_save else None


def _is_lora_layer(module: nn.Module) -> bool:
    return all(hasattr(module, a) for a in ("lora_A", "lora_B", "base_layer", "scaling"))


def _active(layer: Any) -> list[str]:
    """The adapters the layer's forward adds (none where peft merged them already, or
    inside ``disable_adapter()``)."""
    if getattr(layer, "merged_adapters", None) or getattr(layer, "disable_adapters", False):
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
