"""Request bodies of Anthropic's Messages API (`POST /v1/messages`, `/v1/messages/count_tokens`),
and their translation into a chat-completions request, so that both APIs run the same path:
one chat template, one tool-call plan, one reasoning parser.

As on the OpenAI routes, nothing is accepted and ignored: a field (or a content block's key)
that is neither translated here nor in ACCEPTED_WITHOUT_EFFECT is a 400 that names it.
"""
from __future__ import annotations

import functools
import json
from typing import Any

from pydantic import BaseModel, ConfigDict

from pagellm.entrypoints.openai.errors import bad_request, refuse_unknown
from pagellm.entrypoints.openai.protocol import ChatCompletionRequest
from pagellm.entrypoints.openai.reasoning import effort_switch, switch_variable

# A 400 naming a field sent that is not one of Anthropic's Messages API this server implements.
_unknown = functools.partial(refuse_unknown, "Anthropic's Messages API")

# Fields Anthropic's clients send that change nothing here, and why (docs/serving.md lists them).
ACCEPTED_WITHOUT_EFFECT = {
    "metadata": "metadata.user_id is Anthropic's abuse-monitoring id; pagellm keeps no per-user records",
    "service_tier": "Anthropic's processing tiers; pagellm has one",
    "cache_control": "a prompt-cache breakpoint; pagellm's prefix cache reuses every shared prefix by itself",
}

# The keys each content block may carry, beyond `type`.
BLOCK_KEYS = {
    "text": {"text", "cache_control", "citations"},
    "tool_use": {"id", "name", "input", "cache_control"},
    "tool_result": {"tool_use_id", "content", "is_error", "cache_control"},
    "thinking": {"thinking", "signature"},
}
REQUIRED_KEYS = {
    "text": {"text": str},
    "tool_use": {"id": str, "name": str, "input": dict},
    "tool_result": {"tool_use_id": str},
    "thinking": {"thinking": str},
}
NOT_SUPPORTED_BLOCKS = {
    "image": "this server serves a text-only model",
    "document": "this server serves a text-only model",
    "redacted_thinking": "pagellm never redacts thinking, so it cannot have written this block",
}


class AnthropicModel(BaseModel):
    model_config = ConfigDict(extra="allow", strict=True, allow_inf_nan=False)


class AnthropicMessage(AnthropicModel):
    role: str
    content: str | list[dict[str, Any]]


class CountTokensRequest(AnthropicModel):
    model: str
    messages: list[AnthropicMessage]
    system: str | list[dict[str, Any]] | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: dict[str, Any] | None = None
    thinking: dict[str, Any] | None = None


class MessagesRequest(CountTokensRequest):
    max_tokens: int
    stop_sequences: list[str] | None = None
    stream: bool = False
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    metadata: dict[str, Any] | None = None  # accepted without effect: see ACCEPTED_WITHOUT_EFFECT
    service_tier: str | None = None  # accepted without effect
    # Anthropic's structured outputs ({"format": {"type": "json_schema", "schema": {...}}}) and
    # reasoning effort ({"effort": "low" | "medium" | "high"}).
    output_config: dict[str, Any] | None = None
    # pagellm's extra, as on the chat endpoint: a regex, choice, grammar or JSON schema the reply must match.
    structured_outputs: dict[str, Any] | None = None


def _text_of(where: str, content: Any) -> str:
    """A tool_result's or system prompt's text: a string or text blocks."""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise bad_request(f"{where} must be a string or a list of text blocks, got {json.dumps(content)[:80]}",
                          param=where)
    return "\n".join(_block(f"{where}[{i}]", b, {"text"})["text"] for i, b in enumerate(content))


def _block(where: str, block: Any, allowed: set[str]) -> dict:
    """A content block, checked: its type allowed here, its keys known, its fields' types right."""
    kind = block.get("type") if isinstance(block, dict) else None
    if kind in NOT_SUPPORTED_BLOCKS:
        raise bad_request(f"{where}.type {kind!r} is not supported: {NOT_SUPPORTED_BLOCKS[kind]}",
                          param=f"{where}.type")
    if kind not in allowed:
        raise bad_request(f"{where}.type must be one of {', '.join(sorted(allowed))} here, got {kind!r}",
                          param=f"{where}.type")
    _unknown(f"{where}.", block.keys() - BLOCK_KEYS[kind] - {"type"})
    for key, kind_of in REQUIRED_KEYS[kind].items():
        if not isinstance(block.get(key), kind_of):
            raise bad_request(f"{where}.{key} must be a {'string' if kind_of is str else 'JSON object'}, got "
                              f"{json.dumps(block.get(key))[:80]}", param=f"{where}.{key}")
    return block


