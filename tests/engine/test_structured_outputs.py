"""Structured outputs in the engine: the grammar's mask lands on its own row of the batch,
outputs equal transformers' greedy under the same mask, sequences fork and survive preemption
with their parser state, and a request the grammar leaves nothing to pick fails alone."""
from __future__ import annotations

import json
import re

import pytest
import torch
import xgrammar as xgr

from pagellm import LLM, SamplingParams, StructuredOutputsParams
from pagellm.sampling_params import ReasoningBudget, ReasoningSection
from pagellm.worker.logits_processors import bitmask_to_additive
from tests.engine.test_isolation import run as run_requests

REGEX = r"[a-z]{2,5}-\d{2}!"
SCHEMA = {"type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "string", "maxLength": 6}},
          "required": ["a", "b"]}
PROMPTS = [[3, 4, 5, 6, 7], [40, 41, 42], [10, 90, 11, 91, 12, 92], [200, 201]]


@pytest.fixture(scope="module")
def llm(tiny_llama_dir) -> LLM:
    return LLM(tiny_llama_dir, block_size=4, num_kv_blocks=256, max_model_len=256)


@pytest.fixture(scope="module")
def hf(tiny_llama_dir):
    import transformers

    return transformers.AutoModelForCausalLM.from_pretrained(tiny_llama_dir, torch_dtype=torch.float32).eval()


def run(llm: LLM, reqs: list[tuple[list[int], SamplingParams]]) -> dict:
    """Run `reqs` (as r0, r1, ...) to the end; every block back in the pool."""
    return run_requests(llm, [(f"r{i}", prompt, params) for i, (prompt, params) in enumerate(reqs)])


class LibraryMatcher:
    """A grammar library's own matcher, used as it documents itself: the reference for the engine's."""

    def __init__(self, backend: str, compiled, tokenizer_dir: str, eos: int, vocab: int) -> None:
        self.backend = backend
        if backend == "xgrammar":
            self.m = xgr.GrammarMatcher(compiled)
        else:
            import llguidance
            import llguidance.hf
            from transformers import AutoTokenizer

            lt = llguidance.hf.from_tokenizer(AutoTokenizer.from_pretrained(tokenizer_dir), n_vocab=vocab, eos_token=eos)
            self.m = llguidance.LLMatcher(lt, compiled)

    def fill(self, bitmask) -> None:
        if self.backend == "xgrammar":
            self.m.fill_next_token_bitmask(bitmask)
        else:
            import llguidance.torch

            llguidance.torch.fill_next_token_bitmask(self.m, bitmask, 0)

    def accept(self, token: int) -> bool:
        return bool(self.m.accept_token(token) if self.backend == "xgrammar" else self.m.consume_token(token))

    def done(self) -> bool:
        return bool(self.m.is_terminated() if self.backend == "xgrammar" else self.m.is_stopped())


@torch.no_grad()
def hf_masked_greedy(hf, matcher: LibraryMatcher, prompt: list[int], max_tokens: int) -> list[int]:
    """transformers' greedy tokens with the grammar library's own matcher and mask applied at every step."""
    vocab = hf.config.vocab_size
    ids, out = list(prompt), []
    bitmask = xgr.allocate_token_bitmask(1, vocab)
    for _ in range(max_tokens):
        logits = hf(torch.tensor([ids])).logits[:, -1].float()
        matcher.fill(bitmask)
        xgr.apply_token_bitmask_inplace(logits, bitmask)
        token = int(logits.argmax())
        out.append(token)
        assert matcher.accept(token)
        if matcher.done():
            break
        ids.append(token)
    return out


@pytest.mark.parametrize("backend", ["xgrammar", "guidance"])
def test_greedy_under_a_grammar_equals_transformers_with_the_same_mask(llm, hf, tiny_llama_dir, backend):
    """Constrained and free rows side by side: each constrained row gets exactly its own mask
    (transformers + the grammar library's reference mask decide every token), the free rows are untouched."""
    regex = StructuredOutputsParams(regex=REGEX, backend=backend)
    schema = StructuredOutputsParams(json=SCHEMA, disable_any_whitespace=True, backend=backend)
    free = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    reqs = [(PROMPTS[0], SamplingParams(temperature=0, max_tokens=40, structured_outputs=regex)),
            (PROMPTS[1], free),
            (PROMPTS[2], SamplingParams(temperature=0, max_tokens=40, structured_outputs=schema)),
            (PROMPTS[3], free)]
    done = run(llm, reqs)
    grammars = llm.engine.grammars
    for i, spec in ((0, regex), (2, schema)):
        got = done[f"r{i}"].outputs[0]
        name, compiled = grammars.compile(spec)
        assert name == backend
        reference = LibraryMatcher(backend, compiled, tiny_llama_dir, llm.engine.tokenizer.eos_token_id,
                                   hf.config.vocab_size)
        assert got.token_ids == hf_masked_greedy(hf, reference, reqs[i][0], 40)
        assert got.finish_reason == "stop"
    assert re.fullmatch(REGEX, done["r0"].outputs[0].text)
    value = json.loads(done["r2"].outputs[0].text)
    assert isinstance(value["a"], int) and isinstance(value["b"], str)
    for i in (1, 3):
        alone = run(llm, [(reqs[i][0], free)])["r0"].outputs[0].token_ids
        assert done[f"r{i}"].outputs[0].token_ids == alone


