"""Sharing KV blocks end to end: prefix caching, parallel sampling with copy-on-write,
best_of, and preemption of shared sequences."""
from __future__ import annotations

import random
from dataclasses import replace

import pytest
import torch
import transformers

from pagellm import LLM, SamplingParams
from tests.conftest import LOGPROB_ATOL, hf_greedy_logprobs

GREEDY = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)


def _ids(seed: int, n: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(3, 320) for _ in range(n)]


def _tokens(outs) -> list[list[int]]:
    return [c.token_ids for o in outs for c in o.outputs]


def _all_free(llm: LLM) -> None:
    s = llm.stats()
    assert s["used_blocks"] == 0 and s["free_blocks"] == s["total_blocks"]
    assert all(c == 0 for c in llm.engine.kv.pool.ref_cnt)


@pytest.fixture(scope="module")
def cached(tiny_llama_dir) -> LLM:
    return LLM(tiny_llama_dir, block_size=4, num_kv_blocks=400)


@pytest.fixture(scope="module")
def uncached(tiny_llama_dir) -> LLM:
    return LLM(tiny_llama_dir, block_size=4, num_kv_blocks=400, enable_prefix_caching=False)


def test_prefix_caching_matches_transformers(cached, uncached, tiny_llama_dir):
    """Prompts that start with a cached prefix give transformers' tokens and logprobs: on the
    first round (each caches what the one before computed), on the second (all cached), and
    as the second of two requests that share the prefix."""
    hf = transformers.AutoModelForCausalLM.from_pretrained(tiny_llama_dir, dtype=torch.float32).eval()
    prefix = _ids(1, 37)
    prompts = [prefix + _ids(10 + i, 3 + 5 * i) for i in range(4)] + [prefix]
    want = [hf_greedy_logprobs(hf, p, GREEDY.max_tokens) for p in prompts]
    params = replace(GREEDY, logprobs=0)

    def check(outs, expected) -> None:
        for out, (tokens, logprobs) in zip(outs, expected):
            c = out.outputs[0]
            assert c.token_ids == tokens
            assert [lp[t].logprob for t, lp in zip(c.token_ids, c.logprobs)] == pytest.approx(logprobs,
                                                                                               abs=LOGPROB_ATOL)

    items = [{"prompt_token_ids": p} for p in prompts]
    for _ in range(2):  # the second round finds every full block cached
        outs = cached.generate(items, params, use_tqdm=False)
        check(outs, want)
    assert min(o.num_cached_tokens for o in outs) >= 36
    cached.generate(items[0], params, use_tqdm=False)
    second = cached.generate(items[2], params, use_tqdm=False)
    check(second, want[2:3])
    assert second[0].num_cached_tokens >= 36
    _all_free(cached)
    check(uncached.generate(items, params, use_tqdm=False), want)
    assert uncached.stats()["prefix_cache_hits"] == 0


def test_shared_prefix_is_computed_once(tiny_llama_dir):
    llm = LLM(tiny_llama_dir, block_size=4, num_kv_blocks=200)
    k, bs = 6, 4
    prefix = _ids(2, k * bs)
    first = llm.generate({"prompt_token_ids": prefix + [7, 8, 9]}, GREEDY, use_tqdm=False)[0]
    assert first.num_cached_tokens == 0
    before = llm.stats()["prompt_tokens_computed"]
    second_prompt = prefix + [11, 12, 13, 14, 15]
    second = llm.generate({"prompt_token_ids": second_prompt}, GREEDY, use_tqdm=False)[0]
    computed = llm.stats()["prompt_tokens_computed"] - before
    assert second.num_cached_tokens >= k * bs - 1
    assert computed == len(second_prompt) - second.num_cached_tokens
    # A prompt entirely cached still computes its last token.
    third = llm.generate({"prompt_token_ids": prefix}, GREEDY, use_tqdm=False)[0]
    assert third.num_cached_tokens == k * bs - 1
    s = llm.stats()
    assert s["prefix_cache_hits"] >= 2 * k * bs - 1 and s["prefix_cache_queries"] >= s["prefix_cache_hits"]
    assert s["cached_blocks"] > 0
    _all_free(llm)


def test_cache_salt_isolates_tenants(tiny_llama_dir):
    llm = LLM(tiny_llama_dir, block_size=4, num_kv_blocks=200)
    eng = llm.engine
    prompt = {"prompt_token_ids": _ids(3, 20)}
    for rid, salt in [("a", "tenant-1"), ("b", "tenant-2"), ("c", "tenant-1")]:
        eng.add_request(rid, prompt, GREEDY, cache_salt=salt)
        outs = []
        while eng.has_unfinished_requests():
            outs += eng.step()
        cached = outs[-1].num_cached_tokens
        assert cached == {"a": 0, "b": 0, "c": 19}[rid]


