"""Tensor-parallel bookkeeping shared by the layers: this rank's place in the group and
how heads are divided (Megatron's split; KV heads replicated when there are fewer of them
than ranks, as in vLLM)."""
from __future__ import annotations

from dataclasses import dataclass

import torch

from pagellm.distributed.group import TensorParallelGroup


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
