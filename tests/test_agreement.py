"""Every public call that issues a collective, or changes what the ranks will issue, is
agreed on every rank first ([Note: the agreed configuration]).

``test_every_public_function_is_classified`` enumerates the public API (``flatshard`` and
``flatshard.comm_hooks``): a function added without an entry in ``CALLS`` or ``NOT_ON_A_MODEL``
fails it. ``test_calls_that_issue_collectives_or_change_the_configuration_are_agreed`` runs
every entry of ``CALLS`` on a sharded model at the pool's 4 ranks with torch.distributed's
collectives counted (a recording backend in front of gloo) and the store agreements counted
(``Watchdog.entry``), and fails for a call that issued a collective, or changed the model's
agreed configuration, without agreeing first. The other tests: each failure of a rank that
called or set something alone, at 2 and 4 ranks, ends in a named error on every rank.
"""

from __future__ import annotations

import inspect
import os
import tempfile
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch import nn

import flatshard
from flatshard import comm_hooks
from flatshard.testing import internals
from flatshard.testing.isolated import run_isolated
from flatshard.testing.models import ReluLinear, ReluNet
from flatshard.testing.workers import WorkerContext, WorkerPool

# torch.distributed's blocking collectives (the watchdog's list) and its batched P2P
COLLECTIVES = (*sorted(internals.TORCH_COLLECTIVES), "batch_isend_irecv")


def _net(group: dist.ProcessGroup | None = None) -> ReluNet:
    torch.manual_seed(0)
    return flatshard.fully_shard(ReluNet(), auto_wrap_policy={ReluLinear}, process_group=group)


def _step(model: nn.Module, optim: torch.optim.Optimizer | None = None) -> None:
    torch.manual_seed(1)
    model(torch.randn(3, 4)).sum().backward()
    if optim is not None:
        optim.step()
        optim.zero_grad()


class _Comm:
    """An FSDP2-style custom collective (``set_custom_all_gather``)."""

    def __call__(self, output: torch.Tensor, input: torch.Tensor, group: Any, **kw: Any) -> Any:
        return dist.all_gather_into_tensor(output, input, group=group, async_op=True)


def _cm(
    make: Callable[[nn.Module], Any],
) -> Callable[[nn.Module, torch.optim.Optimizer, str], None]:
    def call(model: nn.Module, optim: torch.optim.Optimizer, tmp: str) -> None:
        with make(model):
            pass

    return call


