"""Paged attention through Triton kernels: the GPU path.

Same contract as `TorchAttentionBackend.forward`: store the step's K/V through the slot
mapping, then attend; decodes (first `num_decodes` rows) go through the split-K decode
kernel, everything else (fresh prompts, chunks, prompts with a cached prefix) through one
prefill launch. A layer's options (sliding window, attention chunk, soft-cap) and sinks go into the same
kernels. The decode path touches only tensors and shapes (the options are per-layer constants,
the sinks a tensor), so a decode-only step can be captured in a CUDA graph
(`supports_cuda_graphs`), whatever the layers' options.
"""
from __future__ import annotations

import torch

from pagellm.attention.backend import AttentionBackend, AttentionMetadata, AttentionOptions
from pagellm.attention.triton_kernels import (
    KernelConfig,
    default_prefill_config,
    paged_decode,
    paged_prefill,
    prefill_tiles,
    store_kv,
)


class TritonAttentionBackend(AttentionBackend):
    supports_cuda_graphs = True
    reads_8bit_kv = True

    def __init__(self, decode_config: KernelConfig | None = None, prefill_config: KernelConfig | None = None,
                 num_splits: int | None = None) -> None:
        """Configs None take each device's defaults; `num_splits` None lets the decode kernel choose."""
        self.decode_config = decode_config
        self.prefill_config = prefill_config
        self.num_splits = num_splits
        # Every layer gets the same metadata object in one step: build the prefill work list
        # for the first layer and reuse it in the others.
        self._tiles_for: AttentionMetadata | None = None
        self._tiles: torch.Tensor | None = None

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor,
                v_cache: torch.Tensor, meta: AttentionMetadata, scale: float, options: AttentionOptions | None = None,
                sinks: torch.Tensor | None = None) -> torch.Tensor:
        window = options.sliding_window if options is not None else None
        chunk = options.attention_chunk if options is not None else None
        softcap = (options.softcap or None) if options is not None else None
        fmt = self.kv_format if self.kv_format is not None and self.kv_format.quantized else None
        store_kv(k, v, k_cache, v_cache, meta.slot_mapping, fmt)
        out = torch.empty_like(q)
        nd = meta.num_decodes
        if nd:
            paged_decode(q[:nd], k_cache, v_cache, meta.block_tables[:nd], meta.seq_lens_tensor[:nd], scale,
                         out=out[:nd], num_splits=self.num_splits, config=self.decode_config,
                         sliding_window=window, softcap=softcap, sinks=sinks, kv_format=fmt,
                         attention_chunk=chunk)
        if meta.num_seqs > nd:
            cfg = self.prefill_config or default_prefill_config(q.device, q.shape[-1])
            paged_prefill(q[nd:], k_cache, v_cache, meta.block_tables, self._prefill_tiles(meta, cfg, q.device),
                          scale, out=out[nd:], config=cfg, sliding_window=window, softcap=softcap, sinks=sinks,
                          kv_format=fmt, attention_chunk=chunk)
        return out

    def _prefill_tiles(self, meta: AttentionMetadata, cfg: KernelConfig, device: torch.device) -> torch.Tensor:
        if meta is not self._tiles_for:
            nd = meta.num_decodes
            self._tiles = prefill_tiles(list(range(nd, meta.num_seqs)), meta.query_lens[nd:], meta.seq_lens[nd:],
                                        cfg.block_m, device)
            self._tiles_for = meta
        return self._tiles

__all__ = ["TritonAttentionBackend"]
