"""Linear methods for quantized weights, and the choice of one for a model being built."""
from __future__ import annotations

from contextlib import AbstractContextManager, nullcontext

import torch

from pagellm.layers.linear import linear_method_for_new_layers


def linear_methods(weight_format: str, dtype: torch.dtype) -> AbstractContextManager:
    """The context to build a model in so that its layers keep weights of `weight_format`:
    "dense" (a tensor in the model's dtype), "gguf" (GGUF blocks, see quant/gguf.py), or "int8" /
    "int4" (quantized as they load, see quant/int_weights.py)."""
    if weight_format == "dense":
        return nullcontext()
    if weight_format == "gguf":
        from pagellm.layers.quant.gguf import GGUFLinearMethod

        return linear_method_for_new_layers(lambda: GGUFLinearMethod(dtype))
    if weight_format in ("int8", "int4"):
        from pagellm.layers.quant.int_weights import Int4LinearMethod, Int8LinearMethod

        method = Int8LinearMethod if weight_format == "int8" else Int4LinearMethod
        return linear_method_for_new_layers(lambda: method(dtype))
    raise ValueError(f"weight format {weight_format!r} is not one of dense, gguf, int8, int4")
