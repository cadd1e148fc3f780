"""Prompt logprobs: each prompt token's logprob given the tokens before it equals
transformers' log-softmax within LOGPROB_ATOL in fp32, whatever the chunking, with the prefix
already cached, through preemption, and for n > 1; ranks and top alternatives agree with it."""
from __future__ import annotations

import random

import pytest
import torch
import transformers

from pagellm import LLM, SamplingParams
from tests.conftest import LOGPROB_ATOL

PROMPT_LENGTHS = (1, 2, 9, 30)


@pytest.fixture(scope="module")
def reference(tiny_llama_dir):
    hf = transformers.AutoModelForCausalLM.from_pretrained(tiny_llama_dir, dtype=torch.float32).eval()
    rng = random.Random(7)
    prompts = [[rng.randrange(3, 320) for _ in range(n)] for n in PROMPT_LENGTHS]
    expected = []
    for p in prompts:
        with torch.no_grad():
            logits = hf(torch.tensor([p])).logits[0].float()
        expected.append(torch.log_softmax(logits, -1)[:-1])  # row i scores token i + 1
    return tiny_llama_dir, prompts, expected


def check(outs, prompts, expected, k: int) -> None:
    for out, prompt, lps in zip(outs, prompts, expected):
        got = out.prompt_logprobs
        assert len(got) == len(prompt) and got[0] is None
        for i, entry in enumerate(got[1:]):
            token = prompt[i + 1]
            want = lps[i]
            assert entry[token].logprob == pytest.approx(float(want[token]), abs=LOGPROB_ATOL)
            assert entry[token].rank == int((want > want[token]).sum()) + 1
            top = [t for t in entry if t != token or entry[t].rank <= k]
            assert [entry[t].logprob for t in top] == sorted((entry[t].logprob for t in top), reverse=True)
            assert set(top[:k]) == set(torch.topk(want, k).indices.tolist())
            assert len(entry) in (k, k + 1)


def test_prompt_logprobs_match_transformers(reference):
    path, prompts, expected = reference
    llm = LLM(path, num_kv_blocks=128)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts],
                        SamplingParams(max_tokens=2, prompt_logprobs=3), use_tqdm=False)
    check(outs, prompts, expected, 3)
    plain = llm.generate([{"prompt_token_ids": prompts[-1]}], SamplingParams(max_tokens=2), use_tqdm=False)
    assert plain[0].prompt_logprobs is None


def test_chunked_cached_preempted_and_forked(reference):
    """Chunks of 4 tokens; every prompt first served without prompt logprobs, so its blocks are
    cached when it comes again; a pool small enough to preempt; n = 2 samples."""
    path, prompts, expected = reference
    llm = LLM(path, block_size=4, num_kv_blocks=14, max_num_batched_tokens=4)
    items = [{"prompt_token_ids": p} for p in prompts]
    llm.generate(items, SamplingParams(max_tokens=1), use_tqdm=False)
    control = llm.generate(items[-1:], SamplingParams(max_tokens=1), use_tqdm=False)
    assert control[0].num_cached_tokens > 0  # the cache holds the prompts
    outs = llm.generate(items, SamplingParams(n=2, max_tokens=24, ignore_eos=True, prompt_logprobs=0),
                        use_tqdm=False)
    check(outs, prompts, expected, 0)
    assert all(o.num_cached_tokens == 0 for o in outs)  # yet they were computed, not taken from it
    stats = llm.stats()
    assert stats["num_preemptions"] > 0
    assert stats["free_blocks"] == stats["total_blocks"]


def test_prompt_logprobs_are_checked(tiny_llama_dir):
    with pytest.raises(ValueError, match="prompt_logprobs"):
        SamplingParams(prompt_logprobs=-1)
    llm = LLM(tiny_llama_dir, num_kv_blocks=16)
    with pytest.raises(ValueError, match=r"prompt_logprobs must be <= the vocabulary size \(320\), got 321"):
        llm.generate([{"prompt_token_ids": [5, 6]}], SamplingParams(prompt_logprobs=321), use_tqdm=False)


def test_two_ranks_score_the_prompt_as_one(reference):
    path, prompts, expected = reference
    params = SamplingParams(max_tokens=1, prompt_logprobs=2)
    items = [{"prompt_token_ids": p} for p in prompts]
    with LLM(path, tensor_parallel_size=2, num_kv_blocks=64, block_size=4, max_num_batched_tokens=8) as llm:
        outs = llm.generate(items, params, use_tqdm=False)
    check(outs, prompts, expected, 2)
