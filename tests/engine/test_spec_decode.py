"""Speculative decoding is lossless: with prompt lookup on, every request's tokens (and their
logprobs) are those of plain decoding, greedy and seeded sampling alike, batched, in prefill
chunks, under preemption and with n = 2; rejected proposals leave no block held (the engine
checks its KV bookkeeping after every step in the tests: PAGELLM_CHECK_INVARIANTS).

The random test models rarely repeat themselves, so some requests here are restricted to a few
allowed tokens: their outputs then repeat n-grams that the proposer finds, and proposals are
accepted, while which of the allowed tokens comes next (and each token's logprob, taken from the
raw logits) still depends on every position's K/V.
"""
from __future__ import annotations

import random

import pytest

from pagellm import LLM, SamplingParams
from tests.models.families import build

SPEC = {"method": "ngram", "num_speculative_tokens": 4, "disable_by_batch_size": 16}
N_NEW = 24
LOGPROB_ATOL = 1e-4  # plain decoding's own agreement across batching and chunking (tests/conftest.py)


def _requests() -> list[tuple[list[int], SamplingParams]]:
    """Prompts of several lengths, repetitive and not; half restricted to three tokens (accepted proposals)."""
    rng = random.Random(3)
    out = []
    for i, n in enumerate([1, 5, 17, 40, 100, 3, 12, 30]):
        pattern = [rng.randrange(3, 320) for _ in range(rng.choice([2, 3, 5]))]
        prompt = (pattern * n)[:n] if i % 2 else [rng.randrange(3, 320) for _ in range(n)]
        allowed = dict(allowed_token_ids=rng.sample(range(3, 320), 3)) if i % 4 < 2 else {}
        out.append((prompt, SamplingParams(temperature=0.0, max_tokens=N_NEW, ignore_eos=True, logprobs=0, **allowed)))
    return out


def _run(llm: LLM, requests) -> list[tuple[list[int], list[float]]]:
    prompts = [{"prompt_token_ids": p} for p, _ in requests]
    outs = llm.generate(prompts, [params for _, params in requests], use_tqdm=False)
    return [(c.token_ids, [lp[t].logprob for t, lp in zip(c.token_ids, c.logprobs)])
            for c in (o.outputs[0] for o in outs)]


def _assert_same(got, expected) -> None:
    assert [t for t, _ in got] == [t for t, _ in expected]
    for (_, lps), (_, want) in zip(got, expected):
        assert lps == pytest.approx(want, abs=LOGPROB_ATOL)


def _accepted(llm: LLM) -> int:
    stats = llm.stats()
    assert stats["used_blocks"] == 0  # nothing held once every request finished
    return stats["spec_decode"]["num_accepted_tokens"]


# mistral: every layer slides (a window of 16, shorter than most sequences here). The recurrent
# families (short convolutions, Mamba-2, Gated DeltaNet beside attention) roll each layer's state
# back to the last accepted token's (Qwen3.5 in the fast suite; LFM2's and Granite 4's in the slow one,
# and LFM2's under a draft model in tests/engine/test_spec_decode_draft.py).
@pytest.fixture(scope="module", params=["llama", "mistral", "qwen3_5",
                                        *(pytest.param(f, marks=pytest.mark.slow) for f in ("lfm2", "granite_moe_hybrid"))])
def model(request, tmp_path_factory):
    path = str(build(request.param, tmp_path_factory.mktemp(request.param)))
    requests = _requests()
    return request.param, path, requests, _run(LLM(path, num_kv_blocks=512, block_size=4), requests)


# Pools too small for every request at once (LFM2's blocks hold more: most of its layers keep no K/V).
PREEMPTING_BLOCKS = {"lfm2": 30}


@pytest.mark.parametrize("setup", [
    dict(num_kv_blocks=512, block_size=4),
    dict(num_kv_blocks=512, block_size=4, max_num_batched_tokens=16),  # prompts prefilled in chunks
    dict(num_kv_blocks=None, block_size=4),  # too few blocks for all at once: preemption
], ids=["batched", "chunked", "preempted"])
def test_greedy_equals_plain_decoding(model, setup):
    family, path, requests, expected = model
    preempting = setup["num_kv_blocks"] is None
    if preempting:
        setup = dict(setup, num_kv_blocks=PREEMPTING_BLOCKS.get(family, 40))
    llm = LLM(path, speculative_config=SPEC, **setup)
    _assert_same(_run(llm, requests), expected)
    assert _accepted(llm) > 0
    if preempting:
        assert llm.stats()["num_preemptions"] > 0


