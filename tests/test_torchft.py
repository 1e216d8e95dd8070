"""Fault-tolerant replica groups on torchft (``flatshard.integrations.torchft``).

Three replica groups of 1 rank and two of 2 ranks, each sharded with flatshard
(FULL_SHARD over its own ranks), average their gradients through torchft's quorum (a
Lighthouse in the test's process). Every rank of replica group 1 dies at a step
(``os._exit``), before it or inside its all-reduce (then that step commits nowhere and is
taken again); the other groups take every later step without it, in the same processes;
group 1 is started again, heals from a live group over torchft's checkpoint transport (no
checkpoint on disk) and from then on every group holds bitwise-equal shards. The
parameters equal a reference that replays each committed step with its membership (the
average over the groups that took part, by name, each on its own data for that step).
Under ``flatshard train``, a group of 2 ranks (HYBRID_SHARD inside) is killed and brought
back by its own torchrun (``--max-restarts``).
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch import nn

from flatshard.testing.internals import fast_context
from flatshard.testing.isolated import descendants, rank_pid, wait_until
from flatshard.testing.scripts import last_logged_step, logged_rows

pytest.importorskip("torchft")

MAIN = [sys.executable, "-m", "flatshard.cli.main"]

STEPS, LR = 16, 0.1
# Seconds a step lasts: alone, a group's restart (processes, imports) spans a few steps.
PAUSE, PAUSE_ALONE = 0.1, 1.0


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.up, self.down = nn.Linear(16, 32), nn.Linear(32, 16)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = x + self.down(torch.relu(self.up(x)))
        return out


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(Block(), Block())


def _batch(group: int, rank: int, step: int) -> tuple[torch.Tensor, torch.Tensor]:
    """What rank ``rank`` of replica group ``group`` reads at ``step`` (the data position
    is the step: a group that heals reads on where the others are)."""
    gen = torch.Generator().manual_seed(10_000 * step + 100 * group + rank)
    return torch.randn(4, 16, generator=gen), torch.randn(4, 16, generator=gen)


class DyingAllReduce:
    """The all-reduce hook of a group that dies in the middle of step ``step``'s
    all-reduce: the sum is started, then the process ends before it completes."""

    averages_replicas = True  # it wraps replicate_with's average: it may replace it

    def __init__(self, manager: Any, step: int, model: nn.Module, groups: int) -> None:
        from flatshard.integrations.torchft import ManagerAllReduce, layout_digest

        self.manager, self.step = manager, step
        self.hook = ManagerAllReduce(manager, layout_digest(model), 1, groups)

    def __call__(self, shard: torch.Tensor) -> None:
        if self.manager.current_step() == self.step:
            self.hook._check_layout()  # as the live groups do first
            self.manager.allreduce(shard)  # in flight...
            os._exit(9)
        self.hook(shard)


def _rank_main(
    group: int,
    groups: int,
    rank: int,
    size: int,
    lighthouse: str,
    die_at: int | None,
    start: Any,
    queues: tuple[Any, Any, Any],
) -> None:
    """One rank of one replica group: flatshard over the group, torchft across groups.
    ``queues``: the group's store port (rank 0 to the others), the results, group 0's
    progress (its quorum's size after each step)."""
    ports, out, progress = queues
    from torchft import Manager
    from torchft.optim import OptimizerWrapper
    from torchft.process_group import ProcessGroupGloo

    import flatshard
    from flatshard.integrations.torchft import replicate_with, state_dict_fns

    torch.set_num_threads(1)
    if rank == 0:
        store = dist.TCPStore("localhost", 0, size, is_master=True, wait_for_workers=False)
        for _ in range(size - 1):
            ports.put(store.port)
    else:
        store = dist.TCPStore("localhost", ports.get(timeout=60), size, is_master=False)
    dist.init_process_group("gloo", store=store, rank=rank, world_size=size)
    model = flatshard.fully_shard(_model(), auto_wrap_policy={Block})
    inner = torch.optim.SGD(model.parameters(), lr=LR)
    load, save = state_dict_fns(model, [inner])
    manager = Manager(
        pg=ProcessGroupGloo(),
        min_replica_size=1,
        load_state_dict=load,
        state_dict=save,
        replica_id=f"group{group}",
        store_addr="localhost",
        store_port=store.port,
        rank=rank,
        world_size=size,
        lighthouse_addr=lighthouse,
        use_async_quorum=False,
        timeout=timedelta(seconds=20),
        quorum_timeout=timedelta(seconds=20),
    )
    hook = replicate_with(model, manager, group, groups)
    if die_at is not None and die_at < 0:  # die inside step -die_at's all-reduce instead
        flatshard.set_all_reduce_hook(model, DyingAllReduce(manager, -die_at, model, groups))
    optim = OptimizerWrapper(manager, inner)
    if start is not None:
        start.wait()  # the first quorum: every group heartbeating
    log, pid = [], os.getpid()
    while manager.current_step() < STEPS:
        if die_at is not None and manager.current_step() == die_at >= 0:
            os._exit(9)  # the whole group, at the same step
        optim.zero_grad()  # the quorum, and a heal: the step is known after it
        step = manager.current_step()
        x, y = _batch(group, rank, step)
        ((model(x) - y) ** 2).mean().backward()
        members = hook.members or ()  # the step's quorum, by group
        optim.step()  # only where should_commit says so
        log.append((step, members, manager.current_step() > step))
        if group == 0 and rank == 0:
            progress.put(members)  # the test restarts group 1 once group 0 went on without
        time.sleep(PAUSE_ALONE if len(members) < groups else PAUSE)
    with flatshard.summon_full_params(model):
        params = [p.detach().clone().tolist() for p in model.parameters()]
    out.put({"group": group, "rank": rank, "log": log, "params": params, "pid": pid})
    manager.shutdown(wait=False)
    dist.destroy_process_group()


def _reference(log: list[tuple[int, list[int], bool]], size: int) -> list[torch.Tensor]:
    """The committed steps replayed: each the average of the gradients of the groups in
    its quorum, each group's the average over its ranks."""
    model = _model()
    for step, members, committed in log:
        if not committed:
            continue
        model.zero_grad()
        for group in members:
            for rank in range(size):
                x, y = _batch(group, rank, step)
                (((model(x) - y) ** 2).mean() / (len(members) * size)).backward()
        with torch.no_grad():
            for p in model.parameters():
                p -= LR * p.grad
    return [p.detach() for p in model.parameters()]


@pytest.mark.parametrize(("groups", "size", "die_at"), [(3, 1, 3), (2, 2, -3)])
def test_a_replica_group_dies_and_heals_from_a_live_one(
    groups: int, size: int, die_at: int
) -> None:
    """``die_at`` -3: the group dies inside step 3's all-reduce; group 0's step 3 is then not
    committed (its sum never completed) and is taken again alone."""
    from torchft._torchft import LighthouseServer

    lighthouse = LighthouseServer(
        bind="[::]:0", min_replicas=1, join_timeout_ms=2000, heartbeat_timeout_ms=2000
    )
    ctx = fast_context()  # forked from a server that imported torch once
    out, start, progress = ctx.Queue(), ctx.Barrier(groups * size), ctx.Queue()
    ports = [ctx.Queue() for _ in range(groups)]

    def launch(group: int, die_at: int | None, barrier: Any) -> list[Any]:
        procs = [
            ctx.Process(
                target=_rank_main,
                args=(
                    group,
                    groups,
                    rank,
                    size,
                    lighthouse.address(),
                    die_at,
                    barrier,
                    (ports[group], out, progress),
                ),
            )
            for rank in range(size)
        ]
        for proc in procs:
            proc.start()
        return procs

    try:
        live = [proc for g in range(groups) if g != 1 for proc in launch(g, None, start)]
        dying = launch(1, die_at, start)
        for proc in dying:
            proc.join(timeout=120)
            assert proc.exitcode == 9, proc.exitcode
        while 1 in progress.get(timeout=120):  # group 0 committed a step without group 1
            pass
        healed = launch(1, None, None)  # torchrun's restart of the group
        results = [out.get(timeout=180) for _ in range(groups * size)]
        for proc in live + healed:
            proc.join(timeout=60)
    finally:
        lighthouse.shutdown()
    by_group = {(r["group"], r["rank"]): r for r in results}
    survivor = by_group[0, 0]
    steps = [step for step, _, committed in survivor["log"] if committed]
    assert steps == list(range(STEPS)), survivor["log"]  # every step, without a restart
    assert {r["pid"] for r in results if r["group"] != 1} == {p.pid for p in live}
    every, without = list(range(groups)), [g for g in range(groups) if g != 1]
    quorums = [list(members) for _, members, _ in survivor["log"]]
    failed = [(step, list(m)) for step, m, committed in survivor["log"] if not committed]
    assert failed == ([(3, every)] if die_at < 0 else []), survivor["log"]  # never applied
    assert quorums[:3] == [every] * 3 and without in quorums[3:], quorums
    assert quorums[-1] == every, quorums
    back = by_group[1, 0]["log"]
    assert back[0][0] > 3 and back[-1][0] == STEPS - 1, back  # healed at a later step
    reference = _reference(survivor["log"], size)
    for (group, rank), result in by_group.items():
        params = [torch.tensor(p) for p in result["params"]]
        for ours, theirs in zip(params, reference, strict=True):
            assert torch.allclose(ours, theirs, rtol=1e-5, atol=1e-6), (group, rank)
        for ours, theirs in zip(params, survivor["params"], strict=True):
            assert torch.equal(ours, torch.tensor(theirs)), (group, rank)  # bitwise


def test_train_as_two_replica_groups_is_one_data_parallel_run(tmp_path: Any) -> None:
    """``flatshard train --ft-replicas 2 --ft-replica-id I``: two runs of one rank each,
    every step committed with both groups in the quorum (the Lighthouse waits for two),
    train as one run of 2 ranks: each step's mean loss over the groups equals that run's,
    both groups end with the same held-out loss, and metrics.jsonl says 2 groups a step."""

    from torchft._torchft import LighthouseServer

    lighthouse = LighthouseServer(bind="[::]:0", min_replicas=2, join_timeout_ms=1000)
    common = ["--dim", "32", "--layers", "2", "--heads", "2", "--seq-len", "32", "--batch", "4"]
    common += ["--steps", "4", "--sample-bytes", "0"]
    command = [*MAIN, "train", *common]
    ft = ["--nproc", "1", "--ft-replicas", "2", "--ft-lighthouse", lighthouse.address()]
    try:
        groups = [
            subprocess.Popen(
                [*command, *ft, "--ft-replica-id", str(i), "--out-dir", str(tmp_path / f"g{i}")],
                stdout=subprocess.PIPE,
                stderr=subprocess.STDOUT,
                text=True,
            )
            for i in range(2)
        ]
        outputs = [group.communicate(timeout=240)[0] for group in groups]
    finally:
        lighthouse.shutdown()
    for group, output in zip(groups, outputs, strict=True):
        assert group.returncode == 0, output[-3000:]
    one = subprocess.run(
        [*command, "--nproc", "2", "--out-dir", str(tmp_path / "one")],
        capture_output=True, text=True, timeout=240,
    )  # fmt: skip
    assert one.returncode == 0, one.stderr[-3000:]

    g0, g1, reference = (logged_rows(tmp_path / name) for name in ("g0", "g1", "one"))
    assert [r["replica_groups"] for r in g0 + g1] == [[0, 1]] * 8
    assert not any("quorum_change" in r for r in g0 + g1)  # the same quorum throughout
    for a, b, ref in zip(g0, g1, reference, strict=True):
        assert (a["loss"] + b["loss"]) / 2 == pytest.approx(ref["loss"], rel=1e-5)
    held_out = [o.split("held-out loss ")[1].split()[0] for o in (*outputs, one.stdout)]
    assert held_out[0] == held_out[1], held_out  # the groups hold the same model
    assert float(held_out[0]) == pytest.approx(float(held_out[2]), rel=1e-5)
    assert "0 steps taken with fewer replica groups" in outputs[0]


def test_train_refuses_what_replica_groups_do_not_take(capsys: Any) -> None:
    from flatshard.cli.main import main

    for argv, message in [
        (["--ft-replicas", "1"], "--ft-replicas must be >= 2 replica groups"),
        (["--ft-replicas", "2", "--ft-replica-id", "2"], "--ft-replica-id must be 0 to 1"),
        (["--ft-replica-id", "1"], "--ft-replica-id applies with --ft-replicas"),
        (["--ft-replicas", "2", "--optimizer", "muon"], "--optimizer does not combine"),
        (["--ft-replicas", "2", "--ft-quorum-timeout", "0"], "must be > 0 seconds, got 0.0"),
        (["--ft-quorum-timeout", "5"], "--ft-quorum-timeout applies with --ft-replicas"),
        (["--ft-min-replicas", "2"], "--ft-min-replicas applies with --ft-replicas"),
    ]:
        assert main(["train", *argv]) == 2, argv
        assert message in capsys.readouterr().err, argv
    from flatshard.integrations.torchft import ReplicaGroups

    for options, message in [
        ({"count": 1, "index": 0}, "count must be >= 2 replica groups, got 1"),
        ({"count": 2, "index": 2}, "index must be 0 to 1, got 2"),
        ({"count": 2, "index": 0, "min_replicas": 3}, "min_replicas must be 1 to 2, got 3"),
        ({"count": 2, "index": 0, "quorum_timeout": 0}, "quorum_timeout must be > 0 s"),
    ]:
        with pytest.raises(ValueError, match=message):
            ReplicaGroups(**options)


def test_without_torchft_the_extra_is_named(monkeypatch: Any, capsys: Any) -> None:
    import importlib.util

    from flatshard.cli.main import main
    from flatshard.integrations.torchft import replicate_with

    real = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util, "find_spec", lambda name, *a: None if name == "torchft" else real(name, *a)
    )
    assert main(["train", "--ft-replicas", "2"]) == 2
    assert "--ft-replicas needs torchft: pip install 'flatshard[ft]'" in capsys.readouterr().err
    with pytest.raises(ImportError, match=r"needs torchft: pip install 'flatshard\[ft\]'"):
        replicate_with(nn.Linear(2, 2), None)


