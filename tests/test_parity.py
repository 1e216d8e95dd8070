"""Parity: flatshard trains exactly like one process on the whole batch, and like FSDP2.

Each case trains 5 AdamW steps (weight decay by name and ndim) with each rank on its own
slice of the global batch; per-step losses and final full parameters must match the
non-sharded reference (fp32, rtol 1e-5). Where FSDP2 supports the model, its losses must
match too (FSDP2 rejects 0-dim parameters, which the MLP model has on purpose).
"""

from __future__ import annotations

import pytest

from flatshard.testing.parity import ParityConfig, parity_job
from flatshard.testing.workers import WorkerPool

FSDP2_MODELS = {"gpt", "frozen", "nested", "reuse"}


@pytest.mark.parametrize("world_size", [1, 2, 3])
@pytest.mark.parametrize("model", ["mlp", "gpt", "frozen", "nested", "reuse"])
def test_parity_per_model(pool: WorkerPool, model: str, world_size: int) -> None:
    config = ParityConfig(model=model, world_size=world_size)
    pool.run(parity_job, config, model in FSDP2_MODELS)


@pytest.mark.parametrize("model", ["mlp", "gpt", "frozen", "nested", "reuse"])
def test_parity_sgd(pool: WorkerPool, model: str) -> None:
    # Adam is nearly blind to a gradient's scale; SGD with momentum is not.
    config = ParityConfig(model=model, world_size=3, optimizer="sgd")
    pool.run(parity_job, config, model in FSDP2_MODELS)


@pytest.mark.parametrize("policy", ["callable", "size", "sublayers", "none", "bottom_up"])
@pytest.mark.parametrize("model", ["gpt", "nested"])
def test_parity_per_policy(pool: WorkerPool, model: str, policy: str) -> None:
    pool.run(parity_job, ParityConfig(model=model, world_size=3, policy=policy), False)


@pytest.mark.parametrize(
    "config",
    [
        ParityConfig(model="gpt", world_size=2, checkpoint="inside"),
        ParityConfig(model="gpt", world_size=3, checkpoint="around"),
        # The attention and MLP units inside each checkpointed block gather again in the
        # recomputation.
        ParityConfig(model="gpt", world_size=2, checkpoint="around", policy="sublayers"),
        ParityConfig(model="frozen", world_size=2, checkpoint="inside"),
        ParityConfig(model="nested", world_size=2, checkpoint="inside"),
    ],
    ids=lambda c: f"{c.model}-{c.checkpoint}-{c.policy}-w{c.world_size}",
)
def test_parity_activation_checkpointing(pool: WorkerPool, config: ParityConfig) -> None:
    pool.run(parity_job, config, config.model in FSDP2_MODELS)


@pytest.mark.parametrize(
    "config",
    [
        ParityConfig(model="gpt", world_size=3, micro_batches=2),
        ParityConfig(model="frozen", world_size=2, micro_batches=3),
        ParityConfig(model="gpt", world_size=3, forwards_per_backward=2),
        ParityConfig(model="nested", world_size=2, forwards_per_backward=3),
        ParityConfig(model="mlp", world_size=3, forwards_per_backward=2, checkpoint="inside"),
    ],
    ids=lambda c: f"{c.model}-mb{c.micro_batches}-fpb{c.forwards_per_backward}-w{c.world_size}",
)
def test_parity_accumulation_and_multiple_forwards(pool: WorkerPool, config: ParityConfig) -> None:
    pool.run(parity_job, config, config.model in FSDP2_MODELS)


@pytest.mark.parametrize("forward_prefetch", [False, True])
@pytest.mark.parametrize("backward_prefetch", [None, "BACKWARD_POST", "BACKWARD_PRE"])
@pytest.mark.parametrize("model", ["gpt", "nested"])
def test_parity_with_prefetch(
    pool: WorkerPool, model: str, backward_prefetch: str | None, forward_prefetch: bool
) -> None:
    # Nested units break the reverse-forward-order prediction in backward: a wrong guess
    # costs memory only.
    config = ParityConfig(
        model=model,
        world_size=2,
        optimizer="sgd",
        backward_prefetch=backward_prefetch,
        forward_prefetch=forward_prefetch,
    )
    pool.run(parity_job, config, False)
