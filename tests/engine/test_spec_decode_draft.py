"""Speculative decoding with a draft model (method "draft_model") is lossless: greedy outputs are
plain decoding's token for token, batched, in prefill chunks and under preemption (both modes);
sampled outputs keep the target's logprobs; a draft identical to the target has every proposal
accepted; the draft's own KV cache holds no block once the requests are done; a draft with
another vocabulary is refused, naming what differs.

Two drafts: the target itself (every greedy proposal right: accepted runs, rolled forward) and a
model of another family and other weights (most proposals wrong: rejections, rolled back).
"""
from __future__ import annotations

import json
import logging
import random
import shutil

import pytest

from pagellm import LLM, SamplingParams
from tests.engine.spec_stats import without_times
from tests.models.families import build

N_NEW = 24


def _spec(draft: str, **extra) -> dict:
    return {"method": "draft_model", "model": draft, "num_speculative_tokens": 4, "disable_by_batch_size": 16,
            **extra}


def _requests() -> list[tuple[list[int], SamplingParams]]:
    rng = random.Random(3)
    return [([rng.randrange(3, 320) for _ in range(n)],
             SamplingParams(temperature=0.0, max_tokens=N_NEW, ignore_eos=True, logprobs=0))
            for n in [1, 5, 17, 40, 100, 3, 12, 30]]


def _run(llm: LLM, requests) -> list[tuple[list[int], list[float]]]:
    outs = llm.generate([{"prompt_token_ids": p} for p, _ in requests], [p for _, p in requests], use_tqdm=False)
    return [(c.token_ids, [lp[t].logprob for t, lp in zip(c.token_ids, c.logprobs)])
            for c in (o.outputs[0] for o in outs)]


def _draft_kv(llm: LLM):
    return llm.engine.executor.driver.proposer.kv


def _assert_nothing_held(llm: LLM) -> None:
    assert llm.stats()["used_blocks"] == 0
    kv = _draft_kv(llm)
    kv.check_integrity()
    assert kv.num_used_blocks == 0, kv.block_tables


@pytest.fixture(scope="module")
def models(tiny_llama_dir, tmp_path_factory):
    """(target, the other draft: another family of the same vocabulary, one layer, requests, the
    target's plain greedy outputs)."""
    other = str(build("qwen2", tmp_path_factory.mktemp("draft"), seed=1, num_hidden_layers=1))
    requests = _requests()
    return tiny_llama_dir, other, requests, _run(LLM(tiny_llama_dir, num_kv_blocks=512, block_size=4), requests)


# The second tier's file, far above what these tiny models' blocks need: the default (4 GiB) is
# allocated on disk for each test, and the runs pytest keeps filled the disk.
TIER_BYTES = 64 << 20

SETUPS = {
    "batched": dict(num_kv_blocks=512, block_size=4),
    "chunked": dict(num_kv_blocks=512, block_size=4, max_num_batched_tokens=16),  # prompts prefilled in chunks
    "preempted": dict(num_kv_blocks=40, block_size=4),  # too few blocks for all at once: preemption by recompute
    "swapped": dict(num_kv_blocks=40, block_size=4, preemption_mode="swap"),  # ... by swapping to the second tier
}
FAST = {("same", "batched"), ("other", "chunked"), ("other", "preempted"), ("other", "swapped")}


@pytest.mark.parametrize("which, setup", [
    pytest.param(which, SETUPS[name], id=f"{which}-{name}",
                 marks=() if (which, name) in FAST else pytest.mark.slow)
    for which in ("same", "other") for name in SETUPS])
def test_greedy_with_a_draft_model_equals_plain_decoding(models, setup, which, tmp_path):
    target, other, requests, expected = models
    if setup.get("preemption_mode") == "swap":
        setup = dict(setup, kv_offload_size=TIER_BYTES, kv_offload_dir=str(tmp_path / "tier"))
    llm = LLM(target, speculative_config=_spec(target if which == "same" else other), **setup)
    got = _run(llm, requests)
    assert [t for t, _ in got] == [t for t, _ in expected]
    for (_, lps), (_, want) in zip(got, expected):
        assert lps == pytest.approx(want, abs=1e-4)
    stats = llm.stats()["spec_decode"]
    assert stats["num_drafts"] > 0
    if which == "same":  # the target's own argmax: every proposal is right
        assert stats["num_accepted_tokens"] == stats["num_draft_tokens"]
    else:
        assert stats["num_accepted_tokens"] < stats["num_draft_tokens"]
    if setup["num_kv_blocks"] == 40:
        assert llm.stats()["num_preemptions"] > 0
    _assert_nothing_held(llm)


