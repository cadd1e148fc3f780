"""Greedy outputs match Hugging Face transformers token for token, and each token's logprob
to within LOGPROB_ATOL (fp32, CPU): batched, alone, at several block sizes, in chunks, and
after preemption."""
from __future__ import annotations

import random

import pytest
import torch
import transformers

from pagellm import LLM, SamplingParams
from tests.conftest import assert_matches, hf_greedy_logprobs, tokens_and_logprobs

N_NEW = 24


def _prompts(seed: int, vocab: int, lengths: list[int]) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, vocab) for _ in range(n)] for n in lengths]


@pytest.fixture(scope="module", params=["llama", "qwen2"])
def tiny(request, tiny_llama_dir, tiny_qwen2_dir):
    path = tiny_llama_dir if request.param == "llama" else tiny_qwen2_dir
    hf = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    prompts = _prompts(7, 320, [1, 5, 17, 40, 100, 3])
    expected = [hf_greedy_logprobs(hf, p, N_NEW) for p in prompts]
    return path, prompts, expected


GREEDY = SamplingParams(temperature=0.0, max_tokens=N_NEW, ignore_eos=True, logprobs=0)


def _gen(llm: LLM, prompts, one_at_a_time=False) -> list[tuple[list[int], list[float]]]:
    items = [{"prompt_token_ids": p} for p in prompts]
    if one_at_a_time:
        outs = [llm.generate(i, GREEDY, use_tqdm=False)[0] for i in items]
    else:
        outs = llm.generate(items, GREEDY, use_tqdm=False)
    return tokens_and_logprobs(outs)


def test_batched_matches_transformers(tiny):
    path, prompts, expected = tiny
    llm = LLM(path, num_kv_blocks=256)
    assert_matches(_gen(llm, prompts), expected)
    assert_matches(_gen(llm, prompts, one_at_a_time=True), expected)
    assert llm.stats()["used_blocks"] == 0


@pytest.mark.parametrize("block_size", [1, 16, 32])
def test_block_sizes(tiny, block_size):
    path, prompts, expected = tiny
    # Pools sized to the work (4,096 token slots): the default 1 GiB would be millions of blocks
    # of one token, and the tests check every block's bookkeeping after every step.
    assert_matches(_gen(LLM(path, block_size=block_size, num_kv_blocks=4096 // block_size), prompts), expected)


def test_chunked_prefill(tiny):
    path, prompts, expected = tiny
    # A 16-token budget splits the 40- and 100-token prompts over many steps.
    llm = LLM(path, max_num_batched_tokens=16, block_size=4, num_kv_blocks=1024)
    assert_matches(_gen(llm, prompts), expected)


def test_preemption(tiny):
    path, prompts, expected = tiny
    # 36 blocks of 4 tokens hold the longest request (124 tokens) but not all six at once.
    llm = LLM(path, block_size=4, num_kv_blocks=36)
    assert_matches(_gen(llm, prompts), expected)
    stats = llm.stats()
    assert stats["num_preemptions"] > 0
    assert stats["free_blocks"] == stats["total_blocks"]


def _max_logprob_gap(got, expected) -> float:
    return max(abs(a - b) for (_, lps), (_, want) in zip(got, expected) for a, b in zip(lps, want))
