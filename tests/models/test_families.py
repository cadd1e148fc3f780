"""Every family's greedy tokens equal transformers' token for token, and each token's logprob
within LOGPROB_ATOL, in fp32: batched, and again with chunked prefill, preemption, prefix
caching and n > 1 sharing blocks."""
from __future__ import annotations

import random

import pytest
import torch
import transformers

from pagellm import LLM, SamplingParams
from tests.conftest import assert_matches, hf_greedy_logprobs, tokens_and_logprobs
from tests.models.families import FAMILIES, REFERENCE_DTYPE, build

N_NEW = 20


def _prompts(seed: int, lengths: list[int]) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, 320) for _ in range(n)] for n in lengths]


@pytest.fixture(scope="module", params=sorted(FAMILIES))
def family(request, tmp_path_factory):
    path = str(build(request.param, tmp_path_factory.mktemp(request.param)))
    # Experts multiplied one by one ("eager"): transformers' grouped products take no float64.
    hf = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=REFERENCE_DTYPE.get(request.param, torch.float32),
                                                           attn_implementation="eager",
                                                           experts_implementation="eager").eval()
    prompts = _prompts(3, [1, 6, 19, 37])
    shared = _prompts(4, [21])[0]  # a prefix two prompts share (prefix caching)
    prompts += [shared + [5, 6, 7], shared + [8]]
    expected = [hf_greedy_logprobs(hf, p, N_NEW) for p in prompts]
    return request.param, path, prompts, expected


# Phi-3's LongRoPE uses its short factors for sequences within the original context (64 here)
# and its long ones beyond; an engine fixes the choice by its max_model_len, so these tests,
# whose sequences stay within 64 tokens, serve it with max_model_len=64 (the long factors:
# test_phi3_long_context).
ENGINE_ARGS = {"phi3": {"max_model_len": 64}}

# The pool of the chunked test: too small for every request at once. Families with sliding-window
# layers give back what slid out (and a block of a group holds only that group's layers), so they
# need a smaller pool to be preempted.
CHUNKED_POOL = {"mistral": 20, "qwen3": 20, "olmo3": 20, "gemma2": 20, "gemma3": 20, "ministral3": 20, "gpt_oss": 20,
                 "lfm2": 14, "qwen3_5": 12, "qwen3_5_moe": 12, "granite_moe_hybrid": 12, "gemma4": 24}

GREEDY = SamplingParams(temperature=0.0, max_tokens=N_NEW, ignore_eos=True, logprobs=0)


def _gen(llm: LLM, prompts, params=GREEDY):
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    return outs


def test_batched_matches_transformers(family):
    name, path, prompts, expected = family
    llm = LLM(path, num_kv_blocks=256, **ENGINE_ARGS.get(name, {}))
    assert_matches(tokens_and_logprobs(_gen(llm, prompts)), expected)
    assert llm.stats()["used_blocks"] == 0


def test_chunked_preempted_cached_and_shared(family):
    """Chunks of 8 tokens, a pool too small for every request at once, the shared prefix served
    from the cache, and n = 2 greedy samples that share their blocks and must both equal the reference."""
    name, path, prompts, expected = family
    llm = LLM(path, block_size=4, num_kv_blocks=CHUNKED_POOL.get(name, 40), max_num_batched_tokens=8,
              **ENGINE_ARGS.get(name, {}))
    got = _gen(llm, prompts, SamplingParams(n=2, temperature=0.0, max_tokens=N_NEW, ignore_eos=True, logprobs=0))
    for out, (tokens, _) in zip(got, expected):
        assert [c.token_ids for c in out.outputs] == [tokens, tokens]
    assert_matches(tokens_and_logprobs(got), expected)
    stats = llm.stats()
    # Families with recurrent layers resume a cached prefix from a checkpoint of their state.
    assert stats["num_preemptions"] > 0 and stats["prefix_cache_hits"] > 0
    assert stats["free_blocks"] == stats["total_blocks"]


def test_phi3_long_context(tmp_path):
    """Beyond the original context LongRoPE's long factors apply, from the first token on."""
    path = str(build("phi3", tmp_path / "phi3"))
    hf = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    prompts = _prompts(5, [70, 90])
    expected = [hf_greedy_logprobs(hf, p, N_NEW) for p in prompts]
    assert_matches(tokens_and_logprobs(_gen(LLM(path, num_kv_blocks=256, block_size=4), prompts)), expected)


def test_generate_command_serves_the_family(family, capsys):
    """`pagellm generate --model <dir>` as a user runs it, printing what the Python API gives."""
    from pagellm.cli import main

    name, path, _, _ = family
    extra = [f"--max-model-len={v}" for v in ENGINE_ARGS.get(name, {}).values()]
    argv = ["generate", "--model", path, "--prompt", "hello world", "--max-tokens", "8", "--temperature", "0",
            "--ignore-eos", "--num-kv-blocks", "64", *extra]
    assert main(argv) == 0
    printed = capsys.readouterr().out
    llm = LLM(path, num_kv_blocks=64, **ENGINE_ARGS.get(name, {}))
    text = llm.generate(["hello world"], SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True),
                        use_tqdm=False)[0].outputs[0].text
    assert printed == f"{text}\n"  # the prompt's header line goes to stderr


