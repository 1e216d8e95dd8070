"""Models that ship with flatshard."""

from flatshard.models.gpt import GPT, GPTBlock

__all__ = ["GPT", "GPTBlock"]
