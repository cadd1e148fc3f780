"""Gemma 4's cache beyond exactness (test_families): the KV-shared layers hold no cache, full
and sliding layers keep rows of their own sizes in one pool, and what it cannot serve is refused."""
from __future__ import annotations

import json

import pytest

from pagellm import LLM, SamplingParams
from tests.conftest import tokens_and_logprobs
from tests.models.families import build


@pytest.fixture(scope="module")
def gemma4(tmp_path_factory) -> str:
    return str(build("gemma4", tmp_path_factory.mktemp("gemma4")))


def test_shared_layers_hold_no_cache_and_each_layer_keeps_its_rows(gemma4):
    llm = LLM(gemma4, num_kv_blocks=16, block_size=4)
    runner = llm.engine.runner
    # Five layers, the last two sharing the K/V of layers 2 (sliding) and 1 (full): three caches.
    assert runner.model.cache_index == [0, 1, 2, 2, 1]
    assert runner.layer_rows == [(2, 16, 16), (1, 64, 64), (2, 16, 16)]
    (k_sliding, _), (k_full, _), _ = runner.kv_caches
    blocks = k_full.shape[0]
    assert k_full.shape == (blocks, 4, 1, 64) and k_full.is_contiguous()
    # A sliding layer sees the first half of each block of the slot a full layer fills whole (2 x 16 of 64 values).
    assert k_sliding.shape == (blocks, 4, 2, 16) and not k_sliding.is_contiguous()
    assert k_sliding.untyped_storage().data_ptr() == k_full.untyped_storage().data_ptr()
    # One slot (one layer of each of the three groups), K and V of 4 tokens of 64 float32 values.
    assert runner.bytes_per_block(4) == 1 * 4 * (64 + 64) * 4


def test_8bit_kv_serves_the_mixed_rows(gemma4):
    """int8 K/V through the strided views: the float32 cache's first tokens (later ones drift apart
    on this small random model), logprobs within the format's rounding."""
    prompts = [{"prompt_token_ids": p} for p in ([5, 9, 17, 33, 2, 8, 40], list(range(3, 30)))]
    params = SamplingParams(temperature=0.0, max_tokens=3, ignore_eos=True, logprobs=0)
    want = tokens_and_logprobs(LLM(gemma4, num_kv_blocks=64, block_size=4).generate(prompts, params, use_tqdm=False))
    got = tokens_and_logprobs(LLM(gemma4, num_kv_blocks=64, block_size=4, kv_cache_dtype="int8")
                              .generate(prompts, params, use_tqdm=False))
    assert [t for t, _ in got] == [t for t, _ in want]
    for (_, lps), (_, ref) in zip(got, want):
        assert lps == pytest.approx(ref, abs=0.05)


def test_bidirectional_attention_is_refused_naming_it(gemma4, tmp_path):
    config = json.loads(open(f"{gemma4}/config.json").read())
    (tmp_path / "config.json").write_text(json.dumps({**config, "use_bidirectional_attention": "all"}))
    for name in ("model.safetensors", "tokenizer.json", "tokenizer_config.json"):
        (tmp_path / name).symlink_to(f"{gemma4}/{name}")
    with pytest.raises(ValueError, match="use_bidirectional_attention='all'"):
        LLM(str(tmp_path), num_kv_blocks=16)
