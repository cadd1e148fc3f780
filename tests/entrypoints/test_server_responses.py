"""OpenAI's Responses API with the official `openai` client against the bundled SmolLM2 (the
shared server, with --enable-auto-tool-choice --tool-call-parser hermes): responses.create and
responses.stream (the events in the documented order), the same replies as the chat endpoint, a
tool call round trip through previous_response_id, JSON-schema outputs, the store, and errors."""
from __future__ import annotations

import json

import httpx
import jsonschema
import openai
import pytest

from server_utils import MODEL_NAME

ASK = "What is the capital of France?"
WEATHER = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 20}}, "required": ["city"]}
TOOLS = [{"type": "function", "name": "get_weather", "description": "Weather in a city", "parameters": WEATHER},
         {"type": "function", "name": "get_time", "parameters": {
             "type": "object", "properties": {"tz": {"type": "string", "maxLength": 20}}, "required": ["tz"]}}]


@pytest.fixture(scope="module")
def client(smollm2_server):
    c = smollm2_server.client(timeout=300)
    yield c
    c.close()


def test_create_and_stream_give_the_chat_endpoints_reply(client, smollm2_server):
    kwargs = dict(model=MODEL_NAME, max_output_tokens=8, temperature=0)
    r = client.responses.create(input=ASK, instructions="Answer in one sentence.", **kwargs)
    chat = client.chat.completions.create(model=MODEL_NAME, max_tokens=8, temperature=0, messages=[
        {"role": "system", "content": "Answer in one sentence."}, {"role": "user", "content": ASK}])
    assert r.object == "response" and r.model == MODEL_NAME and r.status == "completed"
    (message,) = r.output
    assert message.type == "message" and message.role == "assistant" and message.status == "completed"
    assert r.output_text == chat.choices[0].message.content and "Paris" in r.output_text
    assert r.usage.input_tokens == chat.usage.prompt_tokens
    assert r.usage.output_tokens == chat.usage.completion_tokens
    assert r.usage.total_tokens == r.usage.input_tokens + r.usage.output_tokens

    with client.responses.stream(input=ASK, instructions="Answer in one sentence.", **kwargs) as stream:
        deltas = "".join(e.delta for e in stream if e.type == "response.output_text.delta")
        final = stream.get_final_response()
    assert deltas == final.output_text == r.output_text and final.usage.output_tokens == r.usage.output_tokens

    # The events as sent: each named in its `event:` line and its data's type, numbered in order.
    body = {"model": MODEL_NAME, "input": ASK, "max_output_tokens": 4, "temperature": 0, "stream": True}
    with httpx.stream("POST", smollm2_server.url + "/v1/responses", json=body, timeout=120) as raw:
        lines = [line for line in raw.iter_lines() if line]
    names = [line.removeprefix("event: ") for line in lines[::2]]
    data = [json.loads(line.removeprefix("data: ")) for line in lines[1::2]]
    assert [d["type"] for d in data] == names and [d["sequence_number"] for d in data] == list(range(len(data)))
    assert names[:4] == ["response.created", "response.in_progress", "response.output_item.added",
                         "response.content_part.added"]
    assert set(names[4:-4]) == {"response.output_text.delta"}
    # Cut short by max_output_tokens: response.incomplete where a finished reply has response.completed.
    assert names[-4:] == ["response.output_text.done", "response.content_part.done", "response.output_item.done",
                          "response.incomplete"]


def test_cut_short_is_incomplete(client):
    r = client.responses.create(model=MODEL_NAME, input=ASK, instructions="Answer at length.", max_output_tokens=3,
                                temperature=0)
    assert r.status == "incomplete" and r.incomplete_details.reason == "max_output_tokens"
    assert r.usage.output_tokens == 3 and r.output[0].status == "incomplete"
    events = [e.type for e in client.responses.create(model=MODEL_NAME, input=ASK, max_output_tokens=3,
                                                      temperature=0, stream=True)]
    assert events[-1] == "response.incomplete"


def test_a_client_that_leaves_mid_stream_frees_its_blocks(client, smollm2_server):
    with client.responses.create(model=MODEL_NAME, input=ASK, max_output_tokens=400, temperature=0,
                                 instructions="Answer at length.", stream=True) as stream:
        next(e for e in stream if e.type == "response.output_text.delta")
    smollm2_server.wait_all_blocks_free()
    with httpx.stream("POST", smollm2_server.url + "/api/generate", timeout=60,
                      json={"model": MODEL_NAME, "prompt": ASK, "options": {"num_predict": 400}}) as r:
        next(r.iter_lines())
    smollm2_server.wait_all_blocks_free()


