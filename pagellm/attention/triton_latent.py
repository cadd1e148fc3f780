"""Triton kernels for multi-head latent attention (layers/mla.py) over paged latent rows: the GPU
path of attention/latent.py.

A latent layer caches one row per token, [c_kv (LORA features), k_rope (ROPE features)], shared by
every head: the key of every head is the whole row and its value the row's c_kv part. The
queries arrive absorbed ([T, H, LORA + ROPE]), so each score is q_nope . c_kv + q_rope . k_rope and
the output stays latent ([T, H, LORA]). The kernels read the rows in place through the block
tables; no per-head K or V is ever formed, and each tile of rows is loaded once for both products
(as the key's c_kv part and as the value) and serves a whole block of heads: every head reads the
same rows, so the heads are the rows of the query matrix, as a GQA group is in the per-head
kernels (triton_kernels.py), here with one "KV head" for all of them.

- `latent_decode`: one query token per sequence; a program takes one (sequence, block of BLOCK_H
  heads, split). Long contexts are split over several programs (flash-decoding) whose partial
  outputs triton_kernels' `_combine_kernel` merges. Tensors and shapes only, no host lengths.
- `latent_prefill`: prompts, chunks of prompts and prompts with a cached prefix, in one launch,
  causal with the offset `context - query_len`; a program takes BLOCK_M query tokens times
  BLOCK_H heads as the rows of one matrix (work list: triton_kernels.prefill_tiles).

c_kv and k_rope are loaded as two tiles, each padded to a power of two on its own (512 + 64 stays
512 + 64 rather than one tile of 1024). Softmax in the log2 domain, accumulated in fp32, as in
triton_kernels.py. 8-bit caches are not read here: the model runner refuses them for latent layers.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from pagellm.attention.triton_kernels import (
    _LOG2E,
    _check_last_dim_contiguous,
    _combine_kernel,
    _num_sms,
    _precision,
    _store_split_output,
    choose_num_splits,
    dot_pad,
    split_buffers,
)


@dataclass(frozen=True)
class LatentConfig:
    """Tile sizes and launch shape of a latent kernel. `block_h` heads (decode) or `rows` =
    query tokens x heads (prefill) make the query matrix; `block_n` rows of the cache per tile."""

    block_n: int
    block_h: int = 16
    rows: int = 32
    num_warps: int = 4
    num_stages: int = 2


def default_latent_config(device: torch.device, lora: int) -> LatentConfig:
    if device.type != "cuda":
        return LatentConfig(block_n=16, block_h=16, rows=16)  # the interpreter: small tiles, few programs
    # A tile of c_kv is block_n x LORA 16-bit values, loaded once for both products, and each program
    # keeps a rows x LORA float32 accumulator: wide rows (DeepSeek's 512) take the shorter tile. A first
    # choice that compiles for sm_90 (tests/attention/compile_for_hopper.py), not yet timed on a GPU.
    return LatentConfig(block_n=32 if lora > 256 else 64)


@triton.jit
def _latent_tile(q_nope, q_rope, cache_ptr, table, pos, valid, keep, m_i, l_i, acc, block_size, stride_cb, stride_cs,
                 qk_scale, LORA: tl.constexpr, LORA_PAD: tl.constexpr, ROPE: tl.constexpr, ROPE_PAD: tl.constexpr,
                 PRECISION: tl.constexpr):
    """One online-softmax step (base 2) over the rows at positions `pos` [BLOCK_N] of one sequence
    (block table `table`), scores where `keep` [rows, BLOCK_N] is false masked out. Every row of
    the query matrix has some kept key in the first tile it reads (position 0 for a prefill, the
    split's first position for a decode), so the running max is finite from then on."""
    block = tl.load(table + pos // block_size, mask=valid, other=0).to(tl.int64)
    row = block * stride_cb + (pos % block_size).to(tl.int64) * stride_cs
    lc = tl.arange(0, LORA_PAD)
    rc = tl.arange(0, ROPE_PAD)
    c = tl.load(cache_ptr + row[:, None] + lc[None, :], mask=valid[:, None] & (lc < LORA)[None, :], other=0.0)
    kr = tl.load(cache_ptr + row[:, None] + LORA + rc[None, :], mask=valid[:, None] & (rc < ROPE)[None, :],
                 other=0.0)
    s = tl.dot(q_nope, tl.trans(c), input_precision=PRECISION)
    s = (s + tl.dot(q_rope, tl.trans(kr), input_precision=PRECISION)) * qk_scale
    s = tl.where(keep, s, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(s, axis=1))
    alpha = tl.exp2(m_i - m_new)
    p = tl.exp2(s - m_new[:, None])
    l_i = l_i * alpha + tl.sum(p, axis=1)
    acc = acc * alpha[:, None] + tl.dot(p.to(c.dtype), c, input_precision=PRECISION)
    return m_new, l_i, acc


@triton.jit
def _latent_decode_kernel(
    q_ptr, cache_ptr, block_tables_ptr, seq_lens_ptr, out_ptr, part_out_ptr, part_lse_ptr,
    qk_scale, num_heads, num_splits, block_size,
    stride_qt, stride_qh,
    stride_cb, stride_cs,
    stride_bt,
    stride_ot, stride_oh,
    stride_ps, stride_ph, stride_pk,
    stride_ls, stride_lh,
    LORA: tl.constexpr, LORA_PAD: tl.constexpr, ROPE: tl.constexpr, ROPE_PAD: tl.constexpr,
    BLOCK_H: tl.constexpr, BLOCK_N: tl.constexpr, DIRECT: tl.constexpr, PRECISION: tl.constexpr,
):
    seq = tl.program_id(0)
    head = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    split = tl.program_id(2)
    seq_len = tl.load(seq_lens_ptr + seq).to(tl.int32)
    # Each sequence is cut into num_splits runs of whole tiles by its own length (as the per-head
    # decode kernel does); an empty run (seq_len 0, or fewer tiles than splits) reports lse -inf.
    tiles_per_split = tl.cdiv(tl.cdiv(seq_len, BLOCK_N), num_splits)
    lo = split * tiles_per_split * BLOCK_N
    hi = tl.minimum(lo + tiles_per_split * BLOCK_N, seq_len)
    h_mask = head < num_heads
    lc = tl.arange(0, LORA_PAD)
    rc = tl.arange(0, ROPE_PAD)
    q_row = q_ptr + seq.to(tl.int64) * stride_qt + head[:, None] * stride_qh
    q_nope = tl.load(q_row + lc[None, :], mask=h_mask[:, None] & (lc < LORA)[None, :], other=0.0)
    q_rope = tl.load(q_row + LORA + rc[None, :], mask=h_mask[:, None] & (rc < ROPE)[None, :], other=0.0)

    m_i = tl.full([BLOCK_H], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_H], tl.float32)
    acc = tl.zeros([BLOCK_H, LORA_PAD], tl.float32)
    table = block_tables_ptr + seq.to(tl.int64) * stride_bt
    n = tl.arange(0, BLOCK_N)
    for start in range(lo, hi, BLOCK_N):
        pos = start + n
        valid = pos < hi
        m_i, l_i, acc = _latent_tile(q_nope, q_rope, cache_ptr, table, pos, valid, valid[None, :], m_i, l_i, acc,
                                     block_size, stride_cb, stride_cs, qk_scale, LORA, LORA_PAD, ROPE, ROPE_PAD,
                                     PRECISION)

    has = l_i > 0
    l_safe = tl.where(has, l_i, 1.0)
    o = acc / l_safe[:, None]
    _store_split_output(o, m_i, l_safe, has, out_ptr, part_out_ptr, part_lse_ptr, seq, split, head, lc,
                        h_mask[:, None] & (lc < LORA)[None, :], h_mask, stride_ot, stride_oh, stride_ps, stride_ph,
                        stride_pk, stride_ls, stride_lh, DIRECT)


@triton.jit
def _latent_prefill_kernel(
    q_ptr, cache_ptr, block_tables_ptr, tiles_ptr, out_ptr,
    qk_scale, num_heads, block_size,
    stride_qt, stride_qh,
    stride_cb, stride_cs,
    stride_bt,
    stride_ot, stride_oh,
    LORA: tl.constexpr, LORA_PAD: tl.constexpr, ROPE: tl.constexpr, ROPE_PAD: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_N: tl.constexpr, PRECISION: tl.constexpr,
):
    tile = tiles_ptr + tl.program_id(0) * 5  # triton_kernels._TILE_FIELDS
    bt_row = tl.load(tile).to(tl.int64)
    q_first = tl.load(tile + 1)
    q_len = tl.load(tile + 2)
    seq_len = tl.load(tile + 3)
    m_start = tl.load(tile + 4)
    # The query matrix's rows: BLOCK_M tokens of the sequence, each with BLOCK_H heads.
    r = tl.arange(0, BLOCK_M * BLOCK_H)
    within = m_start + r // BLOCK_H
    head = tl.program_id(1) * BLOCK_H + r % BLOCK_H
    r_mask = (within < q_len) & (head < num_heads)
    prefix = seq_len - q_len  # positions before this step's tokens: a cached prefix or earlier chunks
    q_pos = prefix + within
    tok = (q_first + within).to(tl.int64)
    lc = tl.arange(0, LORA_PAD)
    rc = tl.arange(0, ROPE_PAD)
    q_row = q_ptr + tok[:, None] * stride_qt + head[:, None] * stride_qh
    q_nope = tl.load(q_row + lc[None, :], mask=r_mask[:, None] & (lc < LORA)[None, :], other=0.0)
    q_rope = tl.load(q_row + LORA + rc[None, :], mask=r_mask[:, None] & (rc < ROPE)[None, :], other=0.0)

    m_i = tl.full([BLOCK_M * BLOCK_H], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M * BLOCK_H], tl.float32)
    acc = tl.zeros([BLOCK_M * BLOCK_H, LORA_PAD], tl.float32)
    table = block_tables_ptr + bt_row * stride_bt
    n = tl.arange(0, BLOCK_N)
    # Causal: no row of this tile sees past its last token's position.
    hi = tl.minimum(seq_len, prefix + m_start + BLOCK_M)
    for start in range(0, hi, BLOCK_N):
        pos = start + n
        valid = pos < hi
        keep = valid[None, :] & (pos[None, :] <= q_pos[:, None])
        m_i, l_i, acc = _latent_tile(q_nope, q_rope, cache_ptr, table, pos, valid, keep, m_i, l_i, acc, block_size,
                                     stride_cb, stride_cs, qk_scale, LORA, LORA_PAD, ROPE, ROPE_PAD, PRECISION)

    o = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]
    tl.store(out_ptr + tok[:, None] * stride_ot + head[:, None] * stride_oh + lc[None, :],
             o.to(out_ptr.dtype.element_ty), mask=r_mask[:, None] & (lc < LORA)[None, :])


