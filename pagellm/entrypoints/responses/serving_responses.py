"""POST /v1/responses, GET and DELETE /v1/responses/{id}: OpenAI's Responses API as an adapter onto
the chat endpoint's path (protocol.to_chat), its replies and stream deltas put back into output
items (reasoning, message, function_call) with their typed stream events, usage and statuses;
stored responses continue with previous_response_id (store.py)."""
from __future__ import annotations

import json
import time
from collections.abc import AsyncIterator

from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse

from pagellm.entrypoints.openai.errors import OpenAIError
from pagellm.entrypoints.openai.serving_chat import ChatRun, OpenAIServingChat
from pagellm.entrypoints.openai.serving_engine import guarded_sse, merge_streams, random_id
from pagellm.entrypoints.responses.protocol import ResponsesRequest, input_items, to_chat
from pagellm.entrypoints.responses.store import ResponseStore
from pagellm.outputs import RequestOutput


class Events:
    """A stream's events, numbered in the order sent (sequence_number), each named in its
    `event:` line and in its data's `type`."""

    def __init__(self) -> None:
        self.number = 0

    def __call__(self, kind: str, **data) -> str:
        body = {"type": kind, "sequence_number": self.number, **data}
        self.number += 1
        return f"event: {kind}\ndata: {json.dumps(body, ensure_ascii=False)}\n\n"

    def error(self, e: OpenAIError) -> str:
        """An engine failure after the stream began: the Responses API's `error` event."""
        return self("error", code=e.code, message=e.message, param=e.param)


def outcome(finish_reason: str | None) -> tuple[str, dict | None]:
    """(status, incomplete_details) of a finished reply."""
    if finish_reason == "length":
        return "incomplete", {"reason": "max_output_tokens"}
    if finish_reason == "abort":  # the server shut down mid-reply
        return "incomplete", None
    return "completed", None


class OutputItems:
    """OpenAI-shaped chat deltas (reasoning_content, content, tool_calls) as a response's output
    items and their stream events: an item opens when its kind begins and is done when another
    begins or the reply ends. A reply streams through one, and a whole reply is fed as one delta,
    so both give the same items."""

    def __init__(self, events: Events) -> None:
        self.event = events
        self.items: list[dict] = []
        self.kind: str | None = None  # the open item's: message, reasoning or function_call
        self.text = ""                # its text so far (for a function call, its arguments)
        self.call: tuple[str, str] = ("", "")  # a function call's (call_id, name)
        self.item_id = ""

    def feed(self, delta: dict) -> list[str]:
        out: list[str] = []
        if delta.get("reasoning_content"):
            if self.kind != "reasoning":
                out += self._open("reasoning")
            out.append(self._delta(delta["reasoning_content"]))
        if delta.get("content"):
            if self.kind != "message":
                out += self._open("message")
            out.append(self._delta(delta["content"]))
        for call in delta.get("tool_calls") or []:
            fn = call.get("function") or {}
            if "id" in call:  # a new call
                out += self._open("function_call", (call["id"], fn["name"]))
            if fn.get("arguments"):
                out.append(self._delta(fn["arguments"]))
        return out

    def finish(self, status: str) -> list[str]:
        """The last item done; a reply with neither text nor calls still has its (empty) message."""
        out = self.close(status)
        if not any(item["type"] in ("message", "function_call") for item in self.items):
            out += self._open("message") + self.close(status)
        return out

    def _item(self, status: str, text: str | None) -> dict:
        item_id = self.item_id
        if self.kind == "function_call":
            return {"id": item_id, "type": "function_call", "call_id": self.call[0], "name": self.call[1],
                    "arguments": text or "", "status": status}
        parts = [] if text is None else [self._part(text)]
        if self.kind == "reasoning":
            return {"id": item_id, "type": "reasoning", "summary": [], "content": parts, "status": status}
        return {"id": item_id, "type": "message", "role": "assistant", "status": status, "content": parts}

    def _part(self, text: str) -> dict:
        if self.kind == "reasoning":
            return {"type": "reasoning_text", "text": text}
        return {"type": "output_text", "text": text, "annotations": [], "logprobs": []}

    @property
    def index(self) -> int:
        return len(self.items) - 1

    def _where(self) -> dict:
        return {"item_id": self.item_id, "output_index": self.index}

    def _open(self, kind: str, call: tuple[str, str] = ("", "")) -> list[str]:
        out = self.close("completed")
        self.kind, self.text, self.call = kind, "", call
        self.item_id = random_id({"message": "msg", "reasoning": "rs", "function_call": "fc"}[kind])
        self.items.append(self._item("in_progress", None))
        out.append(self.event("response.output_item.added", output_index=self.index, item=self.items[-1]))
        if kind != "function_call":
            out.append(self.event("response.content_part.added", **self._where(), content_index=0,
                                  part=self._part("")))
        return out

    def _delta(self, text: str) -> str:
        self.text += text
        if self.kind == "function_call":
            return self.event("response.function_call_arguments.delta", **self._where(), delta=text)
        if self.kind == "reasoning":
            return self.event("response.reasoning_text.delta", **self._where(), content_index=0, delta=text)
        return self.event("response.output_text.delta", **self._where(), content_index=0, delta=text, logprobs=[])

    def close(self, status: str) -> list[str]:
        if self.kind is None:
            return []
        item = self._item(status, self.text)
        if self.kind == "function_call":
            out = [self.event("response.function_call_arguments.done", **self._where(), name=self.call[1],
                              arguments=self.text)]
        else:
            done = ("response.reasoning_text.done" if self.kind == "reasoning" else "response.output_text.done")
            extra = {} if self.kind == "reasoning" else {"logprobs": []}
            out = [self.event(done, **self._where(), content_index=0, text=self.text, **extra),
                   self.event("response.content_part.done", **self._where(), content_index=0,
                              part=item["content"][0])]
        self.items[-1] = item
        out.append(self.event("response.output_item.done", output_index=self.index, item=item))
        self.kind = None
        return out


