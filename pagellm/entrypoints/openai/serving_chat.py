"""POST /v1/chat/completions: messages rendered through the model's (sandboxed) chat template."""
from __future__ import annotations

import json
from collections.abc import AsyncIterator
from dataclasses import dataclass

from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse

from pagellm.engine.async_engine import RequestStream
from pagellm.entrypoints.openai.errors import bad_request, check_request_text
from pagellm.entrypoints.openai.protocol import ChatCompletionRequest, ChatMessage
from pagellm.entrypoints.openai.reasoning import REASONING_PARSERS, ReasoningParser, ReasoningStream, effort_switch
from pagellm.entrypoints.openai.serving_engine import (OpenAIServing, guarded_sse, merge_streams,
                                                       random_id, sse)
from pagellm.entrypoints.openai.tool_calls import (KEEPS_SPECIAL_TOKENS, PARSERS, ToolCall, ToolParser, ToolPlan,
                                                   calls_before_cut, forced_calls, plan_tools)
from pagellm.outputs import CompletionOutput, RequestOutput
from pagellm.sampling_params import ReasoningBudget, ReasoningSection


@dataclass
class ChatRun:
    """A chat request added to the engine: its streams, and how its replies are taken apart."""

    request_id: str
    streams: list[RequestStream]
    tools: ToolPlan
    thinking: ReasoningStream | None
    prompt_tokens: int