def test_a_tool_call_round_trip(client):
    """A named function's call as a function_call item; streamed, its arguments arrive as deltas;
    its output sent back after previous_response_id continues the stored conversation, exactly as
    sending the whole conversation does."""
    kwargs = dict(model=MODEL_NAME, max_output_tokens=40, temperature=0, tools=TOOLS)
    r = client.responses.create(input="What is the weather in Paris?", **kwargs,
                                tool_choice={"type": "function", "name": "get_weather"})
    (call,) = r.output
    assert call.type == "function_call" and call.name == "get_weather" and call.status == "completed"
    jsonschema.validate(json.loads(call.arguments), WEATHER)
    assert r.tool_choice.name == "get_weather"
    with client.responses.stream(input="What is the weather in Paris?", **kwargs,
                                 tool_choice={"type": "function", "name": "get_weather"}) as stream:
        partial = "".join(e.delta for e in stream if e.type == "response.function_call_arguments.delta")
        streamed = stream.get_final_response()
    assert json.loads(partial) == json.loads(call.arguments) == json.loads(streamed.output[0].arguments)

    result = {"type": "function_call_output", "call_id": call.call_id, "output": "18 degrees"}
    follow = client.responses.create(model=MODEL_NAME, previous_response_id=r.id, input=[result],
                                     max_output_tokens=6, temperature=0)
    assert follow.previous_response_id == r.id and follow.output_text
    whole = client.responses.create(model=MODEL_NAME, max_output_tokens=6, temperature=0, input=[
        {"role": "user", "content": [{"type": "input_text", "text": "What is the weather in Paris?"}]},
        {"type": "function_call", "call_id": call.call_id, "name": call.name, "arguments": call.arguments}, result])
    assert whole.output_text == follow.output_text and whole.usage.input_tokens == follow.usage.input_tokens

    anyone = client.responses.create(input="What is the weather in Tokyo?", **{**kwargs, "tools": TOOLS[:1]},
                                     tool_choice="required", parallel_tool_calls=False)
    (one,) = anyone.output
    assert one.type == "function_call" and one.name == "get_weather"


def test_json_schema_and_json_object_outputs(client):
    schema = {"type": "object", "properties": {"capital": {"type": "string", "maxLength": 12}},
              "required": ["capital"], "additionalProperties": False}
    r = client.responses.create(model=MODEL_NAME, input=ASK, max_output_tokens=40, temperature=0,
                                text={"format": {"type": "json_schema", "name": "capital", "schema": schema,
                                                 "strict": True}})
    jsonschema.validate(json.loads(r.output_text), schema)
    assert r.text.format.type == "json_schema"
    anything = client.responses.create(model=MODEL_NAME, input=ASK + " Answer in JSON.", max_output_tokens=40,
                                       temperature=0, text={"format": {"type": "json_object"}})
    assert isinstance(json.loads(anything.output_text), dict)


def test_the_store(client):
    r = client.responses.create(model=MODEL_NAME, input=ASK, max_output_tokens=4, temperature=0,
                                metadata={"run": "7"})
    got = client.responses.retrieve(r.id)
    assert got.id == r.id and got.output_text == r.output_text and got.metadata == {"run": "7"}
    client.responses.delete(r.id)
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(r.id)
    with pytest.raises(openai.NotFoundError) as e:
        client.responses.create(model=MODEL_NAME, input="and Spain?", previous_response_id=r.id, max_output_tokens=4)
    assert e.value.body["param"] == "previous_response_id"
    unstored = client.responses.create(model=MODEL_NAME, input=ASK, max_output_tokens=2, store=False)
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(unstored.id)


@pytest.mark.parametrize("extra, param, words", [
    ({"tools": [{"type": "web_search"}]}, "tools[0].type", "runs no tools of its own"),
    ({"background": True}, "background", "background"),
    ({"frobnicate": 1}, "frobnicate", "frobnicate"),
    ({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "data:"}]}]},
     "input[0].content[0].type", "text-only"),
    ({"input": [{"type": "item_reference", "id": "x"}]}, "input[0].type", "item_reference"),
    ({"reasoning": {"summary": "auto"}}, "reasoning.summary", "summary"),
    ({"reasoning": {"effort": "high"}}, "reasoning.effort", "--reasoning-parser"),
    ({"include": ["reasoning.encrypted_content"]}, "include", "include"),
    ({"truncation": "auto"}, "truncation", "truncation"),
    ({"max_output_tokens": 0}, "max_output_tokens", ">= 1"),
    ({"text": {"verbosity": "low"}}, "text.verbosity", "verbosity"),
    ({"text": {"format": {"type": "json_schema", "name": "x"}}}, "text.format.schema", "JSON schema"),
    ({"tool_choice": {"type": "file_search"}}, "tool_choice.type", "file_search"),
])
def test_refused_fields_are_400_naming_them(smollm2_server, extra, param, words):
    body = {"model": MODEL_NAME, "input": ASK, "max_output_tokens": 4, **extra}
    r = httpx.post(smollm2_server.url + "/v1/responses", json=body, timeout=60)
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["param"] == param and words in error["message"], r.text
