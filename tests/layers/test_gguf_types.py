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


def test_the_cpp_enums_number_the_types_as_the_table():
    """The kernels switch on the GGML type id; an enum that drifted from the table would send a
    type's blocks to another type's decoder."""
    by_name = {t.name: t.id for t in BLOCK_TYPES.values()}
    for kernels, source in KERNEL_SOURCES.items():
        text = (ROOT / "pagellm" / source).read_text()
        enums = [dict((n, int(v)) for n, v in re.findall(r"\b(\w+) = (\d+)", body))
                 for body in re.findall(r"enum[^{]*\{([^}]*)\}", text)]
        numbered = {n: v for e in enums for n, v in e.items() if n in by_name}
        served = {n for n, i in by_name.items() if BLOCK_TYPES[i].kernels == kernels}
        assert served <= set(numbered), (source, served - set(numbered))
        assert all(by_name[n] == v for n, v in numbered.items()), (source, numbered)
