"""The GGUF block types served in their blocks are one table (layers/quant/gguf_types.py): it
agrees with gguf-py's own, the lists the layers and the loader use are drawn from it, and every
prose list of them (README, docs, the --quantization help) names exactly its types. The docs'
table itself is checked by tests/bench/test_doc_tables.py."""
from __future__ import annotations

import re
from dataclasses import fields
from pathlib import Path

import pytest
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

from pagellm.config import EngineConfig
from pagellm.layers.quant import codebook, gguf
from pagellm.layers.quant.gguf_types import BLOCK_TYPES, CODEBOOK, KERNEL_SOURCES

ROOT = Path(__file__).resolve().parents[2]
TYPE_NAME = re.compile(r"\b(?:Q\d_[01K]|IQ\d_[A-Z]+|MXFP4)\b")
SERVED = {t.name for t in BLOCK_TYPES.values()}


def test_the_table_agrees_with_gguf_py():
    for t in BLOCK_TYPES.values():
        kind = GGMLQuantizationType(t.id)
        assert kind.name == t.name and GGML_QUANT_SIZES[kind] == (t.values, t.bytes), t
        assert t.kernels in KERNEL_SOURCES and (ROOT / "pagellm" / KERNEL_SOURCES[t.kernels]).exists()


def test_the_layers_lists_are_drawn_from_the_table():
    assert gguf.NATIVE_TYPES == {i: t.name for i, t in BLOCK_TYPES.items()}
    assert gguf.K_QUANTS == {i for i, t in BLOCK_TYPES.items() if t.name in ("Q4_K", "Q5_K", "Q6_K")}
    assert set(codebook.CODEBOOK_TYPES) == {i for i, t in BLOCK_TYPES.items() if t.kernels == CODEBOOK}


def _line(path: str, anchor: str) -> str:
    return next(line for line in (ROOT / path).read_text().splitlines() if anchor in line)


@pytest.mark.parametrize("text", [
    _line("README.md", "**GGUF** file ("),
    _line("README.md", "matrices stay in their blocks"),
    _line("docs/quantization.md", "| `auto` (default) |"),
    next(f.metadata["help"] for f in fields(EngineConfig) if f.name == "quantization"),
], ids=["README-models", "README-gguf", "quantization.md-auto", "--quantization-help"])
def test_prose_lists_name_the_tables_types(text):
    assert set(TYPE_NAME.findall(text)) == SERVED
