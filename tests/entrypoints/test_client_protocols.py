"""The Responses API's input items and Ollama's requests translated to chat requests: no model, no server."""
from __future__ import annotations

import pytest

from pagellm.entrypoints.ollama.protocol import ChatRequest, chat_request, sampling
from pagellm.entrypoints.openai.errors import OpenAIError
from pagellm.entrypoints.responses.protocol import messages


def test_items_become_chat_messages():
    """An assistant's reasoning, text and calls (separate items) make one assistant message; a
    call's output is a tool message; developer is the system role; text parts are joined."""
    items = [{"role": "developer", "content": "Be brief."},
             {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "hi"},
                                                             {"type": "input_text", "text": "there"}]},
             {"type": "reasoning", "id": "rs_1", "summary": [], "content": [{"type": "reasoning_text", "text": "hm"}]},
             {"type": "message", "role": "assistant", "id": "msg_1", "status": "completed",
              "content": [{"type": "output_text", "text": "Calling.", "annotations": []}]},
             {"type": "function_call", "call_id": "call_1", "name": "f", "arguments": '{"a": 1}', "status": "completed"},
             {"type": "function_call_output", "call_id": "call_1", "output": "42"},
             {"role": "assistant", "content": "Done."}]
    assert messages(items, "Answer in English.") == [
        {"role": "system", "content": "Answer in English."},
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "hi\nthere"},
        {"role": "assistant", "content": "Calling.", "reasoning_content": "hm",
         "tool_calls": [{"id": "call_1", "type": "function", "function": {"name": "f", "arguments": '{"a": 1}'}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "42"},
        {"role": "assistant", "content": "Done."}]
    with pytest.raises(OpenAIError, match=r"input\[0\].colour"):
        messages([{"role": "user", "content": "hi", "colour": "red"}], None)


def test_ollama_options_and_messages():
    assert sampling({"temperature": 0.2, "num_predict": 5, "repeat_penalty": 1.1, "stop": ["\n"], "num_ctx": 512},
                    2048) == {"temperature": 0.2, "max_tokens": 5, "repetition_penalty": 1.1, "stop": ["\n"]}
    assert sampling({"num_predict": -1}, 2048) == {"max_tokens": None}
    req = ChatRequest.model_validate({"model": "m", "think": False, "messages": [
        {"role": "user", "content": "hi"},
        {"role": "assistant", "content": "", "thinking": "hm",
         "tool_calls": [{"function": {"name": "f", "arguments": {"a": 1}}}]},
        {"role": "tool", "content": "42", "tool_name": "f"}]})
    chat = chat_request(req, "{{ enable_thinking }}", True, 2048, "hermes")
    assert [m.model_dump(exclude_none=True) for m in chat.messages] == [
        {"role": "user", "content": "hi"},
        {"role": "assistant", "content": "", "reasoning_content": "hm",
         "tool_calls": [{"id": "call_0", "type": "function", "function": {"name": "f", "arguments": '{"a": 1}'}}]},
        {"role": "tool", "content": "42", "name": "f"}]
    assert chat.chat_template_kwargs == {"enable_thinking": False} and chat.stream
    with pytest.raises(OpenAIError, match="options.typical_p is not supported"):
        sampling({"typical_p": 0.5}, 2048)
