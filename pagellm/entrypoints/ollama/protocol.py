"""Request bodies of Ollama's API (`/api/chat`, `/api/generate`, `/api/show`) and their
translation into the chat endpoint's request (or, for a raw `/api/generate`, the completions
endpoint's), so that every API runs the same path: one chat template, one tool-call parser, one
reasoning parser, one set of sampling checks.

`options` map onto sampling fields (OPTIONS); an option pagellm does not implement is a 400
naming it, as is any field that is neither translated here nor accepted without effect.
"""
from __future__ import annotations

import functools
import json
import re
from typing import Any

from pydantic import BaseModel, ConfigDict, ValidationError

from pagellm.entrypoints.openai.errors import OpenAIError, bad_request, refuse_unknown, validation_error
from pagellm.entrypoints.openai.protocol import ChatCompletionRequest, CompletionRequest
from pagellm.entrypoints.openai.reasoning import thinking_switch

# A 400 naming a field sent that is not one of Ollama's API this server implements.
_unknown = functools.partial(refuse_unknown, "Ollama's API")

TEXT_ONLY = "this server serves a text-only model"

# Ollama's options -> the sampling fields they set (the chat endpoint's names).
OPTIONS = {
    "temperature": "temperature", "top_p": "top_p", "top_k": "top_k", "min_p": "min_p", "seed": "seed",
    "stop": "stop", "repeat_penalty": "repetition_penalty", "presence_penalty": "presence_penalty",
    "frequency_penalty": "frequency_penalty", "num_predict": "max_tokens",
}
# Options refused, and why; any other unknown option is refused too.
NOT_SUPPORTED_OPTIONS = {
    "repeat_last_n": "repeat_penalty here covers every token of the prompt and the reply (vLLM's "
                     "repetition_penalty), not a window of the last n",
    "typical_p": "locally typical sampling is not implemented",
    "tfs_z": "tail-free sampling is not implemented",
    "mirostat": "mirostat sampling is not implemented",
    "mirostat_tau": "mirostat sampling is not implemented",
    "mirostat_eta": "mirostat sampling is not implemented",
    "penalize_newline": "it is not implemented",
    "num_keep": "a prompt over the context is a 400 here, never cut, so there is nothing to keep",
    **dict.fromkeys(("num_batch", "num_gpu", "main_gpu", "num_thread", "low_vram", "use_mmap", "use_mlock",
                     "numa", "vocab_only", "logits_all", "embedding_only"),
                    "the model is loaded once, with the server's own settings (pagellm serve --help)"),
}
# Fields refused when set to anything but their empty value, and why.
NOT_SUPPORTED = {
    "images": TEXT_ONLY,
    "suffix": "fill-in-the-middle is not served",
    "template": "the model's own (Jinja) chat template renders the prompt; a Go template cannot be given",
    "context": "the token context of an earlier reply cannot be continued; send the conversation to /api/chat",
    "logprobs": "logprobs are served on /v1/chat/completions",
    "top_logprobs": "logprobs are served on /v1/chat/completions",
}
MESSAGE_KEYS = {"role", "content", "thinking", "images", "tool_calls", "tool_name"}


class OllamaModel(BaseModel):
    model_config = ConfigDict(extra="allow", strict=True, allow_inf_nan=False)


class OllamaRequest(OllamaModel):
    model: str
    format: str | dict[str, Any] | None = None
    options: dict[str, Any] | None = None
    stream: bool = True
    # Accepted: the model stays loaded for as long as the server runs, whatever is asked.
    keep_alive: str | int | float | None = None
    think: bool | str | None = None
    # pagellm's extra, as on the chat endpoint: a regex, choice, grammar or JSON schema the reply must match.
    structured_outputs: dict[str, Any] | None = None


class ChatRequest(OllamaRequest):
    messages: list[dict[str, Any]] | None = None
    tools: list[dict[str, Any]] | None = None


class GenerateRequest(OllamaRequest):
    prompt: str | None = None
    system: str | None = None
    raw: bool = False


class EmbedRequest(OllamaModel):
    """/api/embed: `input` one text or several; `truncate` (Ollama's default true) cuts an input
    longer than the context instead of refusing it."""
    model: str
    input: str | list[str]
    truncate: bool = True
    dimensions: int | None = None
    options: dict[str, Any] | None = None
    keep_alive: str | int | float | None = None