def _messages(req: CountTokensRequest) -> list[dict]:
    """Anthropic's conversation as chat messages: tool_result blocks become tool messages,
    tool_use blocks an assistant's tool_calls, thinking blocks its reasoning_content."""
    out: list[dict] = []
    if req.system is not None:
        out.append({"role": "system", "content": _text_of("system", req.system)})
    for i, m in enumerate(req.messages):
        where = f"messages[{i}]"
        if m.role not in ("user", "assistant"):
            raise bad_request(f"{where}.role must be 'user' or 'assistant' (the system prompt goes in `system`), "
                              f"got {m.role!r}", param=f"{where}.role")
        if isinstance(m.content, str):
            out.append({"role": m.role, "content": m.content})
            continue
        allowed = {"text", "tool_result"} if m.role == "user" else {"text", "tool_use", "thinking"}
        texts, calls, reasoning = [], [], []
        for j, raw in enumerate(m.content):
            b = _block(f"{where}.content[{j}]", raw, allowed)
            if b["type"] == "text":
                texts.append(b["text"])
            elif b["type"] == "thinking":
                reasoning.append(b["thinking"])
            elif b["type"] == "tool_use":
                calls.append({"id": b["id"], "type": "function",
                              "function": {"name": b["name"], "arguments": json.dumps(b["input"])}})
            else:  # tool_result: a tool message, answering the call it names
                content = _text_of(f"{where}.content[{j}].content", b.get("content", ""))
                if b.get("is_error"):
                    content = f"Error: {content}"
                out.append({"role": "tool", "tool_call_id": b["tool_use_id"], "content": content})
        if texts or calls or reasoning or m.role == "assistant":
            message: dict = {"role": m.role, "content": "\n".join(texts)}
            if calls:
                message["tool_calls"] = calls
            if reasoning:
                message["reasoning_content"] = "\n".join(reasoning)
            out.append(message)
    return out


def _tools(req: CountTokensRequest) -> tuple[list[dict] | None, Any, bool]:
    """(tools, tool_choice, parallel_tool_calls) in chat-completions terms."""
    tools = None
    if req.tools is not None:
        tools = []
        for i, t in enumerate(req.tools):
            if not isinstance(t, dict) or t.get("type") not in (None, "custom"):
                kind = t.get("type") if isinstance(t, dict) else t
                raise bad_request(f"tools[{i}].type {kind!r} is not supported: this server runs no tools of its "
                                  f"own; give custom tools as {{name, description, input_schema}}",
                                  param=f"tools[{i}].type")
            _unknown(f"tools[{i}].", t.keys() - {"type", "name", "description", "input_schema", "cache_control"})
            if not isinstance(t.get("input_schema"), dict):
                raise bad_request(f"tools[{i}].input_schema must be a JSON schema (an object), got "
                                  f"{json.dumps(t.get('input_schema'))[:80]}", param=f"tools[{i}].input_schema")
            fn = {"name": t.get("name"), "parameters": t["input_schema"]}
            if t.get("description") is not None:
                fn["description"] = t["description"]
            tools.append({"type": "function", "function": fn})
    choice, parallel = req.tool_choice, True
    if choice is None:
        return tools, None, parallel
    kind = choice.get("type")
    known = {"auto": {"disable_parallel_tool_use"}, "any": {"disable_parallel_tool_use"},
             "tool": {"name", "disable_parallel_tool_use"}, "none": set()}
    if kind not in known:
        raise bad_request(f"tool_choice.type must be auto, any, tool or none, got {kind!r}", param="tool_choice.type")
    _unknown("tool_choice.", choice.keys() - known[kind] - {"type"})
    parallel = not choice.get("disable_parallel_tool_use", False)
    mapped = {"auto": "auto", "any": "required", "none": "none"}.get(kind) or \
        {"type": "function", "function": {"name": choice.get("name")}}
    return tools, mapped, parallel


def _thinking(req: CountTokensRequest, chat_template: str | None) -> tuple[dict | None, int | None]:
    """The request's `thinking` as chat-template arguments and a reasoning budget (thinking_token_budget)."""
    if req.thinking is None:
        return None, None
    kind = req.thinking.get("type")
    switch = switch_variable(chat_template)
    if kind == "disabled":
        _unknown("thinking.", req.thinking.keys() - {"type"})
        return {switch or "enable_thinking": False}, None
    if kind == "enabled":  # the model thinks as its template lets it, for at most budget_tokens
        _unknown("thinking.", req.thinking.keys() - {"type", "budget_tokens"})
        budget = req.thinking.get("budget_tokens")
        if not isinstance(budget, int) or isinstance(budget, bool) or budget < 1:
            raise bad_request(f"thinking.budget_tokens must be an integer >= 1, got {budget!r}",
                              param="thinking.budget_tokens")
        max_tokens = getattr(req, "max_tokens", None)
        if max_tokens is not None and budget >= max_tokens:  # as Anthropic's API: the answer needs room
            raise bad_request(f"thinking.budget_tokens must be less than max_tokens ({max_tokens}), got {budget}",
                              param="thinking.budget_tokens")
        # A switch that is off unless set (Granite's `thinking`) is turned on; enable_thinking is on already.
        return ({"thinking": True} if switch == "thinking" else None), budget
    if kind == "adaptive":  # the model decides how much to think: what it does here anyway
        _unknown("thinking.", req.thinking.keys() - {"type"})
        return None, None
    raise bad_request(f"thinking.type must be enabled, disabled or adaptive, got {kind!r}", param="thinking.type")


