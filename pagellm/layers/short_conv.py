"""LFM2's short-convolution block: in_proj makes three gates B, C and x; the causal depthwise
convolution (kernel L_cache, no activation) runs over B * x; C gates its output; out_proj.
Its state is each sequence's last L_cache - 1 convolution inputs."""
from __future__ import annotations

import torch
from torch import nn

from pagellm.layers.causal_conv import causal_conv1d
from pagellm.layers.linear import MergedColumnParallelLinear, RowParallelLinear
from pagellm.layers.parallel import TensorParallelGroup, divide, load_rows, rank_and_size
from pagellm.layers.recurrent import RecurrentMixer


class ShortConv(RecurrentMixer):
    """Checkpoint names: `in_proj`, `conv.weight` [hidden, 1, L] (and `conv.bias`), `out_proj`.
    Under tensor parallelism each rank holds a slice of the channels (the convolution is per
    channel), and out_proj sums the slices."""

    def __init__(self, hidden_size: int, kernel_size: int, bias: bool, tp: TensorParallelGroup | None) -> None:
        super().__init__()
        self.rank, size = rank_and_size(tp)
        local = divide(hidden_size, size, "hidden_size (the short convolution's channels)")
        self.in_proj = MergedColumnParallelLinear(hidden_size, [hidden_size] * 3, bias, tp)
        self.conv = nn.Module()
        self.conv.weight = nn.Parameter(torch.empty(local, kernel_size), requires_grad=False)
        self.conv.weight.weight_loader = self._load_conv
        self.conv.bias = nn.Parameter(torch.empty(local), requires_grad=False) if bias else None
        if bias:
            self.conv.bias.weight_loader = self._load_conv
        self.out_proj = RowParallelLinear(hidden_size, hidden_size, bias, tp)
        self.state_shapes = {"conv": (local, kernel_size - 1)}

    def _load_conv(self, param: nn.Parameter, loaded: torch.Tensor, shard_id=None) -> None:
        load_rows(param, loaded.reshape(loaded.shape[0], -1).squeeze(-1) if param.dim() == 1 else
                  loaded.reshape(loaded.shape[0], -1), self.rank)

    def forward(self, x: torch.Tensor, state: dict[str, torch.Tensor], query_lens: list[int]) -> torch.Tensor:
        b, c, h = self.in_proj(x).chunk(3, dim=-1)
        h = causal_conv1d((b * h).float(), self.conv.weight.float(),
                          None if self.conv.bias is None else self.conv.bias.float(), state["conv"], query_lens)
        return self.out_proj((c * h.to(c.dtype)).contiguous())
