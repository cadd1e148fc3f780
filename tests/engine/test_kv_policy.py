"""`kv_policy`: the engine on contiguous reservations gives the same tokens as on pages,
and holds fewer requests at once at the same KV budget."""
from __future__ import annotations

import pytest

from pagellm import LLM, SamplingParams
from pagellm.core.kv.contiguous import ContiguousKVManager


def test_contiguous_policies_give_the_paged_tokens_with_fewer_requests_at_once(tiny_llama_dir):
    prompts = [{"prompt_token_ids": [(7 * i + j) % 200 + 3 for j in range(5 + 3 * i)]} for i in range(6)]
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    results, peaks = {}, {}
    for policy in ("paged", "contiguous-max", "contiguous-oracle"):
        llm = LLM(tiny_llama_dir, block_size=4, num_kv_blocks=40, max_model_len=64, kv_policy=policy)
        assert isinstance(llm.engine.kv, ContiguousKVManager) == (policy != "paged")
        engine, peak = llm.engine, 0
        for i, p in enumerate(prompts):
            engine.add_request(str(i), p, params)
        outs = {}
        while engine.has_unfinished_requests():
            for o in engine.step():
                if o.finished:
                    outs[int(o.request_id)] = o.outputs[0].token_ids
            peak = max(peak, len(engine.scheduler.running))
        results[policy], peaks[policy] = outs, peak
        assert engine.stats().kv.free_blocks == 40  # everything returned
        assert len(engine.kv_snapshot()["ref_cnt"]) == 40  # the dashboard's block map reads either pool
    assert results["contiguous-max"] == results["paged"] == results["contiguous-oracle"]
    # 160 slots, 64 reserved per request under max: two at a time, where pages fit all six.
    assert peaks["contiguous-max"] == 2 and peaks["paged"] == 6


def test_unknown_policy_is_refused_by_name(tiny_llama_dir):
    with pytest.raises(ValueError, match=r"kv_policy must be one of .*'contiguous'"):
        LLM(tiny_llama_dir, kv_policy="contiguous")
