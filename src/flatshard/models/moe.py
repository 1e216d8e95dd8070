"""A mixture-of-experts layer in plain torch: top-k routing over stacked experts.

``GroupedExperts`` is called as torchtitan's is, with tokens sorted by expert and the count
per expert, which is what ``flatshard.Experts`` moves between ranks. Used by the GPT of
``flatshard bench --experts`` and by the tests.
"""

from __future__ import annotations

import math

import torch
from torch import nn


class GroupedExperts(nn.Module):
    """Stacked experts as torchtitan's ``GroupedExperts`` takes them: called with tokens
    sorted by expert and the count per expert, it runs expert ``i`` on its rows. Under
    ``flatshard.Experts`` it holds (and is called for) this rank's experts only."""

    def __init__(self, experts: int, dim: int, hidden: int) -> None:
        super().__init__()
        self.w1 = nn.Parameter(torch.empty(experts, dim, hidden))
        self.w2 = nn.Parameter(torch.empty(experts, hidden, dim))
        self.reset_parameters()

    def reset_parameters(self) -> None:
        with torch.no_grad():
            self.w1.normal_(0.0, self.w1.shape[1] ** -0.5)
            self.w2.normal_(0.0, self.w2.shape[1] ** -0.5)

    def forward(self, x: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
        rows = torch.split(x, counts.tolist())
        outs = [torch.relu(r @ self.w1[i]) @ self.w2[i] for i, r in enumerate(rows)]
        return torch.cat(outs)


class MoELayer(nn.Module):
    """Top-k routing over ``GroupedExperts``; the load-balancing loss of the last forward
    in ``aux_loss`` (the fraction of assignments times the mean router probability per
    expert, Switch Transformer's). ``capacity_factor``: each expert takes at most
    ``ceil(factor * tokens * top_k / experts)`` of this call's assignments, in token order,
    and the rest are dropped (they add nothing); None: dropless."""

    def __init__(
        self, experts: int, dim: int, hidden: int, top_k: int, capacity_factor: float | None = None
    ) -> None:
        super().__init__()
        self.top_k = top_k
        self.capacity_factor = capacity_factor
        self.router = nn.Linear(dim, experts, bias=False)
        self.experts = GroupedExperts(experts, dim, hidden)
        self.aux_loss = torch.zeros(())

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        tokens = x.reshape(-1, x.shape[-1])
        probs = torch.softmax(self.router(tokens), dim=-1)
        weights, chosen = probs.topk(self.top_k, dim=-1)  # (T, k)
        experts = probs.shape[-1]
        flat = chosen.reshape(-1)
        order = torch.argsort(flat, stable=True)
        counts = torch.bincount(flat, minlength=experts)
        share = counts.to(probs.dtype) / flat.numel()
        self.aux_loss = experts * (share * probs.mean(0)).sum()
        if self.capacity_factor is not None:
            capacity = math.ceil(self.capacity_factor * flat.numel() / experts)
            starts = torch.cumsum(counts, 0) - counts
            place = torch.arange(flat.numel(), device=flat.device) - starts[flat[order]]
            order = order[place < capacity]
            counts = counts.clamp(max=capacity)
        source = order // self.top_k  # the token of each sorted assignment
        out = self.experts(tokens[source], counts) * weights.reshape(-1)[order, None]
        combined = torch.zeros_like(tokens).index_add(0, source, out)
        return combined.view_as(x)
