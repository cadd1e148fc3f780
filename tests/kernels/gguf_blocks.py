"""Random GGUF blocks for kernel tests and benchmarks. Kept apart from test_quant_ops, whose import
builds the CPU kernels: the Triton tests on a GPU machine need the blocks, not the CPU build."""
from __future__ import annotations

import numpy as np
import torch
from gguf import GGML_QUANT_SIZES
from gguf import GGMLQuantizationType as T
from gguf.quants import dequantize

# Byte offsets of each block's float16 scales (the rest of a block may be any bytes).
HALF_OFFSETS = {T.Q4_0: [0], T.Q4_1: [0, 2], T.Q8_0: [0], T.Q4_K: [0, 2], T.Q5_K: [0, 2], T.Q6_K: [208],
                T.IQ4_NL: [0], T.IQ4_XS: [0], T.MXFP4: []}
# Byte offsets of each block's E8M0 exponent (MXFP4's scale: 2^(e - 128)).
EXPONENT_OFFSETS = {T.MXFP4: [0]}


def random_blocks(qtype: T, rows: int, cols: int, seed: int = 0) -> np.ndarray:
    """Valid blocks of random content: any bits for the quants and sub-scales, small finite scales."""
    rng = np.random.default_rng(seed)
    values, nbytes = GGML_QUANT_SIZES[qtype]
    raw = rng.integers(0, 256, size=(rows, cols // values, nbytes), dtype=np.uint8)
    for off in HALF_OFFSETS[qtype]:
        scales = (rng.standard_normal((rows, cols // values)) * 0.01).astype(np.float16)
        raw[:, :, off:off + 2] = scales.view(np.uint8).reshape(rows, cols // values, 2)
    for off in EXPONENT_OFFSETS.get(qtype, []):  # scales 2^-11 .. 2^-4, like the fp16 ones above
        raw[:, :, off] = rng.integers(117, 125, size=(rows, cols // values), dtype=np.uint8)
    return raw.reshape(rows, -1)


def reference(raw: np.ndarray, qtype: T, cols: int) -> torch.Tensor:
    """gguf-py's dequantization of `raw`, as float32 rows."""
    return torch.from_numpy(np.asarray(dequantize(raw, qtype), dtype=np.float32).reshape(raw.shape[0], cols))


IQ4_VALUES = np.array([-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113], dtype=np.float32)


def _iq4_runs(x: np.ndarray, scale: np.ndarray) -> np.ndarray:
    """Runs [n, 32] as 16 bytes of codes each (nearest table value to x / scale; value j in byte
    j % 16's low nibble for j < 16, else its high one)."""
    safe = np.where(scale == 0, 1, scale)
    codes = np.abs(x[..., None] / safe[:, None, None] - IQ4_VALUES).argmin(-1).astype(np.uint8)
    return codes[:, :16] | (codes[:, 16:] << 4)


def quantize_iq4(dense: np.ndarray, qtype: T) -> np.ndarray:
    """IQ4_NL or IQ4_XS blocks of float32 rows [..., K], by a plain nearest-value encoder (gguf-py only
    decodes these types; llama.cpp's encoder searches scales harder, the format is the same)."""
    rows = dense.reshape(-1, 32).astype(np.float32)
    if qtype == T.IQ4_NL:
        d = (np.abs(rows).max(-1) / 127).astype(np.float16)
        out = np.concatenate([d.view(np.uint8).reshape(-1, 2), _iq4_runs(rows, d.astype(np.float32))], axis=-1)
        return out.reshape(*dense.shape[:-1], -1)
    sub = np.abs(rows).max(-1).reshape(-1, 8) / 127  # IQ4_XS: each run's ideal scale, 8 runs a super-block
    d = (np.abs(sub).max(-1) / 31).astype(np.float16)
    df = np.where(d == 0, 1, d.astype(np.float32))
    ls = np.clip(np.round(sub / df[:, None]) + 32, 0, 63).astype(np.uint16)
    run_scale = d.astype(np.float32)[:, None] * (ls.astype(np.float32) - 32)
    qs = _iq4_runs(rows, run_scale.reshape(-1)).reshape(-1, 128)
    high = np.bitwise_or.reduce((ls >> 4) << (2 * np.arange(8, dtype=np.uint16)), axis=-1).astype(np.uint16)
    low = (ls & 0x0F).astype(np.uint8)
    out = np.concatenate([d.view(np.uint8).reshape(-1, 2), high.view(np.uint8).reshape(-1, 2),
                          low[:, 0::2] | (low[:, 1::2] << 4), qs], axis=-1)
    return out.reshape(*dense.shape[:-1], -1)