class OpenAIServingChat(OpenAIServing):
    def __init__(self, *args, tool_call_parser: str | None = None, reasoning_parser: str | None = None,
                 grammar_in_reasoning: bool = False, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        # Set with --enable-auto-tool-choice: the format this model writes tool calls in.
        self.tool_call_parser = tool_call_parser
        # Set with --reasoning-parser (auto already resolved): how this model marks its reasoning.
        self.reasoning: ReasoningParser | None = REASONING_PARSERS[reasoning_parser]() if reasoning_parser else None
        # True: a structured output's grammar covers the reasoning too (vLLM's enable_in_reasoning).
        self.grammar_in_reasoning = grammar_in_reasoning

    async def create_chat_completion(self, req: ChatCompletionRequest, raw_request: Request) -> Response:
        run = await self.start(req)
        if req.stream:
            return StreamingResponse(guarded_sse(self.events(req, run.request_id, run.streams[0], run.tools,
                                                             run.thinking), run.streams),
                                     media_type="text/event-stream")
        (final,) = await self.collect(raw_request, run.streams)
        return JSONResponse(self.response(req, run.request_id, final, run.tools, run.thinking))

    async def start(self, req: ChatCompletionRequest, id_prefix: str = "chatcmpl",
                    budget_field: str = "thinking_token_budget") -> ChatRun:
        """Check a chat request, render it and add it to the engine (what every chat-shaped API shares).
        `budget_field`: what the client API calls thinking_token_budget, for its errors."""
        self.check_model(req.model)
        self.check_common(req)
        tools = plan_tools(req.tools, req.tool_choice, req.parallel_tool_calls, self.tool_call_parser is not None)
        if req.top_logprobs is not None and not req.logprobs:
            raise bad_request("top_logprobs requires logprobs to be true", param="top_logprobs")
        self.check_logprobs(req.top_logprobs, "top_logprobs")
        self.check_logprobs(req.prompt_logprobs, "prompt_logprobs")
        if req.stream and req.prompt_logprobs is not None:
            raise bad_request("prompt_logprobs are not available when streaming; send stream: false",
                              param="stream")
        text = self.render_request(req)
        ids = self.truncate(self.tokenizer.encode(text, add_special_tokens=False), req.truncate_prompt_tokens)
        asked = req.max_completion_tokens if req.max_completion_tokens is not None else req.max_tokens
        max_tokens = self.resolve_max_tokens(len(ids), asked, req.n, "messages")
        section = None
        if req.use_beam_search:
            if tools.mode != "none":
                raise bad_request(f"tool_choice {tools.mode} cannot be combined with use_beam_search",
                                  param="use_beam_search")
            params = self.beam_search_params(req, max_tokens)
        else:
            structured = await self.structured_outputs(req, tools.structured_outputs(),
                                                       f"tool_choice {tools.mode}")
            section = self.reasoning_section(text) if structured is not None else None
            params = self.sampling_params(req, max_tokens=max_tokens,
                                          logprobs=(req.top_logprobs or 0) if req.logprobs else None,
                                          prompt_logprobs=req.prompt_logprobs, structured=structured,
                                          reasoning_budget=self.reasoning_budget(req.thinking_token_budget, text,
                                                                                  budget_field),
                                          reasoning_section=section)
            if tools.mode == "auto" and self.tool_call_parser in KEEPS_SPECIAL_TOKENS:
                params.skip_special_tokens = False
            if self.reasoning is not None and self.reasoning.keeps_special_tokens:
                params.skip_special_tokens = False
        # The reply is split into reasoning and answer, unless a forced tool call's grammar covers
        # all of it (enable_in_reasoning, or a prompt that closed the reasoning); a prompt that ends
        # inside the reasoning starts there.
        thinks = self.reasoning is not None and (tools.mode not in ("required", "named") or section is not None)
        thinking = ReasoningStream(self.reasoning, self.reasoning.opens_in(text)) if thinks else None
        request_id = random_id(id_prefix)
        streams = await self.add_requests(request_id, [(None, ids)], [params])
        return ChatRun(request_id, streams, tools, thinking, len(ids))

    def reasoning_budget(self, tokens: int | None, prompt: str, field: str) -> ReasoningBudget | None:
        """A reasoning budget (`field`) as the sampler's rule; it needs to know how this model marks its reasoning."""
        if tokens is None:
            return None
        if self.reasoning is None:
            raise bad_request(f"{field} {tokens!r} needs the server started with --reasoning-parser (how this "
                              f"model marks its reasoning, so the budget knows what to count and how to close it)",
                              param=field)
        return self.reasoning.budget(tokens, self.reasoning.opens_in(prompt),
                                     lambda s: self.tokenizer.encode(s, add_special_tokens=False), field)

    def reasoning_section(self, prompt: str) -> ReasoningSection | None:
        """How the reply's reasoning is marked, so that a structured output's grammar starts after it;
        None: the grammar covers the whole reply (no parser, enable_in_reasoning, or a prompt that
        closed the reasoning itself: thinking switched off)."""
        parser = self.reasoning
        if parser is None or self.grammar_in_reasoning or parser.closes(prompt):
            return None

        def encode(marker: str) -> tuple[int, ...]:
            return tuple(self.tokenizer.encode(marker, add_special_tokens=False))
        return ReasoningSection(tuple(encode(m) for m in parser.grammar_ends or parser.ends),
                                () if parser.opens_in(prompt) else encode(parser.starts[0]))

    def render_request(self, req: ChatCompletionRequest) -> str:
        """The prompt a chat request renders to, through the chat template."""
        kwargs = {**(req.chat_template_kwargs or {}), **self.effort_kwargs(req)}
        reserved = sorted(self.tokenizer.reserved_template_variables & kwargs.keys())
        if reserved:
            raise bad_request(f"chat_template_kwargs may not set {', '.join(reserved)}: the server sets them "
                              f"from the request's own fields", param="chat_template_kwargs")
        if req.continue_final_message and req.add_generation_prompt:
            raise bad_request("continue_final_message needs add_generation_prompt false: one continues the last "
                              "message, the other starts a new one", param="continue_final_message")
        return self.render_text(req.messages, req.add_generation_prompt, tools=req.tools,
                                continue_final_message=req.continue_final_message, **kwargs)

    def effort_kwargs(self, req: ChatCompletionRequest) -> dict:
        """reasoning_effort as the chat-template arguments this model's template reads (reasoning.effort_switch)."""
        if req.reasoning_effort is None:
            return {}
        switch = effort_switch(self.tokenizer.chat_template, req.reasoning_effort, "reasoning_effort",
                               self.reasoning is not None) or {}
        given = req.chat_template_kwargs or {}
        clash = sorted(k for k in switch if k in given and given[k] != switch[k])
        if clash:
            raise bad_request(f"reasoning_effort {req.reasoning_effort!r} sets {clash[0]} to {switch[clash[0]]!r}, "
                              f"but chat_template_kwargs sets it to {given[clash[0]]!r}: send one of them",
                              param="reasoning_effort")
        return switch

    def choice_deltas(self, tools: ToolPlan, thinking: ReasoningStream | None) -> ChoiceDeltas:
        """What turns one streamed choice's text into OpenAI-shaped deltas."""
        return ChoiceDeltas(ToolDeltas(tools, self.parser() if tools.mode == "auto" else None),
                            ReasoningStream(thinking.parser, thinking.opened) if thinking else None)

    def parser(self) -> ToolParser:
        return PARSERS[self.tool_call_parser]()

    def reply(self, tools: ToolPlan, text: str, finish_reason: str | None,
              thinking: ReasoningStream | None = None) -> tuple[dict, str | None]:
        """(the message, the finish reason) of a finished choice: its reasoning and its tool calls
        taken out of the text (tool calls only from the answer, after the reasoning)."""
        reasoning = None
        if thinking is not None:
            split = thinking.parser.split(text, thinking.opened)
            reasoning, text = split.reasoning, split.content or ""
        content, calls = text, None
        if tools.mode in ("required", "named"):
            calls = forced_calls(tools, text)
            if calls is None and finish_reason == "length":  # cut short: the calls it completed, if any
                calls = calls_before_cut(tools, text) or None
            content = None if calls else text  # cut short before a whole call: the client gets the text
        elif tools.mode == "auto":
            content, calls = tools.parse_auto(self.parser(), text)
        message: dict = {"role": "assistant", "content": content}
        if thinking is not None:
            message["content"] = content or None
            message["reasoning_content"] = reasoning
        if calls:
            message["tool_calls"] = [c.to_json() for c in calls]
            # OpenAI: "tool_calls" when the model chose to call; a named function was not its choice;
            # a reply cut by max_tokens stays "length" (its last call was dropped).
            if tools.mode != "named" and finish_reason != "length":
                finish_reason = "tool_calls"
        return message, finish_reason

    def render(self, messages: list[ChatMessage], add_generation_prompt: bool, **kwargs) -> list[int]:
        return self.tokenizer.encode(self.render_text(messages, add_generation_prompt, **kwargs),
                                     add_special_tokens=False)

    def render_text(self, messages: list[ChatMessage], add_generation_prompt: bool, **kwargs) -> str:
        conversation = [self.message_dict(m, i) for i, m in enumerate(messages)]
        kwargs = {k: v for k, v in kwargs.items() if v is not None}
        try:
            text = self.tokenizer.apply_chat_template(conversation, add_generation_prompt=add_generation_prompt,
                                                      **kwargs)
        except ValueError as e:
            raise bad_request(e, param="messages") from None
        check_request_text("messages", text)  # the template may have pasted in a lone surrogate from any field
        return text

    @staticmethod
    def message_dict(m: ChatMessage, index: int = -1) -> dict:
        d = m.model_dump(exclude_none=True)
        if isinstance(m.content, list):
            parts = []
            for j, p in enumerate(m.content):
                if p.type != "text" or p.text is None:
                    # The text model of an image-text checkpoint is served alone (models.registry.MULTIMODAL).
                    raise bad_request(f"messages[{index}].content[{j}]: only text content parts are supported "
                                      f"(image and audio inputs are not served), got type {p.type!r}",
                                      param="messages")
                parts.append(p.text)
            d["content"] = "\n".join(parts)
        if m.tool_calls is not None:
            # An agent loop sends the assistant's calls back with content null. Templates read
            # content as text and a call's arguments as a mapping (OpenAI sends them as JSON text).
            d.setdefault("content", "")
            d["tool_calls"] = [_template_call(c) for c in m.tool_calls]
        if "reasoning_content" in d:
            # gpt-oss's template (and Ollama-style ones) read an assistant's reasoning as `thinking`.
            d.setdefault("thinking", d["reasoning_content"])
        return d

    def logprobs(self, req: ChatCompletionRequest, token_ids: list[int], logprobs) -> dict | None:
        if not req.logprobs or logprobs is None:
            return None
        return self.chat_logprobs(token_ids, logprobs, req.top_logprobs or 0)

    @staticmethod
    def echoed(req: ChatCompletionRequest) -> str:
        """With echo, the text the reply starts with: the last message's, when it is the assistant's
        (the role being generated), as vLLM does."""
        last = req.messages[-1]
        if not req.echo or last.role != "assistant":
            return ""
        return OpenAIServingChat.message_dict(last).get("content") or ""

    def response(self, req: ChatCompletionRequest, request_id: str, final: RequestOutput, tools: ToolPlan,
                 thinking: ReasoningStream | None = None) -> dict:
        choices = []
        echo = self.echoed(req)
        for c in sorted(final.outputs, key=lambda c: c.index):
            message, finish_reason = self.reply(tools, echo + c.text, c.finish_reason, thinking)
            choice = {"index": c.index, "message": message,
                      "logprobs": self.logprobs(req, c.token_ids, c.logprobs),
                      "finish_reason": finish_reason, "stop_reason": c.stop_reason}
            if req.return_token_ids:
                choice["token_ids"] = list(c.token_ids)
            choices.append(choice)
        completion_tokens = sum(len(c.token_ids) for c in final.outputs)
        cached = getattr(final, "num_cached_tokens", 0) or 0
        body = {"id": request_id, "object": "chat.completion", "created": self.now(), "model": self.model_name,
                "choices": choices, "usage": self.usage(len(final.prompt_token_ids), completion_tokens, cached)}
        if req.prompt_logprobs is not None:
            body["prompt_logprobs"] = self.prompt_logprobs_json(final.prompt_logprobs)
        if req.return_token_ids:
            body["prompt_token_ids"] = list(final.prompt_token_ids)
        return body

    async def events(self, req: ChatCompletionRequest, request_id: str,
                     stream: RequestStream, tools: ToolPlan,
                     thinking: ReasoningStream | None = None) -> AsyncIterator[str]:
        """The chunks of a streamed answer (sent through guarded_sse)."""
        created = self.now()
        include_usage = bool(req.stream_options and req.stream_options.include_usage)
        continuous = include_usage and req.stream_options.continuous_usage_stats
        sent_tokens: dict[int, int] = {}
        ended: set[int] = set()  # choices whose finish_reason has been sent
        prompt_tokens = cached = 0

        def usage() -> dict:
            return self.usage(prompt_tokens, sum(sent_tokens.values()), cached)

        def chunk(index: int, delta: dict, c: CompletionOutput | None = None, logprobs=None,
                  token_ids: list[int] | None = None, finish_reason: str | None = None) -> str:
            choice = {"index": index, "delta": delta, "logprobs": logprobs,
                      "finish_reason": (finish_reason or c.finish_reason) if c else None,
                      "stop_reason": c.stop_reason if c else None}
            if token_ids is not None:
                choice["token_ids"] = token_ids
            body = {"id": request_id, "object": "chat.completion.chunk", "created": created,
                    "model": self.model_name, "choices": [choice]}
            if continuous:
                body["usage"] = usage()
            return sse(body)

        # The role comes first, one chunk per choice, before any token (as OpenAI and vLLM do);
        # with echo, it carries the echoed text.
        echo = self.echoed(req)
        for i in range(req.n):
            yield chunk(i, {"role": "assistant", "content": echo})
        deltas = {i: self.choice_deltas(tools, thinking) for i in range(req.n)}
        async for _, out in merge_streams([stream]):
            prompt_tokens = len(out.prompt_token_ids)
            cached = getattr(out, "num_cached_tokens", 0) or 0
            for c in out.outputs:
                if c.index in ended:
                    continue  # its last chunk is sent; later outputs of the request still list it
                done_tokens = sent_tokens.get(c.index, 0)
                finished = c.finish_reason is not None
                delta, finish_reason = deltas[c.index].advance(c.text, finished, c.finish_reason)
                new_ids = c.token_ids[done_tokens:]
                # A chunk only when it carries text, tokens the client asked to see, or the end.
                shows_tokens = new_ids and (req.logprobs or req.return_token_ids)
                if not delta and not shows_tokens and not finished:
                    continue
                sent_tokens[c.index] = len(c.token_ids)
                lps = c.logprobs[done_tokens:] if c.logprobs is not None else None
                yield chunk(c.index, delta or {"content": ""}, c, self.logprobs(req, new_ids, lps),
                            list(new_ids) if req.return_token_ids else None, finish_reason)
                if finished:
                    ended.add(c.index)
        if include_usage:
            yield sse({"id": request_id, "object": "chat.completion.chunk", "created": created,
                       "model": self.model_name, "choices": [], "usage": usage()})


def _template_call(call: dict) -> dict:
    fn = call.get("function") if isinstance(call, dict) else None
    if not isinstance(fn, dict) or not isinstance(fn.get("name"), str):
        raise bad_request(f'messages: a tool call must be {{"id": ..., "type": "function", "function": {{"name": ..., '
                          f'"arguments": "..."}}}}, got {call!r}', param="messages")
    args = fn.get("arguments")
    if isinstance(args, str):
        try:
            args = json.loads(args)
        except json.JSONDecodeError:
            raise bad_request(f"messages: the arguments of the call to {fn['name']!r} are not JSON: {args!r}",
                              param="messages") from None
    return {**call, "function": {**fn, "arguments": args}, "name": fn["name"], "arguments": args}


class ChoiceDeltas:
    """One streamed choice's deltas: its reasoning (`reasoning_content`) first, then the answer's
    content and tool calls, each from the whole text so far."""

    def __init__(self, tools: ToolDeltas, thinking: ReasoningStream | None) -> None:
        self.tools = tools
        self.thinking = thinking

    def advance(self, text: str, finished: bool, finish_reason: str | None) -> tuple[dict, str | None]:
        reasoning = ""
        if self.thinking is not None:  # only the answer goes on to the tool-call parser
            reasoning, answer = self.thinking.advance(text, finished)
            if answer is None and not finished:  # nothing of the answer yet (a named call's header waits too)
                return ({"reasoning_content": reasoning} if reasoning else {}), None
            text = answer or ""
        delta, finish_reason = self.tools.advance(text, finished, finish_reason)
        return ({"reasoning_content": reasoning, **delta} if reasoning else delta), finish_reason


class ToolDeltas:
    """One streamed choice's deltas: its text as content, less what belongs to tool calls,
    which go out as `tool_calls` deltas in OpenAI's shape.

    A named function streams its arguments as they come; `required` sends its calls when the
    JSON array is complete (cut by max_tokens: the calls completed before the cut); `auto` streams text until the parser's marker could begin and sends
    the calls at the end.
    """

    def __init__(self, tools: ToolPlan, parser: ToolParser | None) -> None:
        self.tools = tools
        self.parser = parser
        self.sent = 0          # characters of the text already sent as content or arguments
        self.named_id: str | None = None

    def advance(self, text: str, finished: bool, finish_reason: str | None) -> tuple[dict, str | None]:
        mode = self.tools.mode
        if mode == "named":
            delta: dict = {}
            if self.named_id is None:
                call = ToolCall(self.tools.name, "")
                self.named_id = call.id
                delta = {"tool_calls": [call.to_json(index=0)]}
            new = text[self.sent:]
            self.sent = len(text)
            if new:
                if "tool_calls" in delta:
                    delta["tool_calls"][0]["function"]["arguments"] = new
                else:
                    delta = {"tool_calls": [{"index": 0, "function": {"arguments": new}}]}
            return delta, finish_reason
        if mode == "required":
            if not finished:
                return {}, None
            calls = forced_calls(self.tools, text)
            if calls is None and finish_reason == "length":  # cut short: the calls it completed, if any
                calls = calls_before_cut(self.tools, text) or None
                if calls:
                    return {"tool_calls": [c.to_json(index=i) for i, c in enumerate(calls)]}, finish_reason
            if calls is None:  # cut short before a whole call: the client gets the text
                return {"content": text}, finish_reason
            return {"tool_calls": [c.to_json(index=i) for i, c in enumerate(calls)]}, "tool_calls"
        if mode == "none" or self.parser is None:
            new, self.sent = text[self.sent:], len(text)
            return ({"content": new} if new else {}), finish_reason
        start = self.parser.start(text)
        if not finished:
            end = start if start is not None else len(text) - self.parser.held(text)
            new = text[self.sent:end] if end > self.sent else ""
            self.sent = max(self.sent, end)
            return ({"content": new} if new else {}), None
        _, calls = self.tools.parse_auto(self.parser, text)
        if not calls:
            new, self.sent = text[self.sent:], len(text)
            return ({"content": new} if new else {}), finish_reason
        delta = {"tool_calls": [c.to_json(index=i) for i, c in enumerate(calls)]}
        rest = text[self.sent:start].rstrip() if start is not None and start > self.sent else ""
        if rest:
            delta["content"] = rest
        return delta, "tool_calls"
