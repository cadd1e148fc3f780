"""`--quantization int8 | int4` for dense checkpoints (safetensors): weights quantized as they
load, multiplied by torch's packed CPU kernels.

- int8: symmetric, one scale per output channel, W ~ q * s with q in [-127, 127];
  `torch._weight_int8pack_mm` (activations in the model's dtype, weights int8).
- int4: asymmetric in groups of `group_size` input features (128, or the largest of 128, 64, 32
  that divides the layer's inputs), W ~ q * s + m with q in [0, 15]; packed by
  `torch._convert_weight_to_int4pack_for_cpu` and multiplied by `torch._weight_int4pack_mm_for_cpu`.
  A layer whose inputs no group divides, or whose outputs the packing cannot take (a multiple of
  INT4_ROWS: a mixture of experts' router over 8 experts), is kept in int8.

The token embedding and the LM head stay in the model's dtype, as other engines keep them:
they are one lookup and one product per step, and the head decides every token.

A layer's rows arrive one checkpoint tensor at a time (fused q/k/v, gate/up), so they are
staged in the model's dtype and quantized in `finish`, after which no dense copy remains.
"""
from __future__ import annotations

import logging

import torch
from torch import nn

from pagellm.layers.linear import LinearMethod, UnquantizedLinearMethod
from pagellm.layers.quant.formats import WeightFormat, register
from pagellm.layers.quant.tiled import tiled_product

logger = logging.getLogger("pagellm.quant")

INT4_GROUP_SIZES = (128, 64, 32)
# torch's int4 packing takes output features in multiples of this.
INT4_ROWS = 16


def _is_table(layer: nn.Module) -> bool:
    from pagellm.layers.embedding import VocabParallelEmbedding

    return isinstance(layer, VocabParallelEmbedding)


