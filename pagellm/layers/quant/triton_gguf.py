"""GGUF blocks multiplied on a GPU by a Triton kernel that dequantizes as it multiplies.

y = x @ W^T for W in its GGUF blocks ([N rows, row_bytes] uint8): each program takes a
[BLOCK_M, BLOCK_N] tile of y and walks K one 32-value block at a time, widening the block's
quants and its float16 scale(s) in registers and feeding them to a `tl.dot` in x's dtype with a
float32 accumulator. W never exists dense in memory. Formats, in ggml's layouts: Q8_0 (d * q),
Q4_0 (d * (q - 8)), Q4_1 (d * q + m), and the K-quants most files mix in, Q4_K (8 sub-blocks of
32 with 6-bit scales and mins) and Q6_K (16 sub-blocks of 16 with int8 scales), read 32 values
(one sub-block, or two of Q6_K's) at a time.

Tested under Triton's interpreter on CPU tensors against gguf-py's dequantization
(tests/kernels/test_triton_gguf.py) and compiled for sm_90 by tests/attention/compile_for_hopper.py;
not yet measured on a GPU, so the engine still dequantizes GGUF files at load on CUDA.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from pagellm.layers.quant.gguf_types import BLOCK_TYPES

# The kernel's FORMAT code of each type it decodes; sizes and ids come from the one table.
KERNEL_CODES = {"Q8_0": 0, "Q4_0": 1, "Q4_1": 2, "Q4_K": 3, "Q6_K": 4}
# ggml type id -> (code in the kernel, bytes per block, values per block)
TYPES = {t.id: (KERNEL_CODES[t.name], t.bytes, t.values) for t in BLOCK_TYPES.values() if t.name in KERNEL_CODES}


@triton.jit
def _half_at(ptr, offs, mask):
    """The little-endian float16 at byte offsets `offs`, as float32."""
    lo = tl.load(ptr + offs, mask=mask, other=0).to(tl.uint16)
    hi = tl.load(ptr + offs + 1, mask=mask, other=0).to(tl.uint16)
    return (lo | (hi << 8)).to(tl.float16, bitcast=True).to(tl.float32)


@triton.jit
def _gguf_matmul_kernel(x_ptr, w_ptr, y_ptr, M, N, K, row_bytes, stride_xm, stride_ym,
                        FORMAT: tl.constexpr, BLOCK_BYTES: tl.constexpr, BLOCK_VALUES: tl.constexpr,
                        BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, PRECISION: tl.constexpr):
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    rm = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    j = tl.arange(0, 32)
    m_ok = rm < M
    n_ok = rn < N
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for kc in range(0, K // 32):  # 32 values of K at a time
        x = tl.load(x_ptr + rm[:, None] * stride_xm + kc * 32 + j[None, :], mask=m_ok[:, None], other=0.0)
        per_block: tl.constexpr = BLOCK_VALUES // 32
        t = kc % per_block  # which 32 values of the block
        base = rn.to(tl.int64) * row_bytes + (kc // per_block) * BLOCK_BYTES  # [BLOCK_N] each row's block
        if FORMAT == 0:  # Q8_0: d, then 32 int8 quants
            d = _half_at(w_ptr, base, n_ok)
            q = tl.load(w_ptr + base[:, None] + 2 + j[None, :], mask=n_ok[:, None], other=0)
            w = d[:, None] * q.to(tl.int8, bitcast=True).to(tl.float32)
        elif FORMAT <= 2:  # Q4_0 / Q4_1: value j is the low nibble of byte j (j < 16), the high of byte j - 16
            d = _half_at(w_ptr, base, n_ok)
            qoff = 2 if FORMAT == 1 else 4
            byte = tl.load(w_ptr + base[:, None] + qoff + (j % 16)[None, :], mask=n_ok[:, None], other=0)
            nib = tl.where(j[None, :] < 16, byte & 0x0F, byte >> 4).to(tl.float32)
            if FORMAT == 1:
                w = d[:, None] * (nib - 8.0)
            else:
                m = _half_at(w_ptr, base + 2, n_ok)
                w = d[:, None] * nib + m[:, None]
        elif FORMAT == 3:  # Q4_K: d, dmin, 12 bytes of 6-bit scales/mins, 128 bytes of nibbles
            d = _half_at(w_ptr, base, n_ok)
            dmin = _half_at(w_ptr, base + 2, n_ok)
            s_t = tl.load(w_ptr + base + 4 + t, mask=n_ok, other=0).to(tl.int32)
            s_t4 = tl.load(w_ptr + base + 8 + t, mask=n_ok, other=0).to(tl.int32)
            s_lo = tl.load(w_ptr + base + 4 + (t % 4), mask=n_ok, other=0).to(tl.int32)  # s[t - 4] when t >= 4
            sc = tl.where(t < 4, s_t & 63, (s_t4 & 0x0F) | ((s_lo >> 6) << 4)).to(tl.float32)
            mn = tl.where(t < 4, s_t4 & 63, (s_t4 >> 4) | ((s_t >> 6) << 4)).to(tl.float32)
            byte = tl.load(w_ptr + base[:, None] + 16 + (t // 2) * 32 + j[None, :], mask=n_ok[:, None], other=0)
            nib = tl.where(t % 2 == 0, byte & 0x0F, byte >> 4).to(tl.float32)
            w = (d * sc)[:, None] * nib - (dmin * mn)[:, None]
        else:  # Q6_K: 128 bytes of low nibbles, 64 of high bit pairs, 16 int8 scales, d
            half = t // 4
            c = t % 4
            lo = tl.load(w_ptr + base[:, None] + half * 64 + (c % 2) * 32 + j[None, :], mask=n_ok[:, None], other=0)
            hi = tl.load(w_ptr + base[:, None] + 128 + half * 32 + j[None, :], mask=n_ok[:, None], other=0)
            nib = tl.where(c >= 2, lo >> 4, lo & 0x0F).to(tl.int32)
            q = (nib | (((hi.to(tl.int32) >> (2 * c)) & 3) << 4)) - 32
            sc = tl.load(w_ptr + base[:, None] + 192 + half * 8 + c * 2 + (j // 16)[None, :], mask=n_ok[:, None],
                         other=0).to(tl.int8, bitcast=True).to(tl.float32)
            d = _half_at(w_ptr, base + 208, n_ok)
            w = d[:, None] * sc * q.to(tl.float32)
        acc += tl.dot(x, tl.trans(w.to(x.dtype)), out_dtype=tl.float32, input_precision=PRECISION)
    tl.store(y_ptr + rm[:, None] * stride_ym + rn[None, :], acc.to(y_ptr.dtype.element_ty),
             mask=m_ok[:, None] & n_ok[None, :])


def supported(qtype: int) -> bool:
    return int(qtype) in TYPES


def gguf_matmul(x: torch.Tensor, data: torch.Tensor, qtype: int, cols: int) -> torch.Tensor:
    """x [M, cols] @ W^T for W in blocks of `qtype` (TYPES): [M, rows] in x's dtype."""
    if not supported(qtype):
        name = BLOCK_TYPES[int(qtype)].name if int(qtype) in BLOCK_TYPES else f"type {qtype}"
        raise ValueError(f"GGUF {name} has no Triton kernel ({', '.join(KERNEL_CODES)} do)")
    code, block_bytes, block_values = TYPES[int(qtype)]
    if cols % block_values or data.shape[1] != cols // block_values * block_bytes:
        raise ValueError(f"{data.shape[1]} bytes per row do not hold {cols} values of type {qtype}")
    x = x.contiguous()
    M, N = x.shape[0], data.shape[0]
    y = torch.empty((M, N), dtype=x.dtype, device=x.device)
    block_m = 16 if M <= 16 else 32
    block_n = 64
    grid = (triton.cdiv(M, block_m), triton.cdiv(N, block_n))
    _gguf_matmul_kernel[grid](x, data, y, M, N, cols, data.shape[1], x.stride(0), y.stride(0),
                              FORMAT=code, BLOCK_BYTES=block_bytes, BLOCK_VALUES=block_values, BLOCK_M=block_m,
                              BLOCK_N=block_n,
                              # float32 models multiply in float32 (no TF32 rounding), as on the CPU.
                              PRECISION="ieee" if x.dtype == torch.float32 else "tf32")
    return y
