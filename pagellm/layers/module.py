"""HotModule: an nn.Module whose call goes straight to its forward.

torch's `Module.__call__` looks for forward hooks (the module's and the global ones) and for
tracing on every call: about 1.4 us. A decode step of a 30-layer model calls its layers'
modules some 240 times, so on a small model that check is ~3% of the step. pagellm registers
no hooks; the layers a step runs through derive from HotModule, and registering a hook on one
raises instead of being skipped without a word. (Hooks registered globally, through
torch.nn.modules.module.register_module_forward_hook, do not reach these modules.)
"""
from __future__ import annotations

from typing import Any

from torch import nn


class HotModule(nn.Module):
    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        # Calling the module is calling its forward: the function itself, not a wrapper around it
        # (one Python frame fewer a call). Re-bound for every subclass, so an override is what runs.
        cls.__call__ = cls.forward

    def _no_hooks(self, *args: Any, **kwargs: Any) -> Any:
        raise NotImplementedError(f"{type(self).__name__} is a pagellm HotModule: its calls skip torch's hook "
                                  "machinery, so hooks on it would never run")

    register_forward_hook = register_forward_pre_hook = _no_hooks
    register_full_backward_hook = register_full_backward_pre_hook = register_backward_hook = _no_hooks
