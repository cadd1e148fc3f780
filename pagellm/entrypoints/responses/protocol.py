"""Request bodies of OpenAI's Responses API (`POST /v1/responses`) and their translation into a
chat-completions request, so that both APIs run the same path: one chat template, one tool-call
plan, one reasoning parser.

Input items become chat messages: a message's text parts are joined, `function_call` items
become the assistant's tool calls, `function_call_output` items tool messages, `reasoning`
items the assistant's `reasoning_content`. As on the other routes, nothing is accepted and
ignored: a field (or an item's key) that is neither translated here nor in
ACCEPTED_WITHOUT_EFFECT is a 400 that names it.
"""
from __future__ import annotations

import functools
import json
from typing import Any

from pydantic import BaseModel, ConfigDict

from pagellm.entrypoints.openai.errors import bad_request, refuse_unknown
from pagellm.entrypoints.openai.protocol import ChatCompletionRequest
from pagellm.entrypoints.openai.reasoning import effort_switch

# A 400 naming a field sent that is not one of the Responses API this server implements.
_unknown = functools.partial(refuse_unknown, "the Responses API")

# Fields the Responses clients send that change nothing here, and why (docs/client-apis.md lists them).
ACCEPTED_WITHOUT_EFFECT = {
    "user": "an end-user id for OpenAI's abuse monitoring; pagellm keeps no per-user records",
    "safety_identifier": "an end-user id for OpenAI's abuse monitoring; pagellm keeps no per-user records",
    "service_tier": "OpenAI's processing tiers; pagellm has one",
    "prompt_cache_key": "a routing hint for OpenAI's prompt cache; pagellm's prefix cache reuses every shared "
                        "prefix by itself",
}
NOT_SUPPORTED_TOOLS = "this server runs no tools of its own; give function tools ({type: function, name, parameters})"
TEXT_ONLY = "this server serves a text-only model"

# The keys each input item may carry, beyond `type`.
ITEM_KEYS = {
    "message": {"role", "content", "id", "status", "phase"},
    "function_call": {"call_id", "name", "arguments", "id", "status"},
    "function_call_output": {"call_id", "output", "id", "status"},
    "reasoning": {"id", "summary", "content", "encrypted_content", "status"},
}
PART_KEYS = {
    "input_text": {"text"},
    "output_text": {"text", "annotations", "logprobs"},
    "refusal": {"refusal"},
}
ROLES = {"user": "user", "system": "system", "developer": "system", "assistant": "assistant"}


class ResponsesModel(BaseModel):
    model_config = ConfigDict(extra="allow", strict=True, allow_inf_nan=False)


class ResponsesRequest(ResponsesModel):
    model: str | None = None
    input: str | list[dict[str, Any]]
    instructions: str | None = None
    max_output_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool = True
    text: dict[str, Any] | None = None
    reasoning: dict[str, Any] | None = None
    stream: bool = False
    store: bool = True
    previous_response_id: str | None = None
    metadata: dict[str, str] | None = None  # kept with the response and returned with it
    truncation: str | None = None
    background: bool | None = None
    include: list[str] | None = None
    user: str | None = None  # accepted without effect: see ACCEPTED_WITHOUT_EFFECT
    # pagellm's extra, as on the chat endpoint: a regex, choice, grammar or JSON schema the reply must match.
    structured_outputs: dict[str, Any] | None = None


def _text(where: str, content: Any) -> str:
    """A message's or a tool output's text: a string, or text parts joined."""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise bad_request(f"{where} must be a string or a list of content parts, got {json.dumps(content)[:80]}",
                          param=where)
    texts = []
    for j, part in enumerate(content):
        kind = part.get("type") if isinstance(part, dict) else None
        if kind in ("input_image", "input_file", "input_audio"):
            raise bad_request(f"{where}[{j}].type {kind!r} is not supported: {TEXT_ONLY}", param=f"{where}[{j}].type")
        if kind not in PART_KEYS:
            raise bad_request(f"{where}[{j}].type must be input_text, output_text or refusal, got {kind!r}",
                              param=f"{where}[{j}].type")
        _unknown(f"{where}[{j}].", part.keys() - PART_KEYS[kind] - {"type"})
        text = part.get("refusal" if kind == "refusal" else "text")
        if not isinstance(text, str):
            raise bad_request(f"{where}[{j}].text must be a string, got {json.dumps(text)[:80]}",
                              param=f"{where}[{j}].text")
        texts.append(text)
    return "\n".join(texts)


def _kind(item: dict) -> str | None:
    """An item's type; a bare {role, content} is a message (OpenAI's easy input message)."""
    return item.get("type", "message" if "role" in item else None)


