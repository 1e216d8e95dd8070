"""What rank 0 of ``flatshard train`` shows and writes: progress bar, metrics, plot."""

from __future__ import annotations

import json
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import TextIO


@dataclass(frozen=True)
class StepMetrics:
    """One optimizer step, as written to metrics.jsonl (one JSON object per line)."""

    step: int
    loss: float  # mean over ranks of the step's training loss
    lr: float
    tokens_per_s: float  # global: all ranks' tokens over the step's wall time
    peak_mem_mib: list[float]  # per rank: peak RSS on CPU, max allocated on CUDA
    elapsed_s: float  # since the start of this process's training loop
    # --ft-replicas (written only then): the replica groups in the step's quorum, by
    # --ft-replica-id; and where it differs from the step before's, who left and joined
    replica_groups: list[int] | None = None
    quorum_change: str | None = None


class ProgressBar:
    """A bar redrawn in place on a terminal; a line every ``every`` steps otherwise."""

    def __init__(
        self, total: int, first: int, every: int, memory: str, out: TextIO = sys.stdout
    ) -> None:
        self.total = total
        self.memory = memory  # what peak_mem_mib measures: "peak RSS", "max allocated"
        self.first = first  # the first step this run trains (resumed runs start later)
        self.every = every
        self.out = out
        self.tty = out.isatty()
        self.started = time.perf_counter()

    def update(self, m: StepMetrics) -> None:
        if not self.tty and m.step % self.every and m.step != self.total:
            return
        done = m.step - self.first + 1
        left = (time.perf_counter() - self.started) / done * (self.total - m.step)
        width = 24
        filled = int(width * m.step / self.total)
        mem = " ".join(f"r{rank}:{v:.0f}" for rank, v in enumerate(m.peak_mem_mib))
        line = (
            f"step {m.step:>{len(str(self.total))}}/{self.total} "
            f"[{'=' * filled}{' ' * (width - filled)}] loss {m.loss:.4f} | "
            f"{m.tokens_per_s:,.0f} tok/s | {self.memory} MiB {mem} | ETA {_clock(left)}"
        )
        if self.tty:
            self.out.write("\r" + line + ("\n" if m.step == self.total else ""))
        else:
            self.out.write(line + "\n")
        self.out.flush()

    def note(self, text: str) -> None:
        """A line of its own (a checkpoint saved), above the bar on a terminal."""
        self.out.write(("\r\033[K" if self.tty else "") + text + "\n")
        self.out.flush()


def _clock(seconds: float) -> str:
    minutes, secs = divmod(int(seconds), 60)
    return f"{minutes // 60}:{minutes % 60:02d}:{secs:02d}"


class MetricsLog:
    """Appends ``StepMetrics`` to ``metrics.jsonl``: one line per step, also across resumes.

    ``resumed_at``: the step a resumed run starts after (None: a fresh start, the file is
    emptied). Lines for later steps, written before the crash, are dropped: the resumed run
    trains and logs those steps again.
    """

    def __init__(self, path: Path, resumed_at: int | None) -> None:
        path.parent.mkdir(parents=True, exist_ok=True)
        kept = []
        if resumed_at is not None and path.exists():
            kept = [
                line
                for line in path.read_text().splitlines()
                if (step := _step_of(line)) is not None and step <= resumed_at
            ]
        path.write_text("".join(line + "\n" for line in kept))
        self.path = path

    def write(self, m: StepMetrics) -> None:
        with self.path.open("a") as handle:
            fields = {k: v for k, v in asdict(m).items() if v is not None}
            handle.write(json.dumps(fields) + "\n")


class TensorBoardLog:
    """``--log-to tensorboard``: each ``StepMetrics`` field as a scalar of the same name at its
    step (``peak_mem_mib`` one per rank: ``peak_mem_mib/r0``, ...; ``replica_groups`` their
    count, ``quorum_change`` as text), and ``held_out_loss`` at the last step, in
    ``directory``.

    A fresh start removes the event files of an earlier run there; a resumed run asks
    TensorBoard to drop the events after ``resumed_at`` (``purge_step``), as ``MetricsLog``
    drops those lines: the resumed run logs those steps again.
    """

    def __init__(self, directory: Path, resumed_at: int | None) -> None:
        from torch.utils.tensorboard import SummaryWriter

        if resumed_at is None and directory.is_dir():
            for old in directory.glob("events.out.tfevents.*"):
                old.unlink()
        purge = None if resumed_at is None else resumed_at + 1
        # Flushed every few seconds (torch's default: 2 minutes): a run that crashes keeps
        # what it logged, as metrics.jsonl does.
        self.writer = SummaryWriter(str(directory), purge_step=purge, flush_secs=5)
        self.directory = directory

    def write(self, m: StepMetrics) -> None:
        for name, value in asdict(m).items():
            if name == "step" or value is None:
                continue
            if name == "replica_groups":  # how many (the groups by name: metrics.jsonl)
                self.writer.add_scalar(name, len(value), m.step)
            elif isinstance(value, str):
                self.writer.add_text(name, value, m.step)
            elif isinstance(value, list):
                for rank, v in enumerate(value):
                    self.writer.add_scalar(f"{name}/r{rank}", v, m.step)
            else:
                self.writer.add_scalar(name, value, m.step)

    def finish(self, step: int, held_out: float) -> None:
        self.writer.add_scalar("held_out_loss", held_out, step)
        self.close()

    def close(self) -> None:
        """Write what is pending (a run stopped early: SIGTERM)."""
        self.writer.close()


def _step_of(line: str) -> int | None:
    """The step a metrics line is for; None for a line cut short by a crash."""
    try:
        return int(json.loads(line)["step"])
    except (ValueError, KeyError, TypeError):
        return None


def read_metrics(path: Path) -> list[StepMetrics]:
    """Every step in the file, a resumed run's later lines replacing earlier ones."""
    by_step: dict[int, StepMetrics] = {}
    for line in path.read_text().splitlines():
        if line.strip():
            m = StepMetrics(**json.loads(line))
            by_step[m.step] = m
    return [by_step[s] for s in sorted(by_step)]


def plot(metrics_path: Path, png_path: Path, held_out: float, entropy: float) -> str:
    """Loss (with the held-out loss at the end and the text's unigram entropy, the loss of
    a model that knows byte frequencies only), learning rate and throughput over steps as
    a PNG; what happened, in words."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return "no plot: pip install matplotlib"
    rows = read_metrics(metrics_path)
    steps = [m.step for m in rows]
    fig, (top, middle, bottom) = plt.subplots(
        3, 1, figsize=(7, 8), sharex=True, gridspec_kw={"height_ratios": [3, 1, 1]}
    )
    top.plot(steps, [m.loss for m in rows], label="training loss")
    top.plot(steps[-1:], [held_out], "o", color="tab:red", label=f"held-out loss {held_out:.3f}")
    top.axhline(entropy, color="gray", linestyle="--", label=f"unigram entropy {entropy:.3f}")
    top.set_ylabel("loss (nats/byte)")
    top.legend()
    middle.plot(steps, [m.lr for m in rows], color="tab:green")
    middle.set_ylabel("learning rate")
    bottom.plot(steps, [m.tokens_per_s for m in rows], color="tab:orange")
    bottom.set_ylabel("tokens/s (all ranks)")
    bottom.set_xlabel("step")
    for axis in (top, middle, bottom):
        axis.grid(alpha=0.3)
    fig.suptitle("flatshard train")
    fig.tight_layout()
    fig.savefig(png_path, dpi=100)
    plt.close(fig)
    return f"plot: {png_path}"
