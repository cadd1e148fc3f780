"""Bad input gets a clear error naming the limit, and harms nothing else."""
from __future__ import annotations

import pytest

from pagellm import LLM, SamplingParams


@pytest.fixture(scope="module")
def llm(tiny_llama_dir) -> LLM:
    return LLM(tiny_llama_dir, block_size=4, num_kv_blocks=40, max_model_len=256)


@pytest.mark.parametrize("kwargs, words", [
    (dict(temperature=-0.1), ["temperature", "-0.1", "[0, "]),
    (dict(top_p=0.0), ["top_p", "(0, 1]"]),
    (dict(top_p=1.5), ["top_p", "1.5"]),
    (dict(top_k=0), ["top_k", "0"]),
    (dict(top_k=-2), ["top_k", "-2"]),
    (dict(n=0), ["n", ">= 1"]),
    (dict(max_tokens=0), ["max_tokens", ">= 1"]),
    (dict(min_p=2.0), ["min_p", "[0, 1]"]),
    (dict(logit_bias={5: 101.0}), ["logit_bias[5]", "101.0", "[-100, 100]"]),
    (dict(logit_bias={-3: 1.0}), ["logit_bias", "-3", ">= 0"]),
    (dict(logit_bias={"5": 1.0}), ["logit_bias", "'5'"]),
    (dict(allowed_token_ids=[]), ["allowed_token_ids", "non-empty"]),
    (dict(allowed_token_ids=[1, -2]), ["allowed_token_ids", "-2"]),
    # Every float finite in float32 (the sampler's precision) and in its range.
    (dict(temperature=float("nan")), ["temperature", "finite", "nan"]),
    (dict(temperature=1e39), ["temperature", "1e+39", "3.403e+38"]),
    (dict(temperature=float("inf"), min_tokens=2), ["temperature", "inf"]),
    (dict(top_p=float("nan")), ["top_p", "nan"]),
    (dict(min_p=float("nan")), ["min_p", "nan"]),
    (dict(repetition_penalty=float("nan")), ["repetition_penalty", "nan"]),
    (dict(repetition_penalty=1e-45), ["repetition_penalty", "1e-45", "[0.01, 100]"]),
    (dict(repetition_penalty=1e9), ["repetition_penalty", "1000000000.0"]),
    (dict(presence_penalty=float("nan")), ["presence_penalty", "nan"]),
    (dict(frequency_penalty=float("-inf")), ["frequency_penalty", "-inf"]),
    (dict(logit_bias={5: float("nan")}), ["logit_bias[5]", "nan"]),
    # Seeds: every sample's seed (seed + i) an int64.
    (dict(seed=2 ** 64 - 1, n=2), ["seed", "18446744073709551615", "seed + 1", "64 bits"]),
    (dict(seed=2 ** 63 - 2, best_of=3), ["seed", "seed + 2"]),
    (dict(seed=-(2 ** 63) - 1), ["seed", "-9223372036854775809"]),
    # Strict types: no bools or strings where numbers are due.
    (dict(seed=True), ["seed", "True"]),
    (dict(n="2"), ["n", "'2'"]),
    (dict(max_tokens=8.0), ["max_tokens", "8.0"]),
    (dict(temperature="0.5"), ["temperature", "'0.5'"]),
    (dict(top_k=True), ["top_k", "True"]),
    (dict(logprobs=True), ["logprobs", "True"]),
    (dict(ignore_eos="yes"), ["ignore_eos", "true or false", "'yes'"]),
    (dict(stop_token_ids=[True]), ["stop_token_ids", "True"]),
    (dict(min_tokens=5, max_tokens=3), ["min_tokens", "max_tokens (3)", "5"]),
    # Text that cannot be encoded (a lone surrogate, which JSON can carry).
    (dict(stop=["ok", "\ud800"]), ["stop", "UTF-8", "surrogate"]),
])
def test_invalid_sampling_params(kwargs, words):
    with pytest.raises(ValueError) as e:
        SamplingParams(**kwargs)
    for w in words:
        assert w in str(e.value)


def _ok(llm):
    out = llm.generate({"prompt_token_ids": [3, 4, 5]}, SamplingParams(temperature=0, max_tokens=3, ignore_eos=True),
                       use_tqdm=False)
    assert len(out[0].outputs[0].token_ids) == 3
    s = llm.stats()
    assert s["free_blocks"] == s["total_blocks"] and s["num_waiting"] == s["num_running"] == 0


@pytest.mark.parametrize("prompt, words", [
    ("", ["prompt", "empty"]),
    ("caf\udce9", ["prompt", "UTF-8", "surrogate"]),
    ({"prompt_token_ids": [3, True]}, ["True"]),
    ({"prompt_token_ids": []}, ["prompt", "empty"]),
    ({"prompt_token_ids": [1, 2, 99999]}, ["99999", "[0, 320)"]),
    ({"prompt_token_ids": [-1]}, ["-1"]),
    ({"prompt_token_ids": [7] * 256}, ["256 tokens", "max_model_len is 256"]),
])
def test_bad_prompts_are_refused_and_harm_nothing(llm, prompt, words):
    with pytest.raises(ValueError) as e:
        llm.generate([{"prompt_token_ids": [3, 4]}, prompt], use_tqdm=False)
    for w in words:
        assert w in str(e.value)
    _ok(llm)


