"""Anthropic's Messages API with the official `anthropic` client against the bundled SmolLM2
(served with --enable-auto-tool-choice --tool-call-parser hermes): messages.create and
messages.stream (its text and its events, in Anthropic's order), count_tokens, stop reasons,
a tool call round trip, and errors in Anthropic's shape."""
from __future__ import annotations

import json

import anthropic
import httpx
import jsonschema
import pytest

from server_utils import MODEL_NAME

# The 2026 SDK no longer lists temperature, top_p or top_k among create()'s arguments; older clients
# send them, and the server takes them.
GREEDY = {"temperature": 0}
ASK = [{"role": "user", "content": "What is the capital of France?"}]
WEATHER = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 20},
                                            "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]}},
           "required": ["city", "unit"]}
TOOLS = [{"name": "get_weather", "description": "Weather in a city", "input_schema": WEATHER},
         {"name": "get_time", "description": "Time in a timezone",
          "input_schema": {"type": "object", "properties": {"tz": {"type": "string", "maxLength": 20}},
                           "required": ["tz"]}}]


@pytest.fixture(scope="module")
def client(smollm2_server):
    c = anthropic.Anthropic(base_url=smollm2_server.url, api_key="none", max_retries=0, timeout=300)
    yield c
    c.close()


def test_create_and_count_tokens(client):
    r = client.messages.create(model=MODEL_NAME, max_tokens=24, messages=ASK, extra_body=GREEDY,
                               system=[{"type": "text", "text": "You answer in one word."}],
                               metadata={"user_id": "u1"})
    assert r.type == "message" and r.role == "assistant" and r.model == MODEL_NAME and r.id.startswith("msg")
    (block,) = r.content
    assert block.type == "text" and block.text
    assert r.stop_reason in ("end_turn", "max_tokens") and r.stop_sequence is None
    count = client.messages.count_tokens(model=MODEL_NAME, messages=ASK,
                                         system=[{"type": "text", "text": "You answer in one word."}])
    assert count.input_tokens == r.usage.input_tokens + (r.usage.cache_read_input_tokens or 0) > 10
    assert 1 <= r.usage.output_tokens <= 24
    # A last assistant message is a prefill: the reply continues it, without repeating it.
    prefill = "The capital of France is"
    cont = client.messages.create(model=MODEL_NAME, max_tokens=4, extra_body=GREEDY,
                                  messages=ASK + [{"role": "assistant", "content": prefill}])
    assert "Paris" in cont.content[0].text and prefill not in cont.content[0].text


def test_stop_reasons(client):
    kwargs = dict(model=MODEL_NAME, messages=ASK, extra_body=GREEDY, system="Answer at length.")
    cut = client.messages.create(max_tokens=3, **kwargs)
    assert cut.stop_reason == "max_tokens" and cut.usage.output_tokens == 3
    text = client.messages.create(max_tokens=16, **kwargs).content[0].text
    word = text.split()[1]
    stopped = client.messages.create(max_tokens=16, stop_sequences=[word], **kwargs)
    assert stopped.stop_reason == "stop_sequence" and stopped.stop_sequence == word
    assert word not in stopped.content[0].text


def test_stream_text_and_events(client):
    kwargs = dict(model=MODEL_NAME, max_tokens=16, messages=ASK, extra_body=GREEDY)
    whole = client.messages.create(**kwargs)
    with client.messages.stream(**kwargs) as stream:
        text = "".join(stream.text_stream)
        final = stream.get_final_message()
    assert text == whole.content[0].text == final.content[0].text
    assert final.stop_reason == whole.stop_reason and final.usage.output_tokens == whole.usage.output_tokens

    # The events as sent (the client drops ping): each named in its `event:` line and its data's type.
    body = {**kwargs, **GREEDY, "stream": True}
    del body["extra_body"]
    with httpx.stream("POST", str(client.base_url).rstrip("/") + "/v1/messages", json=body, timeout=120) as r:
        lines = [line for line in r.iter_lines() if line]
    names = [line.removeprefix("event: ") for line in lines[::2]]
    assert [json.loads(line.removeprefix("data: "))["type"] for line in lines[1::2]] == names
    assert names[:3] == ["message_start", "ping", "content_block_start"]
    assert names[-3:] == ["content_block_stop", "message_delta", "message_stop"]
    assert set(names[3:-3]) == {"content_block_delta"}