def _reasoning_text(where: str, item: dict) -> str:
    if item.get("encrypted_content") is not None:
        raise bad_request(f"{where}.encrypted_content is not supported: this server never encrypts reasoning, so "
                          f"it cannot have written it", param=f"{where}.encrypted_content")
    parts = item.get("content") or item.get("summary") or []
    if not isinstance(parts, list) or not all(isinstance(p, dict) and isinstance(p.get("text"), str) for p in parts):
        raise bad_request(f"{where}.content must be a list of {{type: reasoning_text, text}} parts, got "
                          f"{json.dumps(parts)[:80]}", param=f"{where}.content")
    return "\n".join(p["text"] for p in parts)


def messages(items: list[dict], instructions: str | None) -> list[dict]:
    """Input items as chat messages. An assistant's reasoning, text and calls, which the Responses
    API gives as separate items, make one assistant message, as the chat template expects."""
    out: list[dict] = []
    if instructions is not None:
        out.append({"role": "system", "content": instructions})

    def assistant() -> dict:
        """The assistant message the next assistant item belongs to (a new one if the last message is another's)."""
        if not out or out[-1]["role"] != "assistant":
            out.append({"role": "assistant", "content": ""})
        return out[-1]

    for i, item in enumerate(items):
        where = f"input[{i}]"
        if not isinstance(item, dict):
            raise bad_request(f"{where} must be an object (an input item), got {json.dumps(item)[:80]}", param=where)
        kind = _kind(item)
        if kind not in ITEM_KEYS:
            if kind in ("item_reference", "web_search_call", "file_search_call", "computer_call",
                        "computer_call_output", "image_generation_call", "code_interpreter_call",
                        "local_shell_call", "mcp_call", "custom_tool_call"):
                raise bad_request(f"{where}.type {kind!r} is not supported: {NOT_SUPPORTED_TOOLS}",
                                  param=f"{where}.type")
            raise bad_request(f"{where}.type must be message, function_call, function_call_output or reasoning, "
                              f"got {kind!r}", param=f"{where}.type")
        _unknown(f"{where}.", item.keys() - ITEM_KEYS[kind] - {"type"})
        if kind == "message":
            role = ROLES.get(item.get("role"))
            if role is None:
                raise bad_request(f"{where}.role must be user, system, developer or assistant, got "
                                  f"{item.get('role')!r}", param=f"{where}.role")
            text = _text(f"{where}.content", item.get("content"))
            if role == "assistant":
                message = assistant()
                if message["content"] or message.get("tool_calls"):  # a second reply in a row
                    out.append(message := {"role": "assistant", "content": ""})
                message["content"] = text
            else:
                out.append({"role": role, "content": text})
        elif kind == "reasoning":
            message = assistant()
            if message["content"] or message.get("tool_calls"):  # reasoning opens a new reply
                out.append(message := {"role": "assistant", "content": ""})
            message["reasoning_content"] = _reasoning_text(where, item)
        elif kind == "function_call":
            for key in ("call_id", "name", "arguments"):
                if not isinstance(item.get(key), str):
                    raise bad_request(f"{where}.{key} must be a string, got {json.dumps(item.get(key))[:80]}",
                                      param=f"{where}.{key}")
            assistant().setdefault("tool_calls", []).append(
                {"id": item["call_id"], "type": "function",
                 "function": {"name": item["name"], "arguments": item["arguments"]}})
        else:  # function_call_output: a tool message, answering the call it names
            if not isinstance(item.get("call_id"), str):
                raise bad_request(f"{where}.call_id must be a string, got {json.dumps(item.get('call_id'))[:80]}",
                                  param=f"{where}.call_id")
            out.append({"role": "tool", "tool_call_id": item["call_id"],
                        "content": _text(f"{where}.output", item.get("output"))})
    return out


def input_items(req: ResponsesRequest) -> list[dict]:
    """The request's input as a list of items (a string is one user message)."""
    if isinstance(req.input, str):
        return [{"type": "message", "role": "user", "content": req.input}]
    return list(req.input)


