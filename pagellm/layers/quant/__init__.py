"""Linear methods for quantized weights, and the choice of one for a model being built."""
from __future__ import annotations

from contextlib import AbstractContextManager, nullcontext

import torch

from pagellm.layers.linear import linear_method_for_new_layers


def linear_methods(weight_format: str, dtype: torch.dtype) -> AbstractContextManager:
    """The context to build a model in so that its layers keep weights of `weight_format`:
    "dense" (a tensor in the model's dtype) or "gguf" (GGUF blocks, see quant/gguf.py)."""
    if weight_format == "dense":
        return nullcontext()
    if weight_format == "gguf":
        from pagellm.layers.quant.gguf import GGUFLinearMethod

        return linear_method_for_new_layers(lambda: GGUFLinearMethod(dtype))
    raise ValueError(f"weight format {weight_format!r} is not one of dense, gguf")
