"""Building a sharded model: ``fully_shard``, initialization and the startup checks.

``fully_shard`` (``_fully_shard``): choose units, check that ranks agree, create groups,
then per unit allocate shards, materialize or load, and register hooks. Deferred (meta)
initialization and rank-0 broadcast (``_init``), ``skip_init`` for pretrained weights,
and ``shard_keeping_last`` (the last units kept gathered in the ZeRO-2 form). The lines the
startup check compares are made in ``flatshard/runtime/_configuration.py``.

Layer 5: imports ``flatshard.placements`` and below.
"""

from flatshard.sharding._fully_shard import fully_shard
from flatshard.sharding._init import InitOptions, init_weights
from flatshard.sharding._skip_init import skip_init

__all__ = [
    "InitOptions",
    "fully_shard",
    "init_weights",
    "skip_init",
]