# name -> how a user calls it on a sharded model (after one training step)
Call = Callable[[nn.Module, torch.optim.Optimizer, str], Any]
CALLS: dict[str, Call] = {
    "train_step": lambda m, o, t: flatshard.train_step(
        m, [o], lambda i: m(torch.randn(3, 4)).sum()
    ),
    "no_sync": _cm(flatshard.no_sync),
    "join": lambda m, o, t: _cm(lambda model: flatshard.join(model, [o]))(m, o, t),
    "set_requires_all_reduce": lambda m, o, t: flatshard.set_requires_all_reduce(m, False),
    "set_requires_gradient_sync": lambda m, o, t: flatshard.set_requires_gradient_sync(m, False),
    "set_reshard_after_backward": lambda m, o, t: flatshard.set_reshard_after_backward(m, False),
    "set_reshard_after_forward": lambda m, o, t: flatshard.set_reshard_after_forward(m, False),
    "set_separate_reduce_scatter_group": lambda m, o, t: (
        flatshard.set_separate_reduce_scatter_group(m, True)
    ),
    "set_unshard_in_backward": lambda m, o, t: flatshard.set_unshard_in_backward(
        m.blocks[0], False
    ),
    "set_custom_all_gather": lambda m, o, t: flatshard.set_custom_all_gather(m.blocks[0], _Comm()),
    "set_custom_reduce_scatter": lambda m, o, t: flatshard.set_custom_reduce_scatter(
        m.blocks[0], _Comm()
    ),
    "set_gradient_divide_factor": lambda m, o, t: flatshard.set_gradient_divide_factor(m, 1.0),
    "set_prefetch": lambda m, o, t: flatshard.set_prefetch(m.blocks[0], forward=[m.blocks[2]]),
    "clip_grad_norm_": lambda m, o, t: flatshard.clip_grad_norm_(m, 1.0),
    "summon_full_params": _cm(flatshard.summon_full_params),
    "unshard": lambda m, o, t: flatshard.unshard(m.blocks[0]),
    "reshard": lambda m, o, t: flatshard.reshard(m.blocks[0]),
    "register_entry_point": lambda m, o, t: flatshard.register_entry_point(m, "forward"),
    "unit_modules": lambda m, o, t: flatshard.unit_modules(m),
    "full_state_dict": lambda m, o, t: flatshard.full_state_dict(m),
    "sharded_state_dict": lambda m, o, t: flatshard.sharded_state_dict(m),
    "load_state_dict": lambda m, o, t: flatshard.load_state_dict(
        m, flatshard.sharded_state_dict(m)
    ),
    "full_optim_state_dict": lambda m, o, t: flatshard.full_optim_state_dict(m, o),
    "sharded_optim_state_dict": lambda m, o, t: flatshard.sharded_optim_state_dict(m, o),
    "load_optim_state_dict": lambda m, o, t: flatshard.load_optim_state_dict(
        m, o, flatshard.sharded_optim_state_dict(m, o)
    ),
    "save_checkpoint": lambda m, o, t: flatshard.save_checkpoint(f"{t}/ckpt", m, o),
    "load_checkpoint": lambda m, o, t: (
        flatshard.save_checkpoint(f"{t}/ckpt2", m, o),
        flatshard.load_checkpoint(f"{t}/ckpt2", m, o),
    ),
    "export_safetensors": lambda m, o, t: flatshard.export_safetensors(m, f"{t}/export"),
    "load_safetensors": lambda m, o, t: (
        flatshard.export_safetensors(m, f"{t}/export4"),
        flatshard.load_safetensors(m, f"{t}/export4"),
    ),
    "sharding_summary": lambda m, o, t: flatshard.sharding_summary(m),
    "dtype_report": lambda m, o, t: flatshard.dtype_report(m),
    "embedding_traffic": lambda m, o, t: flatshard.embedding_traffic(m),
    "register_comm_hook": lambda m, o, t: comm_hooks.register_comm_hook(
        m, comm_hooks.LowPrecisionHook(torch.bfloat16)
    ),
    "set_all_reduce_hook": lambda m, o, t: flatshard.set_all_reduce_hook(m, _keep),
}


def _keep(shard: torch.Tensor) -> None:
    """An all-reduce hook that leaves the shard as it is."""


# Public functions that take no sharded model, each with why it needs no agreement here.
NOT_ON_A_MODEL: dict[str, str] = {
    "fully_shard": "makes the model: its startup check compares the options by digest",
    "init_weights": "initializes an unsharded model",
    "skip_init": "a context manager for building a model; no collective",
    "set_checks": "this process's timeouts; no collective",
    "plan": "the planner's simulated world (fake backend)",
    "split_division": "arithmetic",
    "register_matrix_optimizer": "declares an optimizer class (its step's refusal); no collective",
    "export_checkpoint": "converts a checkpoint directory offline, in one process",
    "latest_checkpoint": "reads a directory's names and manifests; no collective",
    "CommHook": "a type: the signature of a communication hook",
}


def _public_functions() -> dict[str, Callable[..., Any]]:
    found = {}
    for module in (flatshard, comm_hooks):
        for name in module.__all__:
            value = getattr(module, name)
            if callable(value) and not inspect.isclass(value):
                found[name] = value
    return found


def test_every_public_function_is_classified() -> None:
    public = set(_public_functions())
    unclassified = sorted(public - CALLS.keys() - NOT_ON_A_MODEL.keys())
    assert not unclassified, (
        f"public functions with no entry in CALLS or NOT_ON_A_MODEL: {unclassified}; say how "
        "a user calls each on a sharded model (the agreement test then checks it)"
    )
    stale = sorted((CALLS.keys() | NOT_ON_A_MODEL.keys()) - public)
    assert not stale, f"entries for functions that are not public: {stale}"


@contextmanager
def _recording() -> Iterator[dict[str, int]]:
    """Count torch.distributed's collectives and the watchdog's agreements while inside."""
    counts = {"collectives": 0, "agreements": 0}
    saved = {name: getattr(dist, name) for name in COLLECTIVES if hasattr(dist, name)}

    def counting(fn: Callable[..., Any]) -> Callable[..., Any]:
        def wrapper(*args: Any, **kwargs: Any) -> Any:
            counts["collectives"] += 1
            return fn(*args, **kwargs)

        return wrapper

    dog = internals.watchdog()
    assert dog is not None
    entry = dog.entry

    def agreeing(*args: Any, **kwargs: Any) -> None:
        counts["agreements"] += 1
        entry(*args, **kwargs)

    for name, fn in saved.items():
        setattr(dist, name, counting(fn))
    dog.entry = agreeing  # type: ignore[method-assign]
    try:
        yield counts
    finally:
        for name, fn in saved.items():
            setattr(dist, name, fn)
        del dog.entry


