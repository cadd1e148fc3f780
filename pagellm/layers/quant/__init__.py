"""Linear methods for quantized weights, and the choice of one for a model being built."""
from __future__ import annotations

from collections.abc import Callable
from contextlib import AbstractContextManager, nullcontext

import torch
import torch.nn.functional as F

from pagellm.layers.linear import linear_method_for_new_layers

# Dense values widened at a time by tiled_product (4 MiB of float32; the dense matrix never exists).
TILE_VALUES = 1 << 20


def tiled_product(x: torch.Tensor, rows: int, cols: int,
                  widen: Callable[[int, int], torch.Tensor]) -> torch.Tensor:
    """x [M, cols] @ W^T for a W [rows, cols] kept compressed: `widen(start, end)` gives rows
    [start, end) of W dense in x's dtype, TILE_VALUES values at a time, each multiplied by torch's
    GEMM while it is in cache (compute-bound batches, where widening a tile costs little)."""
    out = torch.empty(x.shape[0], rows, dtype=x.dtype, device=x.device)
    step = max(16, TILE_VALUES // cols)
    for start in range(0, rows, step):
        end = min(rows, start + step)
        out[:, start:end] = F.linear(x, widen(start, end))
    return out


def linear_methods(weight_format: str, dtype: torch.dtype, batch_invariant: bool = False,
                   activation_quantization: str = "none") -> AbstractContextManager:
    """The context to build a model in so that its layers keep weights of `weight_format`:
    "dense" (a tensor in the model's dtype), "gguf" (GGUF blocks, see quant/gguf.py), or "int8" /
    "int4" (quantized as they load, see quant/int_weights.py). `batch_invariant`: every product
    sums in an order that does not depend on the batch (layers/invariant.py); dense and GGUF only.
    `activation_quantization` "int8" / "int8x2": GGUF products round their activations to int8
    codes (quant/gguf.py)."""
    if activation_quantization != "none":
        from pagellm.layers.quant.gguf import check_activation_quantization

        check_activation_quantization(activation_quantization, weight_format, batch_invariant)
    if weight_format == "dense":
        if batch_invariant:
            from pagellm.layers.invariant import BatchInvariantLinearMethod

            return linear_method_for_new_layers(BatchInvariantLinearMethod)
        return nullcontext()
    if weight_format == "gguf":
        from pagellm.layers.quant.gguf import GGUFLinearMethod

        return linear_method_for_new_layers(lambda: GGUFLinearMethod(dtype, batch_invariant,
                                                                             activation_quantization))
    if weight_format in ("int8", "int4"):
        if batch_invariant:
            raise ValueError(f"batch-invariant mode does not cover quantization {weight_format!r} yet (torch's "
                             f"packed kernels pick their path by batch size); use dense or GGUF weights")
        from pagellm.layers.quant.int_weights import Int4LinearMethod, Int8LinearMethod

        method = Int8LinearMethod if weight_format == "int8" else Int4LinearMethod
        return linear_method_for_new_layers(lambda: method(dtype))
    raise ValueError(f"weight format {weight_format!r} is not one of dense, gguf, int8, int4")
