"""Latent attention over paged rows, in plain torch: the reference for multi-head latent
attention (layers/mla.py) on every device.

A latent layer caches one row per token, [c_kv (kv_lora_rank), k_rope (qk_rope_head_dim)],
shared by every head: one KV head whose key is the whole row and whose value is the row's
first `v_dim` features (c_kv). Queries arrive absorbed (each head's q_nope multiplied into the
layer's W_UK, beside its rotated q_rope), so the scores are taken against the rows as they
are cached and the output stays latent ([T, H, kv_lora_rank]) until the layer multiplies it
by W_UV: per-head K/V are never materialised.
"""
from __future__ import annotations

from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from pagellm.attention.backend import AttentionMetadata


def write_rows(rows: torch.Tensor, cache: torch.Tensor, slots: torch.Tensor) -> None:
    """Store this step's rows [T, R] in their slots of cache [blocks, block_size, 1, R]."""
    cache.view(-1, cache.shape[-1]).index_copy_(0, slots, rows.to(cache.dtype))


def latent_attention(q: torch.Tensor, rows: torch.Tensor, cache: torch.Tensor, meta: AttentionMetadata,
                     scale: float, v_dim: int) -> torch.Tensor:
    """q: [T, H, R] absorbed queries; rows: [T, R] this step's rows (written first) -> [T, H, v_dim],
    each query's softmax over its sequence's rows (causal) applied to their first v_dim features."""
    write_rows(rows, cache, meta.slot_mapping)
    flat = cache.flatten(0, 2)  # [slots, R]
    out = q.new_empty(q.shape[0], q.shape[1], v_dim)
    nd, bs = meta.num_decodes, meta.block_size
    if nd:
        # Every decode in one product: rows gathered through the block tables, padding masked.
        nb = -(-max(meta.seq_lens[:nd]) // bs)
        keys = cache[meta.block_tables[:nd, :nb]].reshape(nd, nb * bs, -1).to(q.dtype)  # [B, L, R]
        s = torch.matmul(q[:nd], keys.transpose(1, 2)) * scale  # [B, H, L]
        mask = torch.arange(nb * bs, device=q.device)[None, :] < meta.seq_lens_tensor[:nd, None]
        p = s.masked_fill(~mask[:, None, :], float("-inf")).softmax(-1, dtype=torch.float32).to(q.dtype)
        out[:nd] = torch.matmul(p, keys[..., :v_dim])
    start = nd
    for i in range(nd, meta.num_seqs):
        ql, ctx = meta.query_lens[i], meta.seq_lens[i]
        end = start + ql
        if ctx == ql:  # a fresh prompt: its rows are this step's
            keys = rows[start:end].to(q.dtype)
        else:  # a later chunk or a cached prefix: the sequence's rows through its block table
            table = meta.block_tables[i, :-(-ctx // bs)]
            keys = flat.view(-1, bs, flat.shape[-1])[table].flatten(0, 1)[:ctx].to(q.dtype)
        s = torch.matmul(q[start:end].transpose(0, 1), keys.T) * scale  # [H, ql, ctx]
        qpos = torch.arange(ctx - ql, ctx, device=q.device)[:, None]
        mask = torch.arange(ctx, device=q.device)[None, :] <= qpos
        p = s.masked_fill(~mask, float("-inf")).softmax(-1, dtype=torch.float32).to(q.dtype)
        out[start:end] = torch.matmul(p, keys[:, :v_dim]).transpose(0, 1)
        start = end
    return out
