"""The runtime: what happens during a training step once a model is sharded.

``Unit`` (one unit's configuration, per-step state and hook bodies) and ``StepContext``
(what a root's units share in a step: order, the reduction in flight, ``no_sync``), the
hooks and their guards (``_hooks``), prefetch and the rate limiter, change detection,
inputs' casts and gradient watches, profiler ranges; and the functions users call between
steps: ``no_sync``, ``clip_grad_norm_``, ``summon_full_params``, ``ShardedGradScaler``,
``sharding_summary``; ``train_step``, the one loop of an optimizer step over micro-batches.

Layer 3: imports ``flatshard.flat`` and below.
"""

# The runtime's side of a pipeline schedule, for ``flatshard.integrations.pipelining`` (the
# one small interface features above the runtime plug into; not user API, so not in __all__)
from flatshard.runtime import _pipeline as pipeline_steps  # noqa: F401
from flatshard.runtime._by_hand import UnshardHandle, reshard, summon_full_params, unshard
from flatshard.runtime._clip import clip_grad_norm_
from flatshard.runtime._custom_comms import set_custom_all_gather, set_custom_reduce_scatter
from flatshard.runtime._grad_scaler import ShardedGradScaler
from flatshard.runtime._hooks import register_entry_point
from flatshard.runtime._join import join
from flatshard.runtime._optimizer_steps import register_matrix_optimizer
from flatshard.runtime._prefetch import BackwardPrefetch, Prefetch

# A call every rank of a model's group makes, agreed through the store before it issues
# anything: for the integrations' own entry points (the Trainer's evaluation), whose
# libraries issue collectives flatshard does not see.
from flatshard.runtime._step import agree as agree
from flatshard.runtime._step_loop import StepObserver, train_step
from flatshard.runtime._summary import (
    FlatParamSummary,
    ShardingSummary,
    agreed_configuration,
    dtype_report,
    embedding_traffic,
    sharding_summary,
)
from flatshard.runtime._switches import (
    no_sync,
    set_all_reduce_hook,
    set_gradient_divide_factor,
    set_prefetch,
    set_requires_all_reduce,
    set_requires_gradient_sync,
    set_reshard_after_backward,
    set_reshard_after_forward,
    set_separate_reduce_scatter_group,
    set_unshard_in_backward,
)
from flatshard.runtime._unit import unit_modules

__all__ = [
    "BackwardPrefetch",
    "FlatParamSummary",
    "Prefetch",
    "ShardedGradScaler",
    "ShardingSummary",
    "StepObserver",
    "UnshardHandle",
    "agreed_configuration",
    "clip_grad_norm_",
    "dtype_report",
    "embedding_traffic",
    "join",
    "no_sync",
    "register_entry_point",
    "register_matrix_optimizer",
    "reshard",
    "set_all_reduce_hook",
    "set_custom_all_gather",
    "set_custom_reduce_scatter",
    "set_gradient_divide_factor",
    "set_prefetch",
    "set_requires_all_reduce",
    "set_requires_gradient_sync",
    "set_reshard_after_backward",
    "set_reshard_after_forward",
    "set_separate_reduce_scatter_group",
    "set_unshard_in_backward",
    "sharding_summary",
    "summon_full_params",
    "train_step",
    "unit_modules",
    "unshard",
]
