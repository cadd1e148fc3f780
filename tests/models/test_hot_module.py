"""HotModule: the step's layers skip torch's hook checks, so registering a hook must fail loudly."""
import pytest
import torch

from pagellm.layers.norm import RMSNorm


def test_hot_module_calls_forward_and_refuses_hooks():
    norm = RMSNorm(8, 1e-6)
    x = torch.randn(2, 8)
    assert torch.equal(norm(x), norm.forward(x))
    for register in (norm.register_forward_hook, norm.register_forward_pre_hook, norm.register_full_backward_hook):
        with pytest.raises(NotImplementedError, match="hooks on it would never run"):
            register(lambda *args: None)
