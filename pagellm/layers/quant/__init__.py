"""Linear methods for quantized weights, and the choice of one for a model being built."""
from __future__ import annotations

from contextlib import AbstractContextManager, nullcontext

import torch

from pagellm.layers.linear import linear_method_for_new_layers


def linear_methods(weight_format: str, dtype: torch.dtype, batch_invariant: bool = False) -> AbstractContextManager:
    """The context to build a model in so that its layers keep weights of `weight_format`:
    "dense" (a tensor in the model's dtype), "gguf" (GGUF blocks, see quant/gguf.py), or "int8" /
    "int4" (quantized as they load, see quant/int_weights.py). `batch_invariant`: every product
    sums in an order that does not depend on the batch (layers/invariant.py); dense and GGUF only."""
    if weight_format == "dense":
        if batch_invariant:
            from pagellm.layers.invariant import BatchInvariantLinearMethod

            return linear_method_for_new_layers(BatchInvariantLinearMethod)
        return nullcontext()
    if weight_format == "gguf":
        from pagellm.layers.quant.gguf import GGUFLinearMethod

        return linear_method_for_new_layers(lambda: GGUFLinearMethod(dtype, batch_invariant))
    if weight_format in ("int8", "int4"):
        if batch_invariant:
            raise ValueError(f"batch-invariant mode does not cover quantization {weight_format!r} yet (torch's "
                             f"packed kernels pick their path by batch size); use dense or GGUF weights")
        from pagellm.layers.quant.int_weights import Int4LinearMethod, Int8LinearMethod

        method = Int8LinearMethod if weight_format == "int8" else Int4LinearMethod
        return linear_method_for_new_layers(lambda: method(dtype))
    raise ValueError(f"weight format {weight_format!r} is not one of dense, gguf, int8, int4")
