"""The attention layer: this step's q/k/v for this rank's heads, through the backend that
reads and writes the paged cache, with the layer's own options (scale, sliding window,
logit soft-cap) and, in gpt-oss, its learned sinks."""
from __future__ import annotations

import time

import torch
from torch import nn

from pagellm.attention.backend import AttentionBackend, AttentionMetadata, AttentionOptions
from pagellm.layers.module import HotModule
from pagellm.layers.norm import QKNorm
from pagellm.layers.parallel import TensorParallelGroup, load_whole, rank_and_size
from pagellm.layers.rotary import rotate_qk
from pagellm.timing import phase


class Attention(HotModule):
    """`num_heads`, `num_kv_heads`: this rank's. `sinks`: the layer has a learned logit per head
    (gpt-oss's `self_attn.sinks`, [num_attention_heads] in the checkpoint) that joins each of
    that head's softmax denominators and attends to nothing; a rank of `tp` loads its own heads'."""

    # Caches one latent row per token in K and nothing in V (layers/mla.py's LatentAttention).
    latent = False

    def __init__(self, num_heads: int, num_kv_heads: int, head_dim: int, backend: AttentionBackend,
                 scale: float | None = None, sliding_window: int | None = None,
                 softcap: float | None = None, sinks: bool = False, tp: TensorParallelGroup | None = None,
                 attention_chunk: int | None = None) -> None:
        super().__init__()
        self.num_heads, self.num_kv_heads, self.head_dim = num_heads, num_kv_heads, head_dim
        self.backend = backend
        self.sinks: nn.Parameter | None = None
        if sinks:
            self.sinks = nn.Parameter(torch.empty(num_heads), requires_grad=False)
            self.sinks.weight_loader = self._load_sinks
            rank, size = rank_and_size(tp)
            self._first_head, self._all_heads = rank * num_heads, size * num_heads
        self.options = AttentionOptions(scale if scale is not None else head_dim ** -0.5, sliding_window, softcap,
                                        attention_chunk)
        # The KV group whose block tables this layer reads (set by the model runner, core/kv/groups.py).
        self.kv_group = 0

    def _load_sinks(self, param: nn.Parameter, loaded: torch.Tensor) -> None:
        if tuple(loaded.shape) != (self._all_heads,):
            raise ValueError(f"sinks of shape {tuple(loaded.shape)}, expected ({self._all_heads},): one per head")
        load_whole(param, loaded.narrow(0, self._first_head, self.num_heads))

    def forward_qkv(self, qkv: torch.Tensor, rope: tuple[torch.Tensor, ...] | None,
                    kv_cache: tuple[torch.Tensor, torch.Tensor], meta: AttentionMetadata,
                    qk_norm: QKNorm | None = None) -> torch.Tensor:
        """qkv: [T, (H + 2 KVH) * D], the fused projection; rope: (cos, sin) for q and k, or
        (cos, sin, scale) where the rotated queries are then multiplied by a factor per token
        (RotaryEmbedding.scale_queries; cos and sin None: scaled, not rotated, rotary.QueryScale), or
        None; qk_norm: the family's q/k norms, applied before
        RoPE. -> [T, H * D]. The backend's fused decode path where it has one, else split,
        normalize, rotate, forward."""
        # The fused kernels rotate q and k alike: scaled queries take the split path.
        query_scale = rope[2] if rope is not None and len(rope) > 2 else None
        norm_args = qk_norm.kernel_args(qkv) if qk_norm is not None else None
        if query_scale is None and (qk_norm is None or norm_args is not None):
            timer = self.backend.timer
            start = time.perf_counter() if timer is not None else 0.0
            o = self.backend.decode_from_qkv(qkv, self.num_heads, self.num_kv_heads, rope, kv_cache[0], kv_cache[1],
                                             meta.for_group(self.kv_group), self.options, self.sinks, norm_args)
            if o is not None:
                if timer is not None:  # one "attention" call a layer, whichever path ran (forward times its own)
                    timer.record("attention", time.perf_counter() - start)
                return o
        h, kvh, d = self.num_heads, self.num_kv_heads, self.head_dim
        q, k, v = qkv.split([h * d, kvh * d, kvh * d], dim=-1)
        if qk_norm is not None and not qk_norm.per_head:
            q, k = qk_norm.q(q), qk_norm.k(k)
        q, k = q.view(-1, h, d), k.view(-1, kvh, d)
        if qk_norm is not None and qk_norm.per_head:
            q, k = qk_norm.q(q), qk_norm.k(k)
        if rope is not None and rope[0] is not None:
            q, k = rotate_qk(q, k, rope[0], rope[1])
        if query_scale is not None:
            q = q * query_scale[:, None, None]  # after the rotation, as the reference scales them
        return self.forward(q, k, v, kv_cache, meta)

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kv_cache: tuple[torch.Tensor, torch.Tensor],
                meta: AttentionMetadata) -> torch.Tensor:
        """q: [T, H * D], k, v: [T, KVH * D] (or already [T, heads, D]) -> [T, H * D]."""
        q = q.view(-1, self.num_heads, self.head_dim)
        k = k.view(-1, self.num_kv_heads, self.head_dim)
        v = v.reshape(-1, self.num_kv_heads, self.head_dim)
        meta = meta.for_group(self.kv_group)
        with phase(self.backend.timer, "attention"):
            o = self.backend.forward(q, k, v, kv_cache[0], kv_cache[1], meta, self.options.scale,
                                     options=self.options, sinks=self.sinks)
        return o.reshape(-1, self.num_heads * self.head_dim)
