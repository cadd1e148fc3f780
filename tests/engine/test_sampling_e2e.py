"""Sampling through the whole engine: seeds, stops, logprobs, penalties, limits."""
from __future__ import annotations

import math

import pytest

from pagellm import LLM, SamplingParams


@pytest.fixture(scope="module")
def llm(tiny_llama_dir) -> LLM:
    return LLM(tiny_llama_dir, block_size=4, num_kv_blocks=256)


PROMPTS = [{"prompt_token_ids": [5 + i, 40, 77, 100 + i]} for i in range(6)]


def test_seed_gives_same_text_in_any_batch(llm):
    seeded = SamplingParams(temperature=1.0, seed=1234, max_tokens=12, ignore_eos=True)
    other = SamplingParams(temperature=1.0, max_tokens=12, ignore_eos=True)
    alone = llm.generate(PROMPTS[0], seeded, use_tqdm=False)[0].outputs[0].token_ids
    batch = llm.generate(PROMPTS[1:4] + [PROMPTS[0]] + PROMPTS[4:], [other] * 3 + [seeded] + [other] * 2,
                         use_tqdm=False)
    assert batch[3].outputs[0].token_ids == alone
    # And a different seed gives a different sample (near-certain over 12 tokens at T=1 on random weights).
    diff = llm.generate(PROMPTS[0], SamplingParams(temperature=1.0, seed=99, max_tokens=12, ignore_eos=True),
                        use_tqdm=False)[0].outputs[0].token_ids
    assert diff != alone


def test_max_and_min_tokens(llm):
    out = llm.generate(PROMPTS[:2], SamplingParams(temperature=0, max_tokens=7, ignore_eos=True), use_tqdm=False)
    assert [len(o.outputs[0].token_ids) for o in out] == [7, 7]
    assert all(o.outputs[0].finish_reason == "length" for o in out)
    # min_tokens holds off a stop token (and EOS) until that many tokens exist.
    free = out[0].outputs[0].token_ids
    stop = free[1]
    early = llm.generate(PROMPTS[0], SamplingParams(temperature=0, max_tokens=7, ignore_eos=True,
                                                    stop_token_ids=[stop]), use_tqdm=False)[0].outputs[0]
    assert early.token_ids == free[:2] and early.finish_reason == "stop"
    held = llm.generate(PROMPTS[0], SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, min_tokens=5,
                                                   stop_token_ids=[stop]), use_tqdm=False)[0].outputs[0]
    assert len(held.token_ids) >= 5 and stop not in held.token_ids[:5]
    assert held.finish_reason == "length" or (held.token_ids[-1] == stop and stop not in held.token_ids[:-1])


def test_stop_token_ids(llm):
    free = llm.generate(PROMPTS[0], SamplingParams(temperature=0, max_tokens=10, ignore_eos=True),
                        use_tqdm=False)[0].outputs[0].token_ids
    stop_at = free[4]
    first = free.index(stop_at)
    out = llm.generate(PROMPTS[0], SamplingParams(temperature=0, max_tokens=10, ignore_eos=True,
                                                  stop_token_ids=[stop_at]), use_tqdm=False)[0].outputs[0]
    assert out.token_ids == free[:first + 1]
    assert out.finish_reason == "stop" and out.stop_reason == stop_at


def test_logit_bias_and_allowed_token_ids(llm):
    greedy = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    free = llm.generate(PROMPTS[0], greedy, use_tqdm=False)[0].outputs[0].token_ids
    forced = next(t for t in range(3, 300) if t not in free)
    out = llm.generate(PROMPTS[0], SamplingParams(temperature=0, max_tokens=6, ignore_eos=True,
                                                  logit_bias={forced: 100.0}), use_tqdm=False)[0].outputs[0]
    assert out.token_ids == [forced] * 6
    # The reported logprobs are the model's own, not the biased ones: the forced token is unlikely.
    assert out.cumulative_logprob < -6.0

    allowed = [11, 12, 13, 200]
    mixed = llm.generate(PROMPTS[:3], [SamplingParams(temperature=1.0, seed=7, max_tokens=8, ignore_eos=True,
                                                      allowed_token_ids=allowed), greedy,
                                       SamplingParams(temperature=0, max_tokens=6, ignore_eos=True,
                                                      allowed_token_ids=allowed)], use_tqdm=False)
    assert set(mixed[0].outputs[0].token_ids) <= set(allowed)
    assert set(mixed[2].outputs[0].token_ids) <= set(allowed)
    # A neighbour's restriction does not leak into an unrestricted request.
    assert mixed[1].outputs[0].token_ids == llm.generate(PROMPTS[1], greedy, use_tqdm=False)[0].outputs[0].token_ids


