"""Small reference models that exercise what sharding can get wrong.

Each model has ``make_batch(generator, batch_size)`` and ``loss(batch)`` so that one training
loop serves all of them, and ``UNIT_CLASSES``: the module classes that become units.
Sizes are deliberately odd (7, 13, 37, ...) so that nothing divides the world size.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable
from typing import TypeVar, cast

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

from flatshard.models.gpt import GPT, GPTBlock
from flatshard.models.moe import MoELayer

Batch = tuple[torch.Tensor, torch.Tensor]


class MLPBlock(nn.Module):
    def __init__(self, dim_in: int, dim_out: int) -> None:
        super().__init__()
        self.fc = nn.Linear(dim_in, dim_out)
        self.norm = nn.LayerNorm(dim_out)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = F.gelu(self.norm(self.fc(x)))
        return out


class MLPStack(nn.Module):
    """Linear blocks of odd widths, a scalar temperature parameter and a head."""

    UNIT_CLASSES = frozenset({MLPBlock})

    def __init__(self, dims: tuple[int, ...] = (7, 13, 11, 13)) -> None:
        super().__init__()
        self.dim_in = dims[0]
        self.blocks = nn.Sequential(*(MLPBlock(a, b) for a, b in itertools.pairwise(dims)))
        self.head = nn.Linear(dims[-1], 5)
        self.temperature = nn.Parameter(torch.tensor(1.5))  # a 0-dim parameter

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = self.head(self.blocks(x)) / self.temperature
        return out

    def make_batch(self, gen: torch.Generator, batch_size: int) -> Batch:
        x = torch.randn(batch_size, self.dim_in, generator=gen)
        return x, torch.randint(0, 5, (batch_size,), generator=gen)

    def loss(self, batch: Batch) -> torch.Tensor:
        x, y = batch
        out: torch.Tensor = F.cross_entropy(self(x), y)
        return out


class TinyGPT(GPT):
    """A small GPT with its LM head tied to the token embedding."""

    UNIT_CLASSES: frozenset[type[nn.Module]] = frozenset({GPTBlock})

    def __init__(
        self, vocab: int = 37, dim: int = 16, heads: int = 2, layers: int = 3, seq_len: int = 9
    ) -> None:
        super().__init__(vocab, dim, heads, layers, seq_len)

    def make_batch(self, gen: torch.Generator, batch_size: int) -> Batch:
        idx = torch.randint(0, self.vocab, (batch_size, self.seq_len + 1), generator=gen)
        return idx[:, :-1], idx[:, 1:]

    def loss(self, batch: Batch) -> torch.Tensor:
        x, y = batch
        out: torch.Tensor = F.cross_entropy(self(x).flatten(0, 1), y.flatten())
        return out


class EmbeddingUnitsGPT(TinyGPT):
    """A TinyGPT with a head of its own whose two embedding tables are units of their own:
    no backward op reads them (``set_unshard_in_backward``)."""

    UNIT_CLASSES: frozenset[type[nn.Module]] = frozenset({GPTBlock, nn.Embedding})

    def __init__(self) -> None:
        nn.Module.__init__(self)
        GPT.__init__(self, vocab=37, dim=16, heads=2, layers=3, seq_len=9, tied=False)


class VocabGPT(TinyGPT):
    """A TinyGPT whose vocabulary is large next to its batch, for row-sparse embedding
    tables: tokens drawn unevenly (many repeated, some never drawn), and each half of the
    batch from its own half of the vocabulary, so that with 2 ranks no token is shared."""

    def __init__(self, tied: bool = True, padding_idx: int | None = None) -> None:
        nn.Module.__init__(self)
        GPT.__init__(self, vocab=512, dim=16, heads=2, layers=2, seq_len=9, tied=tied)
        if padding_idx is not None:
            self.tok.padding_idx = padding_idx
            with torch.no_grad():
                self.tok.weight[padding_idx].zero_()

    def make_batch(self, gen: torch.Generator, batch_size: int) -> Batch:
        half = self.vocab // 2
        # Squared uniforms: low ids of each half far more often than high ones.
        draws = torch.rand(batch_size, self.seq_len + 1, generator=gen) ** 2
        idx = (draws * half).long()
        idx[batch_size // 2 :] += half
        if self.tok.padding_idx is not None:
            idx[::3, -3:] = self.tok.padding_idx  # padded tails
        return idx[:, :-1], idx[:, 1:]


class UntiedVocabGPT(VocabGPT):
    def __init__(self) -> None:
        super().__init__(tied=False)


class PaddedVocabGPT(VocabGPT):
    def __init__(self) -> None:
        super().__init__(padding_idx=0)


class LoRALinear(nn.Module):
    """A frozen base weight plus a trainable low-rank update: one unit, both kinds."""

    def __init__(self, dim_in: int, dim_out: int, rank: int = 3) -> None:
        super().__init__()
        self.base = nn.Linear(dim_in, dim_out)
        self.base.requires_grad_(False)
        self.lora_a = nn.Parameter(torch.randn(rank, dim_in) / dim_in)
        self.lora_b = nn.Parameter(torch.randn(dim_out, rank) / rank)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = self.base(x) + (x @ self.lora_a.t()) @ self.lora_b.t()
        return out


class FrozenParts(nn.Module):
    """A frozen embedding submodule, LoRA units mixing frozen and trainable, a head."""

    UNIT_CLASSES = frozenset({LoRALinear})

    def __init__(self, vocab: int = 29, dim: int = 11) -> None:
        super().__init__()
        self.vocab = vocab
        self.embed = nn.Embedding(vocab, dim)
        self.embed.requires_grad_(False)
        self.layers = nn.ModuleList([LoRALinear(dim, dim), LoRALinear(dim, dim)])
        self.head = nn.Linear(dim, vocab)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        x = self.embed(idx)
        for layer in self.layers:
            x = torch.tanh(layer(x))
        out: torch.Tensor = self.head(x)
        return out

    def make_batch(self, gen: torch.Generator, batch_size: int) -> Batch:
        idx = torch.randint(0, self.vocab, (batch_size, 5), generator=gen)
        return idx, torch.roll(idx, 1, dims=1)

    def loss(self, batch: Batch) -> torch.Tensor:
        x, y = batch
        out: torch.Tensor = F.cross_entropy(self(x).flatten(0, 1), y.flatten())
        return out


class Inner(nn.Module):
    def __init__(self, dim: int) -> None:
        super().__init__()
        self.lin = nn.Linear(dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = torch.relu(self.lin(x))
        return out


class Outer(nn.Module):
    """A unit with its own parameters around two inner units."""

    def __init__(self, dim: int) -> None:
        super().__init__()
        self.pre = nn.Linear(dim, dim)
        self.inner = nn.Sequential(Inner(dim), Inner(dim))
        self.scale = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = self.inner(self.pre(x)) * self.scale
        return out


class Nested(nn.Module):
    """Units inside units: Outer blocks, each holding Inner units."""

    UNIT_CLASSES = frozenset({Outer, Inner})

    def __init__(self, dim: int = 10) -> None:
        super().__init__()
        self.dim = dim
        self.outers = nn.Sequential(Outer(dim), Outer(dim))
        self.out = nn.Linear(dim, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = self.out(self.outers(x))
        return out

    def make_batch(self, gen: torch.Generator, batch_size: int) -> Batch:
        x = torch.randn(batch_size, self.dim, generator=gen)
        return x, torch.randint(0, 3, (batch_size,), generator=gen)

    def loss(self, batch: Batch) -> torch.Tensor:
        x, y = batch
        out: torch.Tensor = F.cross_entropy(self(x), y)
        return out


class DictBlock(nn.Module):
    """A unit whose output is a dict, not a tensor."""

    def __init__(self, dim: int) -> None:
        super().__init__()
        self.lin = nn.Linear(dim, dim)

    def forward(self, x: torch.Tensor) -> dict[str, torch.Tensor]:
        hidden = torch.tanh(self.lin(x))
        return {"hidden": hidden, "energy": hidden.square().mean()}


class Reuse(nn.Module):
    """One unit called twice per forward (shared weights) around a dict-returning unit."""

    UNIT_CLASSES = frozenset({MLPBlock, DictBlock})

    def __init__(self) -> None:
        super().__init__()
        self.inp = nn.Linear(6, 9)
        self.shared = MLPBlock(9, 9)
        self.middle = DictBlock(9)
        self.out = nn.Linear(9, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.shared(self.inp(x))
        mid = self.middle(h)
        out: torch.Tensor = self.out(self.shared(mid["hidden"])) + mid["energy"]
        return out

    def make_batch(self, gen: torch.Generator, batch_size: int) -> Batch:
        x = torch.randn(batch_size, 6, generator=gen)
        return x, torch.randint(0, 4, (batch_size,), generator=gen)

    def loss(self, batch: Batch) -> torch.Tensor:
        x, y = batch
        out: torch.Tensor = F.cross_entropy(self(x), y)
        return out


MODELS: dict[str, type[nn.Module]] = {
    "reuse": Reuse,
    "mlp": MLPStack,
    "gpt": TinyGPT,
    "embedding_units_gpt": EmbeddingUnitsGPT,
    "vocab_gpt": VocabGPT,
    "untied_vocab_gpt": UntiedVocabGPT,
    "padded_vocab_gpt": PaddedVocabGPT,
    "frozen": FrozenParts,
    "nested": Nested,
}


# A transformers LlamaConfig small enough for 2 CPU ranks in seconds (the Hugging Face tests)
TINY_LLAMA = {
    "vocab_size": 64,
    "hidden_size": 32,
    "intermediate_size": 64,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "max_position_embeddings": 64,
}

M = TypeVar("M", bound=nn.Module)


def twins(factory: Callable[[], M], seed: int = 0) -> tuple[M, M]:
    """The same module twice, equal weights: one to shard, one as the plain reference."""
    torch.manual_seed(seed)
    model, reference = factory(), factory()
    reference.load_state_dict(model.state_dict())
    return model, reference


def build(name: str, seed: int = 0) -> nn.Module:
    """The named reference model, initialized from ``seed`` (identical on every rank)."""
    torch.manual_seed(seed)
    return MODELS[name]()


class ReluLinear(nn.Module):
    """relu(Linear(8, 8)): a block, or an expert, that is a unit of its own."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = torch.relu(self.lin(x))
        return out