def _configuration(model: nn.Module) -> list[str]:
    return [line for c in internals.contexts_under(model, "test") for line in c.configuration()]


def agreement_job(ctx: WorkerContext, names: list[str], directory: str) -> dict[str, str]:
    group = ctx.group(ctx.world_size)  # the whole world: some switches make groups in it
    assert group is not None
    verdicts = {}
    for name in names:
        model = _net(group)
        optim = torch.optim.SGD(model.parameters(), lr=0.1)
        _step(model, optim)
        before = _configuration(model)
        tmp = os.path.join(directory, name)
        with _recording() as counts:
            CALLS[name](model, optim, tmp)
        changed = _configuration(model) != before
        issued = counts["collectives"] > 0
        if (issued or changed) and not counts["agreements"]:
            what = "issued collectives" if issued else "changed the agreed configuration"
            verdicts[name] = f"{what} without agreeing first"
        else:
            verdicts[name] = "ok"
        dist.barrier(group=group)
    return verdicts


def test_calls_that_issue_collectives_or_change_the_configuration_are_agreed(
    pool: WorkerPool,
) -> None:
    with tempfile.TemporaryDirectory() as tmp:
        verdicts = pool.run(agreement_job, sorted(CALLS), tmp)
    for rank, found in enumerate(verdicts):
        bad = {name: v for name, v in found.items() if v != "ok"}
        assert not bad, f"rank {rank}: {bad}"


def test_a_new_configuration_field_is_compared() -> None:
    """The lines ranks compare come from the dataclass fields: every field of ``UnitConfig``
    and ``Switches`` shows in them, so a field added tomorrow is compared too."""
    from dataclasses import fields, make_dataclass, replace

    from flatshard.testing.internals import Switches, UnitConfig, config_lines

    unit = UnitConfig(flatshard.ShardingStrategy.FULL_SHARD, None, flatshard.Prefetch())
    for value in (unit, Switches()):
        shown = {line.split("=")[0] for line in config_lines(value)}
        assert shown == {f.name for f in fields(value)}
    extended = make_dataclass("Extended", [("new_option", int, 0)], bases=(Switches,), frozen=True)
    assert config_lines(extended()) != config_lines(replace(extended(), new_option=1))


class _Scaled:
    def __init__(self, factor: float) -> None:
        self.factor = factor

    def hook(self, *args: object) -> None: ...


def _hook(*args: object, scale: float = 1.0) -> None: ...


def test_hooks_are_compared_by_what_they_call_and_with_what() -> None:
    """A comm hook given as ``functools.partial`` or as a bound method is compared by the
    function and its arguments or its object's fields, never by address: ranks whose hooks
    scale differently differ (before: every partial read ``functools.partial()``)."""
    from dataclasses import replace
    from functools import partial

    from flatshard.testing.internals import UnitConfig, config_lines

    unit = UnitConfig(flatshard.ShardingStrategy.FULL_SHARD, None, flatshard.Prefetch())

    def lines(hook: object) -> list[str]:
        return config_lines(replace(unit, comm_hook=hook))

    for make in (lambda s: partial(_hook, scale=s), lambda s: _Scaled(s).hook):
        assert lines(make(1.0)) == lines(make(1.0))  # another object, the same hook
        assert lines(make(1.0)) != lines(make(2.0))
        assert not any("0x" in line for line in lines(make(1.0)))


def _ended_by(error: Exception, start: float) -> tuple[str, str, float]:
    """(the error's class, or "unnamed ..." where flatshard did not name it; its message;
    seconds since ``start``): how a rank's job ended."""
    named = str(error).startswith("flatshard") or isinstance(error, flatshard.CollectiveError)
    kind = type(error).__name__
    return kind if named else f"unnamed {kind}", str(error), time.monotonic() - start


# ---------------------------------------------------------------- a rank alone, named
CHECKS = flatshard.Checks(timeout=2.0)
LIMIT_S = 2.0 + 15.0