def test_a_quorum_that_never_forms_is_named(tmp_path: Path) -> None:
    """One replica group alone, where the Lighthouse waits for two, and where
    ``--ft-min-replicas 2`` asks for two: each run stops after ``--ft-quorum-timeout``
    with one line naming the wait and the groups the Lighthouse has heard from."""
    from torchft._torchft import LighthouseServer

    houses = [LighthouseServer(bind="[::]:0", min_replicas=n) for n in (2, 1)]
    run = [*MAIN, "train", "--dim", "32", "--layers", "2", "--heads", "2", "--seq-len", "32"]
    run += ["--batch", "4", "--steps", "2", "--sample-bytes", "0", "--nproc", "1"]
    run += ["--ft-replicas", "2", "--ft-quorum-timeout", "3"]
    try:
        runs = []
        for i, house in enumerate(houses):
            out = str(tmp_path / str(i))
            command = [*run, "--ft-lighthouse", house.address(), "--out-dir", out]
            command += ["--ft-min-replicas", "2"] if i else []
            with (tmp_path / f"{i}.err").open("w") as err:
                runs.append(subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=err))
        for proc in runs:
            proc.wait(timeout=120)
    finally:
        for house in houses:
            house.shutdown()
    errors = [(tmp_path / f"{i}.err").read_text() for i in range(2)]
    assert [proc.returncode for proc in runs] == [1, 1], errors  # a rank's error: exit 1
    assert "flatshard train: error: replica group 0: no quorum formed within 3 s" in errors[0]
    assert "need min_replicas 2" in errors[0] and "heard from: group0." in errors[0], errors[0]
    assert "error: --ft-min-replicas 2: step 1 found only 1 replica group(s)" in errors[1]
    assert "heard from: group0." in errors[1], errors[1]
    assert "Traceback" not in errors[0] + errors[1]