class LegacyEmbeddingsRequest(OllamaModel):
    """/api/embeddings, the older endpoint: one `prompt`, one `embedding` back."""
    model: str
    prompt: str
    options: dict[str, Any] | None = None
    keep_alive: str | int | float | None = None


class ShowRequest(OllamaModel):
    model: str | None = None
    name: str | None = None  # older clients' spelling of model
    verbose: bool = False


def check_fields(req: OllamaModel) -> None:
    """Every field sent is one this server implements (or empty)."""
    for key, value in sorted((req.model_extra or {}).items()):
        if key in NOT_SUPPORTED:
            if value not in (None, "", [], False):
                raise bad_request(f"{key} is not supported: {NOT_SUPPORTED[key]}", param=key)
        else:
            _unknown("", [key])


def sampling(options: dict[str, Any] | None, max_model_len: int) -> dict[str, Any]:
    """`options` as the chat endpoint's sampling fields."""
    out: dict[str, Any] = {"max_tokens": None}
    for name, value in sorted((options or {}).items()):
        if name in OPTIONS:
            if value is not None:
                out[OPTIONS[name]] = value
        elif name == "num_ctx":  # clients send it; the context is set when the server starts
            if not isinstance(value, int) or isinstance(value, bool) or value > max_model_len:
                raise bad_request(f"options.num_ctx must be an integer <= {max_model_len}, this server's context "
                                  f"length (pagellm serve --max-model-len), got {value!r}", param="options.num_ctx")
        elif name in NOT_SUPPORTED_OPTIONS:
            raise bad_request(f"options.{name} is not supported: {NOT_SUPPORTED_OPTIONS[name]}",
                              param=f"options.{name}")
        else:
            raise bad_request(f"options.{name} is not supported: it is not an option this server knows",
                              param=f"options.{name}")
    n = out["max_tokens"]
    if n in (-1, -2):  # Ollama's "until the model stops" and "until the context is full"
        out["max_tokens"] = None
    elif isinstance(n, int) and not isinstance(n, bool) and n < 1:
        raise bad_request(f"options.num_predict must be >= 1, or -1 (no limit) or -2 (fill the context), got {n}",
                          param="options.num_predict")
    return out


def response_format(fmt: str | dict | None) -> dict | None:
    """`format` as the chat endpoint's response_format."""
    if fmt in (None, ""):
        return None
    if fmt == "json":
        return {"type": "json_object"}
    if isinstance(fmt, dict):
        return {"type": "json_schema", "json_schema": {"name": "format", "schema": fmt}}
    raise bad_request(f'format must be "json" or a JSON schema (an object), got {json.dumps(fmt)[:80]}',
                      param="format")


# The chat endpoint's field names in its error messages, as Ollama's clients spell them.
_OLLAMA_NAMES = {**{chat: f"options.{name}" for name, chat in OPTIONS.items()},
                 "response_format.json_schema.schema": "format", "response_format": "format"}
_CHAT_NAME = re.compile(r"(?<![\w.])(" + "|".join(re.escape(k) for k in sorted(_OLLAMA_NAMES, key=len,
                                                                                  reverse=True)) + r")\b")


def renamed(e: OpenAIError) -> OpenAIError:
    """An error of the chat path, its field named as Ollama's request names it."""
    if e.status != 400:
        return e
    message = _CHAT_NAME.sub(lambda m: _OLLAMA_NAMES[m.group(1)], e.message)
    param = _OLLAMA_NAMES.get(e.param, e.param) if e.param else e.param
    return OpenAIError(e.status, message, param=param, code=e.code, headers=e.headers)


