"""POST /v1/messages and /v1/messages/count_tokens: Anthropic's Messages API as an adapter onto
the chat endpoint's path (protocol.to_chat), its replies and stream deltas put back into
Anthropic's content blocks (thinking, text, tool_use), stop reasons, usage and events."""
from __future__ import annotations

import json
from collections.abc import AsyncIterator

from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse

from pagellm.entrypoints.anthropic.protocol import CountTokensRequest, MessagesRequest, to_chat
from pagellm.entrypoints.openai.serving_chat import ChatRun, OpenAIServingChat
from pagellm.entrypoints.openai.errors import OpenAIError
from pagellm.entrypoints.openai.protocol import ChatCompletionRequest
from pagellm.entrypoints.openai.serving_engine import guarded_sse, merge_streams
from pagellm.outputs import CompletionOutput, RequestOutput


def event(kind: str, data: dict) -> str:
    return f"event: {kind}\ndata: {json.dumps({'type': kind, **data}, ensure_ascii=False)}\n\n"


def tool_use_id(call_id: str) -> str:
    return "toolu_" + call_id.removeprefix("call_")


def stop_reason(c: CompletionOutput, finish_reason: str | None, stops: list[str] | None) -> tuple[str, str | None]:
    """(stop_reason, stop_sequence) in Anthropic's terms."""
    if finish_reason == "tool_calls":
        return "tool_use", None
    if finish_reason == "length":
        return "max_tokens", None
    if isinstance(c.stop_reason, str) and c.stop_reason in (stops or ()):
        return "stop_sequence", c.stop_reason
    return "end_turn", None


def usage(prompt_tokens: int, cached: int, output_tokens: int) -> dict:
    # Anthropic counts prompt tokens read from the cache apart from input_tokens.
    return {"input_tokens": prompt_tokens - cached, "output_tokens": output_tokens,
            "cache_read_input_tokens": cached, "cache_creation_input_tokens": 0}


class AnthropicServingMessages:
    def __init__(self, chat: OpenAIServingChat) -> None:
        self.chat = chat

    async def create_message(self, req: MessagesRequest, raw_request: Request) -> Response:
        chat_req = self.to_chat(req)
        run = await self.chat.start(chat_req, id_prefix="msg", budget_field="thinking.budget_tokens")
        if req.stream:
            # Anthropic's stream ends with message_stop, never [DONE]; an engine failure is an error event.
            return StreamingResponse(guarded_sse(self.events(req, run), run.streams,
                                                 error_event=OpenAIError.anthropic_sse, done=None),
                                     media_type="text/event-stream")
        (final,) = await self.chat.collect(raw_request, run.streams)
        return JSONResponse(self.response(req, run, final))

    def to_chat(self, req: CountTokensRequest) -> ChatCompletionRequest:
        return to_chat(req, self.chat.tokenizer.chat_template, self.chat.reasoning is not None)

    def count_tokens(self, req: CountTokensRequest) -> dict:
        chat_req = self.to_chat(req)
        self.chat.check_model(chat_req.model)
        text = self.chat.render_request(chat_req)
        return {"input_tokens": len(self.chat.tokenizer.encode(text, add_special_tokens=False))}

    def message(self, req: MessagesRequest, run: ChatRun, content: list[dict], stop: tuple[str | None, str | None],
                usage_: dict) -> dict:
        return {"id": run.request_id, "type": "message", "role": "assistant", "model": self.chat.model_name,
                "content": content, "stop_reason": stop[0], "stop_sequence": stop[1], "usage": usage_}

    def response(self, req: MessagesRequest, run: ChatRun, final: RequestOutput) -> dict:
        (c,) = final.outputs
        reply, finish_reason = self.chat.reply(run.tools, c.text, c.finish_reason, run.thinking)
        content: list[dict] = []
        if reply.get("reasoning_content") is not None:
            content.append({"type": "thinking", "thinking": reply["reasoning_content"], "signature": ""})
        if reply.get("content"):
            content.append({"type": "text", "text": reply["content"]})
        for call in reply.get("tool_calls") or []:
            fn = call["function"]
            content.append({"type": "tool_use", "id": tool_use_id(call["id"]), "name": fn["name"],
                            "input": json.loads(fn["arguments"])})
        if reply.get("tool_calls") and finish_reason != "length":  # cut by max_tokens: max_tokens
            finish_reason = "tool_calls"  # a named tool too: Anthropic's stop_reason is tool_use
        cached = getattr(final, "num_cached_tokens", 0) or 0
        return self.message(req, run, content, stop_reason(c, finish_reason, req.stop_sequences),
                            usage(len(final.prompt_token_ids), cached, len(c.token_ids)))

    async def events(self, req: MessagesRequest, run: ChatRun) -> AsyncIterator[str]:
        """Anthropic's event order: message_start, ping, per block content_block_start / _delta... /
        _stop, then message_delta (stop reason, usage) and message_stop."""
        start = self.message(req, run, [], (None, None), usage(run.prompt_tokens, 0, 0))
        yield event("message_start", {"message": start})
        yield event("ping", {})
        deltas = self.chat.choice_deltas(run.tools, run.thinking)
        blocks = Blocks()
        async for _, out in merge_streams(run.streams):
            (c,) = out.outputs
            finished = c.finish_reason is not None
            delta, finish_reason = deltas.advance(c.text, finished, c.finish_reason)
            for e in blocks.feed(delta):
                yield e
            if finished:
                for e in blocks.close():
                    yield e
                if blocks.tool_calls and finish_reason != "length":
                    finish_reason = "tool_calls"
                reason, sequence = stop_reason(c, finish_reason, req.stop_sequences)
                cached = getattr(out, "num_cached_tokens", 0) or 0
                yield event("message_delta", {"delta": {"stop_reason": reason, "stop_sequence": sequence},
                                              "usage": usage(len(out.prompt_token_ids), cached, len(c.token_ids))})
                yield event("message_stop", {})
                return


class Blocks:
    """OpenAI-shaped deltas (reasoning_content, content, tool_calls) as Anthropic content-block
    events: a block opens when its kind begins and closes when another begins or the reply ends."""

    def __init__(self) -> None:
        self.index = -1
        self.kind: str | None = None
        self.tool_calls = 0

    def _open(self, kind: str, block: dict) -> list[str]:
        out = self.close()
        self.index += 1
        self.kind = kind
        return out + [event("content_block_start", {"index": self.index, "content_block": block})]

    def _delta(self, delta: dict) -> str:
        return event("content_block_delta", {"index": self.index, "delta": delta})

    def feed(self, delta: dict) -> list[str]:
        out: list[str] = []
        if delta.get("reasoning_content"):
            if self.kind != "thinking":
                out += self._open("thinking", {"type": "thinking", "thinking": "", "signature": ""})
            out.append(self._delta({"type": "thinking_delta", "thinking": delta["reasoning_content"]}))
        if delta.get("content"):
            if self.kind != "text":
                out += self._open("text", {"type": "text", "text": ""})
            out.append(self._delta({"type": "text_delta", "text": delta["content"]}))
        for call in delta.get("tool_calls") or []:
            fn = call.get("function") or {}
            if "id" in call:  # a new call
                self.tool_calls += 1
                out += self._open("tool_use", {"type": "tool_use", "id": tool_use_id(call["id"]),
                                               "name": fn["name"], "input": {}})
            if fn.get("arguments"):
                out.append(self._delta({"type": "input_json_delta", "partial_json": fn["arguments"]}))
        return out

    def close(self) -> list[str]:
        if self.kind is None:
            return []
        self.kind = None
        return [event("content_block_stop", {"index": self.index})]
