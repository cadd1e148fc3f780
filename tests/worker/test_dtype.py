"""Which dtype a model computes in: bfloat16 on a CPU without bfloat16 instructions is refused
with a message that says why and what to use, before anything is loaded."""
from __future__ import annotations

import pytest
import torch

from pagellm import LLM, cpu_features
from pagellm.worker.model_runner import resolve_dtype

CPU = torch.device("cpu")


def test_auto_is_float32_on_the_cpu():
    assert resolve_dtype("auto", CPU) == torch.float32


def test_bfloat16_follows_the_cpus_instructions(monkeypatch):
    monkeypatch.setattr(cpu_features, "has_bf16", lambda: True)
    assert resolve_dtype("bfloat16", CPU) == torch.bfloat16
    monkeypatch.setattr(cpu_features, "has_bf16", lambda: False)
    with pytest.raises(ValueError, match=r"dtype 'bfloat16' needs a CPU with bfloat16 instructions.*'float32'"):
        resolve_dtype("bfloat16", CPU)
    assert resolve_dtype("float32", CPU) == torch.float32


def test_the_engine_refuses_bfloat16_where_the_cpu_lacks_it(tiny_llama_dir, monkeypatch):
    monkeypatch.setattr(cpu_features, "has_bf16", lambda: False)
    with pytest.raises(ValueError, match="bfloat16 instructions"):
        LLM(tiny_llama_dir, dtype="bfloat16", num_kv_blocks=8)


def test_flags_name_this_cpus_bfloat16():
    flags = cpu_features.cpu_flags()
    assert cpu_features.has_bf16() == bool(flags & {"avx512_bf16", "amx_bf16", "bf16"})
