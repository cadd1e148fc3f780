"""Multi-head latent attention (DeepSeek-V2/V3, Kimi K2, Mistral 4): every head's keys and
values are projected up from one compressed row per token, [c_kv (kv_lora_rank), k_rope
(qk_rope_head_dim)], and that row is all the paged cache holds.

Queries are absorbed: q_nope times W_UK (kv_b_proj's key rows, per head) lands in c_kv's
space, so scores are taken against the cached rows as they are, and the attention output,
latent, is multiplied by W_UV (kv_b_proj's value rows) afterwards (attention/latent.py). That
is exact algebra on the reference's products, for prefill and decode alike.

Tensor parallelism splits the heads (q_b_proj / q_proj and kv_b_proj by columns, o_proj by
rows); the latent row does not depend on the head, so every rank computes and caches all of it.
"""
from __future__ import annotations

import torch

from pagellm.attention.backend import AttentionBackend, AttentionMetadata
from pagellm.layers.attention import Attention
from pagellm.layers.linear import ColumnParallelLinear, ReplicatedLinear, RowParallelLinear
from pagellm.layers.module import HotModule
from pagellm.layers.norm import RMSNorm
from pagellm.layers.parallel import TensorParallelGroup, divide, rank_and_size
from pagellm.layers.rotary import apply_rope
from pagellm.timing import phase


class LatentAttention(Attention):
    """The cache-owning part of a latent layer: one KV head whose row is [c_kv, k_rope] (the
    model runner allocates K rows of `row` features and empty V rows for it)."""

    latent = True

    def __init__(self, num_heads: int, kv_lora_rank: int, rope_dim: int, backend: AttentionBackend,
                 scale: float) -> None:
        super().__init__(num_heads, 1, kv_lora_rank + rope_dim, backend, scale=scale)
        self.kv_lora_rank = kv_lora_rank

    def forward(self, q: torch.Tensor, rows: torch.Tensor, kv_cache: tuple[torch.Tensor, torch.Tensor],
                meta: AttentionMetadata) -> torch.Tensor:
        """q: [T, H, R] absorbed queries, rows: [T, R] -> [T, H, kv_lora_rank], still latent."""
        with phase(self.backend.timer, "attention"):
            return self.backend.forward_latent(q, rows, kv_cache[0], meta.for_group(self.kv_group),
                                               self.options.scale, self.kv_lora_rank)


def mla_softmax_scale(rope_parameters: dict | None, qk_head_dim: int) -> float:
    """qk_head_dim ** -0.5, times mscale(factor, mscale_all_dim) squared under YaRN (transformers'
    yarn_apply_mscale: DeepSeek scales the whole score, not only the rotary dimensions)."""
    from transformers.modeling_rope_utils import yarn_apply_mscale

    return float(yarn_apply_mscale(rope_parameters or {}, qk_head_dim ** -0.5))


class MultiHeadLatentAttention(HotModule):
    """Checkpoint names as transformers' DeepseekV3Attention: q_a_proj, q_a_layernorm, q_b_proj
    (or q_proj when `q_lora_rank` is None), kv_a_proj_with_mqa, kv_a_layernorm, kv_b_proj, o_proj.
    `interleaved_rope`: the rotary features come in (even, odd) pairs (config rope_interleave)."""

    def __init__(self, hidden_size: int, num_heads: int, q_lora_rank: int | None, kv_lora_rank: int,
                 qk_nope_head_dim: int, qk_rope_head_dim: int, v_head_dim: int, backend: AttentionBackend,
                 scale: float, *, bias: bool = False, norm_eps: float = 1e-6, interleaved_rope: bool = True,
                 tp: TensorParallelGroup | None = None) -> None:
        super().__init__()
        self.num_heads = divide(num_heads, rank_and_size(tp)[1], "num_attention_heads")  # this rank's
        self.nope, self.rope_dim, self.v_dim, self.rank = qk_nope_head_dim, qk_rope_head_dim, v_head_dim, kv_lora_rank
        self.interleaved_rope = interleaved_rope
        qk = qk_nope_head_dim + qk_rope_head_dim
        self.q_lora_rank = q_lora_rank
        if q_lora_rank is None:
            self.q_proj = ColumnParallelLinear(hidden_size, num_heads * qk, False, tp)
        else:
            self.q_a_proj = ReplicatedLinear(hidden_size, q_lora_rank, bias)
            self.q_a_layernorm = RMSNorm(q_lora_rank, norm_eps)
            self.q_b_proj = ColumnParallelLinear(q_lora_rank, num_heads * qk, False, tp)
        self.kv_a_proj_with_mqa = ReplicatedLinear(hidden_size, kv_lora_rank + qk_rope_head_dim, bias)
        self.kv_a_layernorm = RMSNorm(kv_lora_rank, norm_eps)
        self.kv_b_proj = ColumnParallelLinear(kv_lora_rank, num_heads * (qk_nope_head_dim + v_head_dim), False, tp)
        self.o_proj = RowParallelLinear(num_heads * v_head_dim, hidden_size, bias, tp)
        self.attn = LatentAttention(self.num_heads, kv_lora_rank, qk_rope_head_dim, backend, scale)
        self._absorbed: tuple[torch.Tensor, torch.Tensor] | None = None

    def absorbed(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(W_UK [H, nope, kv_lora_rank], W_UV [H, v_dim, kv_lora_rank]) of this rank's heads, read
        from kv_b_proj through its linear method (so any weight format serves) at the first forward,
        once the weights are in."""
        if self._absorbed is None:
            norm = self.kv_a_layernorm.weight
            eye = torch.eye(self.rank, dtype=norm.dtype, device=norm.device)
            w = self.kv_b_proj(eye).T.reshape(self.num_heads, self.nope + self.v_dim, self.rank)
            self._absorbed = (w[:, :self.nope].contiguous(), w[:, self.nope:].contiguous())
        return self._absorbed

    def _rotate(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        if self.interleaved_rope:  # pairs (x0, x1), (x2, x3)...: the reference rotates evens with odds
            x = torch.cat([x[..., 0::2], x[..., 1::2]], dim=-1)
        return apply_rope(x, cos, sin)

    def forward(self, rope: tuple[torch.Tensor, torch.Tensor], x: torch.Tensor,
                kv_cache: tuple[torch.Tensor, torch.Tensor], meta: AttentionMetadata) -> torch.Tensor:
        h = self.num_heads
        q = self.q_proj(x) if self.q_lora_rank is None else self.q_b_proj(self.q_a_layernorm(self.q_a_proj(x)))
        q_nope, q_rope = q.view(-1, h, self.nope + self.rope_dim).split([self.nope, self.rope_dim], dim=-1)
        c_kv, k_rope = self.kv_a_proj_with_mqa(x).split([self.rank, self.rope_dim], dim=-1)
        cos, sin = rope[0], rope[1]
        rows = torch.cat([self.kv_a_layernorm(c_kv.contiguous()), self._rotate(k_rope[:, None], cos, sin)[:, 0]], -1)
        w_uk, w_uv = self.absorbed()
        q_latent = torch.matmul(q_nope.transpose(0, 1), w_uk).transpose(0, 1)  # [T, H, kv_lora_rank]
        o = self.attn(torch.cat([q_latent, self._rotate(q_rope, cos, sin)], dim=-1), rows, kv_cache, meta)
        o = torch.matmul(o.transpose(0, 1), w_uv.transpose(1, 2)).transpose(0, 1)  # [T, H, v_dim]
        return self.o_proj(o.reshape(-1, h * self.v_dim))