def alone_job(rank: int, case: str) -> tuple[str, str, float]:
    flatshard.set_checks(CHECKS)
    kwargs: dict[str, Any] = {}
    if case == "prefetch" and rank == 1:
        kwargs["prefetch"] = flatshard.Prefetch(backward=flatshard.BackwardPrefetch.BACKWARD_POST)
    torch.manual_seed(rank if case == "meta_seed" else 0)
    start = time.monotonic()
    try:
        if case == "meta_seed":
            with torch.device("meta"):
                net = ReluNet()
        else:
            net = ReluNet()
        if case == "inner_unit" and rank == 0:  # a block sharded on its own, on rank 0 only
            flatshard.fully_shard(net.blocks[0])
        model = flatshard.fully_shard(net, auto_wrap_policy={ReluLinear}, **kwargs)
        if rank == 0:
            if case == "comm_hook":
                comm_hooks.register_comm_hook(model, comm_hooks.LowPrecisionHook(torch.bfloat16))
            elif case == "divide_factor":
                flatshard.set_gradient_divide_factor(model, 1.0)
            elif case == "unshard":
                flatshard.unshard(model.blocks[0])
            elif case == "all_reduce_hook":
                flatshard.set_all_reduce_hook(model, _keep)
        elif case == "divide_factor_both":
            flatshard.set_gradient_divide_factor(model, 2.0)
        if case == "divide_factor_both" and rank == 0:
            flatshard.set_gradient_divide_factor(model, 1.0)
        if case == "eval_first" and rank == 0:  # e.g. a sample before training, on rank 0
            with torch.no_grad():
                model(torch.randn(3, 4))
        for _ in range(2):
            _step(model)
            if case == "eval" and rank == 0:  # e.g. a validation batch, on rank 0 only
                with torch.no_grad():
                    model(torch.randn(3, 4))
            limit = 1.0 if rank == 0 else 2.0
            if case == "clip":
                flatshard.clip_grad_norm_(model, limit)
            elif case == "torch_clip":
                torch.nn.utils.clip_grad_norm_(model.parameters(), limit)
    except Exception as error:
        return _ended_by(error, start)
    return "", "", time.monotonic() - start


CASES = {
    "prefetch": ("ValueError", "prefetch=Prefetch(backward=BACKWARD_POST"),
    "meta_seed": ("ValueError", "meta parameters initialized from seed 1"),
    "inner_unit": ("ValueError", "rank 0 only: fully_shard of a ReluLinear with 1 unit(s)"),
    "comm_hook": ("CollectiveTimeoutError", "register_comm_hook(LowPrecisionHook(dtype=bfloat16"),
    "divide_factor": ("CollectiveTimeoutError", "set_gradient_divide_factor(1.0)"),
    "divide_factor_both": ("CollectiveMismatchError", "set_gradient_divide_factor(2.0)"),
    "unshard": ("CollectiveTimeoutError", "reach unshard"),
    "all_reduce_hook": ("CollectiveTimeoutError", "set_all_reduce_hook("),
    "clip": ("CollectiveMismatchError", "rank 1: clip_grad_norm_(max_norm=2.0, norm_type=2.0)"),
    # (a proof or the 2-s timeout, whichever comes first: both name the evaluation)
    "eval": ("CollectiveMismatchError|CollectiveTimeoutError", "an evaluation forward (no grad)"),
    "eval_first": (
        "CollectiveMismatchError|CollectiveTimeoutError",
        "an evaluation forward (no grad)",
    ),
    "torch_clip": (
        "CollectiveMismatchError",
        "rank 1: torch.nn.utils.clip_grad_norm_(max_norm=2.0, norm_type=2.0)",
    ),
}


@pytest.mark.parametrize(
    ("case", "world"),
    [(case, 2) for case in sorted(CASES)]
    + [(case, 4) for case in ("prefetch", "unshard", "divide_factor_both", "clip", "eval")],
)
def test_an_option_or_call_on_one_rank_is_named_on_every_rank(case: str, world: int) -> None:
    """Before: a hang to the group's timeout (prefetch), gloo's SIGABRT (comm hook, unshard)
    or silently wrong shards (divide factor, per-rank meta seeds, a clip's max_norm: each
    rank scaled its own rows by its own factor). An evaluation forward on rank 0 alone
    (before or between steps): gloo's SIGABRT."""
    error, words = CASES[case]
    for rank, outcome in enumerate(run_isolated(alone_job, case, world_size=world)):
        assert isinstance(outcome, tuple), f"rank {rank}: {outcome}"
        name, message, seconds = outcome
        assert name in error.split("|"), f"rank {rank} ended with {name or 'no error'}: {message}"
        assert seconds < LIMIT_S, f"rank {rank} took {seconds:.1f} s"
        if rank == 0 or "CollectiveMismatchError" in error:
            assert words in message, f"rank {rank}: {message}"


