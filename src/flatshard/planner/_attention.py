"""Attention in a simulation as the target device would run it.

``scaled_dot_product_attention`` picks a kernel by device; on meta it has none and falls
back to the math form, which keeps the (B, heads, T, T) attention weights for backward.
CPUs and GPUs run a fused kernel that keeps only the output and a (B, heads, T) log-sum-exp:
at T = 8192 the difference is gigabytes per layer. While a plan runs, attention on meta
tensors calls the fused kernel the target would pick (their meta forms give the real
shapes of what each keeps for backward).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch
import torch.nn.functional as F

aten = torch.ops.aten


def _fused(device: str, original: Any) -> Any:
    def attention(
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        attn_mask: torch.Tensor | None = None,
        dropout_p: float = 0.0,
        is_causal: bool = False,
        scale: float | None = None,
        enable_gqa: bool = False,
    ) -> torch.Tensor:
        if not query.is_meta:
            kept: torch.Tensor = original(
                query,
                key,
                value,
                attn_mask,
                dropout_p,
                is_causal,
                scale=scale,
                enable_gqa=enable_gqa,
            )
            return kept
        if device == "cpu":  # (both fused kernels take grouped-query key/value heads as is)
            out = aten._scaled_dot_product_flash_attention_for_cpu(
                query, key, value, dropout_p, is_causal, attn_mask=attn_mask, scale=scale
            )
        elif attn_mask is None:
            out = aten._scaled_dot_product_flash_attention(
                query, key, value, dropout_p, is_causal, scale=scale
            )
        else:  # a mask: the memory-efficient kernel (it repeats grouped heads itself)
            if key.size(-3) != query.size(-3):
                repeat = query.size(-3) // key.size(-3)
                key = key.repeat_interleave(repeat, -3)
                value = value.repeat_interleave(repeat, -3)
            bias = _bias(attn_mask, query)
            out = aten._scaled_dot_product_efficient_attention(
                query, key, value, bias, True, dropout_p, is_causal, scale=scale
            )
        result: torch.Tensor = out[0]
        return result

    return attention


def _bias(mask: torch.Tensor, query: torch.Tensor) -> torch.Tensor:
    shape = (*query.shape[:-1], mask.size(-1))
    if mask.dtype == torch.bool:
        mask = torch.zeros(mask.shape, dtype=query.dtype, device=mask.device).masked_fill(
            ~mask, float("-inf")
        )
    return mask.expand(shape)


@contextlib.contextmanager
def fused_attention(device: str) -> Iterator[None]:
    """Attention on meta tensors runs ``device``'s fused kernel (see the module docstring)."""
    original = F.scaled_dot_product_attention
    F.scaled_dot_product_attention = _fused(device, original)
    try:
        yield
    finally:
        F.scaled_dot_product_attention = original
