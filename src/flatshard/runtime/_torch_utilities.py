"""What flatshard installs in torch while a sharded model lives, with its handles.

torch's gradient norm is made global for flatshard's gradients (``_torch_norm.py``), a
step pre-hook of every optimizer sees the model's optimizer steps
(``_optimizer_steps.py``) and torch's ``zero_grad`` functions also drop the gradients kept
unreduced (``_zero_grad.py``). All are installed by the first ``fully_shard`` and removed
when the last sharded model is gone: then the process runs plain torch again (torch's own
functions, no hook).
"""

from __future__ import annotations

import weakref

from torch.optim.optimizer import register_optimizer_step_pre_hook
from torch.utils.hooks import RemovableHandle

from flatshard.runtime._optimizer_steps import before_step
from flatshard.runtime._sharded_models import sharded_contexts, watch
from flatshard.runtime._step import StepContext
from flatshard.runtime._torch_norm import TorchNorms
from flatshard.runtime._zero_grad import ZeroGrads


class TorchReach:
    """Owns every change flatshard makes to torch's process-wide state."""

    def __init__(self) -> None:
        self._step_hook: RemovableHandle | None = None
        self._norms = TorchNorms()
        self._zero_grads = ZeroGrads()

    @property
    def installed(self) -> bool:
        return self._step_hook is not None

    def install(self) -> None:
        if self._step_hook is None:
            self._step_hook = register_optimizer_step_pre_hook(before_step)
            self._norms.install()
            self._zero_grads.install()

    def remove(self) -> None:
        if self._step_hook is not None:
            self._step_hook.remove()
            self._step_hook = None
            self._norms.remove()
            self._zero_grads.remove()

    def remove_if_unused(self) -> None:
        """Remove everything once no sharded model is alive."""
        if not sharded_contexts():
            self.remove()


TORCH_REACH = TorchReach()


def watch_torch_utilities(context: StepContext) -> None:
    """``context``'s model is sharded: torch's gradient norm counts every rank's rows of its
    gradients, its optimizer steps are seen and ``zero_grad`` drops what it keeps
    unreduced, until the last such model is gone."""
    watch(context)
    TORCH_REACH.install()
    weakref.finalize(context, TORCH_REACH.remove_if_unused)
