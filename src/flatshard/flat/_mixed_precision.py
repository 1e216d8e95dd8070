"""Mixed precision and CPU offload policies (paper mechanisms 9 and 10).

The sharded master parameters keep their own dtype. A unit's shard is cast to
``param_dtype`` once per unshard, before the all-gather, so the all-gather and the unsharded
parameters are low precision: peak parameter memory K_full * Psi / F + K_low * max(psi).
Gradients are reduced in ``reduce_dtype`` and handed to the optimizer in the master dtype.
"""

from __future__ import annotations

from collections.abc import Collection
from dataclasses import dataclass, field

import torch
from torch import nn

from flatshard.flat._transport import gather_dtype_error

_FLOATS = (torch.float16, torch.bfloat16, torch.float32, torch.float64)


@dataclass(frozen=True)
class MixedPrecision:
    """Dtypes of compute, communication and buffers; None keeps the parameter's own.

    Attributes:
        param_dtype: dtype of the all-gather and of compute (e.g. torch.bfloat16).
        reduce_dtype: dtype of the gradient reduction; None: the compute dtype
            (``param_dtype``, or the master dtype for ``keep_full_precision`` modules).
        buffer_dtype: buffers are cast to it once, at ``fully_shard``.
        cast_forward_inputs: cast floating-point inputs of each unit to ``param_dtype``.
        output_dtype: cast the floating-point outputs of the module ``fully_shard`` is
            called on (the model's forward output) to it, e.g. ``torch.float32`` for a
            loss computed outside the model; None: as computed. FSDP2's
            ``MixedPrecisionPolicy.output_dtype``, given to the root's call.
        keep_full_precision: module classes (e.g. ``{nn.LayerNorm}``) whose parameters
            stay in the master dtype; their inputs are cast up and outputs back down.
        gather_dtype: the dtype parameters travel in when all-gathered, decoded into the
            compute dtype before the unit runs (None: the compute dtype).
            ``torch.int8``, ``torch.float8_e4m3fn`` or ``torch.float8_e5m2``: one byte per
            weight and one float32 scale per row, computed by each rank from its own rows
            of the master weights (the same at every world size); vectors (biases, norm
            weights) and ``keep_full_precision`` modules travel in the compute dtype.
            ``torch.bfloat16`` / ``torch.float16``: a cast of every parameter. Optimizer,
            master weights, state dicts and the gradient reduction are unchanged. Per
            parameter: ``flatshard.Rows(gather_dtype=...)`` in ``placement``.
    """

    param_dtype: torch.dtype | None = None
    reduce_dtype: torch.dtype | None = None
    buffer_dtype: torch.dtype | None = None
    cast_forward_inputs: bool = True
    keep_full_precision: Collection[type[nn.Module]] = field(default_factory=frozenset)
    output_dtype: torch.dtype | None = None
    gather_dtype: torch.dtype | None = None

    def __post_init__(self) -> None:
        error = gather_dtype_error(self.gather_dtype, "MixedPrecision(gather_dtype=...)")
        if error is not None:
            raise ValueError(error)
        for name in ("param_dtype", "reduce_dtype", "buffer_dtype", "output_dtype"):
            value = getattr(self, name)
            if value is not None and value not in _FLOATS:
                raise ValueError(
                    f"MixedPrecision({name}=...) must be a floating-point torch.dtype or "
                    f"None, got {value!r}"
                )
        classes = tuple(self.keep_full_precision)
        if not all(isinstance(c, type) and issubclass(c, nn.Module) for c in classes):
            raise TypeError(
                "MixedPrecision(keep_full_precision=...) must be nn.Module classes, e.g. "
                f"{{nn.LayerNorm}}; got {self.keep_full_precision!r}"
            )

    def compute_dtype(self, master: torch.dtype, full_precision_module: bool) -> torch.dtype:
        """The dtype a parameter of dtype ``master`` is gathered and used in."""
        if self.param_dtype is None or full_precision_module or not master.is_floating_point:
            return master
        return self.param_dtype

    def gradient_reduce_dtype(self, compute: torch.dtype) -> torch.dtype:
        return self.reduce_dtype or compute


@dataclass(frozen=True)
class CPUOffload:
    """Keep sharded master parameters and their gradients in CPU memory.

    The optimizer then steps on the CPU. Shards are copied to the compute device before
    each all-gather and reduced gradients copied back after each reduction (copies even
    where the compute device is the CPU too, so that a CPU run holds what a GPU run would).
    """

    params: bool = True


def host_of(device: torch.device) -> torch.device:
    """Where CPUOffload keeps the shards of a model computed on ``device``: the CPU, or the
    meta device for a model on meta (``flatshard.plan``'s simulation, see [Note: simulated
    offload] in planner/_simulate.py)."""
    return device if device.type == "meta" else torch.device("cpu")


@dataclass(frozen=True)
class DtypeRow:
    """What happens to one flat parameter group's data, in dtypes."""

    unit: str
    params: int  # original parameter count
    master: str  # sharded parameters (and the optimizer state built from them)
    all_gather: str  # the collective that unshards ("-" when F = 1)
    compute: str  # the unsharded parameters forward/backward use
    reduce: str  # the gradient reduction ("-" when frozen)
    master_device: str
    group: str = ""  # which of the unit's groups, where it has several: its parameters

    @property
    def name(self) -> str:
        """The unit's name, and the group's where the unit has several."""
        return f"{self.unit} [{self.group}]" if self.group else self.unit


@dataclass(frozen=True)
class DtypeReport:
    """The resolved dtypes of every flat parameter group of a model."""

    rows: tuple[DtypeRow, ...]

    def __str__(self) -> str:
        header = ("unit", "params", "master", "all-gather", "compute", "reduce", "master on")
        widths = [max(len(header[0]), *(len(r.name) for r in self.rows)), 6, 9, 10, 9, 9, 9]
        lines = ["  ".join(h.ljust(w) for h, w in zip(header, widths, strict=True))]
        for r in self.rows:
            cells = (
                r.name,
                str(r.params),
                r.master,
                r.all_gather,
                r.compute,
                r.reduce,
                r.master_device,
            )
            lines.append("  ".join(c.ljust(w) for c, w in zip(cells, widths, strict=True)))
        return "\n".join(lines)


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")
