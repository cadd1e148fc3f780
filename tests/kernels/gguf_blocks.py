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
