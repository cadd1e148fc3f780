"""Grammar backends (engine/grammars/): schemas normalised so no backend drops a constraint by
the way it is written, each schema sent to a backend that enforces every keyword it uses, and a
keyword no backend enforces refused by name."""
from __future__ import annotations

import json

import jsonschema
import pytest

from pagellm import SamplingParams, StructuredOutputsParams
from pagellm.engine.grammars import choose_backend
from pagellm.engine.grammars.json_schema import closed_by_default, normalize_schema
from pagellm.engine.grammars.guidance_backend import UNENFORCED as GUIDANCE_UNENFORCED
from pagellm.engine.grammars.xgrammar_backend import UNENFORCED as XGRAMMAR_UNENFORCED
from tests.engine.test_structured_outputs import llm, run  # noqa: F401  (the module's engine)

AVAILABLE = {"xgrammar": XGRAMMAR_UNENFORCED, "guidance": GUIDANCE_UNENFORCED}
BASE = {"type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "string", "maxLength": 4}}}
REF_REQUIRED = {"$defs": {"base": BASE}, "allOf": [{"$ref": "#/$defs/base"}], "required": ["a", "b"]}


def test_allof_of_a_ref_merges_into_the_parent_with_its_required_list():
    merged = normalize_schema(REF_REQUIRED)
    assert "allOf" not in merged
    assert merged["required"] == ["a", "b"] and merged["properties"] == BASE["properties"]
    beside = normalize_schema({"$defs": {"base": BASE}, "$ref": "#/$defs/base", "required": ["a"]})
    assert "$ref" not in beside and beside["required"] == ["a"] and beside["type"] == "object"


@pytest.mark.parametrize("schema", [
    {"allOf": [{"type": "integer"}, {"type": "string"}]},  # conflicting types: not a merge
    {"properties": {"a": {"type": "integer"}}, "additionalProperties": False,
     "allOf": [{"properties": {"b": {"type": "integer"}}}]},  # closed parent: b is not allowed, merging would allow it
    {"$defs": {"n": {"allOf": [{"$ref": "#/$defs/n"}]}}, "allOf": [{"$ref": "#/$defs/n"}]},  # self-reference
])
def test_an_allof_whose_merge_would_not_be_exact_is_left_as_written(schema):
    assert normalize_schema(schema)["allOf"] == schema["allOf"]


def test_closed_by_default_matches_strict_mode():
    closed = closed_by_default({"type": "object", "properties": {"a": {"type": "array", "prefixItems": [{}]}},
                                "patternProperties": {"^x": {}}})
    assert "additionalProperties" not in closed  # patternProperties speak for the other keys
    assert closed["properties"]["a"]["items"] is False


@pytest.mark.parametrize("schema, feature", [
    ({"type": "number", "multipleOf": 0.25}, "multipleOf on numbers"),
    ({"type": "string", "format": "hostname", "maxLength": 20}, "format with minLength/maxLength"),
    ({"type": "string", "pattern": "^[a-z]+$", "minLength": 3}, "pattern with minLength/maxLength"),
    ({"oneOf": [{"type": "integer"}, {"type": "boolean"}]}, "oneOf"),
])
def test_auto_moves_to_guidance_for_what_xgrammar_drops(schema, feature):
    assert choose_backend(StructuredOutputsParams(json=BASE), "auto", AVAILABLE) == "xgrammar"
    assert choose_backend(StructuredOutputsParams(json=schema), "auto", AVAILABLE) == "guidance"
    with pytest.raises(ValueError, match=f"'{feature}'.*xgrammar backend does not enforce.*'guidance'"):
        choose_backend(StructuredOutputsParams(json=schema), "xgrammar", AVAILABLE)
    # an integer multipleOf, a bare pattern or format: xgrammar's
    for fine in ({"type": "integer", "multipleOf": 3}, {"type": "string", "pattern": "^a+$"},
                 {"type": "string", "format": "date"}):
        assert choose_backend(StructuredOutputsParams(json=fine), "auto", AVAILABLE) == "xgrammar"


def test_a_keyword_no_backend_enforces_is_refused_by_name(llm):  # noqa: F811
    schema = {"type": "array", "items": {"type": "integer"}, "uniqueItems": True}
    with pytest.raises(ValueError, match="'uniqueItems', which no grammar backend"):
        llm.engine.add_request("u", {"prompt_token_ids": [3, 4]},
                               SamplingParams(structured_outputs=StructuredOutputsParams(json=schema)))
    assert not llm.engine.has_unfinished_requests()
    # uniqueItems: false asks nothing, and a property named like a keyword is not one.
    fine = {"type": "object", "properties": {"not": {"type": "integer"}}, "required": ["not"], "uniqueItems": False}
    assert llm.engine.grammars.compile(StructuredOutputsParams(json=fine))[0] == "xgrammar"


@pytest.mark.parametrize("backend", ["xgrammar", "guidance"])
def test_required_beside_an_allof_ref_holds_in_every_sample(llm, backend):  # noqa: F811
    """The schema shape whose required list xgrammar alone drops: sampled outputs all carry it."""
    spec = StructuredOutputsParams(json=REF_REQUIRED, backend=backend)
    params = SamplingParams(n=3, temperature=1.0, seed=3, max_tokens=64, structured_outputs=spec)
    outs = run(llm, [([3, 4, 5, 6], params)])["r0"].outputs
    finished = [o for o in outs if o.finish_reason == "stop"]
    assert finished
    for o in finished:
        jsonschema.validate(json.loads(o.text), REF_REQUIRED)


def test_xgrammar_fills_a_few_rows_as_its_thread_pool_fills_many(llm):  # noqa: F811
    """A step's few rows are filled in the engine's thread, many by xgrammar's thread pool: the same
    bits either way, each row from its own matcher's state (70 matchers along one JSON text)."""
    import torch

    from pagellm.engine.grammars import xgrammar_backend

    grammars = llm.engine.grammars
    tok = llm.get_tokenizer()
    spec = StructuredOutputsParams(json=json.dumps(BASE), backend="xgrammar")
    text = tok.encode('{"a": 12345, "b": "xyz"}', add_special_tokens=False)
    matchers = []
    for i in range(70):
        g = grammars.grammar(spec)
        for t in text[:i % (len(text) + 1)]:
            assert g.accept(t)
        matchers.append(g.matcher)
    assert len(matchers) >= xgrammar_backend.BATCH_FILL_FROM
    words = (grammars.vocab_size + 31) // 32
    backend = grammars.backend("xgrammar")
    pooled = torch.zeros(len(matchers), words, dtype=torch.int32)
    backend.fill(matchers, pooled, list(range(len(matchers))))
    one_by_one = torch.zeros_like(pooled)
    for i, m in enumerate(matchers):
        backend.fill([m], one_by_one, [i])
    assert torch.equal(pooled, one_by_one)
    assert len({tuple(row.tolist()) for row in pooled}) > 3  # the states differ, and so do their masks