def test_parallel_samples_equal_their_solo_runs(cached):
    """Copy-on-write isolation: n samples share the prompt's blocks, including the
    partly filled last one, yet each produces exactly what it would alone."""
    prompt = {"prompt_token_ids": _ids(4, 14)}  # 14 tokens: the last block (4 slots) is half full
    n = 4
    params = SamplingParams(n=n, temperature=1.0, seed=100, max_tokens=10, ignore_eos=True)
    out = cached.generate(prompt, params, use_tqdm=False)[0]
    assert [c.index for c in out.outputs] == list(range(n))
    got = [c.token_ids for c in out.outputs]
    assert len({tuple(g) for g in got}) > 1, "the samples should diverge"
    for i in range(n):
        solo = cached.generate(prompt, SamplingParams(temperature=1.0, seed=100 + i, max_tokens=10, ignore_eos=True),
                               use_tqdm=False)[0]
        assert solo.outputs[0].token_ids == got[i]
    _all_free(cached)


def test_fork_shares_blocks_until_they_diverge(tiny_llama_dir):
    llm = LLM(tiny_llama_dir, block_size=4, num_kv_blocks=200)
    eng = llm.engine
    eng.add_request("r", {"prompt_token_ids": _ids(5, 14)},
                    SamplingParams(n=3, temperature=1.0, seed=1, max_tokens=6, ignore_eos=True))
    eng.step()  # prefill and fork: 3 sequences, 4 blocks shared by all
    tables = [eng.kv.block_table(s) for s in ("r", "r#1", "r#2")]
    assert tables[0] == tables[1] == tables[2]
    assert all(eng.kv.pool.ref_cnt[b] == 3 for b in tables[0])
    assert llm.stats()["used_blocks"] == 4
    eng.step()  # each writes into the shared half-full block: two copies, one in place
    tables = [eng.kv.block_table(s) for s in ("r", "r#1", "r#2")]
    assert len({t[-1] for t in tables}) == 3
    assert all(t[:3] == tables[0][:3] for t in tables)
    assert llm.stats()["used_blocks"] == 3 + 3
    while eng.has_unfinished_requests():
        eng.step()
    _all_free(llm)


def test_best_of_returns_the_most_likely(cached):
    prompt = {"prompt_token_ids": _ids(6, 9)}
    params = SamplingParams(n=2, best_of=5, temperature=1.0, seed=7, max_tokens=8, ignore_eos=True)
    out = cached.generate(prompt, params, use_tqdm=False)[0]
    assert len(out.outputs) == 2
    scores = []
    for i in range(5):
        solo = cached.generate(prompt, SamplingParams(temperature=1.0, seed=7 + i, max_tokens=8, ignore_eos=True),
                               use_tqdm=False)[0].outputs[0]
        scores.append((solo.cumulative_logprob, solo.token_ids))
    best = sorted(scores, key=lambda s: -s[0])[:2]
    assert [c.token_ids for c in out.outputs] == [t for _, t in best]
    assert out.outputs[0].cumulative_logprob >= out.outputs[1].cumulative_logprob


def test_preempted_parallel_samples_recompute_correctly(tiny_llama_dir):
    roomy = LLM(tiny_llama_dir, block_size=4, num_kv_blocks=400)
    tight = LLM(tiny_llama_dir, block_size=4, num_kv_blocks=30)
    prompts = [{"prompt_token_ids": _ids(20 + i, 10 + 3 * i)} for i in range(4)]
    params = [SamplingParams(n=3, temperature=0.8, seed=50 + i, max_tokens=20, ignore_eos=True) for i in range(4)]
    want = _tokens(roomy.generate(prompts, params, use_tqdm=False))
    got = _tokens(tight.generate(prompts, params, use_tqdm=False))
    assert tight.stats()["num_preemptions"] > 0
    assert got == want
    _all_free(tight)


def test_abort_group_frees_every_sequence(tiny_llama_dir):
    llm = LLM(tiny_llama_dir, block_size=4, num_kv_blocks=200)
    eng = llm.engine
    eng.add_request("g", {"prompt_token_ids": _ids(8, 10)}, SamplingParams(n=4, max_tokens=50, ignore_eos=True))
    eng.step()
    eng.step()
    assert llm.stats()["num_running"] == 4
    eng.abort_request("g")
    assert not eng.has_unfinished_requests()
    _all_free(llm)
    eng.add_request("h", {"prompt_token_ids": [3]}, SamplingParams(n=2))
    with pytest.raises(ValueError, match="already in use"):
        eng.add_request("h", {"prompt_token_ids": [3]})
    with pytest.raises(ValueError, match="without '#'"):
        eng.add_request("h#1", {"prompt_token_ids": [3]})
    eng.abort_request("h")
    _all_free(llm)