def mismatched_main(
    group: int, lighthouse: str, out: Any, start: Any, sync: bool, differs: str
) -> None:
    """A replica group of one rank whose model has ``group + 2`` blocks (``differs``
    "model"), or whose units divide their gradients by 1 on group 1 ("options"): one step
    (``sync``: torchft's init_sync, the later group copies the first's state at step 0)."""
    from torchft import Manager
    from torchft.optim import OptimizerWrapper
    from torchft.process_group import ProcessGroupGloo

    import flatshard
    from flatshard.integrations.torchft import layout_digest, replicate_with, state_dict_fns

    store = dist.TCPStore("localhost", 0, 1, is_master=True, wait_for_workers=False)
    dist.init_process_group("gloo", store=store, rank=0, world_size=1)
    torch.manual_seed(0)
    blocks = group + 2 if differs == "model" else 2
    model = flatshard.fully_shard(nn.Sequential(*(Block() for _ in range(blocks))))
    if differs == "options" and group == 1:
        flatshard.set_gradient_divide_factor(model, 1.0)  # a sum, not the average
    lr = LR * (1 + group) if differs == "settings" else LR
    inner = torch.optim.SGD(model.parameters(), lr=lr)
    settings = {"lr": lr}
    layout = layout_digest(model, settings)
    load, save = state_dict_fns(model, [inner], None, (layout, 2, settings))
    manager = Manager(
        pg=ProcessGroupGloo(), min_replica_size=1, load_state_dict=load, state_dict=save,
        replica_id=f"group{group}", store_addr="localhost", store_port=store.port, rank=0,
        world_size=1, lighthouse_addr=lighthouse, use_async_quorum=False,
        timeout=timedelta(seconds=20), init_sync=sync,
    )  # fmt: skip
    index = 0 if differs == "index" else group  # "index": both groups take index 0
    replicate_with(model, manager, index, 2, layout)
    optim = OptimizerWrapper(manager, inner)
    start.wait()
    try:
        optim.zero_grad()
        x, y = _batch(group, 0, 0)
        ((model(x) - y) ** 2).mean().backward()
        out.put((group, ""))
    except ValueError as error:
        out.put((group, str(error)))
    manager.shutdown(wait=False)
    dist.destroy_process_group()


