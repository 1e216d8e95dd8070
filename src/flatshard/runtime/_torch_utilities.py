"""What flatshard installs in torch while a sharded model lives, with its handles.

torch's gradient norm is made global for flatshard's gradients (``_torch_norm.py``), a
step pre-hook of every optimizer sees the model's optimizer steps
(``_optimizer_steps.py``) and torch's ``zero_grad`` functions also drop the gradients kept
unreduced (``_zero_grad.py``), and torch's module registration hooks mark each sharded
model to be checked for changes (``_changes.py``). All are installed once, by the first
``fully_shard``, and removed when the last sharded model is gone (garbage-collected): then
the process runs plain torch again (torch's own functions, no hook).
"""

from __future__ import annotations

import weakref

from torch.nn.modules.module import (
    register_module_module_registration_hook,
    register_module_parameter_registration_hook,
)
from torch.optim.optimizer import register_optimizer_step_pre_hook
from torch.utils.hooks import RemovableHandle

from flatshard.runtime._optimizer_steps import before_step
from flatshard.runtime._step import StepContext, watch, watched_contexts
from flatshard.runtime._torch_norm import TorchNorms
from flatshard.runtime._zero_grad import ZeroGrads


class TorchReach:
    """Owns every change flatshard makes to torch's process-wide state."""

    def __init__(self) -> None:
        self._hooks: list[RemovableHandle] = []
        self._norms = TorchNorms()
        self._zero_grads = ZeroGrads()

    @property
    def installed(self) -> bool:
        return bool(self._hooks)

    def install(self) -> None:
        if not self._hooks:
            self._hooks = [
                register_optimizer_step_pre_hook(before_step),
                register_module_parameter_registration_hook(_registered),
                register_module_module_registration_hook(_registered),
            ]
            self._norms.install()
            self._zero_grads.install()

    def remove(self) -> None:
        if self._hooks:
            for hook in self._hooks:
                hook.remove()
            self._hooks = []
            self._norms.remove()
            self._zero_grads.remove()

    def remove_if_unused(self) -> None:
        """Remove everything once no sharded model is alive, counting one whose
        ``fully_shard`` is still building it (it has no unit yet: a collection of an older
        model then must not take the hooks from under it)."""
        if not watched_contexts():
            self.remove()


TORCH_REACH = TorchReach()


def _registered(*unused: object) -> None:
    """A parameter or module was registered somewhere: every sharded model checks itself
    at its next forward ([Note: cheap change detection] in _changes.py)."""
    for context in watched_contexts():
        context.changes.to_check = True


def watch_torch_utilities(context: StepContext) -> None:
    """``context``'s model is sharded: torch's gradient norm counts every rank's rows of its
    gradients, its optimizer steps are seen and ``zero_grad`` drops what it keeps
    unreduced, until the last such model is gone."""
    watch(context)
    TORCH_REACH.install()
    weakref.finalize(context, TORCH_REACH.remove_if_unused)
