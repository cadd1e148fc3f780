"""Gated activations over a fused [gate, up] product: act(gate) * up."""
from __future__ import annotations

import torch
import torch.nn.functional as F

from pagellm.kernels import cpu

# Hugging Face `hidden_act` names -> the gate's activation.
ACTIVATIONS = {
    "silu": F.silu,
    "swish": F.silu,
    "gelu_pytorch_tanh": lambda x: F.gelu(x, approximate="tanh"),
    "gelu_tanh": lambda x: F.gelu(x, approximate="tanh"),
}


def check_activation(name: str, model: str) -> None:
    if name not in ACTIVATIONS:
        raise ValueError(f"{model}: hidden_act {name!r} is not supported (supported: {', '.join(ACTIVATIONS)})")


def act_and_mul(gate_up: torch.Tensor, name: str = "silu") -> torch.Tensor:
    """gate_up: [..., 2I] -> act(gate) * up: [..., I]."""
    if name in ("silu", "swish") and gate_up.dim() == 2 and cpu.usable(gate_up):
        return cpu.silu_and_mul(gate_up)  # one pass instead of three
    gate, up = gate_up.chunk(2, dim=-1)
    return ACTIVATIONS[name](gate) * up
