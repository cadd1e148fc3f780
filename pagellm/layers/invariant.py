"""Batch-invariant matrix products: each row of x @ W^T comes out the same bits whatever other
rows share the product.

torch's CPU GEMM picks its kernel and blocking by the number of rows (a matrix-vector product
for one row, other paths for a few and for many), and each path sums the K terms of an output
in its own order; so a token's hidden state, and in the end its logits, change in the last bits
with the batch it happens to run in. The fused kernel of csrc/quant_ops.cpp sums every output
in one fixed order for any number of rows, and reads dense float32 / float16 / bfloat16 weights
as well as GGUF blocks: batch-invariant mode sends every product through it.
"""
from __future__ import annotations

import torch
from torch import nn

from pagellm.kernels import cpu
from pagellm.layers.linear import UnquantizedLinearMethod

# Dense weight dtypes the kernel reads, as GGML type ids (F32, F16, BF16).
DENSE_TYPES = {torch.float32: 0, torch.float16: 1, torch.bfloat16: 30}
# The kernel sums in chunks of this many values; K must be a multiple.
K_MULTIPLE = 32


def kernels():
    """The compiled kernels, or RuntimeError: the mode has no torch fallback (torch's own products
    are exactly what it avoids)."""
    k = cpu.quant_kernels()
    if k is None:
        raise RuntimeError("batch-invariant mode needs the compiled CPU kernels (a C++ compiler and ninja), "
                           "which could not be built here; see the warning above")
    return k


def check_in_features(in_features: int) -> None:
    if in_features % K_MULTIPLE:
        raise ValueError(f"batch-invariant mode needs every linear layer's input features to be a multiple of "
                         f"{K_MULTIPLE}; this model has a layer with {in_features}")


def invariant_linear(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """x [..., K] @ weight [N, K]^T, in x's dtype, summed in float32 in an order fixed per output."""
    n, k = weight.shape
    w = weight if weight.is_contiguous() else weight.contiguous()
    y = kernels().gguf_matmul(x.reshape(-1, k), w.view(torch.uint8), DENSE_TYPES[w.dtype], k)
    return y.to(x.dtype).reshape(*x.shape[:-1], n)


class BatchInvariantLinearMethod(UnquantizedLinearMethod):
    """A dense weight, as UnquantizedLinearMethod keeps it, multiplied by the fixed-order kernel."""

    def create_weights(self, layer: nn.Module, in_features: int, out_features: int) -> None:
        check_in_features(in_features)
        super().create_weights(layer, in_features, out_features)

    def apply(self, layer: nn.Module, x: torch.Tensor) -> torch.Tensor:
        return invariant_linear(x, layer.weight)
