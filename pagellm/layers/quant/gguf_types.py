"""The GGUF block types pagellm multiplies in their blocks, one row each: the table the linear
methods (quant/gguf.py, quant/codebook.py), the loader and the docs derive their lists from
(docs/quantization.md's table is generated from it; tests/layers/test_gguf_types.py checks the
rest). A GGUF type not here is dequantized at load, with a warning naming it."""
from __future__ import annotations

from dataclasses import dataclass

# The kernels that serve a type: blocks of scaled integers, or 4-bit codes into a table of values
# (quant/codebook.py).
QUANT_OPS = "quant_ops"
CODEBOOK = "codebook"
KERNEL_SOURCES = {QUANT_OPS: "kernels/csrc/quant_ops.cpp", CODEBOOK: "kernels/csrc/quant_codebook_ops.cpp"}


@dataclass(frozen=True)
class BlockType:
    id: int  # the GGML type id, as the file (gguf.GGMLQuantizationType) and the C++ enums number it
    name: str
    values: int  # values per block
    bytes: int  # bytes per block
    kernels: str  # QUANT_OPS or CODEBOOK

    @property
    def k_quant(self) -> bool:
        """A K-quant: super-blocks of 256 values with sub-block scales, whose integer products take
        the activations 256 values at a time (llama.cpp's Q8_K)."""
        return self.name.endswith("_K")


# In the order the docs list them.
BLOCK_TYPES: dict[int, BlockType] = {t.id: t for t in (
    BlockType(8, "Q8_0", 32, 34, QUANT_OPS),
    BlockType(2, "Q4_0", 32, 18, QUANT_OPS),
    BlockType(3, "Q4_1", 32, 20, QUANT_OPS),
    BlockType(12, "Q4_K", 256, 144, QUANT_OPS),
    BlockType(13, "Q5_K", 256, 176, QUANT_OPS),
    BlockType(14, "Q6_K", 256, 210, QUANT_OPS),
    BlockType(39, "MXFP4", 32, 17, CODEBOOK),
    BlockType(20, "IQ4_NL", 32, 18, CODEBOOK),
    BlockType(23, "IQ4_XS", 256, 136, CODEBOOK),
)}


def served_by(kernels: str) -> dict[int, BlockType]:
    return {i: t for i, t in BLOCK_TYPES.items() if t.kernels == kernels}
