"""Training text for ``flatshard train``: bytes of a UTF-8 file, sampled deterministically.

Tokens are bytes (256 ids): nothing to download, any text works. The batch of step ``s``
depends only on the seed and ``s`` (not on the world size or on earlier steps), so a run
resumed from a checkpoint sees exactly the data the uninterrupted run would have seen.
"""

from __future__ import annotations

import math
from collections import Counter
from dataclasses import dataclass
from importlib import resources
from pathlib import Path

import torch

from flatshard.cli.config import ConfigError

VOCAB = 256
DEFAULT_CORPUS = "kjv_genesis_exodus.txt"


@dataclass(frozen=True)
class Corpus:
    """A text as byte ids, split into a training part and a held-out tail."""

    name: str
    train: torch.Tensor  # (N,) int64
    val: torch.Tensor  # (M,) int64

    @property
    def unigram_entropy(self) -> float:
        """Nats per byte of a model that ignores context: what training must beat."""
        counts = Counter(self.train.tolist())
        total = self.train.numel()
        return -sum(c / total * math.log(c / total) for c in counts.values())


def load_corpus(path: str, seq_len: int, val_fraction: float = 0.05) -> Corpus:
    """The shipped corpus (``path == ""``) or the UTF-8 text file at ``path``."""
    if path:
        file = Path(path)
        if not file.is_file():
            raise ConfigError(f"--data: no text file at {path}")
        raw = file.read_bytes()
        name = file.name
    else:
        raw = resources.files("flatshard.data").joinpath(DEFAULT_CORPUS).read_bytes()
        name = f"{DEFAULT_CORPUS} (shipped, public domain)"
    ids = torch.frombuffer(bytearray(raw), dtype=torch.uint8).to(torch.int64)
    split = int(len(ids) * (1 - val_fraction))
    if split <= seq_len + 1 or len(ids) - split <= seq_len + 1:
        raise ConfigError(
            f"--data: {name} has {len(ids)} bytes; --seq-len {seq_len} needs at least "
            f"{int((seq_len + 2) / val_fraction)} for training and held-out windows"
        )
    return Corpus(name=name, train=ids[:split], val=ids[split:])


def batch_for_step(
    ids: torch.Tensor, seq_len: int, rows: int, seed: int, step: int
) -> torch.Tensor:
    """``rows`` windows of ``seq_len + 1`` bytes for step ``step``: (rows, seq_len + 1)."""
    gen = torch.Generator().manual_seed(seed * 1_000_003 + step)
    starts = torch.randint(0, len(ids) - seq_len - 1, (rows,), generator=gen)
    return torch.stack([ids[s : s + seq_len + 1] for s in starts.tolist()])


def decode(ids: list[int]) -> str:
    return bytes(ids).decode("utf-8", errors="replace")


def encode(text: str) -> list[int]:
    return list(text.encode("utf-8"))
