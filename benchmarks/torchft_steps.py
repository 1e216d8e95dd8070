"""A healthy replica group's step while its peer is down and while the peer heals (torchft).

    python benchmarks/torchft_steps.py [--dim 256] [--steps 40]

Two replica groups of one gloo rank each (``flatshard.integrations.torchft``: the GPT
sharded FULL_SHARD inside each group, AdamW, a Lighthouse in this process). Group 1 dies
(``os._exit``) at step 10; once group 0 has committed 5 steps alone, group 1 is started
again and heals from group 0 at its next quorum. Prints group 0's median step time with
both groups up (steps 3-9), at the first step without group 1 (the quorum waits for it
until the Lighthouse's heartbeat timeout, 5 s by default), alone, at the step group 1
heals in (group 0 sends it the state), and after, each as a ratio to both up. Every step
of group 0 is timed from its quorum (``zero_grad``) to its commit (``step``).
"""

from __future__ import annotations

import argparse
import multiprocessing
import os
import statistics
import time
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist


def group_main(group: int, lighthouse: str, args: Any, die_at: int | None, out: Any) -> None:
    from torchft import Manager
    from torchft.optim import OptimizerWrapper
    from torchft.process_group import ProcessGroupGloo

    import flatshard
    from flatshard.integrations.torchft import replicate_with, state_dict_fns
    from flatshard.models import GPT, GPTBlock

    torch.set_num_threads(1)
    store = dist.TCPStore("localhost", 0, 1, is_master=True, wait_for_workers=False)
    dist.init_process_group("gloo", store=store, rank=0, world_size=1)
    torch.manual_seed(0)
    model = GPT(256, args.dim, 4, 4, 128)
    model = flatshard.fully_shard(model, auto_wrap_policy={GPTBlock})
    inner = torch.optim.AdamW(model.parameters(), lr=1e-4)
    load, save = state_dict_fns(model, [inner])
    manager = Manager(
        pg=ProcessGroupGloo(), min_replica_size=1, load_state_dict=load, state_dict=save,
        replica_id=f"group{group}", store_addr="localhost", store_port=store.port, rank=0,
        world_size=1, lighthouse_addr=lighthouse, use_async_quorum=False,
        timeout=timedelta(seconds=30),
    )  # fmt: skip
    replicate_with(model, manager)
    optim = OptimizerWrapper(manager, inner)
    gen = torch.Generator().manual_seed(group)
    while manager.current_step() < args.steps:
        if die_at is not None and manager.current_step() == die_at:
            os._exit(9)
        start = time.perf_counter()
        optim.zero_grad()
        batch = torch.randint(0, 256, (8, 129), generator=gen)
        logits = model(batch[:, :-1])
        torch.nn.functional.cross_entropy(logits.flatten(0, 1), batch[:, 1:].flatten()).backward()
        members = manager.num_participants()
        optim.step()
        if group == 0:
            out.put((manager.current_step(), members, time.perf_counter() - start))
    manager.shutdown(wait=False)
    out.put(None)


def main() -> None:
    from torchft._torchft import LighthouseServer

    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--dim", type=int, default=256)
    parser.add_argument("--steps", type=int, default=40)
    args = parser.parse_args()
    lighthouse = LighthouseServer(bind="[::]:0", min_replicas=1, join_timeout_ms=2000)
    ctx = multiprocessing.get_context("spawn")
    out, quiet = ctx.Queue(), ctx.Queue()
    live = ctx.Process(target=group_main, args=(0, lighthouse.address(), args, None, out))
    dying = ctx.Process(target=group_main, args=(1, lighthouse.address(), args, 10, quiet))
    live.start()
    dying.start()
    steps: list[tuple[int, int, float]] = []
    back = None
    while (item := out.get(timeout=600)) is not None:
        steps.append(item)
        alone = sum(members == 1 for _, members, _ in steps[10:])
        if back is None and not dying.is_alive() and alone >= 5:
            back = ctx.Process(target=group_main, args=(1, lighthouse.address(), args, None, quiet))
            back.start()
    for proc in (live, dying, back):
        if proc is not None:
            proc.join(timeout=60)
    lighthouse.shutdown()
    both = [t for step, members, t in steps if 3 <= step <= 9]
    alone = [t for _, members, t in steps if members == 1]
    rejoined = next(i for i, (_, m, _) in enumerate(steps) if i > 10 and m == 2)
    after = [t for _, members, t in steps[rejoined + 1 :] if members == 2]
    base = statistics.median(both)
    print(f"group 0, median step: both groups up {base * 1e3:.1f} ms (steps 3-9)")
    first_alone = next(t for _, members, t in steps if members == 1)
    rows = [
        ("the first step without group 1 (the quorum waits it out)", first_alone),
        (f"alone ({len(alone)} steps)", statistics.median(alone)),
        (f"the step group 1 heals in (step {steps[rejoined][0]})", steps[rejoined][2]),
        (f"after the heal ({len(after)} steps)", statistics.median(after)),
    ]
    for label, seconds in rows:
        print(f"  {label}: {seconds * 1e3:.1f} ms ({seconds / base:.2f}x)")


if __name__ == "__main__":
    main()