def test_a_tool_call_round_trip(client):
    """A named tool's call as a tool_use block (stop_reason tool_use), its result sent back in a
    tool_result block, and the conversation goes on; streamed, the input arrives as JSON deltas."""
    ask = [{"role": "user", "content": "What is the weather in Paris?"}]
    kwargs = dict(model=MODEL_NAME, max_tokens=80, messages=ask, tools=TOOLS, extra_body=GREEDY,
                  tool_choice={"type": "tool", "name": "get_weather"})
    r = client.messages.create(**kwargs)
    assert r.stop_reason == "tool_use"
    (call,) = r.content
    assert call.type == "tool_use" and call.name == "get_weather" and call.id.startswith("toolu_")
    jsonschema.validate(call.input, WEATHER)
    with client.messages.stream(**kwargs) as stream:
        partial = "".join(e.delta.partial_json for e in stream
                          if e.type == "content_block_delta" and e.delta.type == "input_json_delta")
        streamed = stream.get_final_message()
    assert json.loads(partial) == call.input == streamed.content[0].input and streamed.stop_reason == "tool_use"

    history = ask + [{"role": "assistant", "content": [c.model_dump(exclude_none=True) for c in r.content]},
                     {"role": "user", "content": [{"type": "tool_result", "tool_use_id": call.id,
                                                   "content": [{"type": "text", "text": "18 degrees"}]}]}]
    follow = client.messages.create(model=MODEL_NAME, max_tokens=8, messages=history, extra_body=GREEDY)
    assert follow.content and follow.content[0].type == "text"

    schema = {"type": "object", "properties": {"capital": {"type": "string", "maxLength": 12}},
              "required": ["capital"]}
    shaped = client.messages.create(model=MODEL_NAME, max_tokens=40, messages=ASK, extra_body=GREEDY,
                                    output_config={"format": {"type": "json_schema", "schema": schema}})
    jsonschema.validate(json.loads(shaped.content[0].text), schema)

    anyone = client.messages.create(**{**kwargs, "tool_choice": {"type": "any"}})
    assert anyone.stop_reason == "tool_use" and {c.type for c in anyone.content} == {"tool_use"}


def test_auto_tool_choice_without_a_call_is_text(client):
    """tool_choice auto goes through the server's hermes parser; this small model answers in text."""
    r = client.messages.create(model=MODEL_NAME, max_tokens=12, messages=ASK, tools=TOOLS, extra_body=GREEDY,
                               tool_choice={"type": "auto", "disable_parallel_tool_use": True})
    assert [c.type for c in r.content] == ["text"] and r.stop_reason in ("end_turn", "max_tokens")


def test_errors_in_anthropics_shape(client, smollm2_server):
    def refused(status: int, kind: str, words: str, **kwargs) -> None:
        body = {"model": MODEL_NAME, "max_tokens": 8, "messages": ASK, **kwargs}
        r = httpx.post(smollm2_server.url + "/v1/messages", json=body, timeout=60)
        assert r.status_code == status, r.text
        assert r.json()["type"] == "error" and r.json()["error"]["type"] == kind, r.text
        assert words in r.json()["error"]["message"], r.text

    refused(400, "invalid_request_error", "messages[0].content[0].type 'image'", messages=[
        {"role": "user", "content": [{"type": "image", "source": {"type": "base64", "media_type": "image/png",
                                                                 "data": "AAAA"}}]}])
    refused(400, "invalid_request_error", "frobnicate", frobnicate=1)
    refused(400, "invalid_request_error", "messages[0].content[0].colour", messages=[
        {"role": "user", "content": [{"type": "text", "text": "hi", "colour": "red"}]}])
    # A budget needs --reasoning-parser (this server has none); one that leaves no room for the answer is refused.
    refused(400, "invalid_request_error", "thinking.budget_tokens 4 needs the server started with --reasoning-parser",
            thinking={"type": "enabled", "budget_tokens": 4})
    refused(400, "invalid_request_error", "thinking.budget_tokens must be less than max_tokens (8)",
            thinking={"type": "enabled", "budget_tokens": 1024})
    refused(400, "invalid_request_error", "tools[0].type 'web_search_20250305'",
            tools=[{"type": "web_search_20250305", "name": "web_search"}])
    refused(400, "invalid_request_error", "tool_choice.type", tools=TOOLS, tool_choice={"type": "sometimes"})
    refused(400, "invalid_request_error", "temperature", temperature=1.5)
    refused(404, "not_found_error", "claude-opus", model="claude-opus-4")
    r = httpx.post(smollm2_server.url + "/v1/messages", json={"model": MODEL_NAME, "messages": ASK}, timeout=60)
    assert r.status_code == 400 and "max_tokens" in r.json()["error"]["message"], r.text

    with pytest.raises(anthropic.BadRequestError) as e:  # the client reads the shape too
        client.messages.create(model=MODEL_NAME, max_tokens=8, messages=ASK, output_config={"effort": "high"})
    assert "output_config.effort" in e.value.body["error"]["message"]
    with pytest.raises(anthropic.NotFoundError):
        client.messages.create(model="nope", max_tokens=8, messages=ASK)
