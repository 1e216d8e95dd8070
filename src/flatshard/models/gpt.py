"""A GPT in one sitting (nanoGPT's shape): causal attention blocks, LM head tied to the
token embedding (or untied), each block's MLP dense or a mixture of experts. Used by
``flatshard train``, ``flatshard bench`` and the tests.
"""

from __future__ import annotations

import math
from typing import cast

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from flatshard.models.moe import MoELayer


class Attention(nn.Module):
    def __init__(self, dim: int, heads: int, seq_len: int) -> None:
        super().__init__()
        self.heads = heads
        # No bias: the key bias has an exactly zero gradient (softmax ignores a shift), and
        # AdamW would turn its rounding noise into full-size steps that no parity survives.
        self.qkv = nn.Linear(dim, 3 * dim, bias=False)
        self.proj = nn.Linear(dim, dim)
        mask = torch.tril(torch.ones(seq_len, seq_len, dtype=torch.bool))
        self.register_buffer("causal_mask", mask)  # a buffer: never sharded

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, c = x.shape
        q, k, v = self.qkv(x).split(c, dim=2)  # (B, T, C) each
        q, k, v = (z.view(b, t, self.heads, c // self.heads).transpose(1, 2) for z in (q, k, v))
        att = (q @ k.transpose(-2, -1)) / math.sqrt(c // self.heads)  # (B, nh, T, T)
        mask = cast(torch.Tensor, self.causal_mask)[:t, :t]
        att = att.masked_fill(~mask, float("-inf")).softmax(dim=-1)
        y = (att @ v).transpose(1, 2).reshape(b, t, c)  # (B, T, C)
        out: torch.Tensor = self.proj(y)
        return out


class GPTBlock(nn.Module):
    def __init__(self, dim: int, heads: int, seq_len: int, experts: int = 0) -> None:
        super().__init__()
        self.ln1 = nn.LayerNorm(dim)
        self.attn = Attention(dim, heads, seq_len)
        self.ln2 = nn.LayerNorm(dim)
        self.mlp: nn.Module = (
            # top-2 of ``experts``, each half the dense MLP's width: the same compute a token
            MoELayer(experts, dim, 2 * dim, top_k=2)
            if experts
            else nn.Sequential(nn.Linear(dim, 4 * dim), nn.GELU(), nn.Linear(4 * dim, dim))
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln1(x))
        out: torch.Tensor = x + self.mlp(self.ln2(x))
        return out


class GPT(nn.Module):
    """Token + position embeddings, ``layers`` blocks, final norm, head tied to the embedding
    (``tied=False``: a head of its own); ``experts`` > 0: each block's MLP is a mixture of
    that many experts (top-2), their stacked weights named ``blocks.i.mlp.experts.w1/w2``."""

    def __init__(
        self,
        vocab: int,
        dim: int,
        heads: int,
        layers: int,
        seq_len: int,
        tied: bool = True,
        experts: int = 0,
    ) -> None:
        super().__init__()
        self.seq_len = seq_len
        self.vocab = vocab
        # A pipeline stage holds some of these only (the others None, blocks nn.Identity):
        # the names stay those of the whole model, as torchtitan cuts its models.
        self.tok = nn.Embedding(vocab, dim)
        self.pos = nn.Embedding(seq_len, dim)
        self.blocks = nn.ModuleList(GPTBlock(dim, heads, seq_len, experts) for _ in range(layers))
        self.ln_f = nn.LayerNorm(dim)
        self.head = nn.Linear(dim, vocab, bias=False)
        if tied:
            self.head.weight = self.tok.weight
        # Hugging Face's name and accessors for the tie (a pipeline stage checks them).
        self.tie_word_embeddings = tied
        self.checkpoint_blocks = False  # recompute each block (hooks included) in backward

    def get_input_embeddings(self) -> nn.Module | None:
        return self._modules["tok"]

    def get_output_embeddings(self) -> nn.Module | None:
        return self._modules["head"]

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        """(B, T) ids -> (B, T, vocab) logits; a later pipeline stage takes and an earlier
        one returns (B, T, C) hidden states."""
        x = idx
        parts = self._modules  # a stage's missing parts are None there
        if parts["tok"] is not None:
            positions = torch.arange(idx.shape[1], device=idx.device)
            x = self.tok(idx) + self.pos(positions)  # (B, T, C)
        for block in self.blocks:
            x = checkpoint(block, x, use_reentrant=False) if self.checkpoint_blocks else block(x)
        if parts["head"] is None:
            return x
        out: torch.Tensor = self.head(self.ln_f(x))  # (B, T, vocab)
        return out


def cut_to_stage(model: nn.Module, stage: int, stages: int) -> None:
    """Keep stage ``stage``'s part of the GPT, as torchtitan cuts its models: its blocks
    (the others become nn.Identity, so the names stay the whole model's), the embeddings on
    the first stage, the final norm and the head on the last (None elsewhere)."""
    blocks = cast(nn.ModuleList, model.blocks)
    per = len(blocks) // stages
    for index in range(len(blocks)):
        if not stage * per <= index < (stage + 1) * per:
            blocks[index] = nn.Identity()
    if stage > 0:
        model.tok = model.pos = None  # type: ignore[assignment]
    if stage < stages - 1:
        model.ln_f = model.head = None  # type: ignore[assignment]