def _tools(req: ResponsesRequest) -> tuple[list[dict] | None, Any]:
    """(tools, tool_choice) in chat-completions terms."""
    tools = None
    if req.tools is not None:
        tools = []
        for i, t in enumerate(req.tools):
            kind = t.get("type") if isinstance(t, dict) else t
            if kind != "function":
                raise bad_request(f"tools[{i}].type {kind!r} is not supported: {NOT_SUPPORTED_TOOLS}",
                                  param=f"tools[{i}].type")
            # strict: the arguments hold to `parameters`; a grammar makes them when tool_choice is
            # required or a named function (docs/client-apis.md says what auto does).
            _unknown(f"tools[{i}].", t.keys() - {"type", "name", "description", "parameters", "strict"})
            fn = {k: t[k] for k in ("name", "description", "parameters") if t.get(k) is not None}
            tools.append({"type": "function", "function": fn})
    choice = req.tool_choice
    if isinstance(choice, dict):
        if choice.get("type") != "function":
            raise bad_request(f"tool_choice.type {choice.get('type')!r} is not supported: tool_choice takes none, "
                              f"auto, required or {{type: function, name}}", param="tool_choice.type")
        _unknown("tool_choice.", choice.keys() - {"type", "name"})
        choice = {"type": "function", "function": {"name": choice.get("name")}}
    return tools, choice


def _text_format(text: dict | None) -> dict | None:
    """text.format as the chat endpoint's response_format."""
    if text is None:
        return None
    if text.get("verbosity") is not None:
        raise bad_request("text.verbosity is not supported: this server does not steer how long a model answers",
                          param="text.verbosity")
    _unknown("text.", text.keys() - {"format", "verbosity"})
    fmt = text.get("format")
    kind = fmt.get("type") if isinstance(fmt, dict) else None
    if fmt is None or kind == "text":
        return None
    if kind == "json_object":
        _unknown("text.format.", fmt.keys() - {"type"})
        return {"type": "json_object"}
    if kind != "json_schema":
        raise bad_request(f"text.format.type must be text, json_object or json_schema, got {kind!r}",
                          param="text.format.type")
    _unknown("text.format.", fmt.keys() - {"type", "name", "schema", "description", "strict"})
    if not isinstance(fmt.get("schema"), dict):
        raise bad_request(f"text.format.schema must be a JSON schema (an object), got "
                          f"{json.dumps(fmt.get('schema'))[:80]}", param="text.format.schema")
    return {"type": "json_schema", "json_schema": {"name": fmt.get("name") or "output", "schema": fmt["schema"]}}


def _reasoning(req: ResponsesRequest, chat_template: str | None, splits_reasoning: bool) -> dict | None:
    """reasoning.effort as chat-template arguments (reasoning.effort_switch)."""
    if req.reasoning is None:
        return None
    _unknown("reasoning.", req.reasoning.keys() - {"effort", "summary"})
    if req.reasoning.get("summary") is not None:
        raise bad_request("reasoning.summary is not supported: this server returns the reasoning itself (the "
                          "reasoning item's content), never a summary of it", param="reasoning.summary")
    return effort_switch(chat_template, req.reasoning.get("effort"), "reasoning.effort", splits_reasoning)


def check(req: ResponsesRequest) -> None:
    """The request-wide fields that are refused or must be checked before anything runs."""
    _unknown("", (req.model_extra or {}).keys() - ACCEPTED_WITHOUT_EFFECT.keys())
    if req.background:
        raise bad_request("background is not supported: this server answers while the client waits (or streams)",
                          param="background")
    if req.include:
        raise bad_request(f"include {req.include[0]!r} is not supported: this server adds nothing to a response on "
                          f"request", param="include")
    if req.truncation not in (None, "disabled"):
        raise bad_request(f"truncation {req.truncation!r} is not supported: a prompt over the context is a 400 "
                          f"(truncation disabled)", param="truncation")
    if req.max_output_tokens is not None and req.max_output_tokens < 1:
        raise bad_request(f"max_output_tokens must be >= 1, got {req.max_output_tokens}", param="max_output_tokens")


def to_chat(req: ResponsesRequest, history: list[dict], chat_template: str | None,
            splits_reasoning: bool) -> ChatCompletionRequest:
    """The chat-completions request that does what `req` asks, after the items of `history` (the
    stored conversation of previous_response_id); 400s name the Responses API's fields."""
    check(req)
    items = history + input_items(req)
    if not items:
        raise bad_request("input must hold at least one item", param="input")
    tools, tool_choice = _tools(req)
    body: dict[str, Any] = {
        "model": req.model, "messages": messages(items, req.instructions), "tools": tools,
        "tool_choice": tool_choice, "parallel_tool_calls": req.parallel_tool_calls,
        "max_tokens": req.max_output_tokens, "temperature": req.temperature, "top_p": req.top_p,
        "stream": req.stream, "response_format": _text_format(req.text), "structured_outputs": req.structured_outputs,
        "chat_template_kwargs": _reasoning(req, chat_template, splits_reasoning)}
    try:
        return ChatCompletionRequest.model_validate(body)
    except ValueError as e:  # a message pydantic refused after translation: say which
        raise bad_request(f"input: {e}", param="input") from None
