"""Triton kernels for paged attention and the thin launchers around them.

Owns three jobs over the paged KV pool:

- `store_kv`: write this step's new K/V into their slots (slot = block * block_size + offset);
  a negative slot is skipped, which is how padded rows of a CUDA-graph batch write nothing.
- `paged_decode`: one query token per sequence. A program takes one (sequence, KV head, split)
  and every query head that shares that KV head (GQA), so each K/V tile is read once per KV
  head. Long contexts are split over several programs (flash-decoding); each writes a partial
  output and its log-sum-exp, and `_combine_kernel` merges them. The decode path reads only
  tensors and shapes, never Python lists of lengths, so it can be captured in a CUDA graph.
- `paged_prefill`: prompts, chunks of prompts, and prompts whose prefix is already cached, in
  one launch for the whole batch, all K/V read through the block table with the causal offset
  `context - query_len`. One kernel for the three cases, rather than torch SDPA for fresh
  prompts plus a paged kernel for the cached part: SDPA would need one call per sequence
  (ragged lengths) and a gather of any cached prefix into contiguous memory first, while the
  paged kernel reads the new tokens straight back from the pool, where `store_kv` has just
  put them (still in L2).

Both attention kernels also take a layer's options, as in Hugging Face: a sliding window W (a
query at position i sees keys i - W < j <= i), an attention chunk C (Llama 4: it sees keys j <= i
with j // C == i // C), a logit soft-cap c (each scaled score s becomes
c * tanh(s / c)) and sinks (one logit per query head that joins each softmax's denominator and
attends to nothing, gpt-oss). Each comes with a constexpr flag (HAS_WINDOW, HAS_CHUNK, HAS_SOFTCAP,
HAS_SINKS), so a plain layer compiles to exactly the plain kernel. With a window or a chunk, decode
and prefill skip the tiles wholly before the first visible key. In split-K decode the sink joins the softmax once, in
`_combine_kernel` (or at the end of the decode kernel when there is a single split).

Every cache is [num_blocks, block_size, num_kv_heads, head_dim] (the backend's default
`kv_cache_shape`) with the last dimension contiguous. Softmax runs in the log2 domain
(scores pre-multiplied by scale * log2(e)) so the kernels use exp2, and accumulates in fp32; a
soft-cap applies to the natural-scale score and the capped score then converts to log2 units,
and sink logits (natural) are multiplied by log2(e) as they are read.
Block ids and slots are widened to int64 before they multiply a stride: one layer's pool can
exceed 2**31 elements on a large GPU.

8-bit caches (kv_format.py; constexpr QUANT: the format's KVCode, compared against KV_INT8 and so on)
are uint8 [num_blocks, block_size, num_kv_heads, head_dim + 2]: each row's codes, then its
float16 scale. `store_kv` computes the scale and the codes (rounded to nearest even with integer
and float32 operations, not the GPU's fp8 conversions: Triton's interpreter truncates those, and
the bytes must be the ones KVFormat.encode gives in torch); the attention kernels take each tile's
codes as float16 (exact) into the products and apply the rows' scales to the scores and the
probabilities, one factor per key.
"""
from __future__ import annotations

import functools
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from pagellm.kv_format import KVCode, KVFormat, kernel_code

_LOG2E = 1.4426950408889634
# KVCode's values as the kernels' constexpr QUANT takes them (kv_format.py owns the numbering).
KV_PLAIN: tl.constexpr = tl.constexpr(int(KVCode.PLAIN))
KV_INT8: tl.constexpr = tl.constexpr(int(KVCode.INT8))
KV_FP8_E4M3: tl.constexpr = tl.constexpr(int(KVCode.FP8_E4M3))


# ---------------------------------------------------------------------------------------------
# Store
# ---------------------------------------------------------------------------------------------
@triton.jit
def _rne(x):
    """x rounded to the nearest integer, ties to even (for |x| < 2**22): adding 1.5 * 2**23 leaves
    no fraction bits in the float32 sum, which rounds to nearest even; taking it away is exact."""
    return (x + 12582912.0) - 12582912.0