class OpenAIServingResponses:
    def __init__(self, chat: OpenAIServingChat, store: ResponseStore | None = None) -> None:
        self.chat = chat
        self.store = store if store is not None else ResponseStore()

    async def create_response(self, req: ResponsesRequest, raw_request: Request) -> Response:
        history: list[dict] = []
        if req.previous_response_id is not None:
            stored = self.store.get(req.previous_response_id)
            if stored is None:
                raise OpenAIError(404, f"previous_response_id {req.previous_response_id!r} is not stored here: "
                                       f"unknown, deleted, or evicted (this server keeps the last "
                                       f"{self.store.capacity} responses created with store true, in memory)",
                                  param="previous_response_id", code="response_not_found")
            history = stored.items
        chat_req = to_chat(req, history, self.chat.tokenizer.chat_template, self.chat.reasoning is not None)
        run = await self.chat.start(chat_req, id_prefix="resp")
        created = time.time()
        if req.stream:
            events = Events()
            return StreamingResponse(guarded_sse(self.events(req, run, events, history, created), run.streams,
                                                 error_event=events.error, done=None),
                                     media_type="text/event-stream")
        (final,) = await self.chat.collect(raw_request, run.streams)
        (c,) = final.outputs
        reply, _ = self.chat.reply(run.tools, c.text, c.finish_reason, run.thinking)
        items = OutputItems(Events())
        calls = [{"index": i, **call} for i, call in enumerate(reply.get("tool_calls") or [])]
        items.feed({"reasoning_content": reply.get("reasoning_content"), "content": reply.get("content"),
                    "tool_calls": calls})
        status, incomplete = outcome(c.finish_reason)
        items.finish(status)
        response = self.response(req, run, created, status, items.items, self.usage(final, items.items), incomplete)
        self.keep(req, response, history)
        return JSONResponse(response)

    def retrieve(self, response_id: str) -> dict:
        stored = self.store.get(response_id)
        if stored is None:
            raise self.not_stored(response_id)
        return stored.response

    def delete(self, response_id: str) -> dict:
        if not self.store.delete(response_id):
            raise self.not_stored(response_id)
        return {"id": response_id, "object": "response", "deleted": True}

    def not_stored(self, response_id: str) -> OpenAIError:
        return OpenAIError(404, f"No response {response_id!r} is stored here: unknown, deleted, or evicted (this "
                                f"server keeps the last {self.store.capacity} responses created with store true, "
                                f"in memory)", param="response_id", code="response_not_found")

    def keep(self, req: ResponsesRequest, response: dict, history: list[dict]) -> None:
        """Store the response and its conversation (without the instructions, which do not carry
        over to a continuation, as in OpenAI's API)."""
        if req.store:
            self.store.put(response, history + input_items(req) + response["output"])

    def usage(self, final: RequestOutput, output: list[dict]) -> dict:
        prompt, generated = len(final.prompt_token_ids), len(final.outputs[0].token_ids)
        reasoning = "".join(part["text"] for item in output if item["type"] == "reasoning" for part in item["content"])
        # The reasoning's own tokens are not kept apart from the answer's: it is tokenized again.
        reasoning_tokens = len(self.chat.tokenizer.encode(reasoning, add_special_tokens=False)) if reasoning else 0
        return {"input_tokens": prompt,
                "input_tokens_details": {"cached_tokens": getattr(final, "num_cached_tokens", 0) or 0,
                                         "cache_write_tokens": 0},
                "output_tokens": generated, "output_tokens_details": {"reasoning_tokens": reasoning_tokens},
                "total_tokens": prompt + generated}

    def response(self, req: ResponsesRequest, run: ChatRun, created: float, status: str, output: list[dict],
                 usage: dict | None, incomplete: dict | None) -> dict:
        tools = run.tools
        choice = {"type": "function", "name": tools.name} if tools.mode == "named" else tools.mode
        return {"id": run.request_id, "object": "response", "created_at": created, "status": status,
                "background": False, "error": None, "incomplete_details": incomplete,
                "instructions": req.instructions, "max_output_tokens": req.max_output_tokens,
                "model": self.chat.model_name, "output": output, "parallel_tool_calls": req.parallel_tool_calls,
                "previous_response_id": req.previous_response_id,
                "reasoning": {"effort": (req.reasoning or {}).get("effort"), "summary": None},
                "store": req.store, "temperature": req.temperature, "top_p": req.top_p,
                "text": {"format": (req.text or {}).get("format") or {"type": "text"}},
                "tool_choice": choice, "tools": req.tools or [], "truncation": "disabled",
                "usage": usage, "user": req.user, "metadata": req.metadata or {}}

    async def events(self, req: ResponsesRequest, run: ChatRun, events: Events, history: list[dict],
                     created: float) -> AsyncIterator[str]:
        """The documented order: response.created, response.in_progress, then per output item
        output_item.added, (content_part.added), its deltas, their done event, (content_part.done),
        output_item.done; then response.completed (response.incomplete when cut short)."""
        start = self.response(req, run, created, "in_progress", [], None, None)
        yield events("response.created", response=start)
        yield events("response.in_progress", response=start)
        deltas = self.chat.choice_deltas(run.tools, run.thinking)
        items = OutputItems(events)
        async for _, out in merge_streams(run.streams):
            (c,) = out.outputs
            finished = c.finish_reason is not None
            delta, _ = deltas.advance(c.text, finished, c.finish_reason)
            for e in items.feed(delta):
                yield e
            if finished:
                status, incomplete = outcome(c.finish_reason)
                for e in items.finish(status):
                    yield e
                response = self.response(req, run, created, status, items.items, self.usage(out, items.items),
                                         incomplete)
                self.keep(req, response, history)
                yield events("response.completed" if status == "completed" else "response.incomplete",
                             response=response)
                return
