"""Tensor parallelism as the layers see it: the group (this rank, the group's size, and the two
collectives a sharded forward needs), this rank's place in it and how heads are divided
(Megatron's split; KV heads replicated when there are fewer of them than ranks, as in vLLM).
Starting the ranks and their process groups is pagellm/distributed/'s job."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist


@dataclass(frozen=True)
class TensorParallelGroup:
    rank: int
    size: int
    # A torch.distributed process group; None is the default one (gloo on the CPU, NCCL on CUDA).
    group: Any = None

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """Sum `x` over the ranks, in place."""
        dist.all_reduce(x, group=self.group)
        return x

    def gather_last_dim(self, x: torch.Tensor) -> torch.Tensor | None:
        """The ranks' `x` side by side along the last dimension on rank 0; None elsewhere."""
        x = x.contiguous()
        parts = [torch.empty_like(x) for _ in range(self.size)] if self.rank == 0 else None
        dist.gather(x, parts, dst=0, group=self.group)
        return torch.cat(parts, dim=-1) if parts is not None else None


def rank_and_size(tp: TensorParallelGroup | None) -> tuple[int, int]:
    return (0, 1) if tp is None else (tp.rank, tp.size)


def divide(total: int, size: int, what: str) -> int:
    if total % size:
        raise ValueError(f"tensor_parallel_size={size} does not fit this model: {what} ({total}) "
                         f"must be divisible by {size}")
    return total // size


@dataclass(frozen=True)
class HeadSplit:
    """The attention heads one rank holds."""

    num_heads: int
    num_kv_heads: int
    first_kv_head: int

    @classmethod
    def of(cls, num_heads: int, num_kv_heads: int, tp: TensorParallelGroup | None) -> HeadSplit:
        rank, size = rank_and_size(tp)
        local = divide(num_heads, size, "num_attention_heads")
        if num_kv_heads % size and size % num_kv_heads:
            raise ValueError(f"tensor_parallel_size={size} does not fit this model: num_key_value_heads "
                             f"({num_kv_heads}) must be divisible by {size}, or divide it (to replicate KV heads)")
        if num_kv_heads >= size:
            kv = num_kv_heads // size
            return cls(local, kv, rank * kv)
        # Replicated: this rank's query heads all read KV head rank // (size / kv).
        return cls(local, 1, rank // (size // num_kv_heads))


def load_whole(param: torch.Tensor, loaded) -> None:
    """The default weight loader: the checkpoint tensor is the parameter, whole. A quantized
    checkpoint tensor (GGUF blocks) reaching a dense parameter is dequantized here."""
    if not isinstance(loaded, torch.Tensor):
        loaded = loaded.dequantize()
    if param.shape != loaded.shape:
        raise ValueError(f"shape {tuple(loaded.shape)}, expected {tuple(param.shape)}")
    param.data.copy_(loaded)
