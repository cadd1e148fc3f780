"""A decoder layer's decode plan (layers/decode_plan.py) serves decode steps with the layer's own
kernels and arguments, so its outputs are the modules' bits: greedy tokens and logprobs equal,
exactly, with the plans on and off (PAGELLM_DECODE_PLANS=0), on the bundled GGUF file in the
integer and float32 product modes and on the Llama-shaped families' test models (biases, q/k norms,
sliding windows, layers without rotary, Granite's residual multiplier), 8-bit KV, speculative
verifications and prompts in small chunks included. Against transformers the families' tests check
the same steps (test_families.py). A step of more rows than a plan's products take runs the modules."""
from __future__ import annotations

import pytest

from pagellm import LLM, SamplingParams
from pagellm.loader.bundled import default_model_path
from pagellm.models.llama import LlamaDecoderLayer
from tests.models.families import build


def _prompts(n: int, vocab: int) -> list[dict]:
    return [{"prompt_token_ids": [(7 * i + 3 * j) % (vocab - 300) + 256 for j in range(3 + i % 5)]}
            for i in range(n)]


def _layers(llm: LLM) -> list[LlamaDecoderLayer]:
    return [m for m in llm.engine.runner.model.modules() if isinstance(m, LlamaDecoderLayer)]


def _run(llm: LLM, prompts: list[dict], plans: bool, monkeypatch, max_tokens: int) -> tuple[tuple, list[bool]]:
    """Greedy tokens and their top logprobs, with the layers' plans remade on or off."""
    monkeypatch.setenv("PAGELLM_DECODE_PLANS", "1" if plans else "0")
    for layer in _layers(llm):
        layer.decode_plan = None
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True, logprobs=3)
    outs = llm.generate(prompts, params, use_tqdm=False)
    served = [layer.decode_plan.serves for layer in _layers(llm)]
    tokens = [o.outputs[0].token_ids for o in outs]
    logprobs = [[{t: (lp.logprob, lp.rank) for t, lp in step.items()} for step in o.outputs[0].logprobs] for o in outs]
    return (tokens, logprobs), served


def _same_with_and_without(llm: LLM, prompts: list[dict], monkeypatch, max_tokens: int = 12) -> None:
    planned, served = _run(llm, prompts, True, monkeypatch, max_tokens)
    assert served and all(served), "every layer's plan serves decode steps"
    modules, served = _run(llm, prompts, False, monkeypatch, max_tokens)
    assert not any(served)
    assert planned == modules


@pytest.mark.parametrize("activations, sequences", [("int8x2", 40), ("none", 6)])
def test_bundled_model_decodes_the_same_bits_with_plans(activations, sequences, monkeypatch):
    """The bundled SmolLM2 (Q4_1 layers). 40 sequences are more rows than the integer products take
    in a plan's call on every CPU (32 at most), so their first steps run the modules; batches of 1-8
    rows are left as sequences of several lengths finish."""
    llm = LLM(default_model_path(), activation_quantization=activations, max_num_seqs=40, num_kv_blocks=160)
    prompts = _prompts(sequences, llm.engine.runner.model.cfg.vocab_size)
    _same_with_and_without(llm, prompts, monkeypatch, max_tokens=4 if sequences > 8 else 12)


@pytest.mark.parametrize("family, options", [
    ("llama_biases", {}), ("qwen3", {}), ("smollm3", {}), ("granite", {}), ("mistral", {"kv_cache_dtype": "int8"}),
    # Steps of several tokens a sequence through the plan's products and the attention module:
    # speculative verifications, prompts in chunks of 8.
    ("qwen3", {"speculative_config": {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 1}}),
    ("llama", {"max_num_batched_tokens": 8})])
def test_llama_shaped_families_decode_the_same_bits_with_plans(family, options, tmp_path, monkeypatch):
    llm = LLM(str(build(family, tmp_path / family)), num_kv_blocks=64, **options)
    _same_with_and_without(llm, _prompts(5, 320), monkeypatch)