def test_under_tensor_parallelism_the_draft_proposes_as_on_one_rank(models):
    """Two ranks: the draft runs whole on rank 0, between the ranks' steps; it proposes and keeps
    what it does on one rank (the target itself as its draft: every proposal right), and the outputs
    are plain decoding's."""
    target, _, requests, expected = models
    one = LLM(target, num_kv_blocks=512, block_size=4, speculative_config=_spec(target))
    with LLM(target, num_kv_blocks=512, block_size=4, speculative_config=_spec(target), tensor_parallel_size=2) as llm:
        got = _run(llm, requests)
        stats = llm.stats()["spec_decode"]
        _assert_nothing_held(llm)
    assert [t for t, _ in got] == [t for t, _ in expected]
    for (_, lps), (_, want) in zip(got, expected):
        assert lps == pytest.approx(want, abs=1e-4)
    _run(one, requests)
    assert without_times(stats) == without_times(one.stats()["spec_decode"])
    assert stats["num_accepted_tokens"] == stats["num_draft_tokens"] > 0


def test_a_recurrent_target_rolls_back_to_the_accepted_tokens(models, tmp_path):
    """A target with recurrent layers (LFM2's short convolutions) under a draft model of another
    family, preempted by swapping: its states are rolled back to the accepted tokens' in every
    verification, so its greedy outputs are plain decoding's."""
    _, other, requests, _ = models
    target = str(build("lfm2", tmp_path / "lfm2"))
    expected = _run(LLM(target, num_kv_blocks=512, block_size=4), requests)
    llm = LLM(target, speculative_config=_spec(other), num_kv_blocks=30, block_size=4, preemption_mode="swap",
              kv_offload_size=TIER_BYTES, kv_offload_dir=str(tmp_path / "tier"))
    got = _run(llm, requests)
    assert [t for t, _ in got] == [t for t, _ in expected]
    for (_, lps), (_, want) in zip(got, expected):
        assert lps == pytest.approx(want, abs=1e-4)
    stats = llm.stats()
    assert 0 < stats["spec_decode"]["num_accepted_tokens"] < stats["spec_decode"]["num_draft_tokens"]
    assert stats["num_preemptions"] > 0
    _assert_nothing_held(llm)


def test_sampled_requests_keep_the_targets_logprobs(models):
    """n = 2 seeded samples under penalties, logit_bias, min_tokens and a short max_tokens, verified by
    rejection sampling against the draft's distribution: every token reported has the target's
    logprob given the tokens before it (scored again by the plain engine as a prompt), the limits
    hold, and a seeded request's text is reproducible."""
    target, other, _, _ = models
    rng = random.Random(5)
    requests = []
    for i in range(4):
        allowed = rng.sample(range(3, 320), 6)
        params = SamplingParams(n=2, seed=100 + i, temperature=0.9, top_k=4, max_tokens=[N_NEW, 7][i % 2],
                                allowed_token_ids=allowed, repetition_penalty=1.2, presence_penalty=0.2,
                                logit_bias={allowed[0]: 1.0}, min_tokens=3, logprobs=0)
        requests.append(([rng.randrange(3, 320) for _ in range(rng.randrange(1, 30))], params))

    def run(llm: LLM):
        outs = llm.generate([{"prompt_token_ids": p} for p, _ in requests], [p for _, p in requests],
                            use_tqdm=False)
        return [[(c.token_ids, [lp[t].logprob for t, lp in zip(c.token_ids, c.logprobs)]) for c in o.outputs]
                for o in outs]

    llm = LLM(target, num_kv_blocks=256, block_size=4, speculative_config=_spec(other))
    got = run(llm)
    again = run(llm)  # seeded: the same text again (its prompts now from the prefix cache)
    assert [[t for t, _ in o] for o in again] == [[t for t, _ in o] for o in got]
    _assert_nothing_held(llm)
    assert llm.stats()["spec_decode"]["num_accepted_tokens"] > 0
    samples = [(prompt, params, tokens, logprobs) for (prompt, params), o in zip(requests, got)
               for tokens, logprobs in o]
    scored = LLM(target, num_kv_blocks=256, block_size=4).generate(
        [{"prompt_token_ids": prompt + tokens} for prompt, _, tokens, _ in samples],
        SamplingParams(max_tokens=1, prompt_logprobs=0), use_tqdm=False)
    for (prompt, params, tokens, logprobs), s in zip(samples, scored):
        assert 3 <= len(tokens) <= params.max_tokens and set(tokens) <= set(params.allowed_token_ids)
        want = [lp[t].logprob for t, lp in zip(tokens, s.prompt_logprobs[len(prompt):])]
        assert logprobs == pytest.approx(want, abs=1e-4)


