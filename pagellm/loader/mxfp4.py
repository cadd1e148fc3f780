"""OpenAI's MXFP4 checkpoint tensors (gpt-oss's experts, `<name>_blocks` uint8 [E, rows, cols / 32,
16] and `<name>_scales` uint8 [E, rows, cols / 32]) joined into GGUF's MXFP4 blocks, which the CPU
kernels multiply (layers/quant/codebook.py).

Both formats hold, per 32 values, one E8M0 exponent e and 16 bytes of 4-bit E2M1 codes, and mean
the same value by a code and an exponent: fp4[code] * 2^(e - 127) (GGUF's table is fp4 doubled,
its scale 2^(e - 128)). Only the codes' order in the bytes differs: OpenAI's byte i holds values
2i (low nibble) and 2i + 1 (high), GGUF's byte i values i and i + 16. So a block is the exponent
byte followed by the codes reordered; nothing is rounded.
"""
from __future__ import annotations

from collections.abc import Iterable, Iterator

import torch
from gguf import GGMLQuantizationType

from pagellm.layers.quant.gguf import ExpertBlocks

_PARTS = ("_blocks", "_scales")


def gguf_blocks(blocks: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """OpenAI's blocks [..., G, 16] and scales [..., G] as GGUF MXFP4 rows [..., G * 17]."""
    if blocks.dtype != torch.uint8 or scales.dtype != torch.uint8 or blocks.shape[-1] != 16 \
            or blocks.shape[:-1] != scales.shape:
        raise ValueError(f"MXFP4 blocks {tuple(blocks.shape)} {blocks.dtype} and scales {tuple(scales.shape)} "
                         f"{scales.dtype}: expected uint8 [..., G, 16] and uint8 [..., G]")
    codes = torch.stack([blocks & 0x0F, blocks >> 4], dim=-1).flatten(-2)  # [..., G, 32] in value order
    packed = codes[..., :16] | (codes[..., 16:] << 4)
    return torch.cat([scales.unsqueeze(-1), packed], dim=-1).flatten(-2)


def join_mxfp4(weights: Iterable[tuple[str, torch.Tensor]]) -> Iterator[tuple[str, torch.Tensor | ExpertBlocks]]:
    """The checkpoint's tensors, each `<name>_blocks` and `<name>_scales` pair of experts' matrices
    yielded once, as `<name>` in ExpertBlocks [E, rows, cols] (rows: the matrix's outputs, as both
    formats store them); the others as they come."""
    pending: dict[str, dict[str, torch.Tensor]] = {}
    for name, tensor in weights:
        part = next((p for p in _PARTS if name.endswith(p)), None)
        if part is None or ".experts." not in name:
            yield name, tensor
            continue
        base = name.removesuffix(part)
        pair = pending.setdefault(base, {})
        pair[part] = tensor
        if len(pair) == 2:
            del pending[base]
            blocks, scales = pair["_blocks"], pair["_scales"]
            yield base, ExpertBlocks(gguf_blocks(blocks, scales).contiguous(), int(GGMLQuantizationType.MXFP4),
                                     blocks.shape[-2] * 32)
    if pending:
        base, pair = next(iter(pending.items()))
        missing = next(p for p in _PARTS if p not in pair)
        raise ValueError(f"MXFP4 weight {base}{missing} is missing beside {base}{next(iter(pair))}")
