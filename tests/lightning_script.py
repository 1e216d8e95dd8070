"""Lightning runs for test_lightning.py: ``python lightning_script.py OUT_DIR [PACKAGE]``.

PACKAGE: ``lightning`` (the default: every scenario) or ``pytorch_lightning`` (the standalone
package, with ``flatshard.integrations.pytorch_lightning``: the scenarios of ``shared``).
``python lightning_script.py OUT_DIR replica GROUP LIGHTHOUSE``: one rank, replica group
GROUP of two on torchft (``replica_groups``), writing OUT_DIR/replica<GROUP>.json.

Run as a user runs Lightning: the Trainer (devices=2) launches the second rank itself,
re-running this script. Every scenario trains the same small transformer from the same
seed on each rank's own batches; each rank writes what it saw to OUT_DIR/rank<r>.json.
"""

from __future__ import annotations

import importlib
import json
import sys
import time
from contextlib import nullcontext
from pathlib import Path
from typing import Any, cast

import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import flatshard
from flatshard.testing.internals import checkpoint_writes_start_after

REPLICA = len(sys.argv) > 2 and sys.argv[2] == "replica"
PACKAGE = sys.argv[2] if len(sys.argv) > 2 and not REPLICA else "lightning"
L: Any = importlib.import_module(PACKAGE)  # Trainer, LightningModule, Callback in both
_INTEGRATION = "pytorch_lightning" if PACKAGE == "pytorch_lightning" else "lightning"
_flatshard_lightning = importlib.import_module(f"flatshard.integrations.{_INTEGRATION}")
FlatshardPrecision = _flatshard_lightning.FlatshardPrecision
FlatshardStrategy = _flatshard_lightning.FlatshardStrategy

VOCAB, WIDTH, STEPS = 32, 16, 4
_last_trainer = None  # the Trainer of the last fit


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(WIDTH)
        self.attn = nn.MultiheadAttention(WIDTH, 2, batch_first=True)
        self.mlp = nn.Sequential(
            nn.Linear(WIDTH, 4 * WIDTH), nn.GELU(), nn.Linear(4 * WIDTH, WIDTH)
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.norm(x)
        mask = nn.Transformer.generate_square_subsequent_mask(x.shape[1])
        x = x + self.attn(h, h, h, attn_mask=mask, need_weights=False)[0]
        return x + self.mlp(x)


class Layers(nn.Module):
    """An embedding, two blocks and a head, set on the module itself (under Lightning:
    on the LightningModule, which is then the root unit)."""

    def add_layers(self) -> None:
        self.embed = nn.Embedding(VOCAB, WIDTH)
        self.blocks = nn.ModuleList(Block() for _ in range(2))
        self.head = nn.Linear(WIDTH, VOCAB)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        h = self.embed(tokens)
        for block in self.blocks:
            h = block(h)
        logits: torch.Tensor = self.head(h)
        return logits


class TinyLM(Layers, L.LightningModule):
    """The embedding and head sit on the LightningModule itself: the root unit."""

    def __init__(self, on_meta: bool = False) -> None:
        super().__init__()
        self.on_meta = on_meta
        if not on_meta:
            self.configure_model()

    def configure_model(self) -> None:
        if hasattr(self, "head"):
            return
        with torch.device("meta") if self.on_meta else nullcontext():
            self.add_layers()

    def _loss(self, batch: list[torch.Tensor]) -> torch.Tensor:
        tokens, targets = batch
        return nn.functional.cross_entropy(self(tokens).flatten(0, 1), targets.flatten())

    def training_step(self, batch: list[torch.Tensor], index: int) -> torch.Tensor:
        return self._loss(batch)

    def validation_step(self, batch: list[torch.Tensor], index: int) -> None:
        self.log("val_loss", self._loss(batch), sync_dist=True)

    def configure_optimizers(self) -> Any:
        optim = torch.optim.SGD(self.parameters(), lr=0.5, momentum=0.9)
        schedule = torch.optim.lr_scheduler.StepLR(optim, step_size=1, gamma=0.7)
        return {"optimizer": optim, "lr_scheduler": {"scheduler": schedule, "interval": "step"}}


def init_module(module: nn.Module) -> None:
    """Meta modules' init: MultiheadAttention has no public reset_parameters."""
    if isinstance(module, nn.MultiheadAttention):
        module._reset_parameters()
    elif hasattr(module, "reset_parameters"):
        module.reset_parameters()


class Losses(L.Callback):
    def __init__(self) -> None:
        self.losses: list[float] = []

    def on_train_batch_end(self, trainer: Any, module: Any, outputs: Any, *args: Any) -> None:
        self.losses.append(float(outputs["loss"]))


def loader() -> DataLoader[Any]:
    g = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, VOCAB, (64, 8), generator=g)
    return DataLoader(TensorDataset(tokens, tokens.roll(1, 1)), batch_size=4)


def strategy(kind: str, **options: Any) -> Any:
    if kind == "ddp":
        return "ddp"
    return FlatshardStrategy(auto_wrap_policy={Block}, sharding_strategy=kind, **options)


