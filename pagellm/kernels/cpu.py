"""A compiled paged-decode kernel for the CPU, built on first use.

torch has no op that reads K/V through a block table, so the pure-torch path gathers
each sequence's blocks into a padded copy before attending; on the CPU that copy, not
the arithmetic, dominates a long-context decode step. This small C++ kernel reads the
blocks in place. It is compiled once (torch.utils.cpp_extension, cached under
TORCH_EXTENSIONS_DIR); when no compiler is at hand, or PAGELLM_CPU_KERNELS=0, the torch
path runs instead and the results are the same up to float rounding.
"""
from __future__ import annotations

import logging
import os
from functools import lru_cache
from pathlib import Path

import torch

logger = logging.getLogger(__name__)
_SOURCE = Path(__file__).with_name("csrc") / "paged_decode.cpp"


@lru_cache(maxsize=1)
def _load():
    if os.environ.get("PAGELLM_CPU_KERNELS", "1") == "0":
        return None
    try:
        from torch.utils.cpp_extension import load

        return load(name="pagellm_paged_decode", sources=[str(_SOURCE)],
                    extra_cflags=["-O3", "-march=native", "-fopenmp-simd"], verbose=False)
    except Exception as e:  # no compiler, no ninja, a broken toolchain: fall back, loudly once
        logger.warning("pagellm: CPU paged-decode kernel unavailable (%s); using the torch path", e)
        return None


def available() -> bool:
    return _load() is not None


def paged_decode(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_tables: torch.Tensor,
                 seq_lens: torch.Tensor, scale: float) -> torch.Tensor:
    """q: [B, H, D] float32 on the CPU. Returns [B, H, D]."""
    return _load().paged_decode(q, k_cache, v_cache, block_tables, seq_lens, scale)