@pytest.mark.parametrize(
    ("sync", "differs"),
    [(False, "model"), (True, "model"), (False, "options"), (True, "settings"), (False, "index")],
)
def test_replica_groups_of_other_layouts_are_named(sync: bool, differs: str) -> None:
    """Two groups whose models differ (2 and 3 blocks), whose units' options do (one
    divides its gradients by 1: silently a sum, were they averaged), whose settings do
    (learning rates), or that took the same index. Without torchft's init_sync both take
    step 0 and its check raises on both, by name, instead of averaging shards of other
    rows or scales; with it the group that copies the other's state refuses it by name,
    alone (the other never sums with it)."""
    from torchft._torchft import LighthouseServer

    lighthouse = LighthouseServer(bind="[::]:0", min_replicas=2, join_timeout_ms=1000)
    ctx = fast_context()  # forked from a server that imported torch once
    out, start = ctx.Queue(), ctx.Barrier(2)
    procs = [
        ctx.Process(
            target=mismatched_main, args=(g, lighthouse.address(), out, start, sync, differs)
        )
        for g in range(2)
    ]
    try:
        for proc in procs:
            proc.start()
        results = dict(out.get(timeout=120) for _ in procs)
        for proc in procs:
            proc.join(timeout=60)
    finally:
        lighthouse.shutdown()
    if differs == "index":
        said = "2 replica groups of this step's quorum took the index 0"
        assert all(said in message for message in results.values()), results
    elif not sync:
        layout = "built different models, sharded them otherwise"
        assert all(layout in message for message in results.values()), results
    else:  # the group that heals refuses the other's state, alone
        what = "lr: " if differs == "settings" else "the model, its sharding or its units'"
        named = [m for m in results.values() if "differs from the live group" in m]
        assert len(named) == 1 and what in named[0] and "" in results.values(), results


