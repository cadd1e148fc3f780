"""Gated activations over a fused [gate, up] product: act(gate) * up, or gpt-oss's clamped
SwiGLU."""
from __future__ import annotations

from dataclasses import dataclass

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


@dataclass(frozen=True)
class ClampedSwiGLU:
    """gpt-oss's experts (transformers' GptOssExperts._apply_gate): the gate clamped above and
    the up projection on both sides at `limit`, then (up + 1) * gate * sigmoid(alpha * gate).
    The clamps keep an expert's output bounded whatever its input; the + 1 lets up = 0 pass
    the gate through."""

    alpha: float
    limit: float

    def __call__(self, gate_up: torch.Tensor) -> torch.Tensor:
        """gate_up: [..., 2I], gate then up -> [..., I]."""
        gate, up = gate_up.chunk(2, dim=-1)
        gate = gate.clamp(max=self.limit)
        up = up.clamp(min=-self.limit, max=self.limit)
        return (up + 1) * (gate * torch.sigmoid(gate * self.alpha))


# What a gated layer applies: a `hidden_act` name, or an activation object of its own.
Activation = str | ClampedSwiGLU


def check_activation(name: str, model: str) -> None:
    if name not in ACTIVATIONS:
        raise ValueError(f"{model}: hidden_act {name!r} is not supported (supported: {', '.join(ACTIVATIONS)})")


def act_and_mul(gate_up: torch.Tensor, name: Activation = "silu") -> torch.Tensor:
    """gate_up: [..., 2I] -> act(gate) * up: [..., I] (or what an activation object makes of it)."""
    if not isinstance(name, str):
        return name(gate_up)
    if name in ("silu", "swish") and gate_up.dim() == 2 and cpu.usable(gate_up):
        return cpu.silu_and_mul(gate_up)  # one pass instead of three
    gate, up = gate_up.chunk(2, dim=-1)
    return ACTIVATIONS[name](gate) * up
