"""Lightning's precision settings, carried out by flatshard.

``Trainer(precision=...)`` picks how Lightning runs the step in low precision. Under
``FlatshardStrategy`` each setting becomes what flatshard does for it:

| Lightning          | flatshard                                                         |
| ------------------ | ----------------------------------------------------------------- |
| ``32-true``        | nothing: fp32 throughout                                          |
| ``bf16-mixed``     | ``MixedPrecision(param_dtype=bfloat16, reduce_dtype=float32)``    |
| ``16-mixed``       | ``MixedPrecision(param_dtype=float16, reduce_dtype=float32)`` and |
|                    | ``flatshard.ShardedGradScaler`` (the loss scale agreed by all)   |
| ``bf16-true``,     | the model converted to that dtype before sharding: the shards,    |
| ``16-true``        | gradients and optimizer state are low precision too               |

The "mixed" settings keep fp32 master shards and gather, compute and reduce as the
policy says, so no autocast is needed: flatshard casts the parameters and the floating
inputs of each unit. Gradient clipping by norm takes the norm over every rank's rows
(``flatshard.clip_grad_norm_``), where Lightning's default would take each rank's own.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager, contextmanager
from typing import TYPE_CHECKING, Any, cast

import torch
from torch import nn

import flatshard

from ._packages import lightning_for

# This copy's Lightning package ([Note: one integration, two Lightning packages]).
if TYPE_CHECKING:
    from lightning.pytorch.plugins.precision import Precision
else:
    Precision = lightning_for(__name__).trainer("plugins.precision").Precision

PRECISIONS = ("32-true", "bf16-mixed", "16-mixed", "bf16-true", "16-true")
TRUE_DTYPES = {"bf16-true": torch.bfloat16, "16-true": torch.float16}
_MIXED_DTYPES = {"bf16-mixed": torch.bfloat16, "16-mixed": torch.float16}


class TrueDtypes:
    """The "true" settings (bf16-true, 16-true) for both Lightning plugins: the module
    converted, tensors created and inputs cast in that dtype; nothing for the others."""

    precision: Any

    @property
    def mixed_precision(self) -> flatshard.MixedPrecision | None:
        """The ``fully_shard`` policy this precision stands for (None: none)."""
        return mixed_policy(self.precision)

    def convert_module(self, module: nn.Module) -> nn.Module:
        dtype = TRUE_DTYPES.get(self.precision)
        return module.to(dtype=dtype) if dtype is not None else module

    def tensor_init_context(self) -> AbstractContextManager[None]:
        return default_dtype(TRUE_DTYPES.get(self.precision))

    def module_init_context(self) -> AbstractContextManager[None]:
        return default_dtype(TRUE_DTYPES.get(self.precision))

    def forward_context(self) -> AbstractContextManager[None]:
        return default_dtype(TRUE_DTYPES.get(self.precision))

    def convert_input(self, data: Any) -> Any:
        dtype = TRUE_DTYPES.get(self.precision)
        return data if dtype is None else cast_floats(data, dtype)


class FlatshardPrecision(TrueDtypes, Precision):
    """``Trainer(precision=...)`` under ``FlatshardStrategy``; see the module's table.

    The strategy makes this plugin from whatever precision the ``Trainer`` was given;
    pass one yourself only to give the fp16 run its own ``flatshard.ShardedGradScaler``.
    """

    def __init__(
        self, precision: str = "32-true", scaler: flatshard.ShardedGradScaler | None = None
    ) -> None:
        check_precision(precision)
        if scaler is not None and precision != "16-mixed":
            raise ValueError(
                f"flatshard.integrations.lightning: precision={precision!r} takes no gradient "
                "scaler (only 16-mixed scales the loss); drop the scaler."
            )
        self.precision = cast(Any, precision)  # one of Lightning's literals, checked above
        self.scaler = scaler
        if precision == "16-mixed" and scaler is None:
            self.scaler = flatshard.ShardedGradScaler()
        # The sharded model, set by the strategy once it is sharded: clipping needs it.
        self.model: nn.Module | None = None

    # ---------------------------------------------------------------- clipping
    def clip_grad_by_norm(self, optimizer: torch.optim.Optimizer, clip_val: float) -> None:
        if self.model is None:
            raise RuntimeError(
                "flatshard.integrations.lightning: gradient clipping before the strategy "
                "sharded the model; clip inside the training loop."
            )
        stepped = {id(p) for group in optimizer.param_groups for p in group["params"]}
        trainable = [p for p in self.model.parameters() if p.requires_grad]
        if all(id(p) in stepped for p in trainable):
            flatshard.clip_grad_norm_(self.model, clip_val)
        else:
            # One of several optimizers: its parameters only. flatshard makes torch's norm
            # global over the shards ([Note: torch's clip_grad_norm_ on sharded gradients]).
            torch.nn.utils.clip_grad_norm_(
                [p for g in optimizer.param_groups for p in g["params"]], clip_val
            )

    # ---------------------------------------------------------------- fp16: the scaler
    def pre_backward(self, tensor: torch.Tensor, module: Any) -> torch.Tensor:
        if self.scaler is not None:
            tensor = self.scaler.scale(tensor)
        result: torch.Tensor = super().pre_backward(tensor, module)
        return result

    def optimizer_step(  # type: ignore[override]  # Lightning's own plugins do the same
        self,
        optimizer: Any,
        model: Any,
        closure: Callable[[], Any],
        **kwargs: Any,
    ) -> Any:
        if self.scaler is None:
            return super().optimizer_step(optimizer, model=model, closure=closure, **kwargs)
        closure_result = closure()
        # Unscaled before Lightning's clipping (in _after_closure) sees the gradients.
        self.scaler.unscale_(optimizer)
        self._after_closure(model, optimizer)
        if closure_result is None and model.automatic_optimization:
            return None  # the step skipped backward (training_step returned None)
        result = self.scaler.step(optimizer, **kwargs)
        self.scaler.update()
        return result

    def state_dict(self) -> dict[str, Any]:
        return self.scaler.state_dict() if self.scaler is not None else {}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        if self.scaler is not None and state_dict:
            self.scaler.load_state_dict(state_dict)


def mixed_policy(precision: str) -> flatshard.MixedPrecision | None:
    """The ``fully_shard`` policy a Lightning precision setting stands for (see the table)."""
    low = _MIXED_DTYPES.get(precision)
    if low is None:
        return None
    return flatshard.MixedPrecision(param_dtype=low, reduce_dtype=torch.float32)


def check_precision(precision: str) -> None:
    if precision not in PRECISIONS:
        raise ValueError(
            f"flatshard.integrations.lightning: precision={precision!r} is not supported "
            f"under flatshard; choose one of {', '.join(PRECISIONS)}."
        )


def supported_name(plugin: Any) -> str:
    """The setting of a precision plugin Lightning made from ``precision=``; an error for
    plugins flatshard cannot carry out (double, bitsandbytes, transformer-engine, ...)."""
    name = getattr(plugin, "precision", None)
    if type(plugin).__name__ not in ("Precision", "MixedPrecision", "HalfPrecision") or (
        name not in PRECISIONS
    ):
        raise ValueError(
            f"flatshard.integrations.lightning: flatshard cannot run the precision "
            f"plugin {type(plugin).__name__} (precision={name!r}); pass precision= "
            f"one of {', '.join(PRECISIONS)}, or flatshard's own plugin."
        )
    return str(name)


def from_lightning(plugin: Any) -> FlatshardPrecision:
    """The flatshard plugin for a precision plugin Lightning chose from ``precision=``."""
    if isinstance(plugin, FlatshardPrecision):
        return plugin
    return FlatshardPrecision(supported_name(plugin))


@contextmanager
def default_dtype(dtype: torch.dtype | None) -> Iterator[None]:
    if dtype is None:
        yield
        return
    before = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        yield
    finally:
        torch.set_default_dtype(before)


def cast_floats(data: Any, dtype: torch.dtype) -> Any:
    if isinstance(data, torch.Tensor):
        return data.to(dtype) if data.is_floating_point() else data
    if isinstance(data, dict):
        return {k: cast_floats(v, dtype) for k, v in data.items()}
    if isinstance(data, tuple) and hasattr(data, "_fields"):  # a namedtuple
        return type(data)(*(cast_floats(v, dtype) for v in data))
    if isinstance(data, list | tuple):
        return type(data)(cast_floats(v, dtype) for v in data)
    return data