def _check(q: torch.Tensor, cache: torch.Tensor, v_dim: int) -> int:
    """The rotary features per row (R - v_dim), after checking the shapes agree."""
    if cache.dim() != 4 or cache.shape[2] != 1:
        raise ValueError(f"a latent cache is [num_blocks, block_size, 1, row], got shape {tuple(cache.shape)}")
    row = cache.shape[3]
    if q.shape[-1] != row or not 0 < v_dim <= row:
        raise ValueError(f"absorbed queries of {q.shape[-1]} features and v_dim {v_dim} do not fit latent rows of "
                         f"{row} features")
    if cache.dtype != q.dtype:
        raise ValueError(f"the latent cache ({cache.dtype}) must hold the queries' dtype ({q.dtype}): 8-bit "
                         f"formats are not read by latent layers")
    _check_last_dim_contiguous(q=q, cache=cache)
    return row - v_dim


def latent_heads_block(num_heads: int, cfg: LatentConfig) -> int:
    """Heads per program: a power of two, at most cfg.block_h and cfg.rows (fewer when the layer has fewer)."""
    return min(cfg.block_h, cfg.rows, triton.next_power_of_2(num_heads))


def latent_decode(q: torch.Tensor, cache: torch.Tensor, block_tables: torch.Tensor, seq_lens: torch.Tensor,
                  scale: float, v_dim: int, out: torch.Tensor | None = None, num_splits: int | None = None,
                  config: LatentConfig | None = None) -> torch.Tensor:
    """Latent attention of one absorbed query token per sequence over its paged rows.

    q: [B, H, R]; cache: [num_blocks, block_size, 1, R]; block_tables: [B, W]; seq_lens: [B]
    (context length including the token just stored; 0 gives a zero output). Writes `out`
    [B, H, v_dim] (may be a strided view) and returns it. `num_splits` None picks from the shapes."""
    b, h, _ = q.shape
    rope = _check(q, cache, v_dim)
    if out is None:
        out = q.new_empty(b, h, v_dim)
    if b == 0:
        return out
    block_size = cache.shape[1]
    cfg = config or default_latent_config(q.device, v_dim)
    block_h = max(16, latent_heads_block(h, cfg))  # the rows of tl.dot: 16 at least on a GPU
    head_blocks = triton.cdiv(h, block_h)
    if num_splits is None:
        num_splits = choose_num_splits(b, head_blocks, block_tables.shape[1] * block_size, _num_sms(q.device))
    lora_pad = triton.next_power_of_2(v_dim)
    direct = num_splits == 1
    part_out, part_lse, part_strides = split_buffers(out, b, h, num_splits, v_dim)
    _latent_decode_kernel[(b, head_blocks, num_splits)](
        q, cache, block_tables, seq_lens, out, part_out, part_lse,
        scale * _LOG2E, h, num_splits, block_size,
        q.stride(0), q.stride(1),
        cache.stride(0), cache.stride(1),
        block_tables.stride(0),
        out.stride(0), out.stride(1),
        *part_strides,
        LORA=v_dim, LORA_PAD=dot_pad(v_dim), ROPE=rope, ROPE_PAD=dot_pad(rope),
        BLOCK_H=block_h, BLOCK_N=cfg.block_n, DIRECT=direct, PRECISION=_precision(q.dtype),
        num_warps=cfg.num_warps, num_stages=cfg.num_stages,
    )
    if not direct:
        _combine_kernel[(b, h)](
            part_out, part_lse, out, out, num_splits,
            *part_strides,
            out.stride(0), out.stride(1),
            HEAD_DIM=v_dim, DIM_PAD=lora_pad, SPLITS_PAD=triton.next_power_of_2(num_splits), HAS_SINKS=False,
            num_warps=4,
        )
    return out


