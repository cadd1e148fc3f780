"""The bundled SmolLM2-135M-Instruct GGUF against transformers on the same weights."""
from __future__ import annotations

from pathlib import Path

import pytest
import torch
import transformers

from pagellm import LLM, BeamSearchParams, SamplingParams, cpu_features
from pagellm.bench.report import COMMON_WORDS
from tests.conftest import hf_greedy_logprobs
from tests.engine.test_beam_search import hf_beam

N_NEW = 20
TEXTS = [
    "The capital of France is",
    "def fibonacci(n):\n    ",
    "Once upon a time, in a small village by the sea, there lived an old fisherman who every morning",
    "Hi",
    # A long prompt: many blocks, several prefill chunks below, and a prefix the second round finds cached.
    "Here is a list of words to remember: " + ", ".join(COMMON_WORDS) + ". The first word was",
]
# A real model's logits are larger than the tiny models'; its logprobs agree with transformers'
# to this (measured: at most 2.4e-5, batched, chunked, preempted and cached alike).
LOGPROB_ATOL = 5e-4
# Its normalized last-token embeddings agree with transformers' to this (measured: at most 4.7e-7).
EMBEDDING_ATOL = 1e-5


@pytest.fixture(scope="module")
def llm(smollm2_gguf) -> LLM:
    # float32 activations: this module holds the bundled file to transformers' own results (the
    # default int8x2 mode is held to the dequantized model in tests/models/test_gguf_quantized.py)
    return LLM(smollm2_gguf, activation_quantization="none", max_model_len=1024, kv_cache_memory=256 << 20)


@pytest.fixture(scope="module")
def hf(smollm2_gguf):
    path = Path(smollm2_gguf)
    return transformers.AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name,
                                                             dtype=torch.float32).eval()


@pytest.mark.slow
def test_greedy_matches_transformers_gguf(llm, hf, smollm2_gguf):
    """Tokens and logprobs as transformers gives them: batched; then in prefill chunks of 32
    tokens, in a pool too small for all at once (preemption), twice (the second round from the
    prefix cache)."""
    tok = llm.get_tokenizer()
    prompts = [tok.encode(t) for t in TEXTS]
    assert len(prompts[-1]) > 200
    expected = [hf_greedy_logprobs(hf, p, N_NEW) for p in prompts]
    params = SamplingParams(temperature=0, max_tokens=N_NEW, ignore_eos=True, logprobs=0)
    items = [{"prompt_token_ids": p} for p in prompts]

    def check(outs) -> None:
        for out, (tokens, logprobs) in zip(outs, expected):
            c = out.outputs[0]
            assert c.token_ids == tokens
            assert [lp[t].logprob for t, lp in zip(c.token_ids, c.logprobs)] == pytest.approx(logprobs,
                                                                                               abs=LOGPROB_ATOL)

    outs = llm.generate(items, params, use_tqdm=False)
    check(outs)
    assert outs[0].outputs[0].text == tok.decode(expected[0][0])
    tight = LLM(smollm2_gguf, activation_quantization="none", max_model_len=1024, num_kv_blocks=24,
                max_num_batched_tokens=32)
    for _ in range(2):
        check(tight.generate(items, params, use_tqdm=False))
    stats = tight.stats()
    assert stats["num_preemptions"] > 0 and stats["prefix_cache_hits"] >= 192


def test_chat_knows_paris(llm):
    out = llm.chat([{"role": "user", "content": "What is the capital of France?"}],
                   SamplingParams(temperature=0, max_tokens=30), use_tqdm=False)[0]
    assert "Paris" in out.outputs[0].text
    assert out.outputs[0].finish_reason == "stop"  # ended by <|im_end|>, not by length
    assert llm.stats()["used_blocks"] == 0


@pytest.mark.skipif(not cpu_features.has_bf16(), reason="this CPU has no bfloat16 instructions (bfloat16 refused)")
def test_bfloat16_on_the_cpu_reads_its_kv_in_place_and_still_knows_paris(smollm2_gguf):
    # bf16 is the CPU's fast opt-in (AMX matmuls, half the KV bytes); it rounds differently from
    # the fp32 reference, so it is held to the answer, not to transformers' tokens.
    llm = LLM(smollm2_gguf, dtype="bfloat16", max_model_len=256, num_kv_blocks=64)
    runner = llm.engine.runner
    assert runner.kv_caches[0][0].dtype == torch.bfloat16
    from pagellm.kernels import cpu

    assert cpu.kv_kernels_usable(torch.empty(1, 1, 1, dtype=torch.bfloat16), runner.kv_caches[0][0])
    out = llm.generate("The capital of France is", SamplingParams(temperature=0, max_tokens=4), use_tqdm=False)
    assert out[0].outputs[0].text.startswith(" Paris")
    assert llm.stats()["used_blocks"] == 0


@pytest.mark.slow
def test_beam_search_matches_transformers_gguf(llm, hf):
    tok = llm.get_tokenizer()
    prompts = [tok.encode(t) for t in TEXTS[:2]]
    results = llm.beam_search([{"prompt_token_ids": p} for p in prompts], BeamSearchParams(3, 12))
    for p, res in zip(prompts, results):
        assert res.sequences[0].token_ids == hf_beam(hf, p, 3, 12, 1.0, tok.eos_token_id)


def test_last_token_embeddings_match_transformers_gguf(llm, hf):
    """With no sentence-transformers files, a decoder embeds by its last token's final hidden state,
    normalized: transformers' last_hidden_state on the same weights, prompts batched."""
    assert llm.engine.pooler_config.pooling_type == "LAST" and llm.engine.pooler_config.normalize
    tok = llm.get_tokenizer()
    prompts = [tok.encode(t) for t in TEXTS]
    outs = llm.embed([{"prompt_token_ids": p} for p in prompts], use_tqdm=False)
    for prompt, out in zip(prompts, outs):
        with torch.no_grad():
            hidden = hf.model(torch.tensor([prompt])).last_hidden_state[0, -1]
        want = torch.nn.functional.normalize(hidden, dim=-1)
        got = torch.tensor(out.outputs.embedding)
        assert (got - want).abs().max().item() <= EMBEDDING_ATOL
        assert torch.dot(got, want).item() >= 1 - 1e-5
    assert llm.stats()["used_blocks"] == 0
