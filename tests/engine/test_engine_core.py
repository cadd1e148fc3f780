"""The engine core on its own: schedule -> execute -> update over plain sequences, with a
held sequence whose caller picks its tokens (how beam search drives it from outside)."""
from __future__ import annotations

import ast
import inspect

import pytest
from transformers import AutoModelForCausalLM

import pagellm.engine.core as core_module
from pagellm import LLM, SamplingParams
from pagellm.core.request import Request
from tests.conftest import hf_greedy


@pytest.fixture(scope="module")
def llm(tiny_llama_dir) -> LLM:
    return LLM(tiny_llama_dir, block_size=4, num_kv_blocks=64, max_model_len=128)


def test_core_imports_nothing_of_the_layers_above():
    """The core knows sequences only: no groups, beams, text or outputs."""
    tree = ast.parse(inspect.getsource(core_module))
    imported = {node.module for node in ast.walk(tree) if isinstance(node, ast.ImportFrom)}
    above = {"pagellm.engine.groups", "pagellm.engine.beams", "pagellm.engine.output_processor",
             "pagellm.engine.detokenizer", "pagellm.outputs", "pagellm.beam_search"}
    assert not imported & above


def test_core_steps_plain_and_held_sequences(llm, tiny_llama_dir):
    core = llm.engine.core
    prompt = [3, 14, 15, 9, 2, 6]
    greedy = SamplingParams(temperature=0, max_tokens=5, ignore_eos=True)
    plain = Request("plain", prompt, greedy, max_model_len=128)
    held = Request("held", prompt, SamplingParams(temperature=0, max_tokens=5, ignore_eos=True, logprobs=3),
                   max_model_len=128, caller_appends=True)
    core.add(plain)
    core.add(held)
    chosen = []
    while core.has_unfinished():
        out = core.step()
        assert not out.failures
        assert all(r.request_id != "held" for r in out.updated), "the core must not append to a held sequence"
        if "held" in out.held:
            candidates = out.sampled.top_logprobs[out.rows["held"][0]]
            assert len(candidates) == 3
            # The caller picks the second-best candidate: a choice the core could not make.
            token = candidates[1][0]
            chosen.append(token)
            core.append_token("held", token)
            if len(chosen) == 4:
                core.finish("held")
    ref = AutoModelForCausalLM.from_pretrained(tiny_llama_dir).eval()
    assert plain.output_token_ids == hf_greedy(ref, prompt, 5)
    assert held.output_token_ids == chosen and len(chosen) == 4
    assert core.kv.num_free_blocks == core.kv.num_blocks