def fit(kind: str, steps: int = STEPS, **options: Any) -> dict[str, Any]:
    """Train; the per-step losses of this rank and the validation loss after."""
    ckpt_path = options.pop("ckpt_path", None)
    save_to = options.pop("save_to", None)
    every_step_to = options.pop("every_step_to", None)  # ModelCheckpoint, newest one kept
    devices = options.pop("devices", 2)
    full_params = options.pop("full_params", False)  # the trained parameters, whole
    trainer_options = {
        k: options.pop(k)
        for k in ("gradient_clip_val", "accumulate_grad_batches", "precision", "plugins")
        if k in options
    }
    torch.manual_seed(0)
    model = TinyLM(on_meta=options.pop("on_meta", False))
    if options.pop("init_weights", False):  # the weights a meta build gets (ddp's reference)
        flatshard.init_weights(model, init_module, 0)
    losses = Losses()
    callbacks: list[Any] = [losses, *options.pop("callbacks", [])]
    if every_step_to is not None:
        callbacks.append(
            L.pytorch.callbacks.ModelCheckpoint(
                dirpath=every_step_to,
                every_n_train_steps=1,
                save_top_k=1,
                monitor="step",
                mode="max",
            )
        )
    trainer = L.Trainer(
        accelerator="cpu",
        devices=devices,
        strategy=strategy(kind, **options),
        max_steps=steps,
        logger=False,
        enable_checkpointing=every_step_to is not None,
        enable_progress_bar=False,
        enable_model_summary=False,
        callbacks=callbacks,
        num_sanity_val_steps=0,
        limit_val_batches=2,
        limit_train_batches=2,  # epochs of 2 steps: a checkpoint after 2 resumes at an epoch
        **trainer_options,
    )
    global _last_trainer
    _last_trainer = trainer
    trainer.fit(model, loader(), ckpt_path=ckpt_path)
    if save_to is not None:
        trainer.save_checkpoint(save_to)
    validated = trainer.validate(model, loader(), verbose=False)[0]["val_loss"]
    meta = any(t.is_meta for t in [*model.parameters(), *model.buffers()])
    background = bool(getattr(trainer.strategy, "saves_in_background", False))
    results = {"losses": losses.losses, "val_loss": validated, "meta_left": meta, "bg": background}
    if full_params:
        with flatshard.summon_full_params(model):
            results["params"] = [p.detach().flatten().tolist() for p in model.parameters()]
    return results


def shared(out: Path, state_dict_types: tuple[str, ...]) -> dict[str, Any]:
    """The scenarios of both packages: training with clipping, accumulation, resuming."""
    results: dict[str, Any] = {}
    results["ddp"] = fit("ddp", gradient_clip_val=0.05)
    results["FULL_SHARD"] = fit("FULL_SHARD", gradient_clip_val=0.05)
    results["ddp_accumulate"] = fit("ddp", gradient_clip_val=0.05, accumulate_grad_batches=2)
    results["flatshard_accumulate"] = fit(
        "FULL_SHARD", gradient_clip_val=0.05, accumulate_grad_batches=2
    )
    saved = str(out / "half-ddp.ckpt")
    fit("ddp", steps=2, save_to=saved, gradient_clip_val=0.05)
    results["ddp_resumed"] = fit("ddp", ckpt_path=saved, gradient_clip_val=0.05)
    for state_dict_type in state_dict_types:
        saved = str(out / f"half-{state_dict_type}.ckpt")
        options = {"gradient_clip_val": 0.05, "state_dict_type": state_dict_type}
        fit("FULL_SHARD", steps=2, save_to=saved, **options)
        results[f"resumed_{state_dict_type}"] = fit("FULL_SHARD", ckpt_path=saved, **options)
        results[f"kind_{state_dict_type}"] = "dir" if Path(saved).is_dir() else "file"
    return results


def _watch_removals(directory: Path) -> list[bool]:
    """For each checkpoint the strategy removes: whether another one was whole then (it
    must be: until the newer one is whole, the older one is the newest whole one)."""
    checkpoints = importlib.import_module(f"flatshard.integrations.{_INTEGRATION}._checkpoints")
    real = checkpoints.remove
    seen: list[bool] = []

    def remove(path: Path) -> None:
        others = [p for p in directory.iterdir() if p != path]
        seen.append(any((p / "flatshard.json").exists() for p in others))
        real(path)

    checkpoints.remove = remove
    return seen


def write(out: Path, results: dict[str, Any]) -> None:
    rank = torch.distributed.get_rank()
    (out / f"rank{rank}.json").write_text(json.dumps(results))


def standalone(out: Path) -> None:
    results = shared(out, ("sharded",))
    results["strategy_class"] = type(FlatshardStrategy()).__mro__[1].__module__
    write(out, results)


