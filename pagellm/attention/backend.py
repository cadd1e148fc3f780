"""The attention backend interface; the per-step metadata every backend reads is metadata.py.

The model calls `backend.forward` in each layer and knows nothing else about paging.
A backend owns the layout of its KV cache tensors; the model runner allocates them
through `kv_cache_shape` and fills the metadata.
"""
from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable
from dataclasses import dataclass

import torch

from pagellm.attention.metadata import AttentionMetadata
from pagellm.kv_format import KVFormat
from pagellm.timing import PhaseTimer


@dataclass(frozen=True)
class AttentionOptions:
    """A layer's attention beyond scaled dot products, as in Hugging Face.

    `sliding_window` W: a query at position i sees keys at positions j with i - W < j <= i.
    `softcap` c: each scaled score s becomes c * tanh(s / c) (Gemma 2).
    `attention_chunk` C: a query at position i sees keys at positions j <= i of its own chunk,
    j // C == i // C (Llama 4's chunked layers)."""

    scale: float
    sliding_window: int | None = None
    softcap: float | None = None
    attention_chunk: int | None = None

    def __post_init__(self) -> None:
        for name in ("sliding_window", "attention_chunk"):
            value = getattr(self, name)
            if value is not None and value < 1:
                raise ValueError(f"{name} must be at least 1, got {value}")

    @property
    def plain(self) -> bool:
        """Causal attention over the whole context, nothing else."""
        return self.sliding_window is None and not self.softcap and self.attention_chunk is None

    def visible(self, qpos: torch.Tensor, kpos: torch.Tensor) -> torch.Tensor:
        """Which keys at positions `kpos` queries at positions `qpos` see (broadcast together):
        causal, within the window and the chunk where the layer has them."""
        mask = kpos <= qpos
        if self.sliding_window is not None:
            mask = mask & (kpos > qpos - self.sliding_window)
        if self.attention_chunk is not None:
            mask = mask & (kpos // self.attention_chunk == qpos // self.attention_chunk)
        return mask


class AttentionBackend(ABC):
    """Paged attention: store the step's K/V through the slot mapping, then attend."""

    # True when a decode-only forward reads tensors and shapes alone (no Python lists of
    # lengths, no host synchronisation), so it can be captured in a CUDA graph.
    supports_cuda_graphs: bool = False
    # Where the attention phase is timed, when a benchmark attaches a timer (pagellm.timing).
    timer: PhaseTimer | None = None
    # How K/V rows are stored (kv_format.py), set by the model runner; None: as the
    # cache tensors' dtype, which is then q's.
    kv_format: KVFormat | None = None
    # Whether this backend stores and reads the 8-bit formats.
    reads_8bit_kv: bool = False

    def kv_cache_shape(self, num_blocks: int, block_size: int, num_kv_heads: int, head_dim: int) -> tuple[int, ...]:
        row = head_dim if self.kv_format is None else self.kv_format.row_size(head_dim)
        return (num_blocks, block_size, num_kv_heads, row)

    @abstractmethod
    def forward(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        meta: AttentionMetadata,
        scale: float,
        options: AttentionOptions | None = None,
        sinks: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """q: [T, H, D]; k, v: [T, KVH, D] for this step's tokens. Returns [T, H, D].

        `options` (its scale equals `scale`): a sliding window or a soft-cap; `sinks`: [H]
        logits, one per head, that join each softmax's denominator and attend to nothing
        (gpt-oss)."""

    def decode_from_qkv(self, qkv: torch.Tensor, num_heads: int, num_kv_heads: int,
                        rope: tuple[torch.Tensor, torch.Tensor] | None, k_cache: torch.Tensor,
                        v_cache: torch.Tensor, meta: AttentionMetadata, options: AttentionOptions,
                        sinks: torch.Tensor | None = None,
                        qk_norm: tuple[torch.Tensor, torch.Tensor, float, bool] | None = None) -> torch.Tensor | None:
        """A decode-only step's attention straight from the fused projection qkv [T, (H + 2 KVH) * D],
        rope = (cos, sin) [T, D] applied to q and k first (None: none), after `qk_norm` = (q weight,
        k weight, eps, per_head) where the family normalizes them (QKNorm.kernel_args): [T, H * D],
        or None where this backend has no such path for these inputs (the caller then splits qkv and
        calls forward). A fused path must give what the split one gives."""
        return None

    def decode_call(self, num_heads: int, num_kv_heads: int, options: AttentionOptions, sinks: torch.Tensor | None,
                    qk_norm: tuple[torch.Tensor, torch.Tensor, float, bool] | None, qkv: torch.Tensor,
                    k_cache: torch.Tensor) -> Callable[..., torch.Tensor] | None:
        """decode_from_qkv's work for one layer, its fixed arguments bound once (layers/decode_plan.py):
        a call `(qkv, rope, k_cache, v_cache, slot_mapping, block_tables, seq_lens_tensor)` on a
        decode-only step, with q/k/v like `qkv` and this cache, whose rope covers every head's
        features (the caller checks both). None where this backend has no such call."""
        return None

    def forward_latent(self, q: torch.Tensor, rows: torch.Tensor, cache: torch.Tensor, meta: AttentionMetadata,
                       scale: float, v_dim: int) -> torch.Tensor:
        """Multi-head latent attention (layers/mla.py): store this step's latent rows [T, R] in
        cache [blocks, block_size, 1, R], then attend with absorbed queries q [T, H, R], each row
        the key of every head and its first `v_dim` features the value -> [T, H, v_dim]. The torch
        reference (attention/latent.py) unless a backend has its own."""
        from pagellm.attention.latent import latent_attention

        return latent_attention(q, rows, cache, meta, scale, v_dim)