def stepping_alone_job(rank: int, case: str) -> tuple[str, str]:
    """``optimizer.step()`` on rank 0 alone: between a forward and its backward
    ("between"), an extra one between two steps ("extra"), or with another learning rate
    ("lr"); "all": every rank steps between its forward and its backward."""
    flatshard.set_checks(CHECKS)
    model = _net()
    optim = torch.optim.SGD(model.parameters(), lr=0.1)
    try:
        _step(model, optim)
        torch.manual_seed(2)
        loss = model(torch.randn(3, 4)).sum()
        if case == "all" or (case == "between" and rank == 0):
            optim.step()
        loss.backward()
        optim.step()
        optim.zero_grad()
        if case == "extra" and rank == 0:
            optim.step()
        if case == "lr" and rank == 0:
            optim.param_groups[0]["lr"] = 0.2  # e.g. a scheduler stepped on one rank only
        for _ in range(2):
            _step(model, optim)
    except Exception as error:
        named = str(error).startswith("flatshard") or isinstance(error, flatshard.CollectiveError)
        return type(error).__name__ if named else f"unnamed {type(error).__name__}", str(error)
    return "", ""


@pytest.mark.parametrize(
    ("case", "world"), [("between", 2), ("extra", 2), ("extra", 4), ("lr", 2), ("all", 2)]
)
def test_an_optimizer_step_on_one_rank_is_named_on_every_rank(case: str, world: int) -> None:
    """Before: a step between forward and backward on rank 0 aborted the processes (gloo:
    rank 0 gathered again what its peers reused, "Received data size doesn't match"); an
    extra step (or another learning rate) on rank 0 trained on silently, the ranks' shards
    apart. Unsharded, torch refuses a step between forward and backward too ("modified by
    an inplace operation"), on every rank that steps there."""
    outcomes = run_isolated(stepping_alone_job, case, world_size=world)
    if case in ("extra", "lr"):
        for rank, (name, message) in enumerate(outcomes):
            assert name == "CollectiveMismatchError", f"rank {rank}: {name} {message}"
            assert "optimizer.step() differs between the ranks" in message
            assert "rank 0 (" in message and "optimizer.step() of model '<root>'" in message
        if case == "lr":
            assert "(SGD: params=10 dampening=0 lr=0.2 maximize=False momentum=0" in message
            assert "(SGD: params=10 dampening=0 lr=0.1 maximize=False momentum=0" in message
        return
    stepped = range(world) if case == "all" else [0]
    for rank, (name, message) in enumerate(outcomes):
        if rank in stepped:
            assert name == "RuntimeError", f"rank {rank}: {name} {message}"
            assert f"backward of unit '<root>' on rank {rank} after optimizer.step()" in message
            assert "Call optimizer.step() after loss.backward()" in message
        else:  # told how rank 0 ended, by name, instead of a size mismatch's abort
            assert name in ("PeerLostError", "CollectiveTimeoutError"), f"rank {rank}: {message}"
            assert "rank 0" in message, message


def write_before_backward_job(ctx: WorkerContext, case: str, strategy: str) -> str | None:
    """Every rank writes the weights between a forward and its backward: a load of other
    weights, a write-back of a change inside ``summon_full_params`` ("summon_write"), or
    a summon that only reads ("summon_read": no write, the backward runs)."""
    group = ctx.group(2)
    if group is None:
        return None
    torch.manual_seed(0)
    model = flatshard.fully_shard(
        ReluNet(),
        auto_wrap_policy={ReluLinear},
        process_group=group,
        strategy=flatshard.ShardingStrategy[strategy],
    )
    other = {k: v + 1.0 for k, v in ReluNet().state_dict().items()}
    loss = model(torch.randn(3, 4)).sum()
    if case == "load_state_dict":
        flatshard.load_state_dict(model, other)
    with flatshard.summon_full_params(model, writeback=case == "summon_write"):
        if case == "summon_write":
            with torch.no_grad():
                model.out.weight.mul_(0.5)
    try:
        loss.backward()
    except RuntimeError as error:
        return str(error)
    return "no error"


