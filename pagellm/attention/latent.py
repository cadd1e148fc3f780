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

from pagellm.kv_format import plain_rows

if TYPE_CHECKING:
    from pagellm.attention.metadata import AttentionMetadata


def write_rows(rows: torch.Tensor, cache: torch.Tensor, slots: torch.Tensor) -> None:
    """Store this step's rows [T, R] in their slots of cache [blocks, block_size, 1, R]."""
    cache.view(-1, cache.shape[-1]).index_copy_(0, slots, plain_rows(rows, cache.dtype))


def latent_attention(q: torch.Tensor, rows: torch.Tensor, cache: torch.Tensor, meta: AttentionMetadata,
                     scale: float, v_dim: int) -> torch.Tensor:
    """q: [T, H, R] absorbed queries; rows: [T, R] this step's rows (written first) -> [T, H, v_dim],
    each query's softmax over its sequence's rows (causal) applied to their first v_dim features."""
    write_rows(rows, cache, meta.slot_mapping)
    out = q.new_empty(q.shape[0], q.shape[1], v_dim)
    if meta.num_decodes:
        out[:meta.num_decodes] = decode_latent(q[:meta.num_decodes], cache, meta, scale, v_dim)
    prefill_latent(q, rows, cache, meta, scale, out)
    return out


def decode_latent(q: torch.Tensor, cache: torch.Tensor, meta: AttentionMetadata, scale: float,
                  v_dim: int) -> torch.Tensor:
    """The first len(q) sequences' decode tokens, all in one product: rows gathered through the
    block tables, padding masked."""
    nd, bs = q.shape[0], meta.block_size
    nb = -(-max(meta.seq_lens[:nd]) // bs)
    keys = cache[meta.block_tables[:nd, :nb]].reshape(nd, nb * bs, -1).to(q.dtype)  # [B, L, R]
    s = torch.matmul(q, keys.transpose(1, 2)) * scale  # [B, H, L]
    mask = torch.arange(nb * bs, device=q.device)[None, :] < meta.seq_lens_tensor[:nd, None]
    p = s.masked_fill(~mask[:, None, :], float("-inf")).softmax(-1, dtype=torch.float32).to(q.dtype)
    return torch.matmul(p, keys[..., :v_dim])


def prefill_latent(q: torch.Tensor, rows: torch.Tensor, cache: torch.Tensor, meta: AttentionMetadata,
                   scale: float, out: torch.Tensor) -> None:
    """Fill `out`'s rows of the step's prefills (the sequences after the decodes), each over its
    own rows: this step's for a fresh prompt, else the sequence's through its block table."""
    bs, v_dim = meta.block_size, out.shape[-1]
    start = meta.num_decodes
    for i in range(meta.num_decodes, meta.num_seqs):
        ql, ctx = meta.query_lens[i], meta.seq_lens[i]
        end = start + ql
        if ctx == ql and cache.dtype == q.dtype:
            keys = rows[start:end]
        elif ctx == ql:  # a narrower cache: prompts attend to their rows as the cache holds them
            keys = cache.flatten(0, 2)[meta.slot_mapping[start:end]].to(q.dtype)
        else:
            keys = cache[meta.block_tables[i, :-(-ctx // bs)]].flatten(0, 2)[:ctx].to(q.dtype)
        s = torch.matmul(q[start:end].transpose(0, 1), keys.T) * scale  # [H, ql, ctx]
        qpos = torch.arange(ctx - ql, ctx, device=q.device)[:, None]
        mask = torch.arange(ctx, device=q.device)[None, :] <= qpos
        p = s.masked_fill(~mask, float("-inf")).softmax(-1, dtype=torch.float32).to(q.dtype)
        out[start:end] = torch.matmul(p, keys[:, :v_dim]).transpose(0, 1)
        start = end