@triton.jit
def _encode_rows(x, row_mask, QUANT: tl.constexpr, QMAX: tl.constexpr):
    """Rows x [R, DIM_PAD] (float32; padding 0) as 8-bit codes (uint8) and each row's float16
    scale, as KVFormat.encode computes them: scale = clamp(max|row| / QMAX, 2**-14, 65504) in
    float16, code = x / scale rounded to nearest even (int8) or to the nearest fp8 value."""
    amax = tl.max(tl.abs(x), axis=1)
    scale = tl.minimum(tl.maximum(amax / QMAX, 6.103515625e-05), 65504.0).to(tl.float16)
    y = tl.math.div_rn(x, scale.to(tl.float32)[:, None])
    y = tl.minimum(tl.maximum(y, -QMAX), QMAX)
    if QUANT == KV_INT8:
        code = _rne(y).to(tl.int32) & 0xFF
    else:
        if QUANT == KV_FP8_E4M3:  # e4m3: 3 mantissa bits, exponent bias 7
            MANT: tl.constexpr = 3
            REBIAS: tl.constexpr = 960  # (127 - 7) << 3
            SUB_UNITS: tl.constexpr = 512.0  # 1 / the smallest subnormal, 2**-9
            MIN_NORMAL: tl.constexpr = 0.015625
        else:  # e5m2: 2 mantissa bits, exponent bias 15
            MANT: tl.constexpr = 2
            REBIAS: tl.constexpr = 448  # (127 - 15) << 2
            SUB_UNITS: tl.constexpr = 65536.0
            MIN_NORMAL: tl.constexpr = 6.103515625e-05
        bits = y.to(tl.int32, bitcast=True)
        mag = bits & 0x7FFFFFFF
        # A normal value: drop 23 - MANT mantissa bits rounding to nearest even (a carry moves
        # into the exponent, as it should), then rebias the exponent.
        normal = ((mag + ((1 << (22 - MANT)) - 1) + ((mag >> (23 - MANT)) & 1)) >> (23 - MANT)) - REBIAS
        # A subnormal: whole units of the smallest one (clamped first, so normal values, which
        # this does not serve, stay within int32).
        sub = _rne(tl.minimum(tl.abs(y), MIN_NORMAL) * SUB_UNITS).to(tl.int32)
        code = tl.where(tl.abs(y) < MIN_NORMAL, sub, normal) | ((bits >> 24) & 0x80)
    code = tl.where(row_mask, code, 0)
    return code.to(tl.uint8), scale


@triton.jit
def _store_rows(x, cache_ptr, dst, mask, head_mask, HEAD_DIM: tl.constexpr, QUANT: tl.constexpr,
                QMAX: tl.constexpr):
    if QUANT == KV_PLAIN:
        tl.store(cache_ptr + dst, x, mask=mask)
    else:
        code, scale = _encode_rows(x.to(tl.float32), mask, QUANT, QMAX)
        tl.store(cache_ptr + dst, code, mask=mask)
        # The scale's two bytes after the codes (little-endian, as torch's view writes them).
        bits = scale.to(tl.int16, bitcast=True).to(tl.int32)
        row = dst - tl.arange(0, dst.shape[1])[None, :]  # [heads, 1]: each row's first byte
        tl.store(cache_ptr + row + HEAD_DIM, (bits & 0xFF).to(tl.uint8)[:, None], mask=head_mask)
        tl.store(cache_ptr + row + HEAD_DIM + 1, ((bits >> 8) & 0xFF).to(tl.uint8)[:, None], mask=head_mask)


