"""The registry of weight formats: how linear layers may keep their weights. Each format is
registered by the module that implements it (quant/gguf.py, quant/int_weights.py, dense in
quant/__init__.py); quant/__init__.py looks them up by name."""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from pagellm.layers.linear import LinearMethod


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


def register(fmt: WeightFormat) -> WeightFormat:
    if fmt.name in WEIGHT_FORMATS and WEIGHT_FORMATS[fmt.name] != fmt:
        raise ValueError(f"weight format {fmt.name!r} is registered twice")
    WEIGHT_FORMATS[fmt.name] = fmt
    return fmt