@pytest.mark.parametrize("name", ["mistral", "gemma3"])
def test_sliding_layers_give_back_what_slid_out(name, tmp_path):
    """A generation far past the window in a pool too small to cache it whole: the sliding layers'
    blocks go back as the window moves, and the tokens still equal transformers'. Beside it, a
    second request shares the prompt's cached prefix."""
    path = str(build(name, tmp_path / name))
    hf = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32,
                                                           attn_implementation="eager").eval()
    prompt = _prompts(7, [30])[0]
    new = 90
    expected = hf_greedy_logprobs(hf, prompt, new)
    # Blocks of 4: the whole sequence (120 tokens) takes 30 per group. Mistral has one group, all
    # sliding: 20 blocks could not cache it whole. Gemma 3 has a full group (30) and a sliding one.
    llm = LLM(path, block_size=4, num_kv_blocks={"mistral": 20, "gemma3": 48}[name], max_num_batched_tokens=16)
    kv = llm.engine.kv
    window = min(w for w in kv.windows if w is not None)
    sliding = [g for g, w in enumerate(kv.windows) if w is not None]
    params = SamplingParams(temperature=0.0, max_tokens=new, ignore_eos=True, logprobs=0)
    llm.engine.add_request("a", {"prompt_token_ids": prompt}, params)
    peak = 0
    outs = []
    while llm.engine.has_unfinished_requests():
        outs += [o for o in llm.engine.step() if o.finished]
        for g in sliding:
            table = kv.group_tables("a")[g]
            peak = max(peak, sum(b != 0 for b in table))
    assert_matches(tokens_and_logprobs(outs), [expected])
    assert peak <= -(-(window - 1 + 16) // 4) + 1
    stats = llm.stats()
    assert stats["used_blocks"] == 0
    assert [g["window"] for g in stats["kv_groups"]] == list(kv.windows)
    # The pool's bytes, each tensor counted once though layers of different groups share it.
    runner = llm.engine.runner
    assert llm.engine.memory_report()[0]["kv_cache_bytes"] == (kv.num_blocks + 1) * runner.bytes_per_block(4)
    assert all(g["used_blocks"] == 0 for g in stats["kv_groups"])
    # In a pool that keeps them, the prompt's cached blocks serve a second prompt that extends it:
    # the full group from block 0, the sliding ones only inside the window of the prefix's end.
    llm = LLM(path, block_size=4, num_kv_blocks=200)
    _gen(llm, [prompt], SamplingParams(temperature=0.0, max_tokens=2, ignore_eos=True))
    longer = prompt + [5, 6]
    got = _gen(llm, [longer], SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True, logprobs=0))
    assert got[0].num_cached_tokens == 28  # 7 full blocks of the 30-token prompt
    assert_matches(tokens_and_logprobs(got), [hf_greedy_logprobs(hf, longer, 8)])


def _decode_attention_calls(monkeypatch) -> list[dict]:
    """The layer options of each compiled decode-attention call made from here on (cpu._decode_options:
    per step by decode_attention_qkv, or once per layer by a decode plan's cpu.DecodeAttention)."""
    import inspect

    from pagellm.kernels import cpu

    calls = []
    options = cpu._decode_options
    signature = inspect.signature(options)

    def recorded(*args, **kwargs):
        calls.append(signature.bind(*args, **kwargs).arguments)
        return options(*args, **kwargs)

    monkeypatch.setattr(cpu, "_decode_options", recorded)
    return calls


@pytest.mark.parametrize("name, fused_norms", [("qwen3", True), ("olmo2", True), ("gemma3", False)])
def test_decode_steps_normalize_q_and_k_in_the_fused_kernel(name, fused_norms, tmp_path, monkeypatch):
    """Qwen3's per-head and OLMo 2's all-heads q/k norms run inside cpu.decode_attention_qkv on
    decode steps (its result against transformers: the tests above); Gemma 3's 1 + w norms have no
    kernel, so its layers take the split path."""
    calls = _decode_attention_calls(monkeypatch)
    llm = LLM(str(build(name, tmp_path / name)), num_kv_blocks=64)
    _gen(llm, _prompts(5, [3, 9]), SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True))
    assert (len(calls) > 0 and all(c["qk_norm"] is not None for c in calls)) if fused_norms else calls == []


def test_decode_steps_attend_with_sinks_in_the_fused_kernel(tmp_path, monkeypatch):
    """gpt-oss's decode steps run cpu.decode_attention_qkv with each layer's sinks (its result
    against transformers: the tests above), on the sliding layer and on the full one."""
    calls = _decode_attention_calls(monkeypatch)
    llm = LLM(str(build("gpt_oss", tmp_path / "gpt_oss")), num_kv_blocks=64)
    _gen(llm, _prompts(5, [3, 9]), SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True))
    assert len(calls) > 0 and all(c["sinks"] is not None for c in calls)
    assert {c["sliding_window"] for c in calls} == {8, None}