@pytest.mark.parametrize("params, words", [
    (SamplingParams(stop_token_ids=[1, 320]), ["stop_token_ids", "[320]", "[0, 320)"]),
    (SamplingParams(top_k=321), ["top_k", "[1, 320]", "321"]),
    (SamplingParams(logit_bias={3: 1.0, 320: 5.0, 4000: 1.0}), ["logit_bias", "[320, 4000]", "[0, 320)"]),
    (SamplingParams(allowed_token_ids=[3, 999]), ["allowed_token_ids", "[999]", "[0, 320)"]),
    (SamplingParams(allowed_token_ids=[7], stop_token_ids=[7], min_tokens=2),
     ["allowed_token_ids", "min_tokens (2)", "nothing could be picked"]),
])
def test_token_ids_the_sampler_cannot_honour(llm, params, words):
    with pytest.raises(ValueError) as e:
        llm.generate([{"prompt_token_ids": [3, 4]}] * 2, [SamplingParams(), params], use_tqdm=False)
    for w in words:
        assert w in str(e.value)
    _ok(llm)


def test_request_that_can_never_fit_the_pool(llm):
    # 40 blocks of 4 tokens = 160 slots; 10 + 200 tokens can never fit.
    with pytest.raises(ValueError) as e:
        llm.generate({"prompt_token_ids": [3] * 10}, SamplingParams(max_tokens=200), use_tqdm=False)
    assert "40" in str(e.value) and "KV blocks" in str(e.value)
    _ok(llm)


def test_abort_mid_flight_frees_blocks(llm):
    eng = llm.engine
    eng.add_request("x", {"prompt_token_ids": [3] * 30}, SamplingParams(max_tokens=50, ignore_eos=True))
    eng.add_request("y", {"prompt_token_ids": [4] * 30}, SamplingParams(max_tokens=5, ignore_eos=True))
    eng.step()
    eng.step()
    assert llm.stats()["used_blocks"] > 0
    eng.abort_request("x")
    while eng.has_unfinished_requests():
        eng.step()
    _ok(llm)


@pytest.mark.parametrize("kwargs, words", [
    (dict(block_size=0), ["block_size", "0"]),
    (dict(num_kv_blocks=0), ["num_kv_blocks", "0"]),
    (dict(kv_cache_memory=-5), ["kv_cache_memory"]),
    (dict(dtype="int3"), ["dtype", "int3"]),
    (dict(load_format="pickle"), ["load_format", "pickle"]),
    (dict(max_model_len=100000), ["max_model_len", "512"]),
])
def test_bad_engine_options(tiny_llama_dir, kwargs, words):
    with pytest.raises(ValueError) as e:
        LLM(tiny_llama_dir, **kwargs)
    for w in words:
        assert w in str(e.value)


def test_missing_and_corrupt_model(tmp_path):
    with pytest.raises(FileNotFoundError, match="not found"):
        LLM(str(tmp_path / "nope.gguf"))
    bad = tmp_path / "bad.gguf"
    bad.write_bytes(b"GGUF" + b"\x00" * 20)
    with pytest.raises(ValueError, match="bad.gguf"):
        LLM(str(bad))


def test_a_failing_request_fails_alone(llm):
    """A request whose processing raises is aborted; the others finish untouched."""
    eng = llm.engine
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    for rid in ("ok1", "bad", "ok2"):
        eng.add_request(rid, {"prompt_token_ids": [5, 6, 7]}, params)

    def broken(token_ids):
        raise RuntimeError("detokenizer exploded")

    eng._groups["bad"].texts[0].detokenizer.update = broken
    finished = {}
    while eng.has_unfinished_requests():
        for out in eng.step():
            if out.finished:
                finished[out.request_id] = out
    assert finished["bad"].error == "RuntimeError: detokenizer exploded"
    assert len(finished["ok1"].outputs[0].token_ids) == 6 and finished["ok1"].error is None
    assert finished["ok2"].outputs[0].token_ids == finished["ok1"].outputs[0].token_ids
    _ok(llm)


def test_a_huge_n_is_refused_before_anything_is_built(llm):
    """n = 2**64 once built one sequence id per sample (and the server ran out of memory)."""
    for params in (SamplingParams(n=2 ** 64), SamplingParams(n=2, best_of=2 ** 40)):
        with pytest.raises(ValueError, match="max_num_seqs"):
            llm.generate({"prompt_token_ids": [3, 4]}, params, use_tqdm=False)
    _ok(llm)
