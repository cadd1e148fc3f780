"""Anthropic's Messages requests translated to chat requests, and the API key middleware's
answer on Anthropic's routes: no model, no server."""
from __future__ import annotations

import pytest
from starlette.applications import Starlette
from starlette.responses import PlainTextResponse
from starlette.routing import Route
from starlette.testclient import TestClient

from pagellm.entrypoints.anthropic.protocol import MessagesRequest, to_chat
from pagellm.entrypoints.openai.errors import OpenAIError
from pagellm.entrypoints.openai.middleware import APIKeyMiddleware


def test_a_conversation_becomes_chat_messages():
    req = MessagesRequest.model_validate({
        "model": "m", "max_tokens": 8, "system": [{"type": "text", "text": "Be brief."}],
        "tools": [{"name": "f", "input_schema": {"type": "object"}, "cache_control": {"type": "ephemeral"}}],
        "tool_choice": {"type": "tool", "name": "f", "disable_parallel_tool_use": True},
        "thinking": {"type": "disabled"}, "stop_sequences": ["\n"],
        "messages": [
            {"role": "user", "content": "hi"},
            {"role": "assistant", "content": [{"type": "thinking", "thinking": "hm", "signature": "x"},
                                              {"type": "text", "text": "Calling."},
                                              {"type": "tool_use", "id": "toolu_1", "name": "f", "input": {"a": 1}}]},
            {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "toolu_1", "is_error": True,
                                          "content": [{"type": "text", "text": "boom"}]},
                                         {"type": "text", "text": "again"}]}]})
    chat = to_chat(req)
    messages = [m.model_dump(exclude_none=True) for m in chat.messages]
    assert messages == [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "hi"},
        {"role": "assistant", "content": "Calling.", "reasoning_content": "hm",
         "tool_calls": [{"id": "toolu_1", "type": "function", "function": {"name": "f", "arguments": '{"a": 1}'}}]},
        {"role": "tool", "content": "Error: boom", "tool_call_id": "toolu_1"},
        {"role": "user", "content": "again"}]
    assert chat.tools == [{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}]
    assert chat.tool_choice == {"type": "function", "function": {"name": "f"}} and not chat.parallel_tool_calls
    assert chat.chat_template_kwargs == {"enable_thinking": False} and chat.stop == ["\n"]
    assert chat.max_tokens == 8 and chat.add_generation_prompt


@pytest.mark.parametrize("change, param", [
    ({"messages": [{"role": "system", "content": "x"}]}, "messages[0].role"),
    ({"messages": [{"role": "user", "content": [{"type": "tool_use", "id": "a", "name": "f", "input": {}}]}]},
     "messages[0].content[0].type"),
    ({"messages": [{"role": "user", "content": [{"type": "text"}]}]}, "messages[0].content[0].text"),
    ({"messages": [{"role": "user", "content": "x", "name": "bob"}]}, "messages[0].name"),
    ({"metadata": {"user_id": "u", "tier": 1}}, "metadata.tier"),
    ({"thinking": {"type": "sometimes"}}, "thinking.type"),
    ({"tools": [{"name": "f"}]}, "tools[0].input_schema"),
    ({"max_tokens": 0}, "max_tokens"),
])
def test_bad_requests_name_the_field(change, param):
    body = {"model": "m", "max_tokens": 8, "messages": [{"role": "user", "content": "hi"}], **change}
    with pytest.raises(OpenAIError) as e:
        to_chat(MessagesRequest.model_validate(body))
    assert e.value.status == 400 and e.value.param == param and param in e.value.message


def test_the_api_key_as_anthropics_clients_send_it():
    app = APIKeyMiddleware(Starlette(routes=[Route("/v1/messages", lambda r: PlainTextResponse("ok"),
                                                   methods=["POST"])]), api_key="k")
    client = TestClient(app)
    assert client.post("/v1/messages", headers={"x-api-key": "k"}).text == "ok"
    assert client.post("/v1/messages", headers={"Authorization": "Bearer k"}).text == "ok"
    r = client.post("/v1/messages", headers={"x-api-key": "wrong"})
    assert r.status_code == 401 and r.json()["error"]["type"] == "authentication_error"
    assert r.json()["type"] == "error"
