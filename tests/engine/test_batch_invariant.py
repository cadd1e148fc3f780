"""Batch-invariant mode on the bundled model: seeded samples at temperature 1 come out the same
tokens and the same logprobs, bit for bit, whether a request runs alone, in a batch, with its
prompt prefilled in chunks, from a cached prefix, or recomputed after preemption.

Without the mode, logits move in the last bits with the batch (torch's products sum in an order
chosen by the batch's size), and a draw that lands near a boundary between two tokens picks the
other one: measured, 1-2 of 8 such requests diverge between a batched and a lone run.
"""
from __future__ import annotations

import pytest

from pagellm import LLM, SamplingParams
from pagellm.kernels import cpu

pytestmark = pytest.mark.skipif(cpu.quant_kernels() is None or not cpu.available(),
                                reason="no compiler for the CPU kernels")

SUBJECTS = ["a cat", "a lighthouse keeper", "a robot", "a teacher", "two pilots", "a farmer", "a child", "a king"]
# Long enough to fill a 16-token block (cached prefixes) and to be cut into chunks of 16.
PROMPTS = [f"Here is the opening of a long story, told slowly and with care, about {s} who" for s in SUBJECTS]
MAX_TOKENS = 24


def params(i: int) -> SamplingParams:
    # Request 3 asks for three samples (seeds 103, 104, 105).
    return SamplingParams(temperature=1.0, top_p=0.95 if i % 2 else 1.0, seed=100 + i, n=3 if i == 3 else 1,
                          max_tokens=MAX_TOKENS, logprobs=2, ignore_eos=True)


def samples(outputs) -> list[list[tuple[int, ...]]]:
    """Per request, per sample: its tokens, then each token's logprob and top-2 logprobs."""
    return [[(tuple(c.token_ids), tuple(tuple(sorted((t, lp.logprob) for t, lp in d.items())) for d in c.logprobs))
             for c in out.outputs] for out in outputs]


@pytest.fixture(scope="module")
def batched(smollm2_gguf):
    llm = LLM(smollm2_gguf, batch_invariant=True, max_model_len=256, num_kv_blocks=256)
    together = samples(llm.generate(PROMPTS, [params(i) for i in range(len(PROMPTS))], use_tqdm=False))
    # Then each alone (the first block of each prompt is now a prefix-cache hit).
    alone = [samples(llm.generate([p], [params(i)], use_tqdm=False))[0] for i, p in enumerate(PROMPTS)]
    assert llm.engine.stats().prefix_cache.hits > 0
    return together, alone


def test_seeded_samples_alone_equal_batched(batched):
    together, alone = batched
    assert [len(s) for s in together] == [3 if i == 3 else 1 for i in range(len(PROMPTS))]
    assert together == alone


def test_seeded_samples_survive_chunked_prefill_and_preemption(smollm2_gguf, batched):
    together, _ = batched
    # 16 tokens a step cuts every prompt into chunks; 16 blocks hold the 10 sequences' prompts (their
    # first block is one shared prefix) but not their 24 new tokens, so the latest are preempted.
    tight = LLM(smollm2_gguf, batch_invariant=True, max_model_len=256, num_kv_blocks=16, max_num_batched_tokens=16)
    got = samples(tight.generate(PROMPTS, [params(i) for i in range(len(PROMPTS))], use_tqdm=False))
    assert tight.engine.stats().scheduler.num_preemptions > 0
    assert got == together


def test_the_mode_changes_only_the_last_bits(smollm2_gguf, batched):
    """Greedy decoding agrees with the float32 mode (activation_quantization none), logprobs to
    float32 summation error: the mode sums in another order, it computes the same function."""
    greedy = SamplingParams(temperature=0.0, max_tokens=8, logprobs=0)
    runs = [LLM(smollm2_gguf, batch_invariant=mode, activation_quantization="none", max_model_len=256,
                num_kv_blocks=64).generate(
        PROMPTS[:4], greedy, use_tqdm=False) for mode in (True, False)]
    for a, b in zip(*runs):
        assert a.outputs[0].token_ids == b.outputs[0].token_ids
        for da, db in zip(a.outputs[0].logprobs, b.outputs[0].logprobs):
            (ta, la), = da.items()
            assert abs(la.logprob - db[ta].logprob) < 1e-4


def test_what_the_mode_does_not_cover_is_refused_by_name(tiny_llama_dir):
    with pytest.raises(ValueError, match="batch-invariant mode does not cover quantization 'int8'"):
        LLM(tiny_llama_dir, batch_invariant=True, quantization="int8", num_kv_blocks=16)
    with pytest.raises(ValueError, match="batch_invariant does not cover tensor parallelism"):
        LLM(tiny_llama_dir, batch_invariant=True, tensor_parallel_size=2, num_kv_blocks=16)
