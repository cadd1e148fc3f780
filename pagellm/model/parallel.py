"""Tensor-parallel layers, and the rule that cuts each checkpoint tensor down to this rank's shard.

Megatron's split of a Llama layer: q/k/v and gate/up are column-parallel (each rank computes
its own heads and its own slice of the intermediate features, with no communication);
o_proj and down_proj are row-parallel (each rank multiplies its slice of the input features
and one all-reduce sums the partial results). So a layer costs two all-reduces. The
embedding and the LM head split the vocabulary, padded to a multiple of the group size.
When there are fewer KV heads than ranks, each KV head is replicated on the ranks whose
query heads read it, as in vLLM.

With `tp=None` every factory returns the plain torch module: one rank runs exactly the
unsharded model.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from pagellm.distributed.group import TensorParallelGroup
from pagellm.model.config import ModelArchConfig


def check_tensor_parallel(cfg: ModelArchConfig, size: int) -> None:
    """Raise ValueError when the model's heads or features cannot be split `size` ways."""
    def need(ok: bool, what: str, value: int, rule: str) -> None:
        if not ok:
            raise ValueError(f"tensor_parallel_size={size} does not fit this model: {what} ({value}) {rule}")

    heads, kv = cfg.num_attention_heads, cfg.num_key_value_heads
    need(heads % size == 0, "num_attention_heads", heads, f"must be divisible by {size}")
    need(kv % size == 0 or size % kv == 0, "num_key_value_heads", kv,
         f"must be divisible by {size}, or divide it (to replicate KV heads)")
    need(cfg.intermediate_size % size == 0, "intermediate_size", cfg.intermediate_size, f"must be divisible by {size}")


@dataclass(frozen=True)
class ShardShapes:
    """The sizes one rank holds."""

    num_heads: int
    num_kv_heads: int
    first_kv_head: int
    intermediate_size: int
    vocab_size: int  # this rank's rows of the padded vocabulary

    @classmethod
    def of(cls, cfg: ModelArchConfig, tp: TensorParallelGroup | None) -> ShardShapes:
        if tp is None:
            return cls(cfg.num_attention_heads, cfg.num_key_value_heads, 0, cfg.intermediate_size, cfg.vocab_size)
        check_tensor_parallel(cfg, tp.size)
        kv = cfg.num_key_value_heads
        if kv >= tp.size:
            num_kv, first_kv = kv // tp.size, tp.rank * (kv // tp.size)
        else:  # replicated: the query heads of this rank all read KV head rank // (size / kv)
            num_kv, first_kv = 1, tp.rank // (tp.size // kv)
        return cls(cfg.num_attention_heads // tp.size, num_kv, first_kv, cfg.intermediate_size // tp.size,
                   -(-cfg.vocab_size // tp.size))


class ColumnParallelLinear(nn.Linear):
    """`out_features` is this rank's share of the output; the output stays split across ranks."""

    def __init__(self, in_features: int, out_features: int, bias: bool, tp: TensorParallelGroup) -> None:
        super().__init__(in_features, out_features, bias=bias)
        self.tp = tp


class RowParallelLinear(nn.Linear):
    """`in_features` is this rank's share of the input; the partial products are summed over ranks."""

    def __init__(self, in_features: int, out_features: int, bias: bool, tp: TensorParallelGroup) -> None:
        super().__init__(in_features, out_features, bias=bias)
        self.tp = tp

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.tp.all_reduce(F.linear(x, self.weight))
        return y if self.bias is None else y + self.bias


class VocabParallelEmbedding(nn.Embedding):
    """Rows [rank * n, (rank + 1) * n) of the padded vocabulary. A token looks up its row on the
    rank that holds it, zeros elsewhere, and an all-reduce assembles the embedding exactly."""

    def __init__(self, num_local: int, dim: int, tp: TensorParallelGroup) -> None:
        super().__init__(num_local, dim)
        self.tp = tp
        self.start = tp.rank * num_local

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        local = ids - self.start
        outside = (local < 0) | (local >= self.num_embeddings)
        out = F.embedding(local.masked_fill(outside, 0), self.weight)
        return self.tp.all_reduce(out.masked_fill_(outside.unsqueeze(-1), 0))


def column_linear(in_features: int, out_features: int, bias: bool, tp: TensorParallelGroup | None) -> nn.Linear:
    return nn.Linear(in_features, out_features, bias=bias) if tp is None else \
        ColumnParallelLinear(in_features, out_features, bias, tp)


def row_linear(in_features: int, out_features: int, bias: bool, tp: TensorParallelGroup | None) -> nn.Linear:
    return nn.Linear(in_features, out_features, bias=bias) if tp is None else \
        RowParallelLinear(in_features, out_features, bias, tp)


def embedding(num_local: int, dim: int, tp: TensorParallelGroup | None) -> nn.Embedding:
    return nn.Embedding(num_local, dim) if tp is None else VocabParallelEmbedding(num_local, dim, tp)


def gather_logits(logits: torch.Tensor, tp: TensorParallelGroup, vocab_size: int) -> torch.Tensor | None:
    """The full [rows, vocab] logits on rank 0 (vocabulary padding dropped); None elsewhere."""
    full = tp.gather_last_dim(logits)
    return None if full is None else full[:, :vocab_size]


# What dimension of each Hugging Face tensor is split, and over what unit.
_SPLIT = {
    "self_attn.q_proj": (0, "q"), "self_attn.k_proj": (0, "kv"), "self_attn.v_proj": (0, "kv"),
    "self_attn.o_proj": (1, "q"), "mlp.gate_proj": (0, "inter"), "mlp.up_proj": (0, "inter"),
    "mlp.down_proj": (1, "inter"),
}


def shard_weight(name: str, tensor: torch.Tensor, cfg: ModelArchConfig, tp: TensorParallelGroup) -> torch.Tensor:
    """This rank's slice of the Hugging Face-named `tensor`; norms come back whole.

    Called on each tensor as the loader reads it, so a rank holds at most one full tensor
    at a time, never the whole model.
    """
    shapes = ShardShapes.of(cfg, tp)
    short = name.removeprefix("model.")
    if short in ("embed_tokens.weight", "lm_head.weight"):
        n = shapes.vocab_size
        part = tensor[tp.rank * n:(tp.rank + 1) * n]
        return F.pad(part, (0, 0, 0, n - part.shape[0])) if part.shape[0] < n else part
    for module, (dim, unit) in _SPLIT.items():
        if f".{module}." in short:
            if dim == 1 and tensor.dim() == 1:
                return tensor  # a row-parallel layer's bias is added once, after the sum
            hd = cfg.head_dim
            start, size = {
                "q": (tp.rank * shapes.num_heads * hd, shapes.num_heads * hd),
                "kv": (shapes.first_kv_head * hd, shapes.num_kv_heads * hd),
                "inter": (tp.rank * shapes.intermediate_size, shapes.intermediate_size),
            }[unit]
            return tensor.narrow(dim, start, size)
    return tensor