@triton.jit
def _store_kv_kernel(
    k_ptr, v_ptr, k_cache_ptr, v_cache_ptr, slot_ptr,
    stride_kt, stride_kh, stride_vt, stride_vh,
    stride_cb, stride_cs, stride_ch,
    block_size,
    NUM_KV_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr, HEADS_PAD: tl.constexpr, DIM_PAD: tl.constexpr,
    QUANT: tl.constexpr, QMAX: tl.constexpr,
):
    # One program per token: all of its KV heads in one [heads, dim] tile.
    t = tl.program_id(0)
    slot = tl.load(slot_ptr + t).to(tl.int64)
    h = tl.arange(0, HEADS_PAD)[:, None]
    d = tl.arange(0, DIM_PAD)[None, :]
    head_mask = (h < NUM_KV_HEADS) & (slot >= 0)
    mask = head_mask & (d < HEAD_DIM)
    dst = (slot // block_size) * stride_cb + (slot % block_size) * stride_cs + h * stride_ch + d
    k = tl.load(k_ptr + t.to(tl.int64) * stride_kt + h * stride_kh + d, mask=mask, other=0.0)
    v = tl.load(v_ptr + t.to(tl.int64) * stride_vt + h * stride_vh + d, mask=mask, other=0.0)
    _store_rows(k, k_cache_ptr, dst, mask, head_mask, HEAD_DIM, QUANT, QMAX)
    _store_rows(v, v_cache_ptr, dst, mask, head_mask, HEAD_DIM, QUANT, QMAX)


def store_kv(k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
             slot_mapping: torch.Tensor, kv_format: KVFormat | None = None) -> None:
    """Write k, v [T, KVH, D] into the caches at `slot_mapping` [T]; slots < 0 are skipped.
    `kv_format` 8-bit: the caches are uint8 rows of codes and a scale (None: values as they are)."""
    num_tokens, kvh, d = k.shape
    if num_tokens == 0:
        return
    _check_last_dim_contiguous(k=k, v=v, k_cache=k_cache, v_cache=v_cache)
    assert k_cache.stride() == v_cache.stride(), "K and V caches must share one layout"
    _store_kv_kernel[(num_tokens,)](
        k, v, k_cache, v_cache, slot_mapping,
        k.stride(0), k.stride(1), v.stride(0), v.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        k_cache.shape[1],
        NUM_KV_HEADS=kvh, HEAD_DIM=d, HEADS_PAD=triton.next_power_of_2(kvh), DIM_PAD=triton.next_power_of_2(d),
        **_quant_flags(kv_format),
    )


def _quant_flags(kv_format: KVFormat | None) -> dict:
    code = kernel_code(kv_format)
    return {"QUANT": code, "QMAX": kv_format.qmax if code != KVCode.PLAIN else 0.0}


# ---------------------------------------------------------------------------------------------
# Decode
# ---------------------------------------------------------------------------------------------
@triton.jit
def _decode_rows(cache_ptr, row, valid, d, mask, HEAD_DIM: tl.constexpr, QUANT: tl.constexpr):
    """8-bit rows starting at `row` [BLOCK_N]: the codes as float16 [BLOCK_N, DIM_PAD] and each
    row's scale as float32 [BLOCK_N], value = code * scale. Every code of the three formats is a
    float16 exactly (and a bfloat16), so the tile goes into tl.dot as it is and the scale is applied
    to the scores (K) and the probabilities (V), one factor per key: scaling the tile itself would
    widen it to float32 first, twice the registers of the 16-bit tile the plain path holds."""
    c = tl.load(cache_ptr + row[:, None] + d[None, :], mask=mask, other=0)
    lo = tl.load(cache_ptr + row + HEAD_DIM, mask=valid, other=0).to(tl.int16)
    hi = tl.load(cache_ptr + row + HEAD_DIM + 1, mask=valid, other=0).to(tl.int16)
    scale = ((hi << 8) | lo).to(tl.float16, bitcast=True).to(tl.float32)
    if QUANT == KV_INT8:
        x = c.to(tl.int8, bitcast=True).to(tl.float16)
    elif QUANT == KV_FP8_E4M3:  # e4m3's fields placed in a float16's read 2**8 too small (see the CPU kernel)
        c16 = c.to(tl.int16)
        x = (((c16 & 0x80) << 8) | ((c16 & 0x7F) << 7)).to(tl.float16, bitcast=True)
        scale = scale * 256.0
    else:  # e5m2 is a float16's top byte
        x = (c.to(tl.int16) << 8).to(tl.float16, bitcast=True)
    return x, scale


@triton.jit
def _load_kv_tile(k_cache_ptr, v_cache_ptr, table, pos, valid, d, d_mask, block_size, stride_cb, stride_cs,
                  head_offset, HEAD_DIM: tl.constexpr, QUANT: tl.constexpr):
    """K and V ([BLOCK_N, DIM_PAD]) of positions `pos` of one sequence, read through its block
    table row `table`: a tile may span several pages, so each position looks up its block.
    8-bit caches (QUANT != KV_PLAIN) come back as float16 codes with their rows' scales (k_scale,
    v_scale [BLOCK_N] float32, see _decode_rows); plain caches with placeholders for those."""
    block = tl.load(table + pos // block_size, mask=valid, other=0).to(tl.int64)
    row = block * stride_cb + (pos % block_size) * stride_cs + head_offset
    mask = valid[:, None] & d_mask[None, :]
    if QUANT == KV_PLAIN:
        k = tl.load(k_cache_ptr + row[:, None] + d[None, :], mask=mask, other=0.0)
        v = tl.load(v_cache_ptr + row[:, None] + d[None, :], mask=mask, other=0.0)
        k_scale = valid  # unused: _attend_tile reads the scales only for 8-bit tiles
        v_scale = valid
    else:
        k, k_scale = _decode_rows(k_cache_ptr, row, valid, d, mask, HEAD_DIM, QUANT)
        v, v_scale = _decode_rows(v_cache_ptr, row, valid, d, mask, HEAD_DIM, QUANT)
    return k, v, k_scale, v_scale


@triton.jit
def _tanh(x):
    """tanh through exp2 (no tanh in Triton's core language; this one runs in the interpreter
    and on any GPU): sign(x) * (1 - e) / (1 + e) with e = exp(-2|x|) in (0, 1], never overflows."""
    e = tl.exp2(-2.8853900817779268 * tl.abs(x))  # 2 * log2(e)
    t = (1.0 - e) / (1.0 + e)
    return tl.where(x < 0, -t, t)


@triton.jit
def _attend_tile(q, k, v, k_scale, v_scale, keep, m_i, l_i, acc, qk_scale, softcap, PRECISION: tl.constexpr,
                 HAS_SOFTCAP: tl.constexpr, MAY_BE_EMPTY: tl.constexpr, QUANT: tl.constexpr):
    """One online-softmax step (base 2) over a K/V tile, scores where `keep` is false masked
    out. Returns the new running max, sum and accumulator.

    Plain: score = q.k * qk_scale, qk_scale = scale * log2(e). With HAS_SOFTCAP the launcher
    passes qk_scale = scale / c and softcap = c * log2(e): score = softcap * tanh(q.k * qk_scale),
    that is c * tanh(scale * q.k / c) in log2 units. MAY_BE_EMPTY: some row may have every score
    of this tile (and of all before it) masked, so its running max is still -inf; exponents are
    then taken against 0 instead, which keeps them 0 rather than NaN.

    8-bit tiles (QUANT != KV_PLAIN) are codes: q.(code * scale) = (q.code) * scale, so each key's scale
    multiplies its score column, and each value's scale its probability column before the second
    product (the running sum l_i takes the probabilities unscaled)."""
    k = k.to(q.dtype)  # 8-bit tiles come as float16 codes
    v = v.to(q.dtype)
    s = tl.dot(q, tl.trans(k), input_precision=PRECISION) * qk_scale
    if QUANT != KV_PLAIN:
        s = s * k_scale[None, :]
    if HAS_SOFTCAP:
        s = _tanh(s) * softcap
    s = tl.where(keep, s, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(s, axis=1))
    m_ref = m_new
    if MAY_BE_EMPTY:
        m_ref = tl.where(m_new == float("-inf"), 0.0, m_new)
    alpha = tl.exp2(m_i - m_ref)
    p = tl.exp2(s - m_ref[:, None])
    l_i = l_i * alpha + tl.sum(p, axis=1)
    if QUANT != KV_PLAIN:
        p = p * v_scale[None, :]
    acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=PRECISION)
    return m_new, l_i, acc


@triton.jit
def _decode_kernel(
    q_ptr, k_cache_ptr, v_cache_ptr, block_tables_ptr, seq_lens_ptr,
    out_ptr, part_out_ptr, part_lse_ptr, sinks_ptr,
    qk_scale, softcap, sliding_window, attention_chunk, num_splits, block_size,
    stride_qt, stride_qh,
    stride_cb, stride_cs, stride_ch,
    stride_bt,
    stride_ot, stride_oh,
    stride_ps, stride_ph, stride_pk,
    stride_ls, stride_lh,
    GROUP: tl.constexpr, GROUP_PAD: tl.constexpr, HEAD_DIM: tl.constexpr, DIM_PAD: tl.constexpr,
    BLOCK_N: tl.constexpr, DIRECT: tl.constexpr, PRECISION: tl.constexpr,
    HAS_WINDOW: tl.constexpr, HAS_CHUNK: tl.constexpr, HAS_SOFTCAP: tl.constexpr, HAS_SINKS: tl.constexpr,
    QUANT: tl.constexpr, QMAX: tl.constexpr,
):
    seq = tl.program_id(0)
    kvh = tl.program_id(1)
    split = tl.program_id(2)
    seq_len = tl.load(seq_lens_ptr + seq).to(tl.int32)
    # Each sequence is cut into `num_splits` runs of whole tiles by its own length, so a graph
    # captured with many splits (sized for the longest context) still spreads a short sequence
    # over all of them instead of leaving it on the first. Empty splits (seq_len 0 for padded
    # graph rows, or fewer tiles than splits) run no iteration and report lse = -inf.
    if HAS_WINDOW or HAS_CHUNK:
        # The query (position seq_len - 1) sees keys from win_start on: the tiles are laid from
        # the tile holding win_start, so none wholly before the window (or its chunk) is read, and
        # every tile read still holds a visible key (win_start itself, or positions after it).
        win_start = seq_len * 0
        if HAS_WINDOW:
            win_start = tl.maximum(seq_len - sliding_window, 0)
        if HAS_CHUNK:
            win_start = tl.maximum(win_start, tl.maximum(seq_len - 1, 0) // attention_chunk * attention_chunk)
        first = (win_start // BLOCK_N) * BLOCK_N
        tiles_per_split = tl.cdiv(tl.cdiv(seq_len - first, BLOCK_N), num_splits)
        lo = first + split * tiles_per_split * BLOCK_N
    else:
        tiles_per_split = tl.cdiv(tl.cdiv(seq_len, BLOCK_N), num_splits)
        lo = split * tiles_per_split * BLOCK_N
    hi = tl.minimum(lo + tiles_per_split * BLOCK_N, seq_len)

    g = tl.arange(0, GROUP_PAD)
    d = tl.arange(0, DIM_PAD)
    n = tl.arange(0, BLOCK_N)
    head = kvh * GROUP + g
    g_mask = g < GROUP
    d_mask = d < HEAD_DIM
    # The GROUP query heads of this KV head are the rows of one matrix (padded to GROUP_PAD >= 16
    # for tl.dot): one pass over K/V serves them all.
    q = tl.load(q_ptr + seq.to(tl.int64) * stride_qt + head[:, None] * stride_qh + d[None, :],
                mask=g_mask[:, None] & d_mask[None, :], other=0.0)

    m_i = tl.full([GROUP_PAD], float("-inf"), tl.float32)
    l_i = tl.zeros([GROUP_PAD], tl.float32)
    acc = tl.zeros([GROUP_PAD, DIM_PAD], tl.float32)
    table = block_tables_ptr + seq.to(tl.int64) * stride_bt
    for start in range(lo, hi, BLOCK_N):
        pos = start + n
        valid = pos < hi
        k, v, k_scale, v_scale = _load_kv_tile(k_cache_ptr, v_cache_ptr, table, pos, valid, d, d_mask, block_size,
                                               stride_cb, stride_cs, kvh * stride_ch, HEAD_DIM, QUANT)
        keep = valid
        if HAS_WINDOW or HAS_CHUNK:
            keep = keep & (pos >= win_start)
        m_i, l_i, acc = _attend_tile(q, k, v, k_scale, v_scale, keep[None, :], m_i, l_i, acc, qk_scale, softcap,
                                     PRECISION, HAS_SOFTCAP, False, QUANT)

    has = l_i > 0
    l_safe = tl.where(has, l_i, 1.0)
    if DIRECT and HAS_SINKS:
        # One split: the whole softmax is here, so the sink joins its denominator now (with split
        # K it joins once, in _combine_kernel). An empty row (m_i = -inf) divides 0 by inf: 0.
        sink = tl.load(sinks_ptr + head, mask=g_mask, other=0.0).to(tl.float32) * 1.4426950408889634
        l_safe = l_i + tl.exp2(sink - m_i)
    o = acc / l_safe[:, None]
    _store_split_output(o, m_i, l_safe, has, out_ptr, part_out_ptr, part_lse_ptr, seq, split, head, d,
                        g_mask[:, None] & d_mask[None, :], g_mask, stride_ot, stride_oh, stride_ps, stride_ph,
                        stride_pk, stride_ls, stride_lh, DIRECT)


@triton.jit
def _store_split_output(o, m_i, l_safe, has, out_ptr, part_out_ptr, part_lse_ptr, seq, split, head, cols, o_mask,
                        h_mask, stride_ot, stride_oh, stride_ps, stride_ph, stride_pk, stride_ls, stride_lh,
                        DIRECT: tl.constexpr):
    """A decode program's normalised output [heads, cols]: straight to out when its sequence is one
    split, else as its split's partial output and log-sum-exp, which _combine_kernel merges."""
    if DIRECT:
        tl.store(out_ptr + seq.to(tl.int64) * stride_ot + head[:, None] * stride_oh + cols[None, :],
                 o.to(out_ptr.dtype.element_ty), mask=o_mask)
    else:
        lse = tl.where(has, m_i + tl.log2(l_safe), float("-inf"))
        part = part_out_ptr + seq.to(tl.int64) * stride_ps + split * stride_pk
        tl.store(part + head[:, None] * stride_ph + cols[None, :], o, mask=o_mask)
        tl.store(part_lse_ptr + seq.to(tl.int64) * stride_ls + head * stride_lh + split, lse, mask=h_mask)


@triton.jit
def _combine_kernel(
    part_out_ptr, part_lse_ptr, out_ptr, sinks_ptr, num_splits,
    stride_ps, stride_ph, stride_pk,
    stride_ls, stride_lh,
    stride_ot, stride_oh,
    HEAD_DIM: tl.constexpr, DIM_PAD: tl.constexpr, SPLITS_PAD: tl.constexpr, HAS_SINKS: tl.constexpr,
):
    # One program per (sequence, query head): weight each split's output by exp2(lse - max).
    # A sink is one more term of the denominator, exp2(sink - max), with no output of its own.
    seq = tl.program_id(0).to(tl.int64)
    head = tl.program_id(1)
    k = tl.arange(0, SPLITS_PAD)
    d = tl.arange(0, DIM_PAD)
    k_mask = k < num_splits
    d_mask = d < HEAD_DIM
    lse = tl.load(part_lse_ptr + seq * stride_ls + head * stride_lh + k, mask=k_mask, other=float("-inf"))
    top = tl.max(lse, axis=0)
    if HAS_SINKS:
        sink = tl.load(sinks_ptr + head).to(tl.float32) * 1.4426950408889634  # natural log -> log2
        top = tl.maximum(top, sink)
    # A sequence with nothing to attend to (a padded graph row) gets zeros, not NaN.
    top = tl.where(top == float("-inf"), 0.0, top)
    w = tl.exp2(lse - top)
    total = tl.sum(w, axis=0)
    if HAS_SINKS:
        total += tl.exp2(sink - top)
    w = w / tl.where(total > 0, total, 1.0)
    parts = tl.load(part_out_ptr + seq * stride_ps + head * stride_ph + k[:, None] * stride_pk + d[None, :],
                    mask=k_mask[:, None] & d_mask[None, :], other=0.0)
    o = tl.sum(parts * w[:, None], axis=0)
    tl.store(out_ptr + seq * stride_ot + head * stride_oh + d, o.to(out_ptr.dtype.element_ty), mask=d_mask)


@dataclass(frozen=True)
class KernelConfig:
    """Tile sizes and launch shape of one kernel; `block_m` is unused by decode."""

    block_n: int
    num_warps: int = 4
    num_stages: int = 2
    block_m: int = 16


# Enough programs for a couple per multiprocessor, so that the last wave is not mostly idle; past
# that a split only adds its partial write and the combine (on an H200, B=64 x 8 KV heads, 3.9
# programs per SM, read its K/V faster unsplit than in two splits: benchmarks/results/gpu_check-*).
_DECODE_PROGRAMS_PER_SM = 2
# Below this many tokens a split's fixed cost (loading q, writing a partial) outweighs its work.
_MIN_SPLIT_TOKENS = 256
_MAX_SPLITS = 32


def split_buffers(out: torch.Tensor, b: int, h: int, num_splits: int, width: int
                  ) -> tuple[torch.Tensor, torch.Tensor, tuple[int, ...]]:
    """The split-K partials of a decode launch: per sequence, head and split, the output [width]
    and its log-sum-exp (float32), and their strides; with one split, placeholders (the kernel
    writes `out` itself) and zero strides."""
    if num_splits == 1:
        return out, out, (0, 0, 0, 0, 0)
    part_out = torch.empty(b, h, num_splits, width, dtype=torch.float32, device=out.device)
    part_lse = torch.empty(b, h, num_splits, dtype=torch.float32, device=out.device)
    return part_out, part_lse, (part_out.stride(0), part_out.stride(1), part_out.stride(2),
                                part_lse.stride(0), part_lse.stride(1))


def choose_num_splits(num_seqs: int, num_kv_heads: int, max_context: int, num_sms: int) -> int:
    """How many programs share one (sequence, KV head): enough to fill the GPU, none too short.

    Depends only on shapes (batch size, the block table's width), never on the lengths in
    it, so a CUDA graph captured for a batch size keeps a valid choice at every replay.
    """
    programs = max(1, num_seqs * num_kv_heads)
    want = -(-(_DECODE_PROGRAMS_PER_SM * num_sms) // programs)
    most = max(1, max_context // _MIN_SPLIT_TOKENS)
    return max(1, min(want, most, _MAX_SPLITS))


def group_pad(group: int) -> int:
    """Rows of the decode kernel's query tile. Triton 3.6 would pad fewer rows itself; 16 is
    the tensor cores' own tile height, the shape its MMA lowering is most used with."""
    return max(16, triton.next_power_of_2(group))


def dot_pad(n: int) -> int:
    """A tl.dot reduction dimension: a power of two, and at least the 16 that 16-bit tensor-core
    instructions reduce over (the interpreter accepts less; the GPU compiler does not)."""
    return max(16, triton.next_power_of_2(n))


@functools.lru_cache(maxsize=None)
def _num_sms(device: torch.device) -> int:
    if device.type != "cuda":
        return 1
    return torch.cuda.get_device_properties(device).multi_processor_count


def default_decode_config(device: torch.device, head_dim: int) -> KernelConfig:
    if device.type != "cuda":
        return KernelConfig(block_n=16)  # the interpreter: smallest tile tl.dot accepts
    return KernelConfig(block_n=64 if head_dim <= 128 else 32, num_warps=4, num_stages=2)


def default_prefill_config(device: torch.device, head_dim: int) -> KernelConfig:
    if device.type != "cuda":
        return KernelConfig(block_n=16, block_m=16)
    if head_dim <= 128:
        return KernelConfig(block_n=64, block_m=64, num_warps=4, num_stages=2)
    return KernelConfig(block_n=32, block_m=64, num_warps=8, num_stages=2)


@dataclass(frozen=True)
class _Options:
    """A layer's options as kernel arguments: scalars, an optional tensor and the constexpr flags."""

    qk_scale: float
    softcap: float
    sliding_window: int
    attention_chunk: int
    sinks: torch.Tensor | None
    flags: dict


def _kernel_options(scale: float, sliding_window: int | None, softcap: float | None, sinks: torch.Tensor | None,
                    num_heads: int, attention_chunk: int | None = None) -> _Options:
    """Scores become c * tanh(scale * q.k / c) in log2 units as (q.k * qk_scale) -> tanh ->
    * softcap: so with a cap, qk_scale = scale / c and softcap = c * log2(e) (see _attend_tile)."""
    if sliding_window is not None and sliding_window < 1:
        raise ValueError(f"sliding_window must be at least 1, got {sliding_window}")
    if attention_chunk is not None and attention_chunk < 1:
        raise ValueError(f"attention_chunk must be at least 1, got {attention_chunk}")
    if sinks is not None:
        if tuple(sinks.shape) != (num_heads,):
            raise ValueError(f"sinks must have one logit per query head ({num_heads}), got shape {tuple(sinks.shape)}")
        sinks = sinks.contiguous()
    if softcap:
        qk_scale, cap = scale / softcap, softcap * _LOG2E
    else:
        qk_scale, cap = scale * _LOG2E, 0.0
    return _Options(qk_scale, cap, sliding_window or 0, attention_chunk or 0, sinks,
                    {"HAS_WINDOW": sliding_window is not None, "HAS_CHUNK": attention_chunk is not None,
                     "HAS_SOFTCAP": bool(softcap),
                     "HAS_SINKS": sinks is not None})


def paged_decode(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_tables: torch.Tensor,
                 seq_lens: torch.Tensor, scale: float, out: torch.Tensor | None = None,
                 num_splits: int | None = None, config: KernelConfig | None = None, *,
                 sliding_window: int | None = None, softcap: float | None = None,
                 sinks: torch.Tensor | None = None, kv_format: KVFormat | None = None,
                 attention_chunk: int | None = None) -> torch.Tensor:
    """Attention of one query token per sequence over its paged context.

    q: [B, H, D]; block_tables: [B, W]; seq_lens: [B] (context length including the token just
    stored; 0 gives a zero output). `num_splits` None picks from the shapes. Writes `out`
    [B, H, D] (may be a strided view) and returns it. No host synchronisation: capturable, with
    or without options. `sliding_window` and `attention_chunk` (None: the whole context), `softcap` (None or 0: none)
    and `sinks` ([H] natural-log logits, any float dtype) as in `AttentionOptions`. `kv_format`:
    an 8-bit format for uint8 caches (None: the caches hold values).
    """
    b, h, d = q.shape
    kvh = k_cache.shape[2]
    assert h % kvh == 0, f"{h} query heads do not share {kvh} KV heads evenly"
    _check_last_dim_contiguous(q=q, k_cache=k_cache, v_cache=v_cache)
    assert k_cache.stride() == v_cache.stride(), "K and V caches must share one layout"
    if out is None:
        out = torch.empty_like(q)
    if b == 0:
        return out
    block_size = k_cache.shape[1]
    cfg = config or default_decode_config(q.device, d)
    if num_splits is None:
        num_splits = choose_num_splits(b, kvh, block_tables.shape[1] * block_size, _num_sms(q.device))
    group = h // kvh
    dim_pad = dot_pad(d)
    opts = _kernel_options(scale, sliding_window, softcap, sinks, h, attention_chunk)
    sinks_arg = out if opts.sinks is None else opts.sinks  # an unused placeholder without sinks
    direct = num_splits == 1
    part_out, part_lse, part_strides = split_buffers(out, b, h, num_splits, d)
    _decode_kernel[(b, kvh, num_splits)](
        q, k_cache, v_cache, block_tables, seq_lens,
        out, part_out, part_lse, sinks_arg,
        opts.qk_scale, opts.softcap, opts.sliding_window, opts.attention_chunk, num_splits, block_size,
        q.stride(0), q.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        block_tables.stride(0),
        out.stride(0), out.stride(1),
        *part_strides,
        GROUP=group, GROUP_PAD=group_pad(group), HEAD_DIM=d, DIM_PAD=dim_pad,
        BLOCK_N=cfg.block_n, DIRECT=direct, PRECISION=_precision(q.dtype), **opts.flags,
        **_quant_flags(kv_format), num_warps=cfg.num_warps, num_stages=cfg.num_stages,
    )
    if not direct:
        _combine_kernel[(b, h)](
            part_out, part_lse, out, sinks_arg, num_splits,
            *part_strides,
            out.stride(0), out.stride(1),
            HEAD_DIM=d, DIM_PAD=dim_pad, SPLITS_PAD=triton.next_power_of_2(num_splits),
            HAS_SINKS=opts.flags["HAS_SINKS"],
            num_warps=4,
        )
    return out


# ---------------------------------------------------------------------------------------------
# Prefill / extend
# ---------------------------------------------------------------------------------------------
# A prefill work item is one tile of BLOCK_M query rows of one sequence, five int32 fields:
# (block-table row, first query token of the sequence in q, query length, context length,
# first row of the tile within the sequence's queries).
_TILE_FIELDS = 5


@triton.jit
def _prefill_kernel(
    q_ptr, k_cache_ptr, v_cache_ptr, block_tables_ptr, tiles_ptr, out_ptr, sinks_ptr,
    qk_scale, softcap, sliding_window, attention_chunk, block_size,
    stride_qt, stride_qh,
    stride_cb, stride_cs, stride_ch,
    stride_bt,
    stride_ot, stride_oh,
    GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, DIM_PAD: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, PRECISION: tl.constexpr,
    HAS_WINDOW: tl.constexpr, HAS_CHUNK: tl.constexpr, HAS_SOFTCAP: tl.constexpr, HAS_SINKS: tl.constexpr,
    QUANT: tl.constexpr, QMAX: tl.constexpr,
):
    tile = tiles_ptr + tl.program_id(0) * 5  # _TILE_FIELDS
    head = tl.program_id(1)
    row = tl.load(tile).to(tl.int64)
    q_first = tl.load(tile + 1)
    q_len = tl.load(tile + 2)
    seq_len = tl.load(tile + 3)
    m_start = tl.load(tile + 4)
    kvh = head // GROUP
    # The query rows are the last q_len positions of the context: the first seq_len - q_len are
    # a cached prefix or earlier chunks, already in the pool.
    prefix = seq_len - q_len
    r = m_start + tl.arange(0, BLOCK_M)
    r_mask = r < q_len
    q_pos = prefix + r
    d = tl.arange(0, DIM_PAD)
    d_mask = d < HEAD_DIM
    n = tl.arange(0, BLOCK_N)
    tok = (q_first + r).to(tl.int64)
    q = tl.load(q_ptr + tok[:, None] * stride_qt + head * stride_qh + d[None, :],
                mask=r_mask[:, None] & d_mask[None, :], other=0.0)

    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, DIM_PAD], tl.float32)
    table = block_tables_ptr + row * stride_bt
    # Causal: no row of this tile sees past the tile's last position.
    hi = tl.minimum(seq_len, prefix + m_start + BLOCK_M)
    lo = 0
    if HAS_WINDOW:
        # Nor before the first row's window: start at the tile holding its first visible key.
        lo = (tl.maximum(prefix + m_start - sliding_window + 1, 0) // BLOCK_N) * BLOCK_N
    if HAS_CHUNK:
        # Nor before the first row's chunk.
        lo = tl.maximum(lo, ((prefix + m_start) // attention_chunk * attention_chunk // BLOCK_N) * BLOCK_N)
    for start in range(lo, hi, BLOCK_N):
        pos = start + n
        valid = pos < hi
        k, v, k_scale, v_scale = _load_kv_tile(k_cache_ptr, v_cache_ptr, table, pos, valid, d, d_mask, block_size,
                                               stride_cb, stride_cs, kvh * stride_ch, HEAD_DIM, QUANT)
        keep = valid[None, :] & (pos[None, :] <= q_pos[:, None])
        if HAS_WINDOW:
            keep = keep & (pos[None, :] > q_pos[:, None] - sliding_window)
        if HAS_CHUNK:
            keep = keep & (pos[None, :] // attention_chunk == q_pos[:, None] // attention_chunk)
        # Without a window or chunks every row sees position 0 in the first tile, so the running
        # max is finite from then on; with them, a later row may see nothing in the first tiles.
        m_i, l_i, acc = _attend_tile(q, k, v, k_scale, v_scale, keep, m_i, l_i, acc, qk_scale, softcap,
                                     PRECISION, HAS_SOFTCAP, HAS_WINDOW or HAS_CHUNK, QUANT)

    l_safe = tl.where(l_i > 0, l_i, 1.0)
    if HAS_SINKS:
        # The head's sink joins every row's denominator (a row with nothing seen divides 0 by inf).
        sink = tl.load(sinks_ptr + head).to(tl.float32) * 1.4426950408889634
        l_safe = l_i + tl.exp2(sink - m_i)
    o = acc / l_safe[:, None]
    tl.store(out_ptr + tok[:, None] * stride_ot + head * stride_oh + d[None, :],
             o.to(out_ptr.dtype.element_ty), mask=r_mask[:, None] & d_mask[None, :])


def prefill_tiles(block_table_rows: list[int], query_lens: list[int], seq_lens: list[int], block_m: int,
                  device: torch.device) -> torch.Tensor:
    """The work list of `paged_prefill`: one int32 row per BLOCK_M query rows of a sequence.

    Sequence i's queries are tokens [sum(query_lens[:i]), ...) of the q given to the kernel,
    and its block table is row `block_table_rows[i]`. Built on the host once per step: ragged
    lengths then cost no idle programs.
    """
    rows: list[int] = []
    q_first = 0
    for bt_row, ql, sl in zip(block_table_rows, query_lens, seq_lens):
        for m_start in range(0, ql, block_m):
            rows += [bt_row, q_first, ql, sl, m_start]
        q_first += ql
    return torch.tensor(rows, dtype=torch.int32).view(-1, _TILE_FIELDS).to(device)


def paged_prefill(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_tables: torch.Tensor,
                  tiles: torch.Tensor, scale: float, out: torch.Tensor | None = None,
                  config: KernelConfig | None = None, *, sliding_window: int | None = None,
                  softcap: float | None = None, sinks: torch.Tensor | None = None,
                  kv_format: KVFormat | None = None, attention_chunk: int | None = None) -> torch.Tensor:
    """Causal attention of the prefill tokens q [T, H, D] over their paged contexts.

    `tiles` comes from `prefill_tiles` with the same `config.block_m`; every query token's K/V
    must already be in the cache. Writes `out` [T, H, D] and returns it. Options as in
    `paged_decode`.
    """
    _, h, d = q.shape
    kvh = k_cache.shape[2]
    assert h % kvh == 0, f"{h} query heads do not share {kvh} KV heads evenly"
    _check_last_dim_contiguous(q=q, k_cache=k_cache, v_cache=v_cache)
    assert k_cache.stride() == v_cache.stride(), "K and V caches must share one layout"
    if out is None:
        out = torch.empty_like(q)
    num_tiles = tiles.shape[0]
    if num_tiles == 0:
        return out
    cfg = config or default_prefill_config(q.device, d)
    opts = _kernel_options(scale, sliding_window, softcap, sinks, h, attention_chunk)
    _prefill_kernel[(num_tiles, h)](
        q, k_cache, v_cache, block_tables, tiles, out, out if opts.sinks is None else opts.sinks,
        opts.qk_scale, opts.softcap, opts.sliding_window, opts.attention_chunk, k_cache.shape[1],
        q.stride(0), q.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        block_tables.stride(0),
        out.stride(0), out.stride(1),
        GROUP=h // kvh, HEAD_DIM=d, DIM_PAD=dot_pad(d),
        BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, PRECISION=_precision(q.dtype), **opts.flags,
        **_quant_flags(kv_format), num_warps=cfg.num_warps, num_stages=cfg.num_stages,
    )
    return out


# ---------------------------------------------------------------------------------------------
def _precision(dtype: torch.dtype) -> str:
    # fp32 runs exact ("ieee") so fp32 results match the torch reference; 16-bit inputs go
    # through the tensor cores whatever this says.
    return "ieee" if dtype == torch.float32 else "tf32"


def _check_last_dim_contiguous(**tensors: torch.Tensor) -> None:
    for name, t in tensors.items():
        if t.stride(-1) != 1:
            raise ValueError(f"{name} must have a contiguous last dimension, got strides {tuple(t.stride())}")


__all__ = ["KernelConfig", "choose_num_splits", "default_decode_config", "default_prefill_config",
           "paged_decode", "paged_prefill", "prefill_tiles", "store_kv"]