def test_stop_string_truncates_text(llm):
    tok = llm.get_tokenizer()
    free = llm.generate(PROMPTS[1], SamplingParams(temperature=0, max_tokens=12, ignore_eos=True),
                        use_tqdm=False)[0].outputs[0]
    text = free.text
    stop = text[3:5]
    assert stop
    out = llm.generate(PROMPTS[1], SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, stop=[stop]),
                       use_tqdm=False)[0].outputs[0]
    assert out.text == text[:text.index(stop)]
    assert out.finish_reason == "stop" and out.stop_reason == stop
    assert tok.decode(out.token_ids).startswith(out.text)


def test_logprobs(llm):
    out = llm.generate(PROMPTS[2], SamplingParams(temperature=0, max_tokens=5, logprobs=3, ignore_eos=True),
                       use_tqdm=False)[0].outputs[0]
    assert len(out.logprobs) == 5
    total = 0.0
    for tok, entry in zip(out.token_ids, out.logprobs):
        assert tok in entry and entry[tok].rank == 1  # greedy picks the top token
        top = sorted(entry.values(), key=lambda lp: -lp.logprob)
        assert len(entry) == 3 and all(lp.logprob <= 0 for lp in top)
        total += entry[tok].logprob
    assert math.isclose(out.cumulative_logprob, total, rel_tol=1e-5)


def test_repetition_penalty_changes_greedy_output(llm):
    plain = llm.generate(PROMPTS[3], SamplingParams(temperature=0, max_tokens=16, ignore_eos=True), use_tqdm=False)
    penal = llm.generate(PROMPTS[3], SamplingParams(temperature=0, max_tokens=16, ignore_eos=True,
                                                    repetition_penalty=5.0), use_tqdm=False)
    toks = penal[0].outputs[0].token_ids
    assert toks != plain[0].outputs[0].token_ids
    # A strong penalty makes repeats rarer than without it.
    assert len(set(toks)) >= len(set(plain[0].outputs[0].token_ids))


def test_stop_string_found_on_the_last_allowed_token_is_the_finish_reason(llm):
    """The token that reaches max_tokens also completes a stop string: the text is cut there, so
    the finish reason is "stop" (it was "length", with the text cut all the same)."""
    free = llm.generate(PROMPTS[3], SamplingParams(temperature=0, max_tokens=12, ignore_eos=True),
                        use_tqdm=False)[0].outputs[0]
    tok = llm.get_tokenizer()
    for k in range(2, 13):
        text = tok.decode(free.token_ids[:k])
        last = text[-1:]
        if last and last != "\ufffd" and last not in text[:-1] and tok.decode(free.token_ids[:k - 1]) == text[:-1]:
            break
    else:
        pytest.skip("no token of this output ends with a character new to the text")
    out = llm.generate(PROMPTS[3], SamplingParams(temperature=0, max_tokens=k, ignore_eos=True, stop=[last]),
                       use_tqdm=False)[0].outputs[0]
    assert out.text == text[:-1]
    assert out.finish_reason == "stop" and out.stop_reason == last


def test_the_stopping_token_is_not_text_even_when_special_tokens_are_kept(llm):
    """EOS or a stop token ends the output's token ids but not its text (vLLM's rule), also with
    skip_special_tokens false, which a format with special markers (harmony) needs: otherwise the
    answer would end in '</s>'. include_stop_str_in_output keeps it."""
    tok = llm.get_tokenizer()
    for stop_ids in ([], [2]):  # EOS (</s>, id 1), then a stop token (<unk>, id 2)
        token = stop_ids[0] if stop_ids else 1
        params = dict(temperature=0, max_tokens=8, min_tokens=3, logit_bias={token: 100.0}, stop_token_ids=stop_ids,
                      skip_special_tokens=False)
        out = llm.generate(PROMPTS[0], SamplingParams(**params), use_tqdm=False)[0].outputs[0]
        assert out.finish_reason == "stop" and len(out.token_ids) == 4 and out.token_ids[-1] == token
        assert out.text == tok.decode(out.token_ids[:3], skip_special_tokens=False)
        kept = llm.generate(PROMPTS[0], SamplingParams(**params, include_stop_str_in_output=True),
                            use_tqdm=False)[0].outputs[0]
        assert kept.text == tok.decode(out.token_ids, skip_special_tokens=False) != out.text
