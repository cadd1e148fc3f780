"""How big the KV pool is when nobody says: README's rule, 1 GiB on the CPU or half the free
memory if that is less; a fraction of the free memory or a byte count when given."""
from __future__ import annotations

import pytest

from pagellm import LLM

GIB = 1 << 30


@pytest.mark.parametrize("free, asked, budget", [
    (8 * GIB, None, GIB),                  # plenty free: 1 GiB
    (GIB, None, GIB // 2),                 # little free: half of it
    (2 * GIB, 0.125, GIB // 4),             # a fraction of what is free
    (8 * GIB, 3 << 20, 3 << 20),           # bytes
])
def test_kv_pool_size(tiny_llama_dir, monkeypatch, free, asked, budget):
    monkeypatch.setattr("pagellm.worker.model_runner.free_memory_bytes", lambda device: free)
    llm = LLM(tiny_llama_dir, kv_cache_memory=asked)
    per_block = llm.engine.runner.bytes_per_block(16)
    assert per_block == 2 * 2 * 16 * 2 * 16 * 4  # K and V, 2 layers, 16 tokens, 2 KV heads of 16, fp32
    assert llm.stats()["total_blocks"] == budget // per_block
    kv_bytes = llm.engine.memory_report()[0]["kv_cache_bytes"]
    assert budget - per_block < kv_bytes <= budget
