"""Linear methods for quantized weights, and the choice of one for a model being built."""
from __future__ import annotations

import importlib
from collections.abc import Callable
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from pagellm.layers.linear import LinearMethod, linear_method_for_new_layers

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


@dataclass(frozen=True)
class WeightFormat:
    """One way linear layers keep their weights, registered by the module that implements it
    (`register`); `linear_methods` builds a model's layers with it."""

    name: str
    # (model dtype, batch_invariant, activation_quantization) -> a factory of each new layer's
    # LinearMethod, or None for the layers' own dense method.
    factory: Callable[[torch.dtype, bool, str], Callable[[], LinearMethod] | None]
    # Batch-invariant mode covers it; else `why_not_invariant` says why not.
    batch_invariant: bool = True
    why_not_invariant: str = ""
    # `--quantization NAME`: a safetensors checkpoint quantized as it loads.
    quantizes_on_load: bool = False
    devices: tuple[str, ...] = ("cpu", "cuda")


WEIGHT_FORMATS: dict[str, WeightFormat] = {}
# The modules that register the formats besides dense: imported on first use (they load kernels).
_FORMAT_MODULES = ("pagellm.layers.quant.gguf", "pagellm.layers.quant.int_weights")


def register(fmt: WeightFormat) -> WeightFormat:
    if fmt.name in WEIGHT_FORMATS and WEIGHT_FORMATS[fmt.name] != fmt:
        raise ValueError(f"weight format {fmt.name!r} is registered twice")
    WEIGHT_FORMATS[fmt.name] = fmt
    return fmt


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
