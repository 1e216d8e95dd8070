"""How ``flatshard plan`` shows a plan: a table for people, JSON for tools, a PNG timeline."""

from __future__ import annotations

from flatshard.cli.config import ConfigError
from flatshard.cli.internals import ALLOCATOR_SLACK
from flatshard.cli.sizes import GiB, size
from flatshard.planner import Plan


def _host_lines(plan: Plan) -> list[str]:
    """CPU offload: what the host memory holds at its peak (shards, gradients, moments)."""
    if not plan.setup.cpu_offload:
        return []
    host = plan.cluster.host_memory_bytes
    room = f"  of {size(host)} host memory per rank" if host else "  (the same memory)"
    return [f"  {'host memory (CPU offload), peak':<40} {size(plan.host_memory_bytes):>12}{room}"]


def table(plan: Plan, budget: int | None = None) -> str:
    """The plan's figures; with ``budget`` (--memory-budget), whether it fits that too."""
    setup, cluster, step = plan.setup, plan.cluster, plan.step
    budget_lines = []
    if budget is not None:
        budget_lines.append(
            f"  {'memory budget (--memory-budget)':<40} {size(budget):>12}  "
            + ("fits" if plan.fits_within(budget) else "DOES NOT FIT")
        )
    lines = [
        f"plan: {plan.params / 1e6:,.1f}M parameters ({plan.trainable / 1e6:,.1f}M trained) "
        f"in {plan.units} units; {setup.strategy.name} over {setup.world_size} ranks "
        f"({cluster.hosts} x {cluster.ranks_per_host}) on {cluster.name}",
        "",
        "memory per rank at the step's peak (live tensors, as the dispatcher counts them):",
    ]
    for what, nbytes in sorted(plan.memory.items(), key=lambda kv: -kv[1]):
        lines.append(f"  {what:<40} {size(nbytes):>12}")
    lines += [
        f"  {'peak':<40} {size(plan.peak_memory_bytes):>12}",
        f"  {'between steps (sharded state)':<40} {size(plan.at_rest_bytes):>12}",
        f"  {'device memory needed':<40} {size(plan.device_memory_needed):>12}"
        f"  (+{ALLOCATOR_SLACK:.0%} allocator slack"
        f"{', +1 GiB context' if cluster.device != 'cpu' else ''})",
        f"  {'device memory':<40} {size(cluster.memory_bytes):>12}  "
        + ("fits" if plan.fits else "DOES NOT FIT"),
        *budget_lines,
        *_host_lines(plan),
        "",
        "collectives per step (this rank):",
    ]
    for c in plan.collectives:
        lines.append(
            f"  {c.kind:<15} {c.count:>5} x  {size(c.bytes):>12} in all  "
            f"{c.seconds * 1e3:>9.2f} ms alone  ({c.links})"
        )
    if not plan.collectives:
        lines.append("  none (one rank)")
    lines += _pipeline_lines(plan)
    lines += [
        "",
        f"step time: {step.seconds * 1e3:.2f} ms (compute {step.compute_s * 1e3:.2f} ms, "
        f"communication {step.communication_s * 1e3:.2f} ms, of which exposed "
        f"{step.exposed_communication_s * 1e3:.2f} ms)",
        f"throughput: {_flops(plan.tflops_per_device * 1e12)} per device, "
        f"{plan.mfu:.0%} of peak (recomputation counted)",
    ]
    lines += [f"note: {note}" for note in cluster.notes]
    return "\n".join(lines)


def _pipeline_lines(plan: Plan) -> list[str]:
    """--pp: every pipeline rank's memory and work, the bubble and the sends."""
    cost = plan.pipeline
    if cost is None:
        return []
    layout = cost.layout
    lines = [
        "",
        f"pipeline: {layout.stages} stages on {layout.ranks} ranks ({layout.schedule}, "
        f"{layout.microbatches} micro-batches a step); above: the rank with the most memory",
        f"  {'rank':<5} {'stages':<8} {'peak':>10} {'at rest':>10} {'in flight':>10} "
        f"{'activations/mb':>15} {'work/step':>12}",
    ]
    for r in cost.ranks:
        stages = ",".join(map(str, r.stages))
        lines.append(
            f"  {r.rank:<5} {stages:<8} {size(r.peak_memory_bytes):>10} "
            f"{size(r.at_rest_bytes):>10} {r.in_flight:>10} {size(r.activation_bytes):>15} "
            f"{r.busy_s * 1e3:>9.2f} ms"
        )
    lines += [
        f"  bubble: {cost.bubble_s * 1e3:.2f} ms, {cost.bubble_fraction:.1%} of the step; "
        f"sends: {size(cost.send_bytes)} per rank per step ({cost.send_s * 1e3:.2f} ms to fill "
        "and drain)",
    ]
    return lines


def _flops(rate: float) -> str:
    return f"{rate / 1e12:,.1f} TFLOP/s" if rate >= 1e12 else f"{rate / 1e9:,.1f} GFLOP/s"


def chart(plan: Plan, path: str) -> None:
    try:
        import matplotlib
    except ImportError:
        raise ConfigError("--chart needs matplotlib: pip install matplotlib") from None
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 3.5))
    ax.plot([b / GiB for b in plan.timeline], color="tab:blue")
    if plan.cluster.memory_bytes < 3 * plan.peak_memory_bytes:  # else off the scale
        ax.axhline(plan.cluster.memory_bytes / GiB, color="tab:red", linestyle="--", lw=1)
    ax.set_xlabel("op of the training step (forward, backward, optimizer)")
    ax.set_ylabel("live tensors per rank (GiB)")
    ax.set_title(f"flatshard plan: {plan.setup.strategy.name}, {plan.setup.world_size} ranks")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