def test_a_draft_with_another_vocabulary_is_refused(models, tmp_path):
    """Refused as the draft's config and tokenizer are read, before any weight is."""
    target = models[0]
    bigger = shutil.copytree(target, tmp_path / "bigger")
    config = json.loads((bigger / "config.json").read_text())
    (bigger / "config.json").write_text(json.dumps({**config, "vocab_size": 384}))
    with pytest.raises(ValueError) as e:
        LLM(target, num_kv_blocks=64, speculative_config=_spec(str(bigger)))
    assert all(w in str(e.value) for w in ("speculative_config model", "384 tokens", "320"))
    renamed = shutil.copytree(target, tmp_path / "renamed")
    tok = json.loads((renamed / "tokenizer.json").read_text())
    vocab = tok["model"]["vocab"]
    token = next(t for t, i in vocab.items() if i == 200)
    vocab["\u00a7renamed"] = vocab.pop(token)
    (renamed / "tokenizer.json").write_text(json.dumps(tok))
    with pytest.raises(ValueError) as e:
        LLM(target, num_kv_blocks=64, speculative_config=_spec(str(renamed)))
    assert all(w in str(e.value) for w in ("token id 200", "renamed", repr(token)))


def test_a_recurrent_draft_rolls_back_to_the_accepted_drafts(models, tmp_path, monkeypatch):
    """A draft with recurrent layers (LFM2's short convolutions) keeps its states after each of a
    proposal's passes and starts the next proposal from the one after the accepted drafts: its
    proposals, and so what the target accepts, are those of a draft that reads every sequence
    again from its start at each proposal; the target's greedy outputs are plain decoding's."""
    target, _, requests, expected = models
    lfm2 = str(build("lfm2", tmp_path / "lfm2", vocab_size=320))

    def run(reread: bool) -> tuple[list, dict]:
        llm = LLM(target, num_kv_blocks=512, block_size=4, speculative_config=_spec(lfm2))
        proposer = llm.engine.executor.driver.proposer
        assert proposer.runner.recurrent
        if reread:  # every proposal from the sequence's start, with fresh states
            start = type(proposer)._start
            monkeypatch.setattr(proposer, "_start", lambda q: (proposer.release([q.request_id]), start(proposer, q))[1])
        got = _run(llm, requests)
        _assert_nothing_held(llm)
        return got, llm.stats()["spec_decode"]

    kept, kept_stats = run(reread=False)
    fresh, fresh_stats = run(reread=True)
    assert [t for t, _ in kept] == [t for t, _ in expected] == [t for t, _ in fresh]
    assert 0 < kept_stats["num_accepted_tokens"] < kept_stats["num_draft_tokens"]
    assert without_times(kept_stats) == without_times(fresh_stats)


def test_the_draft_cache_takes_its_share_of_the_kv_budget(models, caplog):
    """A byte budget gives both pools as many blocks, their bytes together within it; the log says so."""
    target, other = models[:2]
    budget = 1 << 20
    with caplog.at_level(logging.INFO, logger="pagellm.engine"):
        llm = LLM(target, kv_cache_memory=budget, block_size=4, speculative_config=_spec(other))
    runner = llm.engine.executor.driver
    per_block = runner.bytes_per_block(4) + runner.proposer.runner.bytes_per_block(4)
    assert llm.engine.core.kv.num_blocks == _draft_kv(llm).num_blocks == budget // per_block
    assert any("draft model" in r.message and "split between them" in r.message for r in caplog.records)


@pytest.mark.slow  # two engines of the bundled model
def test_the_bundled_model_with_its_own_quantized_file_as_draft(smollm2_gguf):
    """The pair `pagellm bench spec-decode --method draft_model` measures: the bundled model served
    dequantized, its Q4_1 file as the draft. Greedy text, tokens, a stop string and finish reasons
    are plain decoding's, and most proposals are accepted (the same weights, quantized)."""
    options = dict(max_model_len=512, kv_cache_memory=64 << 20, quantization="none")
    prompts = ["Write a short poem about the sea.", "List the planets of the solar system."]
    params = [SamplingParams(temperature=0.0, max_tokens=40), SamplingParams(temperature=0.0, max_tokens=40,
                                                                            stop=[" Mars"])]
    plain = LLM(smollm2_gguf, **options)
    want = [o.outputs[0] for o in plain.chat([[{"role": "user", "content": p}] for p in prompts], params,
                                             use_tqdm=False)]
    llm = LLM(smollm2_gguf, speculative_config=_spec(smollm2_gguf), **options)
    got = [o.outputs[0] for o in llm.chat([[{"role": "user", "content": p}] for p in prompts], params,
                                          use_tqdm=False)]
    assert [(c.token_ids, c.text, c.finish_reason) for c in got] == [(c.token_ids, c.text, c.finish_reason)
                                                                     for c in want]
    assert llm.stats()["spec_decode"]["acceptance_rate"] > 0.7
    _assert_nothing_held(llm)