def latent_prefill_block_m(num_heads: int, cfg: LatentConfig) -> int:
    """Query tokens per prefill program (the `block_m` its work list, prefill_tiles, is cut by)."""
    return max(1, cfg.rows // latent_heads_block(num_heads, cfg))


def latent_prefill(q: torch.Tensor, cache: torch.Tensor, block_tables: torch.Tensor, tiles: torch.Tensor,
                   scale: float, v_dim: int, out: torch.Tensor | None = None,
                   config: LatentConfig | None = None) -> torch.Tensor:
    """Causal latent attention of the prefill tokens q [T, H, R] over their paged rows.

    `tiles` comes from triton_kernels.prefill_tiles with block_m = latent_prefill_block_m(H, config);
    every query token's row must already be in the cache. Writes `out` [T, H, v_dim] and returns it."""
    _, h, _ = q.shape
    rope = _check(q, cache, v_dim)
    if out is None:
        out = q.new_empty(q.shape[0], h, v_dim)
    if tiles.shape[0] == 0:
        return out
    cfg = config or default_latent_config(q.device, v_dim)
    block_h = latent_heads_block(h, cfg)
    _latent_prefill_kernel[(tiles.shape[0], triton.cdiv(h, block_h))](
        q, cache, block_tables, tiles, out,
        scale * _LOG2E, h, cache.shape[1],
        q.stride(0), q.stride(1),
        cache.stride(0), cache.stride(1),
        block_tables.stride(0),
        out.stride(0), out.stride(1),
        LORA=v_dim, LORA_PAD=dot_pad(v_dim), ROPE=rope, ROPE_PAD=dot_pad(rope),
        BLOCK_M=latent_prefill_block_m(h, cfg), BLOCK_H=block_h, BLOCK_N=cfg.block_n,
        PRECISION=_precision(q.dtype), num_warps=cfg.num_warps, num_stages=cfg.num_stages,
    )
    return out


__all__ = ["LatentConfig", "default_latent_config", "latent_decode", "latent_prefill", "latent_prefill_block_m"]
