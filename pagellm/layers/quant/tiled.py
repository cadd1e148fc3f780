"""A product with a weight matrix kept compressed, widened a tile at a time: the path of the
quantized formats for compute-bound batches."""
from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F

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
