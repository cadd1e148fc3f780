"""Weights whose rows (or columns) are several parts that tensor parallelism cuts each on its
own: Gated DeltaNet's fused q/k/v/z/b/a projection, Mamba-2's gate/x/B/C/dt projection, the two
layers' depthwise convolutions over q/k/v or x/B/C, and Gated DeltaNet's out_proj with its value
heads tiled (a GGUF file's order). A rank keeps, of each part, the rows (columns) of its heads
(or, for Mamba-2 groups shared by several ranks, the rows of its group), side by side in part
order.
"""
from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
from torch import nn

from pagellm.layers.causal_conv import causal_conv1d
from pagellm.layers.linear import LinearBase, LinearMethod, RowParallelLinear
from pagellm.layers.module import HotModule
from pagellm.layers.parallel import TensorParallelGroup, divide, load_whole
from pagellm.layers.quant.gguf import GGUFBlocks

if TYPE_CHECKING:
    from pagellm.layers.recurrent import StateTrace


@dataclass(frozen=True)
class Part:
    """`total` rows in the checkpoint tensor, of which this rank keeps `local` from row `first`."""

    total: int
    local: int
    first: int

    @classmethod
    def split(cls, total: int, rank: int, size: int, what: str) -> Part:
        """Rank `rank`'s 1/size of the rows (`what` names them in the error when they do not divide)."""
        n = divide(total, size, what)
        return cls(total, n, rank * n)


def part_rows(loaded, parts: list[Part]) -> Iterator[tuple[int, object]]:
    """(row in this rank's tensor, the checkpoint rows that go there) for each part of `loaded`,
    a checkpoint tensor (or quantized blocks) made of `parts` along dim 0."""
    total = sum(p.total for p in parts)
    if loaded.shape[0] != total:
        raise ValueError(f"{loaded.shape[0]} rows, expected {total}")
    src = dst = 0
    for p in parts:
        yield dst, loaded.narrow(0, src + p.first, p.local)
        src, dst = src + p.total, dst + p.local


class PartsColumnParallelLinear(LinearBase):
    """A column-parallel layer whose output rows are `pieces` in order: checkpoint tensor ->
    the parts it is made of. With one piece keyed None the checkpoint holds the layer as one
    tensor (Mamba-2's in_proj); otherwise the keys are the parts a family's `stacked_params`
    route the checkpoint's tensors to (Gated DeltaNet's in_proj_qkv, _z, _b, _a)."""

    def __init__(self, in_features: int, pieces: dict[object, list[Part]], bias: bool = False,
                 tp: TensorParallelGroup | None = None, method: LinearMethod | None = None) -> None:
        self.pieces = pieces
        super().__init__(in_features, sum(p.local for ps in pieces.values() for p in ps), bias, tp, method)
        if list(pieces) != [None]:
            for p in self.parameters(recurse=False):
                p.parts_needed = set(pieces)

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor, shard_id=None) -> None:
        if shard_id not in self.pieces:
            raise ValueError(f"part {shard_id!r} is none of {list(self.pieces)}")
        offset = 0
        for key, parts in self.pieces.items():
            if key == shard_id:
                break
            offset += sum(p.local for p in parts)
        for row, rows in part_rows(loaded, self.pieces[shard_id]):
            self.store(param, rows, offset + row)


class PartsRowParallelLinear(RowParallelLinear):
    """A row-parallel layer whose input columns are `parts` in order (Gated DeltaNet's out_proj
    in a GGUF file: one part per value head of a key head, each over all key heads): a rank
    keeps, of each part, the columns of its heads, side by side."""

    def __init__(self, parts: list[Part], out_features: int, tp: TensorParallelGroup | None = None) -> None:
        self.parts = parts
        super().__init__(sum(p.total for p in parts), out_features, tp=tp)

    def weight_loader(self, param: nn.Parameter, loaded, shard_id=None) -> None:
        total = sum(p.total for p in self.parts)
        if loaded.shape[1] != total:
            raise ValueError(f"{loaded.shape[1]} columns, expected {total}")
        columns, src = [], 0
        for p in self.parts:
            columns.append(loaded.narrow(1, src + p.first, p.local))
            src += p.total
        self.store(param, _side_by_side(columns))


def _side_by_side(columns: list) -> object:
    """Column pieces of one weight (tensors, or GGUF blocks cut at block boundaries) joined."""
    if len(columns) == 1:
        return columns[0]
    if isinstance(columns[0], GGUFBlocks):
        return GGUFBlocks(torch.cat([c.data for c in columns], dim=1), columns[0].qtype,
                          sum(c.shape[1] for c in columns))
    return torch.cat(columns, dim=1)


class PartsConv1d(HotModule):
    """A causal depthwise convolution (`activation` after it: SiLU, or None) with Hugging Face's
    nn.Conv1d parameters (`weight` [channels, 1, K], optional `bias`), of this rank's channels of
    `parts`. Computes in float32 whatever the model's dtype, like the state it carries."""

    def __init__(self, parts: list[Part], kernel_size: int, bias: bool, activation: str | None = "silu") -> None:
        super().__init__()
        self.parts = parts
        self.activation = activation
        channels = sum(p.local for p in parts)
        self.weight = nn.Parameter(torch.empty(channels, 1, kernel_size), requires_grad=False)
        self.bias = nn.Parameter(torch.empty(channels), requires_grad=False) if bias else None
        for p in self.parameters(recurse=False):
            p.weight_loader = self.weight_loader

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor, shard_id=None) -> None:
        for row, rows in part_rows(loaded, self.parts):
            load_whole(param.data.narrow(0, row, rows.shape[0]), rows)

    def forward(self, x: torch.Tensor, state: torch.Tensor, query_lens: list[int],
                trace: StateTrace | None = None) -> torch.Tensor:
        """x [T, channels] -> [T, channels] float32; state [num_seqs, channels, K - 1] updated (and
        traced for `trace`'s sequences, as "conv")."""
        bias = None if self.bias is None else self.bias.float()
        return causal_conv1d(x.float(), self.weight[:, 0].float(), bias, state, query_lens, self.activation, trace)


def sharded_vector(part: Part) -> nn.Parameter:
    """A per-head parameter (A_log, dt_bias, D, a norm's weight) of which this rank keeps `part`."""
    param = nn.Parameter(torch.empty(part.local), requires_grad=False)
    param.weight_loader = lambda p, loaded, shard_id=None: load_whole(p, loaded.narrow(0, part.first, part.local))
    return param


def leading_decodes(query_lens: list[int]) -> int:
    """How many sequences at the start of a step compute one token each (decodes come first):
    the recurrent layers step those together."""
    for i, n in enumerate(query_lens):
        if n != 1:
            return i
    return len(query_lens)