class ReluNet(nn.Module):
    """Linear(4, 8), three ``ReluLinear`` units, Linear(8, 2): the small model of the tests
    that make ranks disagree."""

    def __init__(self) -> None:
        super().__init__()
        self.inp = nn.Linear(4, 8)
        self.blocks = nn.ModuleList(ReluLinear() for _ in range(3))
        self.out = nn.Linear(8, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.inp(x)
        for block in self.blocks:
            h = block(h)
        out: torch.Tensor = self.out(h)
        return out


class Trunk(nn.Module):
    """A trunk ``a`` with two heads ``b`` and ``c``: a loss may use one head or both."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.b, self.c = nn.Linear(8, 8), nn.Linear(8, 8), nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        h = self.a(x)
        return self.b(h), self.c(h)


class MoEBlock(nn.Module):
    def __init__(self, experts: int, dim: int, hidden: int, top_k: int) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(dim)
        self.moe = MoELayer(experts, dim, hidden, top_k)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = x + self.moe(self.norm(x))
        return out


class TinyMoE(nn.Module):
    """Linear in, ``layers`` MoE blocks, linear out: the test suite's mixture of experts.
    ``loss``: the mean squared error plus 0.01 times the blocks' load-balancing losses."""

    def __init__(
        self, experts: int = 4, dim: int = 8, hidden: int = 16, layers: int = 2, top_k: int = 2
    ) -> None:
        super().__init__()
        self.inp = nn.Linear(dim, dim)
        self.blocks = nn.ModuleList(MoEBlock(experts, dim, hidden, top_k) for _ in range(layers))
        self.out = nn.Linear(dim, dim)
        self.checkpoint_blocks = False  # recompute each block (its all-to-alls too) in backward

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.inp(x)
        for block in self.blocks:
            x = checkpoint(block, x, use_reentrant=False) if self.checkpoint_blocks else block(x)
        out: torch.Tensor = self.out(x)
        return out

    def loss(self, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        x, y = batch
        fit = F.mse_loss(self(x), y)
        blocks = cast(list[MoEBlock], list(self.blocks))
        aux = torch.stack([b.moe.aux_loss for b in blocks]).sum()
        out: torch.Tensor = fit + 0.01 * aux
        return out


def experts_of(name: str, param: nn.Parameter) -> bool:
    """Whether ``name`` is a stacked expert weight of ``TinyMoE`` (or torchtitan's MoE)."""
    return ".experts." in f".{name}"