STEPS_CLI = 100
PACED = """
from flatshard.testing.internals import replica_steps_pause

replica_steps_pause(alone=0.5, together=0.05)
"""


def test_a_group_that_would_heal_from_a_live_group_of_its_own_index_stops_alone(
    local_group: Any,
) -> None:
    """A job started twice with one --ft-replica-id: the late one heals from the live one
    before it ever sums with it. Before: the two met in the next step's check of indices
    and both stopped, the live group at step 79 of 600."""
    import flatshard
    from flatshard.integrations.torchft import LayoutMismatch, state_dict_fns

    models = [flatshard.fully_shard(_model(), auto_wrap_policy={Block}) for _ in range(3)]
    optims = [torch.optim.SGD(m.parameters(), lr=LR) for m in models]
    with torch.no_grad():  # the group behind
        for param in models[2].parameters():
            param.add_(1.0)
    live = state_dict_fns(models[0], [optims[0]], index=0)[1]()
    with pytest.raises(LayoutMismatch, match=r"heal from has the index 0 too; this group takes"):
        state_dict_fns(models[1], [optims[1]], index=0)[0](live)
    state_dict_fns(models[2], [optims[2]], index=1)[0](live)  # another index: it heals
    for mine, theirs in zip(models[2].parameters(), models[0].parameters(), strict=True):
        assert torch.equal(mine, theirs)


