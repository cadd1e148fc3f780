"""LFM2's short-convolution block: in_proj makes three gates B, C and x; the causal depthwise
convolution (kernel L_cache, no activation) runs over B * x; C gates its output; out_proj.
Its state is each sequence's last L_cache - 1 convolution inputs."""
from __future__ import annotations

import torch

from pagellm.layers.linear import MergedColumnParallelLinear, RowParallelLinear
from pagellm.layers.parallel import TensorParallelGroup, rank_and_size
from pagellm.layers.recurrent import RecurrentMixer, StateTrace
from pagellm.layers.sharded_parts import Part, PartsConv1d


class ShortConv(RecurrentMixer):
    """Checkpoint names: `in_proj`, `conv.weight` [hidden, 1, L] (and `conv.bias`), `out_proj`.
    Under tensor parallelism each rank holds a slice of the channels (the convolution is per
    channel), and out_proj sums the slices."""

    def __init__(self, hidden_size: int, kernel_size: int, bias: bool, tp: TensorParallelGroup | None) -> None:
        super().__init__()
        rank, size = rank_and_size(tp)
        channels = Part.split(hidden_size, rank, size, "hidden_size (the short convolution's channels)")
        self.in_proj = MergedColumnParallelLinear(hidden_size, [hidden_size] * 3, bias, tp)
        self.conv = PartsConv1d([channels], kernel_size, bias, activation=None)
        self.out_proj = RowParallelLinear(hidden_size, hidden_size, bias, tp)
        self.state_shapes = {"conv": (channels.local, kernel_size - 1)}

    def forward(self, x: torch.Tensor, state: dict[str, torch.Tensor], query_lens: list[int],
                trace: StateTrace | None = None) -> torch.Tensor:
        b, c, h = self.in_proj(x).chunk(3, dim=-1)
        h = self.conv(b * h, state["conv"], query_lens, trace)
        return self.out_proj((c * h.to(c.dtype)).contiguous())
