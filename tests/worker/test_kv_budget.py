"""How big the KV pool is when nobody says: README's rule, 1 GiB on the CPU or half the free
memory if that is less; a fraction of the free memory or a byte count when given."""
from __future__ import annotations

import re

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


@pytest.mark.parametrize("option", ["num_kv_blocks", "kv_cache_memory"])
def test_a_pool_beyond_the_host_memory_is_refused_with_the_figures(tiny_llama_dir, option):
    """Asked for twice what the host has available (MemAvailable, read for real): refused at start,
    naming the option, the bytes asked for and the bytes available, before anything is allocated."""
    from pagellm.worker.model_runner import free_memory_bytes
    import torch

    per_block = 2 * 2 * 16 * 2 * 16 * 4
    blocks = 2 * free_memory_bytes(torch.device("cpu")) // per_block
    value = blocks if option == "num_kv_blocks" else blocks * per_block
    with pytest.raises(ValueError) as e:
        LLM(tiny_llama_dir, **{option: value})
    message = str(e.value)
    match = re.fullmatch(rf"{option}={value} asks for a KV cache of (\d+) bytes \(.* GiB: {blocks} blocks of "
                         rf"{per_block} bytes\) but this host has (\d+) bytes \(.* GiB\) available beside the "
                         rf"weights \(MemAvailable\); lower kv_cache_memory .*", message)
    assert match, message
    asked, available = int(match[1]), int(match[2])
    assert asked == blocks * per_block > available > 0