@pytest.mark.parametrize("strategy", ["FULL_SHARD", "SHARD_GRAD_OP"])
@pytest.mark.parametrize("case", ["load_state_dict", "summon_write", "summon_read"])
def test_a_write_between_forward_and_backward_is_refused(
    pool: WorkerPool, case: str, strategy: str
) -> None:
    """Before: a load (or a summon's write-back) between a forward and its backward gave
    a gradient of neither the old nor the new weights (backward gathered the new ones
    beside the old activations), silently; unsharded, torch refuses it ("modified by an
    inplace operation"). A summon that only reads there stays allowed."""
    for rank, message in enumerate(pool.run(write_before_backward_job, case, strategy)[:2]):
        if case == "summon_read":
            assert message == "no error", message
            continue
        what = "summon_full_params's write-back" if case == "summon_write" else case
        assert message.startswith(f"flatshard: backward of unit '<root>' on rank {rank} after"), (
            message
        )
        assert f"after {what} wrote its shards since its forward" in message, message
        assert f"Call {what} between steps" in message, message


def writeback_alone_job(rank: int) -> tuple[str, bool, bool]:
    """A change inside ``summon_full_params`` on rank 0 only (through ``.data``, which no
    version counter sees), then the same change on every rank."""
    model = _net()
    with flatshard.summon_full_params(model, writeback=False):
        before = model.inp.weight.detach().clone()
    message = ""
    try:
        with flatshard.summon_full_params(model):
            if rank == 0:
                model.inp.weight.data.fill_(0.5)  # e.g. weights loaded on rank 0 only
    except RuntimeError as error:
        message = str(error)
    with flatshard.summon_full_params(model, writeback=False):
        unchanged = bool(torch.equal(model.inp.weight, before))
    with flatshard.summon_full_params(model):
        model.inp.weight.data.fill_(0.25)
    with flatshard.summon_full_params(model, writeback=False):
        written = bool((model.inp.weight == 0.25).all())
    return message, unchanged, written


@pytest.mark.parametrize("world", [2, 4])
def test_a_write_back_of_a_change_on_one_rank_is_named_on_every_rank(world: int) -> None:
    """Before: each rank wrote back its own rows, rank 0's change landed in rank 0's rows
    only (a silent mix of two models)."""
    for rank, (message, unchanged, written) in enumerate(
        run_isolated(writeback_alone_job, world_size=world)
    ):
        assert "summon_full_params(writeback=True) ended with 1 full parameter(s)" in message
        assert "'inp.weight': one value on rank(s) 0, another on rank(s) 1" in message
        assert "nothing was written back" in message and f"(seen on rank {rank})" in message
        assert unchanged, f"rank {rank}: the refused write-back changed the shards"
        assert written, f"rank {rank}: the same change on every rank was not written back"


