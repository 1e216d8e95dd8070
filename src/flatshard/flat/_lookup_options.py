"""``nn.Embedding`` and ``nn.EmbeddingBag`` options a flat group cannot serve, refused by
name.

Checked when ``fully_shard`` builds a unit and again before each lookup module's forward
(the options are plain attributes a user may set afterwards: ``model.tok.sparse = True``).
Unrefused, each would end in torch's autograd error about views in a later backward, or,
where none is raised, in weights that are no longer DDP's.
"""

from __future__ import annotations

from torch import nn

from flatshard.comm._agreement import global_rank

LOOKUPS = (nn.Embedding, nn.EmbeddingBag)  # the modules whose options are checked


def refuse_lookup_options(
    name: str, embedding: nn.Embedding | nn.EmbeddingBag, trainable: bool, row_sparse: bool
) -> None:
    """Raise for an option of ``embedding`` (looking up parameter ``name``) that its flat
    group cannot serve; ``row_sparse``: the table takes the row-sparse path."""
    if embedding.max_norm is not None:
        raise ValueError(max_norm_message(name, embedding.max_norm))
    if embedding.sparse and trainable and not row_sparse:
        served = (
            ", or give it placement=flatshard.RowSparse() in fully_shard (with a shard "
            "group above one rank): only the looked-up rows are then fetched and their "
            "gradients sent"
            if isinstance(embedding, nn.Embedding)
            else ""
        )
        raise ValueError(
            f"flatshard: {type(embedding).__name__} '{name}' has sparse=True (sparse "
            f"gradients, rank {global_rank()}); flatshard reduces a gradient as dense "
            "shards of its flat group, which a sparse gradient cannot flow into. Set "
            f"sparse=False (the same gradient, dense){served}."
        )


def max_norm_message(name: str, max_norm: float) -> str:
    return (
        f"flatshard: embedding '{name}' has max_norm={max_norm} (rank {global_rank()}), "
        "which renormalizes the looked-up rows of the weight in place during forward. "
        "flatshard's forward reads a gathered copy (or rows) of the sharded weight, so the "
        "renormalization would not reach the weights the optimizer steps. Set max_norm=None "
        "and renormalize in your own code, e.g. after optimizer.step() inside "
        "flatshard.summon_full_params(model) (written back to the shards)."
    )