def test_forked_samples_each_follow_the_grammar(llm):
    params = SamplingParams(n=6, temperature=1.5, seed=5, max_tokens=40,
                            structured_outputs=StructuredOutputsParams(regex=REGEX))
    outs = run(llm, [(PROMPTS[0], params)])["r0"].outputs
    texts = [o.text for o in outs]
    assert all(re.fullmatch(REGEX, t) for t in texts), texts
    assert len(set(texts)) > 1  # the siblings' parser states are their own


def test_preemption_keeps_the_parser_state(tiny_llama_dir, llm):
    """A pool too small for the batch preempts and recomputes sequences mid-output: their seeded
    structured outputs equal those of a roomy pool."""
    params = [SamplingParams(temperature=1.0, seed=s, max_tokens=60, structured_outputs=StructuredOutputsParams(
        json=SCHEMA)) for s in range(6)]
    reqs = [(PROMPTS[i % 4] * 3, p) for i, p in enumerate(params)]
    roomy = run(llm, reqs)
    tight = LLM(tiny_llama_dir, block_size=4, num_kv_blocks=40, max_model_len=256)
    small = run(tight, reqs)
    assert tight.stats()["num_preemptions"] > 0
    for rid, out in roomy.items():
        assert small[rid].outputs[0].token_ids == out.outputs[0].token_ids


def test_nothing_left_to_pick_fails_only_that_request(llm):
    """allowed_token_ids that the regex never allows: that request fails with no_token_allowed,
    the one beside it finishes as usual."""
    digits_only = SamplingParams(temperature=0, max_tokens=10, allowed_token_ids=[3, 4, 5],
                                 structured_outputs=StructuredOutputsParams(regex="[a-z]+"))
    fine = SamplingParams(temperature=0, max_tokens=10, structured_outputs=StructuredOutputsParams(regex="[a-z]{1,4}!"))
    done = run(llm, [(PROMPTS[0], digits_only), (PROMPTS[1], fine)])
    assert done["r0"].error is not None and "no token can be picked" in str(done["r0"].error)
    assert done["r1"].error is None and re.fullmatch("[a-z]{1,4}!", done["r1"].outputs[0].text)


def test_compiled_grammars_are_cached(llm):
    grammars = llm.engine.grammars
    spec = StructuredOutputsParams(choice=["alpha", "beta"])
    first = grammars.compile(spec)
    hits = grammars.hits
    assert grammars.compile(StructuredOutputsParams(choice=["alpha", "beta"])) is first
    assert grammars.hits == hits + 1


@pytest.mark.parametrize("spec, words", [
    (StructuredOutputsParams(regex="a(b"), ["structured_outputs.regex", "parenthesis"]),
    (StructuredOutputsParams(json='{"type": "objec"}'), ["structured_outputs.json", "objec"]),
    (StructuredOutputsParams(grammar="root ::= nope"), ["structured_outputs.grammar", "nope"]),
])
def test_an_invalid_constraint_is_refused_and_leaves_nothing(llm, spec, words):
    with pytest.raises(ValueError) as e:
        llm.engine.add_request("bad", {"prompt_token_ids": [3, 4]}, SamplingParams(structured_outputs=spec))
    for w in words:
        assert w in str(e.value)
    assert not llm.engine.has_unfinished_requests()
    run(llm, [(PROMPTS[0], SamplingParams(max_tokens=2))])  # and the id is free again


@pytest.mark.parametrize("kwargs, words", [
    ({}, "exactly one"),
    ({"regex": "a", "json_object": True}, "exactly one"),
    ({"choice": []}, "non-empty list"),
    ({"choice": ["a", ""]}, "non-empty strings"),
    ({"json": 3}, "JSON schema"),
    ({"grammar": ""}, "non-empty string"),
    ({"regex": "\ud800"}, "lone surrogate"),
])
def test_params_are_checked_where_built(kwargs, words):
    with pytest.raises(ValueError, match=words):
        StructuredOutputsParams(**kwargs)


def test_sampling_params_take_a_dict():
    p = SamplingParams(structured_outputs={"json": {"type": "object", "properties": {"z": {}, "a": {}}}})
    assert list(json.loads(p.structured_outputs.json)["properties"]) == ["z", "a"]  # order kept: outputs follow it
    with pytest.raises(ValueError, match="takes only"):
        SamplingParams(structured_outputs={"schema": {}})


