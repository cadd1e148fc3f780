"""Linear methods for quantized weights, and the choice of one for a model being built."""
from __future__ import annotations

import importlib
from collections.abc import Callable
from contextlib import AbstractContextManager, nullcontext

import torch

from pagellm.layers.linear import LinearMethod, linear_method_for_new_layers
from pagellm.layers.quant.formats import WEIGHT_FORMATS, WeightFormat, register

# The modules that register the formats besides dense: imported on first use (they load kernels).
_FORMAT_MODULES = ("pagellm.layers.quant.gguf", "pagellm.layers.quant.int_weights")


def weight_format(name: str) -> WeightFormat:
    """The registered format `name`; ValueError naming the formats there are."""
    for module in _FORMAT_MODULES:
        importlib.import_module(module)
    if name not in WEIGHT_FORMATS:
        raise ValueError(f"weight format {name!r} is not one of {', '.join(WEIGHT_FORMATS)}")
    return WEIGHT_FORMATS[name]


def quantized_on_load(quantization: str) -> WeightFormat | None:
    """The format a `--quantization` value quantizes a safetensors checkpoint into as it loads;
    None for "auto" and "none" (the file's own form, or dense)."""
    if quantization in ("auto", "none"):
        return None
    fmt = weight_format(quantization)
    return fmt if fmt.quantizes_on_load else None


def linear_methods(weight_format_name: str, dtype: torch.dtype, batch_invariant: bool = False,
                   activation_quantization: str = "none") -> AbstractContextManager:
    """The context to build a model in so that its layers keep weights of the registered format
    `weight_format_name`: "dense" (a tensor in the model's dtype), "gguf" (GGUF blocks, see
    quant/gguf.py), or "int8" / "int4" (quantized as they load, see quant/int_weights.py).
    `batch_invariant`: every product sums in an order that does not depend on the batch
    (layers/invariant.py). `activation_quantization` "int8" / "int8x2": GGUF products round their
    activations to int8 codes (quant/gguf.py)."""
    fmt = weight_format(weight_format_name)
    if activation_quantization != "none":
        from pagellm.layers.quant.gguf import check_activation_quantization

        check_activation_quantization(activation_quantization, weight_format_name, batch_invariant)
    if batch_invariant and not fmt.batch_invariant:
        raise ValueError(f"batch-invariant mode does not cover quantization {fmt.name!r} yet "
                         f"({fmt.why_not_invariant}); use dense or GGUF weights")
    factory = fmt.factory(dtype, batch_invariant, activation_quantization)
    return nullcontext() if factory is None else linear_method_for_new_layers(factory)


def _dense(dtype: torch.dtype, batch_invariant: bool, activations: str) -> Callable[[], LinearMethod] | None:
    if not batch_invariant:
        return None
    from pagellm.layers.invariant import BatchInvariantLinearMethod

    return BatchInvariantLinearMethod


register(WeightFormat("dense", _dense))
