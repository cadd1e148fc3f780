"""RMSNorm and its variants: Gemma's `x * (1 + w)`, and a norm over a feature dimension
that tensor parallelism splits (OLMo 2's q/k norms over all heads); QKNorm pairs the q and k
norms some families apply before RoPE."""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from pagellm.layers.parallel import TensorParallelGroup
from pagellm.kernels import cpu
from pagellm.layers.module import HotModule
from pagellm.layers.parallel import load_whole, rank_and_size


def kernel_serves(norm: nn.Module, x: torch.Tensor) -> bool:
    """Whether the compiled kernels (cpu.rms_norm, cpu.add_rms_norm) normalize x with this norm's
    weight: a plain weight (not Gemma's 1 + w) of x's dtype, on rows the kernels take."""
    return not norm.unit_offset and cpu.usable(x) and norm.weight.dtype == x.dtype and x.shape[-1] > 0


class RMSNorm(HotModule):
    """Normalizes the last dimension. `unit_offset`: the weight is stored as w - 1 and
    applied as (1 + w), in float32 (Gemma)."""

    def __init__(self, size: int, eps: float, unit_offset: bool = False) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size), requires_grad=False)
        self.weight.weight_loader = load_whole
        self.eps = eps
        self.unit_offset = unit_offset

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.unit_offset:
            return F.rms_norm(x.float(), self.weight.shape, 1.0 + self.weight.float(), self.eps).to(x.dtype)
        if kernel_serves(self, x):
            # One pass with the reference's roundings (torch's own is ~10 small operations a call).
            if x.dim() == 2:  # the hidden states; view(shape) alone costs a few microseconds a call
                return cpu.rms_norm(x, self.weight, self.eps)
            return cpu.rms_norm(x.reshape(-1, x.shape[-1]), self.weight, self.eps).view(x.shape)
        if x.dtype == torch.float32:
            return F.rms_norm(x, self.weight.shape, self.weight, self.eps)
        # Normalize in fp32 like the reference, whatever the model dtype.
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * xf.to(x.dtype)

    def add_and_norm(self, x: torch.Tensor, h: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(x + h, self(x + h)): a residual add and the next block's norm, in one kernel where it serves."""
        if x.dim() == 2 and h.dtype == x.dtype and kernel_serves(self, x):
            return cpu.add_rms_norm(x, h, self.weight, self.eps)
        s = x + h
        return s, self(s)


class ShardedRMSNorm(HotModule):
    """RMSNorm over `size` features of which this rank holds `size / tp.size` (its heads):
    the sum of squares is all-reduced, so every rank normalizes by the whole row's RMS."""

    def __init__(self, size: int, eps: float, tp: TensorParallelGroup | None) -> None:
        super().__init__()
        self.tp = tp
        self.rank, tp_size = rank_and_size(tp)
        self.size = size
        self.weight = nn.Parameter(torch.ones(size // tp_size), requires_grad=False)
        self.weight.weight_loader = self.weight_loader
        self.eps = eps
        self.unit_offset = False

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor, shard_id=None) -> None:
        n = param.shape[0]
        load_whole(param, loaded.narrow(0, self.rank * n, n))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.tp is None:
            return RMSNorm.forward(self, x)  # the plain norm: same attributes, same roundings
        xf = x.float()
        sq = self.tp.all_reduce(xf.pow(2).sum(-1, keepdim=True))
        xf = xf * torch.rsqrt(sq / self.size + self.eps)
        return self.weight * xf.to(x.dtype)


class QKNorm:
    """The q and k norms a family applies before RoPE: per head (`per_head`: Qwen3, Gemma 3) or
    over all of a token's heads at once (OLMo 2). Holds the layer's own norm modules (their
    weights load under the layer's names), so it is not a module itself."""

    def __init__(self, q: nn.Module, k: nn.Module, per_head: bool) -> None:
        self.q, self.k, self.per_head = q, k, per_head

    def kernel_args(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, float, bool] | None:
        """(q weight, k weight, eps, per_head) for a compiled kernel to normalize q and k of x as these
        norms would (cpu.rms_norm's roundings), or None where it cannot: Gemma's 1 + w, a norm whose
        sum of squares is all-reduced across ranks, or rows the kernels do not take."""
        q, k = self.q, self.k
        if (kernel_serves(q, x) and kernel_serves(k, x) and getattr(q, "tp", None) is None
                and getattr(k, "tp", None) is None and q.eps == k.eps):
            return q.weight, k.weight, q.eps, self.per_head
        return None