def test_bitmask_matches_xgrammar_layout():
    torch.manual_seed(0)
    vocab = 333  # not a multiple of 32: the last word is partly padding
    bitmask = torch.randint(-2 ** 31, 2 ** 31 - 1, (3, (vocab + 31) // 32), dtype=torch.int32)
    logits = torch.zeros(3, vocab)
    xgr.apply_token_bitmask_inplace(logits, bitmask)
    additive = bitmask_to_additive(bitmask, vocab)
    assert additive.shape == (3, vocab) and torch.isin(additive, torch.tensor([0.0, float("-inf")])).all()
    assert torch.equal(additive == 0, logits == 0)


@pytest.mark.parametrize("text, valid", [
    ('{"b": "\x1f', False),         # a raw control character is not JSON
    ('{"b": "a\tb', False),
    ('{"b": "a b\u00e9", "c": ["xy", "\u00e9\u00e9"]}', True),
    ('{"b": "abcdefg', False),      # maxLength 6
    ('{"b": "x", "c": ["y"]}', False),  # minLength 2
])
def test_length_bounded_strings_are_json_strings(llm, text, valid):
    """xgrammar's own rule for strings with minLength/maxLength takes raw control characters
    (mlc-ai/xgrammar#800), which JSON forbids; the engine compiles them out."""
    schema = {"type": "object", "properties": {"b": {"type": "string", "maxLength": 6},
                                               "c": {"type": "array", "items": {"type": "string", "minLength": 2}}},
              "required": ["b", "c"]}
    _, compiled = llm.engine.grammars.compile(StructuredOutputsParams(json=schema, disable_any_whitespace=True,
                                                                      backend="xgrammar"))
    matcher = xgr.GrammarMatcher(compiled, terminate_without_stop_token=True)
    assert bool(matcher.accept_string(text)) is valid


def test_the_grammar_starts_where_the_reasoning_ends(llm):
    """With a reasoning section the reasoning is free and the grammar applies after it: the
    reasoning's tokens equal the unconstrained greedy's, and what follows equals the greedy run
    under the grammar from there. The end is the model's own (its third token stands for the end
    marker), or the budget's forced close; a reply may also open the reasoning itself."""
    spec = StructuredOutputsParams(regex=REGEX)
    free = run(llm, [(PROMPTS[0], SamplingParams(temperature=0, max_tokens=3, ignore_eos=True))])["r0"].outputs[0]
    free = free.token_ids
    unused = next(t for t in range(3, 300) if t not in free)
    close = (unused + 1, unused + 2)
    cases = {  # name: (section, budget, the free tokens the reply starts with)
        "ended": (ReasoningSection(((free[2],),)), None, list(free)),
        "opened by the reply": (ReasoningSection(((free[2],),), start_token_ids=(free[0],)), None, list(free)),
        "closed by the budget": (ReasoningSection(((unused,),)), ReasoningBudget(2, close, (unused,)),
                                 list(free[:2]) + list(close)),
    }
    reqs = [(PROMPTS[0], SamplingParams(temperature=0, max_tokens=40, structured_outputs=spec, reasoning_section=s,
                                        reasoning_budget=b)) for s, b, _ in cases.values()]
    done = run(llm, reqs)
    for i, (name, (_, _, head)) in enumerate(cases.items()):
        out = done[f"r{i}"].outputs[0]
        assert out.token_ids[:len(head)] == head, name
        answer = run(llm, [(PROMPTS[0] + head, SamplingParams(temperature=0, max_tokens=40, structured_outputs=spec))])
        assert out.token_ids[len(head):] == answer["r0"].outputs[0].token_ids, name
        assert re.fullmatch(REGEX, answer["r0"].outputs[0].text) and out.finish_reason == "stop", name


def test_reasoning_and_grammars_under_speculation_decode_as_without(llm, tiny_llama_dir):
    """Prompt lookup on: the masks of each verified position come from the grammar (and its
    reasoning gate) walked along the proposals before it, so replies that reason freely and then
    answer under a regex or a schema, or that open the reasoning themselves, are token for token
    those decoded without speculation, with proposals verified under them."""
    spec_llm = LLM(tiny_llama_dir, block_size=4, num_kv_blocks=256, max_model_len=256,
                   speculative_config={"method": "ngram", "num_speculative_tokens": 4,
                                       "prompt_lookup_min": 1, "prompt_lookup_max": 2})
    free = run(llm, [(PROMPTS[0], SamplingParams(temperature=0, max_tokens=3, ignore_eos=True))])["r0"].outputs[0]
    free = free.token_ids
    sections = [None, ReasoningSection(((free[2],),)), ReasoningSection(((free[2],),), start_token_ids=(free[0],))]
    reqs = [(prompt, SamplingParams(temperature=0, max_tokens=40, structured_outputs=constraint, reasoning_section=s))
            for prompt in PROMPTS[:2] for s in sections
            for constraint in (StructuredOutputsParams(regex=REGEX), StructuredOutputsParams(json=json.dumps(SCHEMA)))]
    want, got = run(llm, reqs), run(spec_llm, reqs)
    assert {k: o.outputs[0].token_ids for k, o in got.items()} == {k: o.outputs[0].token_ids for k, o in want.items()}
    stats = spec_llm.stats()["spec_decode"]
    assert 0 < stats["num_accepted_tokens"] < stats["num_draft_tokens"]