def _tool_calls(where: str, calls: Any) -> list[dict]:
    """Ollama's {function: {name, arguments: {...}}} as chat tool calls (arguments as JSON text)."""
    if not isinstance(calls, list):
        raise bad_request(f"{where} must be a list, got {json.dumps(calls)[:80]}", param=where)
    out = []
    for j, call in enumerate(calls):
        fn = call.get("function") if isinstance(call, dict) else None
        if not isinstance(fn, dict) or not isinstance(fn.get("name"), str):
            raise bad_request(f'{where}[{j}] must be {{"function": {{"name": ..., "arguments": {{...}}}}}}, got '
                              f"{json.dumps(call)[:80]}", param=f"{where}[{j}]")
        _unknown(f"{where}[{j}].", call.keys() - {"function", "id", "type"})
        _unknown(f"{where}[{j}].function.", fn.keys() - {"name", "arguments", "index"})
        args = fn.get("arguments") or {}
        out.append({"id": call.get("id") or f"call_{j}", "type": "function",
                    "function": {"name": fn["name"], "arguments": args if isinstance(args, str) else json.dumps(args)}})
    return out


def messages(raw: list[dict]) -> list[dict]:
    """Ollama's messages as chat messages: `thinking` is the assistant's reasoning_content,
    `tool_name` names the tool a tool message answers."""
    out = []
    for i, m in enumerate(raw):
        where = f"messages[{i}]"
        if not isinstance(m, dict):
            raise bad_request(f"{where} must be an object, got {json.dumps(m)[:80]}", param=where)
        _unknown(f"{where}.", m.keys() - MESSAGE_KEYS)
        if m.get("role") not in ("system", "user", "assistant", "tool"):
            raise bad_request(f"{where}.role must be system, user, assistant or tool, got {m.get('role')!r}",
                              param=f"{where}.role")
        if m.get("images"):
            raise bad_request(f"{where}.images is not supported: {TEXT_ONLY}", param=f"{where}.images")
        content = m.get("content") or ""
        if not isinstance(content, str):
            raise bad_request(f"{where}.content must be a string, got {json.dumps(content)[:80]}",
                              param=f"{where}.content")
        message: dict[str, Any] = {"role": m["role"], "content": content}
        if m.get("thinking"):
            message["reasoning_content"] = m["thinking"]
        if m.get("tool_calls"):
            message["tool_calls"] = _tool_calls(f"{where}.tool_calls", m["tool_calls"])
        if m.get("tool_name"):
            message["name"] = m["tool_name"]
        out.append(message)
    return out


def _validated(cls: type, body: dict) -> Any:
    try:
        return cls.model_validate(body)
    except ValidationError as e:  # a value of the wrong type (renamed() names it as Ollama's clients do)
        raise validation_error(list(e.errors()), body) from None


def chat_request(req: ChatRequest | GenerateRequest, chat_template: str | None, splits_reasoning: bool,
                 max_model_len: int, tool_parser: str | None) -> ChatCompletionRequest:
    """The chat-completions request for /api/chat, or for /api/generate (its prompt a user message
    after the `system` one)."""
    check_fields(req)
    if isinstance(req, ChatRequest):
        convo = messages(req.messages or [])
        tools = req.tools or None
    else:
        convo = ([{"role": "system", "content": req.system}] if req.system else []) + \
            [{"role": "user", "content": req.prompt or ""}]
        tools = None
    if tools and tool_parser is None:
        raise bad_request("tools need the server started with --enable-auto-tool-choice and --tool-call-parser "
                          "(which format the model writes tool calls in)", param="tools")
    body = {"model": req.model, "messages": convo, "tools": tools, "tool_choice": "auto" if tools else None,
            "stream": req.stream, "response_format": response_format(req.format),
            "structured_outputs": req.structured_outputs,
            "chat_template_kwargs": thinking_switch(chat_template, req.think, "think", splits_reasoning),
            **sampling(req.options, max_model_len)}
    return _validated(ChatCompletionRequest, body)


def raw_request(req: GenerateRequest, max_model_len: int) -> CompletionRequest:
    """The completions request for /api/generate with raw: the prompt as it is, no template."""
    check_fields(req)
    for name in ("system", "think"):
        if getattr(req, name) is not None:
            raise bad_request(f"{name} cannot be combined with raw: it goes through the chat template, which raw "
                              f"leaves out", param=name)
    body = {"model": req.model, "prompt": req.prompt or "", "stream": req.stream,
            "response_format": response_format(req.format), "structured_outputs": req.structured_outputs,
            **sampling(req.options, max_model_len)}
    return _validated(CompletionRequest, body)