def _output_format(config: dict | None) -> dict | None:
    """output_config's format as the chat endpoint's response_format."""
    if config is None:
        return None
    _unknown("output_config.", config.keys() - {"format", "effort"})
    fmt = config.get("format")
    if fmt is None:
        return None
    if not isinstance(fmt, dict) or fmt.get("type") != "json_schema" or not isinstance(fmt.get("schema"), dict):
        raise bad_request(f'output_config.format must be {{"type": "json_schema", "schema": {{...}}}}, got '
                          f"{json.dumps(fmt)[:80]}", param="output_config.format")
    _unknown("output_config.format.", fmt.keys() - {"type", "schema"})
    return {"type": "json_schema", "json_schema": {"name": "output", "schema": fmt["schema"]}}


# Anthropic's efforts. The model's chat template is what takes an effort (gpt-oss's reasoning_effort:
# low, medium, high); the two above high have no level there to go to, so they are refused, not lowered.
EFFORTS = ("low", "medium", "high")
EFFORTS_ABOVE = ("xhigh", "max")


def _effort(config: dict | None, chat_template: str | None, splits_reasoning: bool) -> dict:
    """output_config.effort as chat-template arguments (reasoning.effort_switch)."""
    effort = (config or {}).get("effort")
    if effort is None:
        return {}
    if effort in EFFORTS_ABOVE:
        raise bad_request(f"output_config.effort {effort!r} is not supported: a model's chat template takes at most "
                          f"'high' (its reasoning_effort levels are {', '.join(EFFORTS)})", param="output_config.effort")
    if effort not in EFFORTS:
        raise bad_request(f"output_config.effort must be one of {', '.join(EFFORTS + EFFORTS_ABOVE)}, got {effort!r}",
                          param="output_config.effort")
    return effort_switch(chat_template, effort, "output_config.effort", splits_reasoning) or {}


def to_chat(req: CountTokensRequest, chat_template: str | None = None,
            splits_reasoning: bool = False) -> ChatCompletionRequest:
    """The chat-completions request that does what `req` asks (400s naming Anthropic's fields).
    `chat_template` and `splits_reasoning` (the server has a reasoning parser) decide what an
    output_config.effort can reach."""
    _unknown("", (req.model_extra or {}).keys() - ACCEPTED_WITHOUT_EFFECT.keys())
    for i, m in enumerate(req.messages):
        _unknown(f"messages[{i}].", (m.model_extra or {}).keys())
    if not req.messages:
        raise bad_request("messages must hold at least one message", param="messages")
    tools, tool_choice, parallel = _tools(req)
    template_kwargs, budget = _thinking(req, chat_template)
    effort = _effort(getattr(req, "output_config", None), chat_template, splits_reasoning)
    if effort:
        template_kwargs = {**(template_kwargs or {}), **effort}
    body: dict[str, Any] = {"model": req.model, "messages": _messages(req), "tools": tools,
                            "tool_choice": tool_choice, "parallel_tool_calls": parallel,
                            "chat_template_kwargs": template_kwargs}
    if req.messages[-1].role == "assistant":  # a prefill: the reply continues it
        body.update(add_generation_prompt=False, continue_final_message=True)
    if isinstance(req, MessagesRequest):
        if req.max_tokens < 1:
            raise bad_request(f"max_tokens must be >= 1, got {req.max_tokens}", param="max_tokens")
        if req.temperature is not None and not 0.0 <= req.temperature <= 1.0:
            raise bad_request(f"temperature must be in [0, 1] (Anthropic's range), got {req.temperature}",
                              param="temperature")
        if req.metadata is not None:
            _unknown("metadata.", req.metadata.keys() - {"user_id"})
        body.update(max_tokens=req.max_tokens, stop=req.stop_sequences, stream=req.stream,
                    temperature=req.temperature, top_p=req.top_p, top_k=req.top_k,
                    structured_outputs=req.structured_outputs, response_format=_output_format(req.output_config),
                    thinking_token_budget=budget)
    try:
        return ChatCompletionRequest.model_validate(body)
    except ValueError as e:  # a message pydantic refused after translation: say which
        raise bad_request(f"messages: {e}", param="messages") from None
