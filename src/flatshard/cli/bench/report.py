"""What ``flatshard bench`` prints and writes: the summary, the table and the chart."""

from __future__ import annotations

import statistics
from typing import Any


def summarize(
    tokens: int, units: int, runs: dict[str, list[dict[str, Any]]]
) -> dict[str, dict[str, float]]:
    """Per system: medians, peaks, and ratios; ``units``: flatshard units (blocks + root)."""
    summary = {}
    for system, system_runs in runs.items():
        median = statistics.median(t for r in system_runs for t in r["step_times"])
        summary[system] = {
            "median_step_s": median,
            "tokens_per_s": tokens / median,
            "peak_mem_mib": max(r["peak_mem_mib"] for r in system_runs),
            "tensor_peak_mib": max(r["tensor_peak_mib"] for r in system_runs),
            "tensor_rest_mib": max(r["tensor_rest_mib"] for r in system_runs),
            "formula_rest_mib": system_runs[0]["formula_rest_mib"],
            "formula_collective_bytes": system_runs[0]["formula_collective_bytes"],
            "collective_output_bytes": system_runs[0]["collective_output_bytes"],
            "all_gather_bytes": system_runs[0]["all_gather_bytes"],
            "all_to_all_bytes": system_runs[0]["all_to_all_bytes"],
            "sent_bytes": system_runs[0]["sent_bytes"],
            "token_bytes": statistics.median(r["token_bytes"] for r in system_runs),
        }
        embedding = (
            "embedding_bytes_per_step",
            "embedding_sparse_lookups",
            "embedding_dense_lookups",
        )
        for key in embedding:
            if key in system_runs[0]:
                summary[system][key] = system_runs[0][key]
        for key in {k for r in system_runs for k in r if k.startswith("wait_s ")}:
            summary[system][key] = statistics.median(r.get(key, 0.0) for r in system_runs)
        waits = [w for r in system_runs for w in r["comm_waits"]]
        if waits:
            summary[system]["exposed_comm_s"] = statistics.median(waits)
        bubbles = [b for r in system_runs for b in r.get("bubbles", [])]
        if bubbles:  # --pp: [Note: the bubble, measured]
            summary[system]["bubble"] = statistics.median(bubbles)
        for kind, nbytes in system_runs[0].get("bytes_by_kind", {}).items():
            summary[system][f"bytes {kind}"] = nbytes
    floor = summary.get("floor", {}).get("median_step_s")
    comm = runs.get("comm")
    if comm is not None and floor is not None:  # [Note: the achievable bound]
        summary["comm"]["cpu_s"] = statistics.median(t for r in comm for t in r["cpu_times"])
        bound = floor + summary["comm"]["cpu_s"]
        for row in summary.values():
            row["bound_s"] = bound
            row["time_vs_bound"] = row["median_step_s"] / bound
    for row in summary.values():
        if floor is not None:
            # Time added on top of training alone: unhidden communication plus overhead.
            row["over_floor_s"] = row["median_step_s"] - floor
            # On a model with negligible compute (--preset overhead): host time per unit.
            row["over_floor_ms_per_unit"] = row["over_floor_s"] * 1e3 / units
        for other in ("fsdp2", "ddp", "floor"):
            if other in summary:
                row[f"time_vs_{other}"] = row["median_step_s"] / summary[other]["median_step_s"]
    return summary