def test_seeded_sampling_and_logits_processors_equal_plain_decoding(tiny_llama_dir):
    """n = 2 seeded samples under penalties, logit_bias, min_tokens, stop tokens and a short max_tokens:
    each position's processors see the proposals before it as output, and its draw uses the uniform of
    that token index, so the samples are plain decoding's token for token."""
    rng = random.Random(5)
    requests = []
    for i in range(6):
        allowed = rng.sample(range(3, 320), 4)
        params = SamplingParams(n=2, seed=100 + i, temperature=0.8, top_k=3, max_tokens=[N_NEW, 7][i % 2],
                                allowed_token_ids=allowed, repetition_penalty=1.3, presence_penalty=0.2,
                                frequency_penalty=0.1, logit_bias={allowed[0]: 1.5}, min_tokens=3,
                                stop_token_ids=[allowed[1]] if i == 2 else None, logprobs=1)
        requests.append(([rng.randrange(3, 320) for _ in range(rng.randrange(1, 30))], params))

    def run(llm: LLM):
        outs = llm.generate([{"prompt_token_ids": p} for p, _ in requests], [p for _, p in requests], use_tqdm=False)
        return [[(c.token_ids, c.finish_reason, [lp[t].logprob for t, lp in zip(c.token_ids, c.logprobs)])
                 for c in o.outputs] for o in outs]

    expected = run(LLM(tiny_llama_dir, num_kv_blocks=256, block_size=4))
    llm = LLM(tiny_llama_dir, num_kv_blocks=256, block_size=4, speculative_config=SPEC)
    got = run(llm)
    assert [[(t, r) for t, r, _ in o] for o in got] == [[(t, r) for t, r, _ in o] for o in expected]
    for o, want in zip(got, expected):
        for (_, _, lps), (_, _, lps_want) in zip(o, want):
            assert lps == pytest.approx(lps_want, abs=LOGPROB_ATOL)
    assert all(len(t) <= p.max_tokens for o, (_, p) in zip(got, requests) for t, _, _ in o)
    assert _accepted(llm) > 0


def test_a_large_batch_does_not_speculate(tiny_llama_dir):
    requests = _requests()
    llm = LLM(tiny_llama_dir, num_kv_blocks=512, block_size=4,
              speculative_config={**SPEC, "disable_by_batch_size": len(requests) - 1})
    prompts = [{"prompt_token_ids": p} for p, _ in requests]
    # Every request runs to the end together (same length): never fewer running than the threshold allows.
    llm.generate(prompts, [p for _, p in requests], use_tqdm=False)
    assert llm.stats()["spec_decode"]["num_drafts"] == 0


@pytest.mark.parametrize("options, words", [
    (dict(kv_policy="contiguous-max"), ["speculative_config", "kv_policy 'paged'"]),
])
def test_what_cannot_roll_back_is_refused(tiny_llama_dir, options, words):
    with pytest.raises(ValueError) as e:
        LLM(tiny_llama_dir, num_kv_blocks=64, speculative_config=SPEC, **options)
    assert all(w in str(e.value) for w in words)


def test_recurrent_models_roll_back_on_every_tensor_parallel_rank(tmp_path):
    """LFM2's short convolutions split across two ranks: each rank traces its shard of the states
    while verifying and rolls it back to the accepted tokens', so tokens and logprobs are one
    rank's plain decoding's, with proposals accepted and rejected."""
    path = str(build("lfm2", tmp_path / "lfm2"))
    requests = _requests()[:4]  # two restricted to three tokens: proposals accepted
    expected = _run(LLM(path, num_kv_blocks=256, block_size=4), requests)
    with LLM(path, num_kv_blocks=256, block_size=4, speculative_config=SPEC, tensor_parallel_size=2) as llm:
        got = _run(llm, requests)
        stats = llm.stats()["spec_decode"]
        assert llm.stats()["used_blocks"] == 0
    _assert_same(got, expected)
    assert 0 < stats["num_accepted_tokens"] < stats["num_draft_tokens"]


@pytest.fixture(scope="module")
def smollm2(smollm2_gguf) -> tuple[LLM, LLM]:
    """The bundled model without and with speculation, with float32 activations: in the default mode
    (int8x2) a verification's extra rows can move a product from the integer kernel to the float32
    one, so logprobs would differ by that mode's own rounding (~1e-3) rather than summation order."""
    options = dict(max_model_len=1024, kv_cache_memory=64 << 20, activation_quantization="none")
    return LLM(smollm2_gguf, **options), LLM(smollm2_gguf, speculative_config=SPEC, **options)


COPY = ("Copy the list exactly.\nList: apple, river, garden, window, letter, morning, island, forest, market, "
        "question, simple, travel, winter\nCopy: apple, river,")


