"""Paged attention in plain torch: the CPU path and the reference for other backends."""
from __future__ import annotations

import torch
import torch.nn.functional as F

from pagellm.attention import latent
from pagellm.attention.backend import AttentionBackend, AttentionMetadata, AttentionOptions
from pagellm.kv_format import KVFormat, plain_rows
from pagellm.kernels import cpu


def write_kv(k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, slots: torch.Tensor,
             kv_format: KVFormat | None = None) -> None:
    """Store each new token's K/V in its slot (block_id * block_size + offset), in `kv_format`
    (None: as the cache's dtype)."""
    if cpu.kv_kernels_usable(k, k_cache, kv_format):
        cpu.store_kv(k, v, k_cache, v_cache, slots, kv_format)
        return
    for x, cache in ((k, k_cache), (v, v_cache)):
        rows = plain_rows(x, cache.dtype) if kv_format is None else kv_format.encode(x)
        if cache.is_contiguous():
            cache.view(-1, *cache.shape[2:]).index_copy_(0, slots, rows)
        else:  # a layer's view of a slot sized for larger layers (model_runner._allocate_mixed_shapes)
            bs = cache.shape[1]
            cache[slots // bs, slots % bs] = rows


def read_kv(rows: torch.Tensor, kv_format: KVFormat | None, dtype: torch.dtype) -> torch.Tensor:
    """Cached rows (from gather_kv or a block-table index) as values of `dtype`."""
    return rows.to(dtype) if kv_format is None else kv_format.decode(rows, dtype)


def stored_kv(cache: torch.Tensor, slots: torch.Tensor, kv_format: KVFormat | None, dtype: torch.dtype) -> torch.Tensor:
    """The rows write_kv just put at `slots`, as attention reads them: [T, KVH, D]."""
    bs = cache.shape[1]
    return read_kv(cache[slots // bs, slots % bs], kv_format, dtype)


def gather_kv(cache: torch.Tensor, block_table: torch.Tensor, length: int, start: int = 0) -> torch.Tensor:
    """Cached tokens start .. length - 1 of one sequence (`start` a multiple of the block size), as
    [length - start, KVH, D]. A sliding window starts past the blocks it no longer reads (the KV
    manager may have given them back)."""
    bs = cache.shape[1]
    nb = -(-length // bs)
    return cache[block_table[start // bs:nb]].flatten(0, 1)[:length - start]


# Batch-invariant mode cuts long contexts into runs of this many keys, at fixed positions.
INVARIANT_RUN = 256
# A prefill of at most this many query tokens over a cached context (a speculative verification of
# k drafts, a short follow-up turn) is attended token by token by the compiled kernel, reading the
# cache in place: gathering the whole context into a contiguous tensor for SDPA costs a copy of
# every cached key per layer, which for a handful of queries outweighs the product itself.
SHORT_QUERY_TOKENS = 16


class TorchAttentionBackend(AttentionBackend):
    """`compiled_decode`: read K/V in place with the compiled CPU kernel for decodes
    (None: whenever it is available and the cache is float32, bfloat16 or 8-bit on the CPU). False keeps
    the pure-torch path, the reference that every other path is tested against.

    `batch_invariant`: every query token, decode or prefill, goes through the compiled kernel on
    its own, reading its keys from the cache block by block from position 0, with long contexts
    cut at fixed positions; its sums are then the same whether it is decoded, prefilled whole,
    in a chunk, or recomputed after preemption, and whatever else is in the batch.
    (SDPA's prefill tiles by the prompt's length, and the decode kernel splits contexts by the
    batch's load: both change a token's sums with what runs beside it.)"""

    reads_8bit_kv = True

    def __init__(self, compiled_decode: bool | None = None, batch_invariant: bool = False) -> None:
        self.compiled_decode = compiled_decode
        self.batch_invariant = batch_invariant

    def _use_compiled(self, q: torch.Tensor, k_cache: torch.Tensor) -> bool:
        return self.compiled_decode is not False and cpu.kv_kernels_usable(q, k_cache, self.kv_format)

    def forward(self, q, k, v, k_cache, v_cache, meta: AttentionMetadata, scale: float,
                options: AttentionOptions | None = None, sinks: torch.Tensor | None = None) -> torch.Tensor:
        fmt = self.kv_format
        write_kv(k, v, k_cache, v_cache, meta.slot_mapping, fmt)
        if meta.num_seqs > meta.num_decodes and fmt is not None and (fmt.quantized or fmt.dtype != q.dtype):
            # Prompts attend to their own K/V as the cache holds them (see kv_format.py).
            k = stored_kv(k_cache, meta.slot_mapping, fmt, q.dtype)
            v = stored_kv(v_cache, meta.slot_mapping, fmt, q.dtype)
        if options is not None and options.plain:
            options = None
        if self.batch_invariant:
            token_seq, key_lens = meta.query_token_keys()
            return cpu.paged_attention(q, k_cache, v_cache, meta.block_tables, key_lens, scale,
                                       options.sliding_window if options else None,
                                       options.softcap if options else None, sinks, token_seq, INVARIANT_RUN, fmt,
                                       options.attention_chunk if options else None)
        nd = meta.num_decodes
        compiled = self._use_compiled(q, k_cache)
        if compiled and nd == meta.num_seqs:  # decodes only: the kernel's output is the step's, no copy
            return self._compiled_decode(q, k_cache, v_cache, meta, scale, options, sinks, fmt)
        short = {i for i in range(nd, meta.num_seqs) if self._short_query(meta, i)} if compiled else set()
        if short and len(short) == meta.num_seqs - nd:  # decodes and short prefills: one kernel call, token by token
            return self._compiled_tokens(q, k_cache, v_cache, meta, scale, options, sinks, fmt)
        out = torch.empty_like(q)
        if nd:
            if compiled:
                out[:nd] = self._compiled_decode(q[:nd], k_cache, v_cache, meta, scale, options, sinks, fmt)
            else:
                out[:nd] = self._decode(q[:nd], k_cache, v_cache, meta, scale, options, sinks, fmt)
        start = nd
        for i in range(nd, meta.num_seqs):
            ql, ctx = meta.query_lens[i], meta.seq_lens[i]
            end = start + ql
            if i in short:
                out[start:end] = self._compiled_tokens(q, k_cache, v_cache, meta, scale, options, sinks, fmt,
                                                       slice(start, end))
            else:
                out[start:end] = self._prefill(q[start:end], k[start:end], v[start:end], k_cache, v_cache,
                                               meta.block_tables[i], ctx, scale, options, sinks, fmt)
            start = end
        return out

    @staticmethod
    def _short_query(meta: AttentionMetadata, i: int) -> bool:
        """Whether sequence i's queries go to the compiled kernel token by token: few, over a cached context."""
        ql = meta.query_lens[i]
        return ql <= SHORT_QUERY_TOKENS and meta.seq_lens[i] > ql

    @staticmethod
    def _compiled_tokens(q, k_cache, v_cache, meta: AttentionMetadata, scale: float,
                         options: AttentionOptions | None, sinks: torch.Tensor | None,
                         kv_format: KVFormat | None, tokens: slice = slice(None)) -> torch.Tensor:
        """The step's query `tokens` (all by default) read in place by the compiled kernel: token t
        attends to the first key_lens[t] keys of its sequence's table."""
        token_seq, key_lens = meta.query_token_keys()
        return cpu.paged_attention(q[tokens], k_cache, v_cache, meta.block_tables, key_lens[tokens], scale,
                                   options.sliding_window if options else None,
                                   options.softcap if options else None, sinks, token_seq[tokens], kv_format=kv_format,
                                   attention_chunk=options.attention_chunk if options else None)

    def decode_from_qkv(self, qkv, num_heads, num_kv_heads, rope, k_cache, v_cache, meta: AttentionMetadata,
                        options: AttentionOptions, sinks: torch.Tensor | None = None,
                        qk_norm: tuple[torch.Tensor, torch.Tensor, float, bool] | None = None) -> torch.Tensor | None:
        # The compiled kernels in one call (cpu.decode_attention_qkv): on a short decode step the
        # Python-level splitting, views and checks around them cost more than attending. A step whose
        # sequences each bring a few tokens over their cached context (a speculative verification's)
        # takes it too, token by token, as forward's _compiled_tokens attends them.
        if (self.batch_invariant or meta.num_seqs == 0
                or (rope is not None and rope[0].shape[-1] * (num_heads + 2 * num_kv_heads) != qkv.shape[-1])
                or not self._use_compiled(qkv, k_cache)):
            return None
        token_seq, lens = None, meta.seq_lens_tensor
        if meta.num_decodes != meta.num_seqs:
            if not all(self._short_query(meta, i) for i in range(meta.num_decodes, meta.num_seqs)):
                return None
            token_seq, lens = meta.query_token_keys()
        return cpu.decode_attention_qkv(qkv, num_heads, num_kv_heads, rope, k_cache, v_cache, meta.slot_mapping,
                                        meta.block_tables, lens, options.scale,
                                        options.sliding_window, options.softcap, sinks, self.kv_format, qk_norm=qk_norm,
                                        attention_chunk=options.attention_chunk, token_seq=token_seq)

    def decode_call(self, num_heads, num_kv_heads, options: AttentionOptions, sinks, qk_norm, qkv,
                    k_cache) -> cpu.DecodeAttention | None:
        if self.batch_invariant or not self._use_compiled(qkv, k_cache):
            return None
        return cpu.DecodeAttention(num_heads, num_kv_heads, options.scale, options.sliding_window, options.softcap,
                                   sinks, self.kv_format, qk_norm, options.attention_chunk)

    def forward_latent(self, q: torch.Tensor, rows: torch.Tensor, cache: torch.Tensor, meta: AttentionMetadata,
                       scale: float, v_dim: int) -> torch.Tensor:
        """Decodes through the compiled kernel, reading the latent rows in place: a latent row is
        one KV head whose value is its own first v_dim features, so the kernel gets the cache as
        both K and V and its output's last R - v_dim features (the rows' rotary part) are dropped.
        Batch-invariant mode sends every token that way; prefills otherwise go through torch."""
        if not self._use_compiled(q, cache) or (meta.num_decodes == 0 and not self.batch_invariant):
            return super().forward_latent(q, rows, cache, meta, scale, v_dim)
        latent.write_rows(rows, cache, meta.slot_mapping)
        if self.batch_invariant:
            token_seq, key_lens = meta.query_token_keys()
            return cpu.paged_attention(q, cache, cache, meta.block_tables, key_lens, scale, token_seq=token_seq,
                                       fixed_run=INVARIANT_RUN, kv_format=self.kv_format)[..., :v_dim]
        nd = meta.num_decodes
        decoded = cpu.paged_attention(q[:nd], cache, cache, meta.block_tables[:nd], meta.seq_lens_tensor[:nd], scale,
                                      kv_format=self.kv_format)[..., :v_dim]
        if nd == meta.num_seqs:
            return decoded
        out = q.new_empty(q.shape[0], q.shape[1], v_dim)
        out[:nd] = decoded
        latent.prefill_latent(q, rows, cache, meta, scale, out)
        return out

    @staticmethod
    def _compiled_decode(q, k_cache, v_cache, meta: AttentionMetadata, scale: float,
                         options: AttentionOptions | None, sinks: torch.Tensor | None,
                         kv_format: KVFormat | None) -> torch.Tensor:
        """The first len(q) sequences' decode tokens, read in place by the compiled kernel."""
        nd = q.shape[0]
        return cpu.paged_attention(q, k_cache, v_cache, meta.block_tables[:nd], meta.seq_lens_tensor[:nd], scale,
                                   options.sliding_window if options else None,
                                   options.softcap if options else None, sinks, kv_format=kv_format,
                                   attention_chunk=options.attention_chunk if options else None)

    @staticmethod
    def _decode(q, k_cache, v_cache, meta: AttentionMetadata, scale: float, options: AttentionOptions | None = None,
                sinks: torch.Tensor | None = None, kv_format: KVFormat | None = None) -> torch.Tensor:
        """One query token per sequence, all sequences in one batched product."""
        nd = meta.num_decodes
        bs = meta.block_size
        max_len = max(meta.seq_lens[:nd])
        nb = -(-max_len // bs)
        tables = meta.block_tables[:nd, :nb]
        kvh, d = k_cache.shape[2], q.shape[2]
        # [B, KVH, L, D]; padding slots hold finite values (the cache starts zeroed).
        keys = read_kv(k_cache[tables], kv_format, q.dtype).view(nd, nb * bs, kvh, d).transpose(1, 2)
        vals = read_kv(v_cache[tables], kv_format, q.dtype).view(nd, nb * bs, kvh, d).transpose(1, 2)
        h = q.shape[1]
        # The G query heads that share a KV head ride in the "query length" dimension,
        # so each K/V block is read once per KV head rather than once per query head.
        qg = q.view(nd, kvh, h // kvh, d)
        kpos = torch.arange(nb * bs, device=q.device)[None, :]
        lens = meta.seq_lens_tensor[:nd, None]
        mask = kpos < lens if options is None else options.visible(lens - 1, kpos)
        if (options is not None and options.softcap) or sinks is not None:
            # [B, KVH, G, 1, D] against [B, KVH, 1, L, D]: every query head of a group reads its KV head.
            o = attend(qg.unsqueeze(3), keys.unsqueeze(2), vals.unsqueeze(2), mask[:, None, None, None, :], scale,
                       options.softcap if options else None,
                       None if sinks is None else sinks.view(1, kvh, h // kvh, 1, 1))
            return o.reshape(nd, h, d)
        o = F.scaled_dot_product_attention(qg, keys, vals, attn_mask=mask[:, None, None, :], scale=scale)
        return o.reshape(nd, h, d)

    @staticmethod
    def _prefill(q, k, v, k_cache, v_cache, block_table, ctx: int, scale: float,
                 options: AttentionOptions | None = None, sinks: torch.Tensor | None = None,
                 kv_format: KVFormat | None = None) -> torch.Tensor:
        ql = q.shape[0]
        qh = q.transpose(0, 1).unsqueeze(0)  # [1, H, ql, D]
        if options is not None or sinks is not None:
            # With a window or chunks, read from the block holding the first query's first visible key.
            first = 0
            if options is not None and ctx != ql:
                q0, window, chunk = ctx - ql, options.sliding_window, options.attention_chunk
                first_visible = max(0, q0 - window + 1 if window else 0, q0 // chunk * chunk if chunk else 0)
                first = first_visible // k_cache.shape[1] * k_cache.shape[1]
            keys = k if ctx == ql else read_kv(gather_kv(k_cache, block_table, ctx, first), kv_format, q.dtype)
            vals = v if ctx == ql else read_kv(gather_kv(v_cache, block_table, ctx, first), kv_format, q.dtype)
            h, kvh = q.shape[1], keys.shape[1]
            qpos = torch.arange(ctx - ql, ctx, device=q.device)[:, None]
            kpos = torch.arange(first, ctx, device=q.device)[None, :]
            mask = kpos <= qpos if options is None else options.visible(qpos, kpos)
            # [KVH, G, ql, D] against [KVH, 1, ctx, D].
            o = attend(q.transpose(0, 1).reshape(kvh, h // kvh, ql, -1), keys.transpose(0, 1).unsqueeze(1),
                       vals.transpose(0, 1).unsqueeze(1), mask, scale, options.softcap if options else None,
                       None if sinks is None else sinks.view(kvh, h // kvh, 1, 1))
            return o.reshape(h, ql, -1).transpose(0, 1)
        if ctx == ql:
            # A fresh prompt: its K/V are all in this step, no need to read the cache.
            kh, vh = k.transpose(0, 1).unsqueeze(0), v.transpose(0, 1).unsqueeze(0)
            o = F.scaled_dot_product_attention(qh, kh, vh, is_causal=True, scale=scale, enable_gqa=True)
        else:
            # Part of the context is already cached (a later chunk, a cached prefix).
            kh = read_kv(gather_kv(k_cache, block_table, ctx), kv_format, q.dtype).transpose(0, 1).unsqueeze(0)
            vh = read_kv(gather_kv(v_cache, block_table, ctx), kv_format, q.dtype).transpose(0, 1).unsqueeze(0)
            qpos = torch.arange(ctx - ql, ctx, device=q.device)
            mask = torch.arange(ctx, device=q.device)[None, :] <= qpos[:, None]
            o = F.scaled_dot_product_attention(qh, kh, vh, attn_mask=mask, scale=scale, enable_gqa=True)
        return o.squeeze(0).transpose(0, 1)


def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor, scale: float,
           softcap: float | None, sinks: torch.Tensor | None) -> torch.Tensor:
    """Softmax attention written out, for what scaled_dot_product_attention cannot do: scores
    soft-capped (c * tanh(s / c)) before the mask, and sink logits in each denominator.
    Shapes broadcast: q [..., Lq, D], k and v [..., L, D], mask [..., Lq, L], sinks [..., 1, 1]."""
    s = torch.matmul(q, k.transpose(-1, -2)) * scale
    if softcap:
        s = torch.tanh(s / softcap) * softcap
    s = s.masked_fill(~mask, float("-inf"))
    if sinks is None:
        return torch.matmul(s.softmax(-1), v)
    s = torch.cat([s, sinks.to(s.dtype).expand(*s.shape[:-1], 1)], dim=-1)
    p = (s - s.amax(-1, keepdim=True)).softmax(-1)[..., :-1]
    return torch.matmul(p, v)
