"""Paged attention through Triton kernels: the GPU path.

Same contract as `TorchAttentionBackend.forward`: store the step's K/V through the slot
mapping, then attend; decodes (first `num_decodes` rows) go through the split-K decode
kernel, everything else (fresh prompts, chunks, prompts with a cached prefix) through one
prefill launch. A layer's options (sliding window, attention chunk, soft-cap) and sinks go into the same
kernels. The decode path touches only tensors and shapes (the options are per-layer constants,
the sinks a tensor), so a decode-only step can be captured in a CUDA graph
(`supports_cuda_graphs`), whatever the layers' options.

Latent layers (layers/mla.py) go through their own kernels (triton_latent.py), which read the
cached latent rows in place for decodes and prefills alike.
"""
from __future__ import annotations

import torch

from pagellm.attention import latent
from pagellm.attention.backend import AttentionBackend, AttentionMetadata, AttentionOptions
from pagellm.attention.triton_latent import (
    LatentConfig,
    default_latent_config,
    latent_decode,
    latent_prefill,
    latent_prefill_block_m,
)
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
                 num_splits: int | None = None, latent_config: LatentConfig | None = None) -> None:
        """Configs None take each device's defaults; `num_splits` None lets the decode kernel choose."""
        self.decode_config = decode_config
        self.prefill_config = prefill_config
        self.latent_config = latent_config
        self.num_splits = num_splits
        # Every layer gets the same metadata object in one step: build the prefill work list
        # for the first layer and reuse it in the others (latent layers cut theirs into tiles of
        # another height, kept apart).
        self._tiles_for: AttentionMetadata | None = None
        self._tiles: torch.Tensor | None = None
        self._latent_tiles_for: tuple[AttentionMetadata, int] | None = None
        self._latent_tiles: torch.Tensor | None = None

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

    def forward_latent(self, q: torch.Tensor, rows: torch.Tensor, cache: torch.Tensor, meta: AttentionMetadata,
                       scale: float, v_dim: int) -> torch.Tensor:
        """The rows stored through the slot mapping, then the decodes through `latent_decode` and
        the prefills through one `latent_prefill` launch, both reading the rows in place."""
        if self.kv_format is not None and self.kv_format.quantized:
            raise ValueError(f"kv_cache_dtype {self.kv_format.name!r} is not read by latent attention layers; "
                             f"use kv_cache_dtype 'auto'")
        latent.write_rows(rows, cache, meta.slot_mapping)
        out = q.new_empty(q.shape[0], q.shape[1], v_dim)
        nd = meta.num_decodes
        cfg = self.latent_config or default_latent_config(q.device, v_dim)
        if nd:
            latent_decode(q[:nd], cache, meta.block_tables[:nd], meta.seq_lens_tensor[:nd], scale, v_dim,
                          out=out[:nd], num_splits=self.num_splits, config=cfg)
        if meta.num_seqs > nd:
            block_m = latent_prefill_block_m(q.shape[1], cfg)
            if self._latent_tiles_for is None or self._latent_tiles_for[0] is not meta \
                    or self._latent_tiles_for[1] != block_m:
                self._latent_tiles = prefill_tiles(list(range(nd, meta.num_seqs)), meta.query_lens[nd:],
                                                   meta.seq_lens[nd:], block_m, q.device)
                self._latent_tiles_for = (meta, block_m)
            latent_prefill(q[nd:], cache, meta.block_tables, self._latent_tiles, scale, v_dim, out=out[nd:],
                           config=cfg)
        return out

    def _prefill_tiles(self, meta: AttentionMetadata, cfg: KernelConfig, device: torch.device) -> torch.Tensor:
        if meta is not self._tiles_for:
            nd = meta.num_decodes
            self._tiles = prefill_tiles(list(range(nd, meta.num_seqs)), meta.query_lens[nd:], meta.seq_lens[nd:],
                                        cfg.block_m, device)
            self._tiles_for = meta
        return self._tiles

__all__ = ["TritonAttentionBackend"]