def test_the_bundled_model_copying_accepts_proposals_and_decodes_as_without(smollm2):
    """A model copying its prompt accepts most proposals; tokens, logprobs, text, a stop string met
    inside an accepted run and the finish reason are plain decoding's."""
    plain, spec = smollm2
    stops = [None, [" island"], [", is"]]  # to the length limit; met while copying; never met
    params = [SamplingParams(temperature=0.0, max_tokens=32, stop=stop, logprobs=0) for stop in stops]
    want, got = ([o.outputs[0] for o in llm.generate([COPY] * len(stops), params, use_tqdm=False)]
                 for llm in (plain, spec))
    assert [(c.token_ids, c.text, c.finish_reason, c.stop_reason) for c in got] == \
        [(c.token_ids, c.text, c.finish_reason, c.stop_reason) for c in want]
    for c, w in zip(got, want):
        assert [lp[t].logprob for t, lp in zip(c.token_ids, c.logprobs)] == pytest.approx(
            [lp[t].logprob for t, lp in zip(w.token_ids, w.logprobs)], abs=5e-4)
    assert got[1].finish_reason == "stop" and got[1].stop_reason == " island"
    assert _accepted(spec) >= sum(len(c.token_ids) for c in got) // 3


def test_decode_steps_are_timed_by_their_rows(smollm2):
    """stats() keeps the steps that only decode by their rows (a sequence's token and its
    proposals): one sequence copying its prompt verifies every proposal in such a step, so the
    rows past the first, summed over the steps, are the proposed tokens; the plain steps are the
    1-row ones; every step took time."""
    _, spec = smollm2
    before = spec.stats()["spec_decode"]
    # a prompt of its own: its prefill computed here, not found in the prefix cache
    prompt = "Copy the list exactly.\nList: red, green, blue, yellow, purple, orange, silver, golden, white\nCopy: red,"
    out = spec.generate([prompt], SamplingParams(temperature=0.0, max_tokens=24), use_tqdm=False)[0].outputs[0]
    after = spec.stats()["spec_decode"]
    steps = {rows: e["steps"] - before["decode_steps_by_rows"].get(rows, {"steps": 0})["steps"]
             for rows, e in after["decode_steps_by_rows"].items()}
    assert sum((rows - 1) * n for rows, n in steps.items()) == after["num_draft_tokens"] - before["num_draft_tokens"] > 0
    # each step gave the sequence one token and its accepted proposals, the prefill the first
    accepted = after["num_accepted_tokens"] - before["num_accepted_tokens"]
    assert sum(steps.values()) + accepted + 1 >= len(out.token_ids) and steps.get(1, 0) > 0
    assert all(e["mean_ms"] > 0 for e in after["decode_steps_by_rows"].values())


ECHO = ('Return this JSON object unchanged.\n{"name": "Ada Lovelace", "born": 1815, "field": "mathematics", '
        '"known_for": ["the analytical engine", "the first program"], "country": "England"}\nJSON: ')
ECHO_SCHEMA = {"type": "object", "properties": {
    "name": {"type": "string"}, "born": {"type": "integer"}, "field": {"type": "string"},
    "known_for": {"type": "array", "items": {"type": "string"}}, "country": {"type": "string"}},
    "required": ["name", "born", "field", "known_for", "country"]}


@pytest.mark.parametrize("backend", ["xgrammar", "guidance"])
def test_structured_outputs_speculate_and_decode_as_without(smollm2, backend):
    """A request under a grammar speculates: each verified position is masked by the grammar's
    state after the proposals before it, so the JSON it echoes from its prompt is proposed and
    accepted, a proposal the grammar refuses ends the accepted run, and the output (greedy, and
    seeded sampling, token for token), its text and finish reason are plain decoding's; tokens a
    verification accepts after the grammar's end are not kept."""
    import json

    from pagellm import StructuredOutputsParams

    plain, spec = smollm2
    so = StructuredOutputsParams(json=json.dumps(ECHO_SCHEMA), backend=backend)
    params = [SamplingParams(temperature=0.0, max_tokens=64, structured_outputs=so, logprobs=0),
              SamplingParams(temperature=0.8, seed=11, max_tokens=64, structured_outputs=so)]
    before = _accepted(spec)
    want, got = ([o.outputs[0] for o in llm.generate([ECHO] * len(params), params, use_tqdm=False)]
                 for llm in (plain, spec))
    assert [(c.token_ids, c.text, c.finish_reason) for c in got] == \
        [(c.token_ids, c.text, c.finish_reason) for c in want]
    assert got[0].finish_reason == "stop" and json.loads(got[0].text)["born"] == 1815
    assert _accepted(spec) - before >= len(got[0].token_ids) // 3
