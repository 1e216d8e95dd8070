"""What a resume changes: the options that differ from the saved run's, each with what it
does to the run, and ``--exact-resume``'s refusal of those that change the losses.

[Note: what a resume changes]
A checkpoint of ``flatshard train`` keeps its run's options. A resume with other options
is often meant (more steps, another strategy, another world size) and sometimes not (a
changed --seed draws other batches from then on: the losses drift from the original
run without a word). So every differing option is listed, in one of three kinds:
- run control (--steps' end aside: where files go, how often to log or save), not listed;
- layout (strategy, units, world size at the same global batch, offload, compile):
  the same mathematics, the losses equal up to rounding;
- trajectory (seed, data, global batch, schedule, model, precision): the losses differ
  from the original run's from the resumed step on. ``--exact-resume`` refuses these.
"""

from __future__ import annotations

from typing import Any

from flatshard.cli.config import RENAMED, ConfigError
from flatshard.cli.lm.config import TrainConfig

_CONTROL = {
    "resume", "exact_resume", "out_dir", "log_every", "ckpt_dir", "ckpt_every", "keep_ckpts",
    "ckpt_async", "ckpt_on_preempt", "sample_bytes", "nproc", "max_restarts", "device",
    "share_gpus", "predict", "fit_memory", "log_to",
}  # fmt: skip
_LAYOUT = {
    "strategy", "sharding_factor", "units", "keep_gathered", "checkpoint_activations",
    "cpu_offload", "compile", "row_sparse_tables", "accum_no_sync", "ep", "pp_schedule",
}  # fmt: skip
# trajectory options -> what a change does, in words
_EFFECTS = {
    "seed": "each step's batch is drawn from the seed: the data order differs",
    "data": "the training text differs",
    "seq_len": "the sequences differ",
    "steps": "the learning-rate schedule decays over the new step count",
    "lr": "the updates differ",
    "min_lr": "the updates differ",
    "lr_schedule": "the updates differ",
    "warmup_steps": "the updates differ",
    "weight_decay": "the updates differ",
    "clip": "the updates differ",
    "optimizer": "the updates differ",
    "mixed_precision": "the numerics differ",
    "gather_dtype": "the numerics differ",
    "pp": "the stages differ (and from --pp 1 to more the head is no longer tied: the "
    "model differs)",
}


def resume_changes(
    saved: dict[str, Any], saved_world: int, config: TrainConfig, world: int
) -> list[str]:
    """Each option of ``config`` that differs from the saved run's, with what it changes
    (the world size and the global batch included); raises ``ConfigError`` under
    --exact-resume where one changes the losses."""
    saved = {RENAMED.get(name, name): value for name, value in saved.items()}  # older runs
    now = config.__dict__
    changed, trajectory = [], []
    for name in sorted(set(saved) & set(now)):
        if saved[name] == now[name] or name in _CONTROL or name in ("batch", "grad_accum"):
            continue
        flag = f"--{name.replace('_', '-')} {now[name]} (was {saved[name]})"
        if name in _LAYOUT:
            changed.append(f"{flag}: the same mathematics, the losses equal up to rounding")
        else:
            line = f"{flag}: {_EFFECTS.get(name, 'the model differs')}"
            changed.append(line)
            trajectory.append(line)
    before = saved_world * saved["batch"] * saved["grad_accum"]
    after = world * config.batch * config.grad_accum
    if saved_world != world or before != after:
        line = world_change(saved_world, saved["batch"] * saved["grad_accum"], config, world)
        changed.append(line)
        if before != after:
            trajectory.append(line)
    if trajectory and config.exact_resume:
        raise ConfigError(
            "--exact-resume: this run would not continue the saved one exactly:\n  "
            + "\n  ".join(trajectory)
            + "\nRun with the saved options, or drop --exact-resume to continue anyway."
        )
    return changed


def world_change(saved_world: int, saved_per_rank: int, config: TrainConfig, world: int) -> str:
    """What resuming at ``world`` ranks a checkpoint saved at ``saved_world`` changes (each
    rank then read ``saved_per_rank`` sequences per step), and the flags that keep it."""
    before = saved_world * saved_per_rank
    after = world * config.batch * config.grad_accum
    ranks = f"resumed at {world} rank{'s' * (world != 1)} (saved at {saved_world})"
    if before == after:
        return f"{ranks}: the global batch stays {before} sequences per step"
    ways = []
    if before % (world * config.grad_accum) == 0:
        ways.append(f"--batch {before // (world * config.grad_accum)}")
    if before % (world * config.batch) == 0:
        ways.append(f"--grad-accum {before // (world * config.batch)}")
    keep = f"; to keep it: {' or '.join(ways)}" if ways else ""
    return (
        f"{ranks}: the global batch changes from {before} to {after} sequences per step, "
        f"and the data each step reads with it{keep}"
    )
