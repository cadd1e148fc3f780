"""How the paged cache stores K and V: in the model's dtype, or in 8 bits with a scale.

An 8-bit format stores each token's K (or V) of one KV head as D one-byte codes followed by
that row's float16 scale, one row of D + 2 bytes: value = code * scale, with
scale = max|row| / qmax (127 for int8, 448 for fp8 e4m3, 57344 for fp8 e5m2). The scale lives in
the block beside its codes, so a block is still one slice of one tensor: copy-on-write, and
anything else that moves whole blocks, moves the scales with them and needs no second tensor.

Why one scale per token and head: a token's row is written once, in the step that computes it,
so its scale is known then. A scale per block would have to be fixed before the block's later
tokens exist (or rewrite the block's earlier codes when a larger value arrives), and one
outlier token would coarsen its neighbours. It costs 2 bytes per row: 66 bytes for D = 64
against bfloat16's 128 (1.94x as many tokens in the same bytes), 130 against 256 for D = 128.
Scales are floored at float16's smallest normal number (2**-14) so that they keep their full
precision (a row smaller than that is stored to within 2**-15 absolute).

Every attention path reads the values the cache holds: a prompt's own K/V are rounded the same
way before it attends to them, so a token's output does not depend on whether its context was
computed in this step, an earlier chunk, or came from the prefix cache.
"""
from __future__ import annotations

import enum
from dataclasses import dataclass

import torch

from pagellm.config import KV_CACHE_DTYPES
SCALE_BYTES = 2  # a float16 scale after each row's codes
_MIN_SCALE = 2.0 ** -14  # float16's smallest normal number
_F16_MAX = 65504.0  # float16's largest finite number: the largest scale, and a float16 cache's bound


class KVCode(enum.IntEnum):
    """How the kernels know a format: the one numbering shared by Python, the C++ kernels (built
    with these values as -DPAGELLM_KV_<NAME>, kernel_defines) and the Triton kernels (their
    constexpr QUANT compared against these)."""

    PLAIN = 0  # values as they are (float32, bfloat16, float16)
    INT8 = 1
    FP8_E4M3 = 2
    FP8_E5M2 = 3


def kernel_defines() -> list[str]:
    """The compiler flags that give the C++ kernels KVCode's values."""
    return [f"-DPAGELLM_KV_{code.name}={int(code)}" for code in KVCode]


@dataclass(frozen=True)
class KVFormat:
    """One way of storing K/V rows. `dtype` is the value dtype (plain formats) or the dtype of
    the one-byte codes (8-bit formats, whose cache tensors are uint8 rows of D + 2 bytes)."""

    name: str
    dtype: torch.dtype
    qmax: float | None = None  # the largest code; None: values stored as they are
    kernel_code: KVCode = KVCode.PLAIN  # how the kernels know the format

    @property
    def quantized(self) -> bool:
        return self.qmax is not None

    @property
    def storage_dtype(self) -> torch.dtype:
        return torch.uint8 if self.quantized else self.dtype

    def row_size(self, head_dim: int) -> int:
        """Elements of storage_dtype per token per KV head: the cache tensor's last dimension."""
        return head_dim + SCALE_BYTES if self.quantized else head_dim

    def bytes_per_row(self, head_dim: int) -> int:
        return self.row_size(head_dim) * torch.empty((), dtype=self.storage_dtype).element_size()

    def encode(self, x: torch.Tensor) -> torch.Tensor:
        """Rows x [..., D] as they are stored: x in `dtype`, or [..., D + 2] uint8 codes and scale."""
        if not self.quantized:
            return plain_rows(x, self.dtype)
        xf = x.float()
        scale = (xf.abs().amax(-1, keepdim=True) / self.qmax).clamp(_MIN_SCALE, _F16_MAX).half()
        codes = xf / scale.float()  # within +-qmax, up to the scale's rounding: clamped below
        if self.dtype == torch.int8:
            codes = codes.round_().clamp_(-self.qmax, self.qmax).to(torch.int8)
        else:
            codes = codes.clamp_(-self.qmax, self.qmax).to(self.dtype)
        return torch.cat([codes.view(torch.uint8), scale.view(torch.uint8)], dim=-1)

    def decode(self, rows: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """Stored rows back to values [..., D] in `dtype`."""
        if not self.quantized:
            return rows.to(dtype)
        d = rows.shape[-1] - SCALE_BYTES
        codes = rows[..., :d].contiguous().view(self.dtype).float()
        scale = rows[..., d:].contiguous().view(torch.float16).float()
        return (codes * scale).to(dtype)


def plain_rows(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """x as a plain cache of `dtype` stores it: float16 saturates at +-65504 (an infinity would turn
    every later score of its head into NaN; the compiled store_kv does the same)."""
    if dtype == torch.float16 and x.dtype != torch.float16:
        x = x.float().clamp(-_F16_MAX, _F16_MAX)  # in float32: bfloat16 would round the bound to 65536
    return x.to(dtype)


def kernel_code(kv_format: KVFormat | None) -> int:
    """The number the kernels know a cache's rows by (None: values as they are)."""
    return int(kv_format.kernel_code if kv_format is not None else KVCode.PLAIN)


_QUANTIZED = {
    "int8": KVFormat("int8", torch.int8, 127.0, KVCode.INT8),
    "fp8_e4m3": KVFormat("fp8_e4m3", torch.float8_e4m3fn, 448.0, KVCode.FP8_E4M3),
    "fp8_e5m2": KVFormat("fp8_e5m2", torch.float8_e5m2, 57344.0, KVCode.FP8_E5M2),
}
_PLAIN = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def resolve_kv_format(kv_cache_dtype: str, model_dtype: torch.dtype) -> KVFormat:
    """The format for `--kv-cache-dtype` on a model computing in `model_dtype`."""
    name = "fp8_e4m3" if kv_cache_dtype == "fp8" else kv_cache_dtype
    if name == "auto":
        return KVFormat(str(model_dtype).removeprefix("torch."), model_dtype)
    if name in _QUANTIZED:
        return _QUANTIZED[name]
    if name in _PLAIN:
        return KVFormat(name, _PLAIN[name])
    raise ValueError(f"kv_cache_dtype must be one of {KV_CACHE_DTYPES}, got {kv_cache_dtype!r}")