# ---------------------------------------------------------------- an argument on one rank
def argument_alone_job(rank: int, case: str, folder: str) -> tuple[str, str, float]:
    """One argument or setting that differs on one rank (in ``folder``, shared by the
    ranks): a call's argument, a dict, an optimizer's or a scaler's setting, the checks."""
    flatshard.set_checks(flatshard.Checks(timeout=2.0, debug=case == "debug" and rank == 1))
    other = rank == 1
    start = time.monotonic()
    try:
        init = flatshard.InitOptions()
        if case == "check_consistency":
            init = flatshard.InitOptions(check_consistency=not other)
        elif case == "check_weights":
            init = flatshard.InitOptions(check_weights=other)
        torch.manual_seed(0)
        model = flatshard.fully_shard(ReluNet(), auto_wrap_policy={ReluLinear}, init=init)
        params = list(model.parameters())
        optim = torch.optim.SGD(
            params[:-1] if case == "subset" and other else params,
            lr=0.1,
            momentum=0.9 if case == "full_optim_dict" else 0.0,
            maximize=case == "maximize" and other,
        )
        if case == "scaler":
            scaler = flatshard.ShardedGradScaler(init_scale=2.0**10 if other else 2.0**16)
            torch.manual_seed(1)
            scaler.scale(model(torch.randn(3, 4)).sum()).backward()
            scaler.step(optim)
        for _ in range(2):
            _step(model, optim)
        ckpt = os.path.join(folder, "ckpt")
        if case == "save_path":
            flatshard.save_checkpoint(os.path.join(folder, f"r{rank}"), model, optim)
        elif case == "save_optimizer":
            flatshard.save_checkpoint(ckpt, model, None if other else optim)
        elif case in ("load_path", "load_optimizer"):
            flatshard.save_checkpoint(ckpt, model, optim)
            flatshard.load_checkpoint(ckpt, model)  # the same call on every rank: loads
            where = os.path.join(folder, "elsewhere") if case == "load_path" and other else ckpt
            given = None if case == "load_optimizer" and other else optim
            flatshard.load_checkpoint(where, model, given)
        elif case == "resume_state":
            resume = None if other else flatshard.ResumeState()
            flatshard.save_checkpoint(ckpt, model, optim, resume_state=resume)
        elif case == "names_on_one_rank":
            export = os.path.join(folder, "export")
            flatshard.export_safetensors(model, export)
            flatshard.load_safetensors(model, export, names=None if other else str)
        elif case == "names_on_load":  # a names function built from a per-rank setting
            export = os.path.join(folder, "export")
            flatshard.export_safetensors(model, export)
            swap = {"blocks.0.": "blocks.1.", "blocks.1.": "blocks.0."} if other else {}

            def names(key: str) -> str:
                renamed = (to + key[len(of) :] for of, to in swap.items() if key.startswith(of))
                return next(renamed, key)

            flatshard.load_safetensors(model, export, names=names)
        elif case == "export_dtype":
            export = os.path.join(folder, "export")
            flatshard.export_safetensors(model, export, dtype=torch.bfloat16 if other else None)
        elif case in ("from_rank0", "full_dict"):
            full = flatshard.full_state_dict(model, rank0_only=False)
            if case == "full_dict" and other:
                full["blocks.1.lin.weight"] = full["blocks.1.lin.weight"] + 1.0
            flatshard.load_state_dict(model, full, from_rank0=case == "from_rank0" and not other)
        elif case == "summon_writeback":
            with flatshard.summon_full_params(model, writeback=not other):
                pass
        elif case == "clip_with_norm":  # accelerate's clipping: the norm, then this
            from torch.nn.utils import clip_grads_with_norm_, get_total_norm

            model(torch.randn(3, 4)).sum().backward()
            norm = get_total_norm([p.grad for p in params if p.grad is not None])
            clip_grads_with_norm_(params, 0.05 if other else 0.1, norm)
        elif case == "full_optim_dict":
            full = flatshard.full_optim_state_dict(model, optim, rank0_only=False)
            if other:
                full["state"]["blocks.1.lin.weight"]["momentum_buffer"] *= 2.0
            flatshard.load_optim_state_dict(model, optim, full)
    except Exception as error:
        return _ended_by(error, start)
    return "", "", time.monotonic() - start


MISMATCH = "CollectiveMismatchError"
ARGUMENTS = {  # case: (the error every rank raises, words every rank's message holds)
    "save_path": (MISMATCH, "/r1', optimizer=SGD"),
    "save_optimizer": (MISMATCH, "optimizer=None"),
    "load_path": (MISMATCH, "/elsewhere', optimizer=SGD"),
    "load_optimizer": (MISMATCH, "optimizer=None, strict=True"),
    "export_dtype": (MISMATCH, "dtype=bfloat16"),
    "resume_state": (MISMATCH, "resume_state=None"),
    "names_on_load": ("ValueError", "ranks map entries to other names"),
    "names_on_one_rank": (MISMATCH, "dtype=None, names=None)"),
    "from_rank0": (MISMATCH, "from_rank0=True"),
    "full_dict": ("ValueError", "'blocks.1.lin.weight': digest"),
    "full_optim_dict": ("ValueError", "'blocks.1.lin.weight' momentum_buffer: digest"),
    "summon_writeback": (MISMATCH, "summon_full_params(writeback=False)"),
    "clip_with_norm": (MISMATCH, "clip_grads_with_norm_(max_norm=0.05)"),
    "maximize": (MISMATCH, "maximize=True"),
    "subset": (MISMATCH, "params=9"),
    "scaler": ("RuntimeError", "scaled their losses by different scales"),
    "debug": (f"{MISMATCH}|CollectiveTimeoutError", "ranks 1 agree on every collective"),
    "check_consistency": (MISMATCH, "check_consistency=False"),
    "check_weights": (MISMATCH, "check_weights=True"),
}


