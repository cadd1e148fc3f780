"""The GGUF types whose 4-bit codes index a table of 16 values, served in their blocks: MXFP4
(gpt-oss's experts), IQ4_NL and IQ4_XS. Their products are csrc/quant_codebook_ops.cpp's; this
module says which one a batch takes, and layers/quant/gguf.py (GGUFBlocks, the linear method)
treats these types as it treats its own.

Up to FUSED_MAX_ROWS rows of x run the float32 kernel (blocks streamed once, their values widened
in registers: the dense product up to summation order), or with `activation_quantization` int8 /
int8x2 up to INT8_MAX_ROWS rows the integer kernel (x rounded per 32 values as the other types'
integer kernels round it); larger batches return None, and the caller widens tiles of W for
torch's GEMM (compute-bound there). Bounds from benchmarks/codebook_matmul.py on 1B shapes, one
thread (codebook-matmul-2026-12-05-1thread-int8x2-16bit.json, shared cores under load): the float32
kernel ties the tiles at 16 rows; int8 beats both up to 32 on every shape; int8x2 beats the
float32 kernel at one row (0.9 against 1.2-1.5 ms) and ties it at 4-8.
"""
from __future__ import annotations

import torch

from pagellm.kernels import cpu
from pagellm.layers.quant.gguf_types import CODEBOOK, served_by

# GGML type id -> name.
CODEBOOK_TYPES = {i: t.name for i, t in served_by(CODEBOOK).items()}
FUSED_MAX_ROWS = {torch.float32: 16, torch.bfloat16: 16}
INT8_MAX_ROWS = {"int8": 32, "int8x2": 8}


def product(x: torch.Tensor, data: torch.Tensor, qtype: int, cols: int, batch_invariant: bool = False,
            activations: str = "none") -> torch.Tensor | None:
    """x [M, cols] @ W^T in float32 for W in blocks of `qtype`, or None where the batch is better
    served by widened tiles (or the kernels are not built). `batch_invariant`: the float32 kernel
    at every M (its sums do not depend on M)."""
    kernels = cpu.codebook_kernels() if x.is_cpu else None
    if kernels is None:
        if batch_invariant:
            raise RuntimeError("batch-invariant mode needs the compiled CPU kernels (a C++ compiler and ninja)")
        return None
    rows = x.shape[0]
    if batch_invariant:
        return kernels.codebook_matmul(x, data, qtype, cols)
    if activations != "none" and kernels.has_int8_activations and rows <= INT8_MAX_ROWS[activations]:
        return kernels.codebook_matmul_int8(x, data, qtype, cols, activations == "int8x2")
    if rows <= FUSED_MAX_ROWS.get(x.dtype, 0):
        return kernels.codebook_matmul(x, data, qtype, cols)
    return None


def dequantize_rows(data: torch.Tensor, qtype: int, cols: int, rows: torch.Tensor,
                    dtype: torch.dtype) -> torch.Tensor | None:
    """Rows `rows` as dense rows of float32 or bfloat16, or None without the compiled kernels."""
    kernels = cpu.codebook_kernels() if data.device.type == "cpu" else None
    if kernels is None or dtype not in (torch.float32, torch.bfloat16):
        return None
    return kernels.codebook_dequantize_rows(data, qtype, cols, rows, dtype)