def quantize_int8(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(q int8 [N, K], scale float32 [N]) with w ~ q * scale[:, None], per output channel."""
    w = w.float()
    scale = (w.abs().amax(1) / 127.0).clamp_(min=torch.finfo(torch.float32).tiny)
    q = torch.round(w / scale[:, None]).clamp_(-127, 127).to(torch.int8)
    return q, scale


def quantize_int4(w: torch.Tensor, group_size: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(q int32 [N, K] in [0, 15], scale [N, K/G], minimum [N, K/G]) with w ~ q * scale + minimum
    in each group of `group_size` input features."""
    n, k = w.shape
    g = w.float().view(n, k // group_size, group_size)
    low, high = g.amin(-1), g.amax(-1)
    scale = ((high - low) / 15.0).clamp_(min=torch.finfo(torch.float32).tiny)
    q = torch.round((g - low[..., None]) / scale[..., None]).clamp_(0, 15).to(torch.int32).view(n, k)
    return q, scale, low


def int4_group(in_features: int, group_size: int = 128) -> int | None:
    """The int4 group a layer with `in_features` inputs gets: `group_size` or the largest smaller
    one of INT4_GROUP_SIZES that divides it; None if none does (the layer stays int8)."""
    return next((g for g in (group_size, *INT4_GROUP_SIZES) if g <= group_size and in_features % g == 0), None)


_warned_float32 = False


class _StagedLinearMethod(LinearMethod):
    """Holds the dense weight until `finish`, then only the quantized form."""

    def __init__(self, dtype: torch.dtype) -> None:
        global _warned_float32
        self.dtype = dtype
        self.dense = UnquantizedLinearMethod()
        if dtype == torch.float32 and not _warned_float32:
            # benchmarks/results/quant-matmul-2026-12-01.json: torch's packed kernels are the fastest
            # product at batch 1 in bfloat16, and 5-60x slower than a dense one with float32 activations.
            _warned_float32 = True
            logger.warning("int8/int4 weights with float32 activations are slower than dense float32 (torch's "
                           "packed CPU kernels are fast in bfloat16; int4 has no other path): use --dtype bfloat16")

    def create_weights(self, layer: nn.Module, in_features: int, out_features: int) -> None:
        self.dense.create_weights(layer, in_features, out_features)

    def finish(self, layer: nn.Module) -> None:
        if _is_table(layer):
            return
        weight = layer.weight.data
        del layer.weight
        self.quantize(layer, weight)

    def quantize(self, layer: nn.Module, weight: torch.Tensor) -> None:
        raise NotImplementedError

    def apply(self, layer: nn.Module, x: torch.Tensor) -> torch.Tensor:
        if _is_table(layer):
            return self.dense.apply(layer, x)
        shape = x.shape
        y = self.matmul(layer, x.reshape(-1, shape[-1]).to(self.dtype))
        return y.reshape(*shape[:-1], y.shape[-1])

    def matmul(self, layer: nn.Module, x: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError


def _int8(layer: nn.Module, weight: torch.Tensor, dtype: torch.dtype) -> None:
    q, scale = quantize_int8(weight)
    layer.qweight = nn.Parameter(q, requires_grad=False)
    layer.scales = nn.Parameter(scale.to(dtype), requires_grad=False)


# With float32 activations torch's int8 kernel is 4-60x slower than a dense product at every
# batch size (quant-matmul-2026-12-01.json): past this many rows (none, in float32) rows of W
# are widened a tile at a time for torch's GEMM instead.
PACKED_MAX_ROWS = {torch.float32: 0}


def _int8_matmul(x: torch.Tensor, q: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    if x.shape[0] <= PACKED_MAX_ROWS.get(x.dtype, 1 << 30):
        return torch._weight_int8pack_mm(x, q, scales)
    return tiled_product(x, *q.shape, lambda start, end: q[start:end].to(x.dtype).mul_(scales[start:end, None]))


class Int8LinearMethod(_StagedLinearMethod):
    def quantize(self, layer: nn.Module, weight: torch.Tensor) -> None:
        _int8(layer, weight, self.dtype)

    def matmul(self, layer: nn.Module, x: torch.Tensor) -> torch.Tensor:
        return _int8_matmul(x, layer.qweight, layer.scales)


class Int4LinearMethod(_StagedLinearMethod):
    def __init__(self, dtype: torch.dtype, group_size: int = 128) -> None:
        super().__init__(dtype)
        self.group_size = group_size

    def quantize(self, layer: nn.Module, weight: torch.Tensor) -> None:
        n, k = weight.shape
        group = int4_group(k, self.group_size)
        if group is None or n % INT4_ROWS:
            logger.info("a layer of %d x %d is kept in int8: int4 takes inputs that a group size of %s divides and "
                        "outputs in multiples of %d", n, k, INT4_GROUP_SIZES, INT4_ROWS)
            layer.int4_group = 0
            _int8(layer, weight, self.dtype)
            return
        q, scale, low = quantize_int4(weight, group)
        # The kernel reads w = (q - 8) * scale + zero, per [group, output] pair.
        zero = low + 8.0 * scale
        layer.int4_group = group
        layer.qweight = nn.Parameter(torch._convert_weight_to_int4pack_for_cpu(q, 1), requires_grad=False)
        layer.scales_and_zeros = nn.Parameter(torch.stack([scale, zero], -1).transpose(0, 1).contiguous()
                                              .to(self.dtype), requires_grad=False)

    def matmul(self, layer: nn.Module, x: torch.Tensor) -> torch.Tensor:
        if not layer.int4_group:
            return _int8_matmul(x, layer.qweight, layer.scales)
        return torch._weight_int4pack_mm_for_cpu(x, layer.qweight, layer.int4_group, layer.scales_and_zeros)


_PACKED = "torch's packed kernels pick their path by batch size"
register(WeightFormat("int8", lambda dtype, invariant, activations: lambda: Int8LinearMethod(dtype),
                      batch_invariant=False, why_not_invariant=_PACKED, quantizes_on_load=True, devices=("cpu",)))
register(WeightFormat("int4", lambda dtype, invariant, activations: lambda: Int4LinearMethod(dtype),
                      batch_invariant=False, why_not_invariant=_PACKED, quantizes_on_load=True, devices=("cpu",)))