@pytest.mark.parametrize(
    ("case", "world"),
    [(case, 2) for case in sorted(ARGUMENTS)]
    + [
        (case, 4)
        for case in (
            "save_path",
            "full_dict",
            "full_optim_dict",
            "scaler",
            "debug",
            "check_consistency",
        )
    ],
)
def test_an_argument_or_setting_on_one_rank_is_named_on_every_rank(case: str, world: int) -> None:
    """Before: a checkpoint saved or loaded at another path, or without the optimizer, on
    one rank, an export in another dtype, a full (optimizer) dict changed on one rank, an
    optimizer with maximize=True or without one parameter, a resume state saved by one
    rank (its load then failed on the others), a names function that maps entries to
    other names on one rank (each rank's rows read from another tensor), a scaler with another
    init_scale, a clip by a given norm with another max_norm: silent (a checkpoint
    committed incomplete, a model or optimizer state mixed from two, shards updated by
    different factors); load_state_dict's from_rank0 or debug mode on one rank:
    a wait to the timeout; check_consistency=False on one rank: gloo's SIGABRT;
    check_weights on one rank: "different values" that were not."""
    error, words = ARGUMENTS[case]
    with tempfile.TemporaryDirectory() as folder:
        outcomes = run_isolated(argument_alone_job, case, folder, world_size=world)
    for rank, outcome in enumerate(outcomes):
        assert isinstance(outcome, tuple), f"rank {rank}: {outcome}"
        name, message, seconds = outcome
        assert name in error.split("|"), f"rank {rank} ended with {name or 'no error'}: {message}"
        assert words in message, f"rank {rank}: {message}"
        assert seconds < LIMIT_S, f"rank {rank} took {seconds:.1f} s"
        one_call = ("save_", "load_", "export_", "from_", "summon_", "clip_")  # other values
        if case.startswith(one_call):
            assert "with other arguments (above): pass the same values to" in message, message


def two_optimizers_job(ctx: WorkerContext) -> dict[str, torch.Tensor] | None:
    """A GAN's pattern in one sharded model: ``blocks.0`` generates, ``blocks.2``
    discriminates, each with its own optimizer; the discriminator steps between the
    generator's forward and its backward, which reads none of the discriminator's
    shards."""
    group = ctx.group(2)
    torch.manual_seed(0)
    net = ReluNet()
    if group is not None:  # ranks 2 and 3 train the unsharded reference
        net = flatshard.fully_shard(net, auto_wrap_policy={ReluLinear}, process_group=group)
    generator = torch.optim.SGD(net.blocks[0].parameters(), lr=0.1)
    discriminator = torch.optim.SGD(net.blocks[2].parameters(), lr=0.1)
    x = torch.randn(3, 8, generator=torch.Generator().manual_seed(5))
    for _ in range(2):
        fake = net.blocks[0](x)
        net.blocks[2](fake.detach()).sum().backward()
        discriminator.step()
        discriminator.zero_grad()
        net.blocks[2](fake).pow(2).sum().backward()  # through blocks.0, forward before the step
        generator.step()
        generator.zero_grad()
        discriminator.zero_grad()
    if group is None:
        return dict(net.state_dict()) if ctx.rank == 3 else None
    return flatshard.full_state_dict(net)


def test_a_step_of_other_units_between_a_forward_and_its_backward_is_allowed(
    pool: WorkerPool,
) -> None:
    """Only a step that wrote the unit's own shards refuses its backward (as unsharded
    torch refuses only a write of what the graph saved)."""
    sharded, _, _, reference = pool.run(two_optimizers_job)
    assert sharded is not None and reference is not None
    assert sharded.keys() == reference.keys()
    for name, value in reference.items():
        torch.testing.assert_close(sharded[name], value, msg=name)


def test_set_prefetch_targets_are_named_as_they_are_after_adoption(
    local_group: dist.ProcessGroup,
) -> None:
    """``set_prefetch`` on units sharded bottom-up, before the model's own call: the agreed
    configuration holds the units themselves, so what ranks compare names them as they are
    called once the model adopted them (a copy of their labels at the call said ``<root>``)."""
    from flatshard.runtime import agreed_configuration
    from flatshard.testing.models import MLPStack

    model = MLPStack()
    for block in model.blocks:
        flatshard.fully_shard(block, process_group=local_group)
    flatshard.set_prefetch(model.blocks[0], forward=[model.blocks[2], model.blocks[1]])
    flatshard.set_prefetch(model.blocks[1], backward=[])
    flatshard.fully_shard(model, process_group=local_group)
    lines = agreed_configuration(model)
    first = lines.index("unit 'blocks.0':")
    assert "  prefetch_forward=(blocks.2, blocks.1)" in lines[first : first + 20], lines
    second = lines.index("unit 'blocks.1':")
    assert "  prefetch_backward=()" in lines[second : second + 20], lines