def main(out: Path) -> None:
    results = shared(out, ("sharded", "full"))
    results["SHARD_GRAD_OP"] = fit("SHARD_GRAD_OP", gradient_clip_val=0.05)
    # 2 replicas of 1 rank each: the all-reduce across replicas is the whole reduction
    results["HYBRID_SHARD"] = fit("HYBRID_SHARD", gradient_clip_val=0.05, sharding_factor=1)
    offload = flatshard.CPUOffload(params=True)
    results["offload"] = fit("FULL_SHARD", gradient_clip_val=0.05, cpu_offload=offload)
    results["ddp_unclipped"] = fit("ddp")
    results["ddp_init"] = fit("ddp", init_weights=True)
    init = flatshard.InitOptions(seed=0)
    results["meta"] = fit("FULL_SHARD", on_meta=True, param_init_fn=init_module, init=init)
    results["bf16"] = fit("FULL_SHARD", steps=2, precision="bf16-mixed")
    # Lightning turns 16-mixed into bf16 on CPU; the plugin given directly keeps fp16 and
    # its ShardedGradScaler (scale, unscale before clipping, step, update)
    fp16 = FlatshardPrecision("16-mixed")
    results["fp16"] = fit("FULL_SHARD", steps=2, gradient_clip_val=0.05, plugins=[fp16])
    results["fp16_scale"] = float(cast(Any, fp16.scaler).get_scale())
    # Saved in the background (Lightning's AsyncCheckpointIO plugin): resumes as the
    # synchronous save does; ModelCheckpoint's
    # removal of the older checkpoint waits for the newer one to be whole
    saved = str(out / "half-async.ckpt")
    background = {"plugins": [L.pytorch.plugins.io.AsyncCheckpointIO()]}
    fit("FULL_SHARD", steps=2, save_to=saved, gradient_clip_val=0.05, **background)
    background = {"plugins": [L.pytorch.plugins.io.AsyncCheckpointIO()]}
    results["resumed_async"] = fit(
        "FULL_SHARD", ckpt_path=saved, gradient_clip_val=0.05, **background
    )
    every = out / "every-step"
    removals = _watch_removals(every)
    with checkpoint_writes_start_after(0.2):  # each write outlasts a step
        background = {"plugins": [L.pytorch.plugins.io.AsyncCheckpointIO()]}
        results["async_every_step"] = fit("FULL_SHARD", every_step_to=every, **background)
    results["async_kept"] = sorted(p.name for p in every.iterdir())
    results["removed_with_a_whole_one_left"] = removals
    results["disagreements"] = disagreements(cast(Any, _last_trainer).strategy)
    write(out, results)


def disagreements(strategy: Any) -> list[str]:
    """The errors of a barrier and a broadcast that differ by rank (each agreed through the
    store first, so nothing is sent and the ranks go on)."""
    rank = strategy.global_rank
    said = []
    calls = [lambda: strategy.barrier(f"rank {rank}"), lambda: strategy.broadcast("x", rank)]
    for call in calls:
        try:
            call()
        except flatshard.CollectiveMismatchError as error:
            said.append(str(error))
    return said


class JoinLate(L.Callback):
    """Late joining, seen from group 0: after its second step it says so (``out/group0``)
    and waits for group 1 to start (``out/group1``), then takes its steps alone slowly, so
    group 1 joins while it trains."""

    def __init__(self, out: Path) -> None:
        self.out = out

    def on_train_batch_end(self, trainer: Any, module: Any, outputs: Any, *args: Any) -> None:
        if trainer.global_step == 2:
            (self.out / "group0").touch()
            _wait_for(self.out / "group1")
        if len(trainer.strategy.replica_group.quorum) < 2:
            time.sleep(0.5)


def _wait_for(path: Path) -> None:
    while not path.exists():
        time.sleep(0.05)


def replica(out: Path, group: int, lighthouse: str, late: bool) -> None:
    """Replica group ``group`` of two (one rank each) on torchft: trains as rank ``group``
    of the 2-rank runs; writes its losses and its full parameters. ``late``: group 1 starts
    once group 0 took two steps, and heals from it (``JoinLate``)."""
    from flatshard.integrations.torchft import ReplicaGroups

    groups = ReplicaGroups(2, group, lighthouse)
    options: dict[str, Any] = {"steps": 12} if late else {}
    if late and group == 0:
        options["callbacks"] = [JoinLate(out)]
    elif late:
        _wait_for(out / "group0")
        (out / "group1").touch()
    results = fit("FULL_SHARD", devices=1, replica_groups=groups, full_params=True, **options)
    lr_scheduler = cast(Any, _last_trainer).lr_scheduler_configs[0].scheduler
    results["lr"] = lr_scheduler.get_last_lr()
    results["global_step"] = cast(Any, _last_trainer).global_step
    (out / f"replica{group}.json").write_text(json.dumps(results))


if __name__ == "__main__":
    if REPLICA:
        replica(Path(sys.argv[1]), int(sys.argv[3]), sys.argv[4], "late" in sys.argv[5:])
    else:
        (standalone if PACKAGE == "pytorch_lightning" else main)(Path(sys.argv[1]))
