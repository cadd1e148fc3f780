"""Structured outputs over HTTP with the official `openai` client, against the bundled SmolLM2:
every spelling clients use (response_format, vLLM's structured_outputs and guided_* extras),
outputs checked by jsonschema / re, and bad constraints refused with a 400 naming the field."""
from __future__ import annotations

import json
import re

import jsonschema
import openai
import pytest

from server_utils import MODEL_NAME

PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "minLength": 1, "maxLength": 12},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "city": {"type": "string", "enum": ["Paris", "London", "Tokyo"]},
        "tags": {"type": "array", "items": {"type": "string", "maxLength": 8}, "maxItems": 3},
    },
    "required": ["name", "age", "city", "tags"],
    "additionalProperties": False,
}
ASK = [{"role": "user", "content": "Describe a person as JSON with their name, age, city and a few tags."}]


@pytest.fixture(scope="module")
def client(smollm2_server):
    c = smollm2_server.client(timeout=300)
    yield c
    c.close()


@pytest.mark.slow  # a long sweep: `make test-slow`
def test_json_schema_holds_for_50_seeded_samples(client):
    """response_format json_schema: 5 requests x n=10 sampled at temperature 1 (seeded), every one
    of the 50 outputs complete and valid under the schema. The requests run at once, as a server
    sees them, so that the 50 sequences share steps (each its own grammar state)."""
    from concurrent.futures import ThreadPoolExecutor

    def ask(seed: int) -> list[tuple[str, str]]:
        r = client.chat.completions.create(
            model=MODEL_NAME, messages=ASK, n=10, temperature=1.0, seed=seed, max_tokens=120,
            response_format={"type": "json_schema", "json_schema": {"name": "person", "schema": PERSON}})
        return [(c.finish_reason, c.message.content) for c in r.choices]

    with ThreadPoolExecutor(5) as pool:
        outputs = [o for answers in pool.map(ask, range(5)) for o in answers]
    assert len(outputs) == 50
    assert [f for f, _ in outputs].count("stop") == 50, outputs
    for _, text in outputs:
        jsonschema.validate(json.loads(text), PERSON)
    assert len({text for _, text in outputs}) > 10  # sampled, not one answer repeated


def test_json_object_on_completions_and_streamed(client):
    kwargs = dict(model=MODEL_NAME, prompt="Here is a cat as a JSON object: ", max_tokens=80, temperature=0,
                  extra_body={"response_format": {"type": "json_object"}})
    r = client.completions.create(**kwargs)
    assert r.choices[0].finish_reason == "stop"
    assert isinstance(json.loads(r.choices[0].text), dict)
    streamed = "".join(c.choices[0].text for c in client.completions.create(**kwargs, stream=True) if c.choices)
    assert streamed == r.choices[0].text


def test_regex_choice_and_grammar_spellings(client):
    def chat(**extra):
        r = client.chat.completions.create(model=MODEL_NAME, messages=[{"role": "user", "content": "Pick one."}],
                                           max_tokens=40, temperature=1.0, seed=7, n=4, extra_body=extra)
        assert {c.finish_reason for c in r.choices} == {"stop"}
        return [c.message.content for c in r.choices]

    for text in chat(structured_outputs={"regex": r"[A-Z][a-z]{2,6} \d{1,3}"}):
        assert re.fullmatch(r"[A-Z][a-z]{2,6} \d{1,3}", text), text
    for text in chat(guided_regex=r"(yes|no)!"):
        assert text in ("yes!", "no!")
    for text in chat(guided_choice=["red", "green", "blue"]) + chat(structured_outputs={"choice": ["red", "blue"]}):
        assert text in ("red", "green", "blue")
    grammar = 'root ::= "(" num ("+" num)* ")"\nnum ::= [1-9] [0-9]?'
    for text in chat(structured_outputs={"grammar": grammar}) + chat(guided_grammar=grammar):
        assert re.fullmatch(r"\([1-9][0-9]?(\+[1-9][0-9]?)*\)", text), text
    for text in chat(guided_json={"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"]},
                     guided_decoding_backend="xgrammar"):
        assert isinstance(json.loads(text)["ok"], bool)
    # llguidance, pinned by the request.
    for text in chat(guided_json={"type": "object", "properties": {"n": {"type": "integer", "multipleOf": 7, "minimum": 0, "maximum": 999}},
                                  "required": ["n"]}, guided_decoding_backend="guidance"):
        assert json.loads(text)["n"] % 7 == 0


def test_text_response_format_is_unconstrained(client):
    kwargs = dict(model=MODEL_NAME, messages=ASK, max_tokens=12, temperature=0)
    plain = client.chat.completions.create(**kwargs).choices[0].message.content
    assert client.chat.completions.create(**kwargs, response_format={"type": "text"}).choices[0].message.content \
        == plain


@pytest.mark.parametrize("extra, param, words", [
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "objec"}}}},
     "response_format", ["objec"]),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x"}}}, "response_format", ["schema"]),
    ({"response_format": {"type": "xml"}}, "response_format", ["xml", "json_schema"]),
    ({"structured_outputs": {"regex": "a(b"}}, "structured_outputs", ["regex", "parenthesis"]),
    ({"structured_outputs": {"grammar": "root ::= foo"}}, "structured_outputs", ["foo"]),
    ({"structured_outputs": {"regex": "a", "choice": ["b"]}}, "structured_outputs", ["exactly one"]),
    ({"structured_outputs": {"pattern": "a"}}, "structured_outputs", ["pattern", "regex"]),
    ({"guided_choice": []}, "guided_choice", ["non-empty"]),
    ({"guided_regex": "a", "guided_json": {"type": "object"}}, "guided_regex", ["only one", "guided_json"]),
    ({"guided_decoding_backend": "outlines", "guided_regex": "a"}, "guided_decoding_backend", ["outlines"]),
    ({"structural_tag": {}}, "structural_tag", ["not supported"]),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {
        "type": "array", "uniqueItems": True}}}}, "response_format", ["'uniqueItems'", "no grammar backend"]),
    ({"guided_json": {"type": "number", "multipleOf": 0.5}, "guided_decoding_backend": "xgrammar"}, "guided_json",
     ["'multipleOf on numbers'", "xgrammar backend does not enforce", "'guidance'"]),
])
def test_bad_constraints_are_400_naming_the_field(client, extra, param, words):
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model=MODEL_NAME, messages=ASK, max_tokens=4, extra_body=extra)
    err = e.value.body
    assert err["param"] == param, err
    for w in words:
        assert w in err["message"], err