def test_a_hook_that_would_replace_the_replicas_average_is_refused(local_group: Any) -> None:
    """Before: set_all_reduce_hook after replicate_with replaced the average across the
    groups, and the replicas drifted apart (by 0.0018 in 3 steps), silently."""
    import flatshard
    from flatshard.integrations.torchft import replicate_with

    model = flatshard.fully_shard(_model(), auto_wrap_policy={Block})
    replicate_with(model, manager=object())  # (the manager is used at the first reduction)
    with pytest.raises(ValueError, match=r"average their gradients across replica groups"):
        flatshard.set_all_reduce_hook(model, lambda shard: None)
    replicate_with(model, manager=object())  # another manager's average: allowed
    flatshard.set_all_reduce_hook(model, None)  # and undone


def test_train_group_killed_is_restarted_by_torchrun_and_heals(tmp_path: Any) -> None:
    """Two replica groups of 2 ranks (HYBRID_SHARD inside each: two replicas of one rank):
    group 0 under ``flatshard train``'s own launch, group 1 under ``torchrun
    --max-restarts 1``, started once group 0 has taken a step (it joins, healing from
    group 0). Once both took a step together (group 1 at step 4 or later), every rank of
    group 1 is SIGKILLed: group 0 takes every step, each once, in the same
    processes, and logs group 1 leaving and coming back; torchrun restarts group 1, which
    heals from group 0 (no checkpoint is read) and ends with the same model (the same
    held-out loss, to the last digit). Steps pause (``PACED``): longer where a group
    trains alone, so the other's start or restart spans a few of its steps."""
    from torchft._torchft import LighthouseServer

    lighthouse = LighthouseServer(
        bind="[::]:0", min_replicas=1, join_timeout_ms=1000, heartbeat_timeout_ms=2000
    )
    run = ["--dim", "32", "--layers", "2", "--heads", "2", "--seq-len", "32", "--batch", "4"]
    run += ["--steps", str(STEPS_CLI), "--sample-bytes", "0", "--strategy", "HYBRID_SHARD"]
    run += ["--sharding-factor", "1", "--ft-replicas", "2", "--ft-lighthouse"]
    run += [lighthouse.address()]
    out = [tmp_path / "g0", tmp_path / "g1"]
    shim = tmp_path / "shim"
    shim.mkdir()
    (shim / "sitecustomize.py").write_text(PACED)
    slow = {**os.environ, "PYTHONPATH": os.pathsep.join([str(shim), *sys.path])}
    fresh = {**slow, "TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1"}  # docs/cli.md's torchrun recipe
    torchrun = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2"]
    torchrun += ["--rdzv-backend", "c10d", "--rdzv-endpoint", "localhost:0"]
    torchrun += ["--max-restarts", "1", "-m", "flatshard.cli.main", "train"]
    logs = [(tmp_path / f"g{i}.out").open("w") for i in range(2)]  # never a full pipe
    try:
        live = subprocess.Popen(
            [*MAIN, "train", *run, "--nproc", "2", "--ft-replica-id", "0", "--out-dir",
             str(out[0])], stdout=logs[0], stderr=subprocess.STDOUT, env=slow,
        )  # fmt: skip
        wait_until(lambda: last_logged_step(out[0]) >= 1)  # group 1 joins a running group 0
        dying = subprocess.Popen(
            [*torchrun, *run, "--ft-replica-id", "1", "--out-dir", str(out[1])],
            stdout=logs[1], stderr=subprocess.STDOUT, env=fresh,
        )  # fmt: skip
        # Both groups in the quorum, then kill group 1
        wait_until(lambda: last_logged_step(out[1]) >= 4 and [0, 1] in _quorums(out[0]))
        ranks, before = descendants(live.pid), len(_quorums(out[0]))
        # Both found before either is killed: the agent ends a group's other rank itself
        # once one dies, which can beat a lookup made after the first kill.
        pids = {rank: rank_pid(dying.pid, rank) for rank in (0, 1)}
        for rank, pid in pids.items():
            assert pid is not None, f"no process for group 1's rank {rank}"
            with contextlib.suppress(ProcessLookupError):  # (gone with its peer already)
                os.kill(pid, signal.SIGKILL)
        wait_until(lambda: [0] in _quorums(out[0])[before:] and _quorums(out[0])[-1] == [0, 1])
        assert descendants(live.pid) == ranks  # group 0 went on in the same processes
        live.wait(timeout=300)
        dying.wait(timeout=300)
    finally:
        lighthouse.shutdown()
        for log in logs:
            log.close()
    outputs = [(tmp_path / f"g{i}.out").read_text() for i in range(2)]
    assert live.returncode == 0 and dying.returncode == 0, outputs
    rows = logged_rows(out[0])
    assert [r["step"] for r in rows] == list(range(1, STEPS_CLI + 1)), rows  # each step once
    changes = [r["quorum_change"] for r in rows if "quorum_change" in r]
    assert changes[-2].endswith("replica group 1 left; 1 of 2 groups in the quorum"), changes
    assert changes[-1].endswith("replica group 1 joined; 2 of 2 groups in the quorum"), changes
    assert [r["replica_groups"] for r in rows][-1] == [0, 1]
    alone = sum(r["replica_groups"] == [0] for r in rows)
    assert f"{alone} steps taken with fewer replica groups" in outputs[0], outputs[0]
    assert "replica group 1 left" in outputs[0]  # on the console too
    assert outputs[1].count("healed from a live group at step") == 2, outputs[1]  # join, back
    assert "resumed from" not in outputs[1]  # no checkpoint: the state came from group 0
    held_out = [o.split("held-out loss ")[1].split()[0] for o in outputs]
    assert held_out[0] == held_out[1], held_out


def _quorums(out_dir: Path) -> list[list[int]]:
    """The replica groups of each step ``flatshard train`` logged in ``out_dir``."""
    return [row["replica_groups"] for row in logged_rows(out_dir)] or [[]]
