"""Where users already train: flatshard inside other trainers (optional extras).

- ``flatshard.integrations.lightning``: ``FlatshardStrategy``, a PyTorch Lightning strategy
  (``pip install 'flatshard[lightning]'``).
- ``flatshard.integrations.transformers``: ``FlatshardTrainer``, the Hugging Face
  ``Trainer`` with a sharded model (``pip install 'flatshard[hf]'``).

Neither is imported by ``import flatshard``; each imports its trainer when imported.

The layer above the facade, beside the CLI: built on the public ``flatshard`` names only.
"""
