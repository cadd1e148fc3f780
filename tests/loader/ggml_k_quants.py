"""Q4_K and Q6_K dequantization written from ggml's block layout (ggml-common.h, and
dequantize_row_q4_K / dequantize_row_q6_K in ggml-quants.c), one super-block of 256 values at
a time, in float32 in ggml's order of operations. An oracle independent of the `gguf` package,
which the loader itself calls."""
from __future__ import annotations

import numpy as np

QK_K = 256
Q4_K_BYTES = 2 + 2 + 12 + QK_K // 2          # d, dmin, 12 bytes of 6-bit scales and mins, 4-bit quants
Q6_K_BYTES = QK_K // 2 + QK_K // 4 + QK_K // 16 + 2  # ql, qh, int8 scales, d


def _f16(b: np.ndarray) -> np.float32:
    return np.float32(b[:2].copy().view(np.float16)[0])


def _scale_min_k4(j: int, q: np.ndarray) -> tuple[int, int]:
    """get_scale_min_k4: sub-block j's 6-bit scale and min, packed into 12 bytes."""
    if j < 4:
        return int(q[j]) & 63, int(q[j + 4]) & 63
    return ((int(q[j + 4]) & 0xF) | ((int(q[j - 4]) >> 6) << 4),
            (int(q[j + 4]) >> 4) | ((int(q[j]) >> 6) << 4))


def dequantize_q4_k_block(block: np.ndarray) -> np.ndarray:
    assert block.shape == (Q4_K_BYTES,)
    d, dmin = _f16(block[0:2]), _f16(block[2:4])
    scales, qs = block[4:16], block[16:]
    y = np.empty(QK_K, dtype=np.float32)
    for j, chunk in enumerate(range(0, QK_K, 64)):  # 64 values: 32 low nibbles, then 32 high nibbles
        sc, m = _scale_min_k4(2 * j, scales)
        d1, m1 = d * np.float32(sc), dmin * np.float32(m)
        sc, m = _scale_min_k4(2 * j + 1, scales)
        d2, m2 = d * np.float32(sc), dmin * np.float32(m)
        q = qs[32 * j:32 * j + 32]
        y[chunk:chunk + 32] = d1 * (q & 0xF).astype(np.float32) - m1
        y[chunk + 32:chunk + 64] = d2 * (q >> 4).astype(np.float32) - m2
    return y


def dequantize_q6_k_block(block: np.ndarray) -> np.ndarray:
    assert block.shape == (Q6_K_BYTES,)
    ql, qh = block[0:128], block[128:192]
    sc = block[192:208].view(np.int8).astype(np.float32)
    d = _f16(block[208:210])
    y = np.empty(QK_K, dtype=np.float32)
    for half in range(2):  # 128 values each: ql advances by 64, qh by 32, scales by 8
        l_, h_, s_, out = ql[64 * half:], qh[32 * half:], sc[8 * half:], 128 * half
        for l in range(32):
            i = l // 16
            q1 = ((int(l_[l]) & 0xF) | (((int(h_[l]) >> 0) & 3) << 4)) - 32
            q2 = ((int(l_[l + 32]) & 0xF) | (((int(h_[l]) >> 2) & 3) << 4)) - 32
            q3 = ((int(l_[l]) >> 4) | (((int(h_[l]) >> 4) & 3) << 4)) - 32
            q4 = ((int(l_[l + 32]) >> 4) | (((int(h_[l]) >> 6) & 3) << 4)) - 32
            y[out + l] = d * s_[i] * np.float32(q1)
            y[out + l + 32] = d * s_[i + 2] * np.float32(q2)
            y[out + l + 64] = d * s_[i + 4] * np.float32(q3)
            y[out + l + 96] = d * s_[i + 6] * np.float32(q4)
    return y


def dequantize_rows(data: np.ndarray, block_bytes: int, block_fn) -> np.ndarray:
    """[rows, n_blocks * block_bytes] uint8 -> [rows, n_blocks * 256] float32."""
    rows = data.reshape(data.shape[0], -1, block_bytes)
    return np.stack([np.concatenate([block_fn(b) for b in row]) for row in rows])