def table(summary: dict[str, dict[str, float]], memory: str) -> str:
    width = max(10, *(len(system) for system in summary))
    header = f"{'system':<{width}} {'step s':>8} {'tokens/s':>10} {'tensors MiB':>11} "
    header += f"{'at rest':>8} "
    header += f"{f'peak {memory} MiB':>15} "
    header += f"{'coll. MB':>9} {'sent MB':>8} "
    header += f"{'comm wait s':>12} {'over floor s':>13} {'ms/unit':>8} "
    header += f"{'vs fsdp2':>9} "
    header += f"{'vs ddp':>7} {'vs floor':>9} {'vs bound':>9}"
    lines = [header]
    for system, row in summary.items():
        ratios = [row.get(f"time_vs_{o}") for o in ("fsdp2", "ddp", "floor", "bound")]
        cells = [_cell(r, "x", w) for r, w in zip(ratios, (9, 7, 9, 9), strict=True)]
        lines.append(
            f"{system:<{width}} {row['median_step_s']:>8.3f} {row['tokens_per_s']:>10,.0f} "
            f"{row['tensor_peak_mib']:>11,.1f} {row['tensor_rest_mib']:>8,.1f} "
            f"{row['peak_mem_mib']:>15,.0f} {row['collective_output_bytes'] / 1e6:>9.1f} "
            f"{row['sent_bytes'] / 1e6:>8.1f} "
            f"{_cell(row.get('exposed_comm_s'), '', 12)} "
            f"{_cell(row.get('over_floor_s'), '', 13)} "
            f"{_cell(row.get('over_floor_ms_per_unit'), '', 8)} " + " ".join(cells)
        )
    comm = summary.get("comm", {})
    if "bound_s" in comm:  # [Note: the achievable bound]
        lines.append(
            f"bound: floor + the least collectives' CPU time (comm: rank 0's "
            f"{comm['cpu_s']:.3f} s per step) = {comm['bound_s']:.3f} s"
        )
    return "\n".join(lines)


def pipeline_line(summary: dict[str, dict[str, float]], stages: str) -> str:
    """--pp: each system's bubble measured and rank 0's bytes per step by kind."""
    parts = []
    for system, row in summary.items():
        kinds = ", ".join(
            f"{key[len('bytes ') :]} {value / 1e6:.1f}"
            for key, value in sorted(row.items())
            if key.startswith("bytes ") and value
        )
        parts.append(f"{system}: bubble {row.get('bubble', float('nan')):.2f}; MB {kinds}")
    return f"pipeline ({stages}), rank 0 per step: " + " | ".join(parts)


def scaling_table(by_world: dict[int, dict[str, dict[str, float]]], systems: list[str]) -> str:
    """Per system and world size: step time, per-rank memory, collective bytes; flatshard's
    "at rest" and collective bytes next to their formulas (``cli/bench/formula.py``)."""
    header = f"{'system':<12} {'W':>2} {'step s':>8} {'tensors MiB':>11} {'at rest':>8} "
    header += f"{'rest x W':>9} {'formula':>8} {'coll. MB':>9} {'formula':>8}"
    lines = ["scaling (per rank; 'formula': flatshard's by formula, '-' for other systems)"]
    lines.append(header)
    for system in systems:
        for world, summary in by_world.items():
            row = summary[system]
            rest = row["tensor_rest_mib"]
            known = row["formula_rest_mib"] >= 0
            lines.append(
                f"{system:<12} {world:>2} {row['median_step_s']:>8.3f} "
                f"{row['tensor_peak_mib']:>11,.1f} {rest:>8,.1f} {rest * world:>9,.1f} "
                + _cell(row["formula_rest_mib"] if known else None, "MiB", 8)
                + f" {row['collective_output_bytes'] / 1e6:>9.2f} "
                + _cell(row["formula_collective_bytes"] / 1e6 if known else None, "MB", 8)
            )
    return "\n".join(lines)


def _cell(value: float | None, unit: str, width: int) -> str:
    text = "-" if value is None else (f"{value:.2f}{unit}" if unit == "x" else f"{value:.3f}")
    if value is not None and unit in ("MiB", "MB"):
        text = f"{value:,.2f}"
    return f"{text:>{width}}"


def chart(summary: dict[str, dict[str, float]], path: str, device: str) -> str:
    """The bench as a PNG at ``path``; what happened, in words."""
    try:
        import matplotlib
    except ImportError:
        return "no chart (bench.png): pip install matplotlib"

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    systems = list(summary)
    fig, axes = plt.subplots(1, 2, figsize=(9, 3.5))
    axes[0].bar(systems, [summary[s]["median_step_s"] for s in systems], color="tab:blue")
    axes[0].set_ylabel("median step time (s)")
    axes[1].bar(systems, [summary[s]["peak_mem_mib"] for s in systems], color="tab:orange")
    memory = "RSS" if device == "cpu" else "GPU memory allocated"
    axes[1].set_ylabel(f"peak {memory} per rank (MiB)")
    fig.suptitle("flatshard bench (same GPT, same data)")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return f"chart: {path}"
