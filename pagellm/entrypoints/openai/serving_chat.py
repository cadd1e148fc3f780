"""POST /v1/chat/completions: messages rendered through the model's (sandboxed) chat template."""
from __future__ import annotations

from collections.abc import AsyncIterator

from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse

from pagellm.engine.async_engine import RequestStream
from pagellm.entrypoints.openai.errors import bad_request, check_request_text
from pagellm.entrypoints.openai.protocol import ChatCompletionRequest, ChatMessage
from pagellm.entrypoints.openai.serving_engine import (OpenAIServing, guarded_sse, merge_streams,
                                                       random_id, sse)
from pagellm.outputs import CompletionOutput, RequestOutput


class OpenAIServingChat(OpenAIServing):
    async def create_chat_completion(self, req: ChatCompletionRequest, raw_request: Request) -> Response:
        self.check_model(req.model)
        self.check_common(req)
        if req.top_logprobs is not None and not req.logprobs:
            raise bad_request("top_logprobs requires logprobs to be true", param="top_logprobs")
        self.check_logprobs(req.top_logprobs, "top_logprobs")
        self.check_logprobs(req.prompt_logprobs, "prompt_logprobs")
        if req.stream and req.prompt_logprobs is not None:
            raise bad_request("prompt_logprobs are not available when streaming; send stream: false",
                              param="stream")
        kwargs = req.chat_template_kwargs or {}
        reserved = sorted(self.tokenizer.reserved_template_variables & kwargs.keys())
        if reserved:
            raise bad_request(f"chat_template_kwargs may not set {', '.join(reserved)}: the server sets them "
                              f"from the request's own fields", param="chat_template_kwargs")
        if req.continue_final_message and req.add_generation_prompt:
            raise bad_request("continue_final_message needs add_generation_prompt false: one continues the last "
                              "message, the other starts a new one", param="continue_final_message")
        ids = self.render(req.messages, req.add_generation_prompt, tools=req.tools,
                          continue_final_message=req.continue_final_message, **kwargs)
        ids = self.truncate(ids, req.truncate_prompt_tokens)
        asked = req.max_completion_tokens if req.max_completion_tokens is not None else req.max_tokens
        max_tokens = self.resolve_max_tokens(len(ids), asked, req.n, "messages")
        params = self.sampling_params(req, max_tokens=max_tokens,
                                      logprobs=(req.top_logprobs or 0) if req.logprobs else None,
                                      prompt_logprobs=req.prompt_logprobs,
                                      structured=await self.structured_outputs(req))
        request_id = random_id("chatcmpl")
        streams = await self.add_requests(request_id, [(None, ids)], [params])
        if req.stream:
            return StreamingResponse(guarded_sse(self.events(req, request_id, streams[0]), streams),
                                     media_type="text/event-stream")
        (final,) = await self.collect(raw_request, streams)
        return JSONResponse(self.response(req, request_id, final))

    def render(self, messages: list[ChatMessage], add_generation_prompt: bool, **kwargs) -> list[int]:
        conversation = [self.message_dict(m) for m in messages]
        kwargs = {k: v for k, v in kwargs.items() if v is not None}
        try:
            text = self.tokenizer.apply_chat_template(conversation, add_generation_prompt=add_generation_prompt,
                                                      **kwargs)
        except ValueError as e:
            raise bad_request(e, param="messages") from None
        check_request_text("messages", text)  # the template may have pasted in a lone surrogate from any field
        return self.tokenizer.encode(text, add_special_tokens=False)

    @staticmethod
    def message_dict(m: ChatMessage) -> dict:
        d = m.model_dump(exclude_none=True)
        if isinstance(m.content, list):
            parts = []
            for p in m.content:
                if p.type != "text" or p.text is None:
                    raise bad_request(f"only text content parts are supported, got type {p.type!r}",
                                      param="messages")
                parts.append(p.text)
            d["content"] = "\n".join(parts)
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

    def response(self, req: ChatCompletionRequest, request_id: str, final: RequestOutput) -> dict:
        choices = []
        echo = self.echoed(req)
        for c in sorted(final.outputs, key=lambda c: c.index):
            choice = {"index": c.index, "message": {"role": "assistant", "content": echo + c.text},
                      "logprobs": self.logprobs(req, c.token_ids, c.logprobs),
                      "finish_reason": c.finish_reason, "stop_reason": c.stop_reason}
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
                     stream: RequestStream) -> AsyncIterator[str]:
        """The chunks of a streamed answer (sent through guarded_sse)."""
        created = self.now()
        include_usage = bool(req.stream_options and req.stream_options.include_usage)
        continuous = include_usage and req.stream_options.continuous_usage_stats
        sent_text: dict[int, int] = {}
        sent_tokens: dict[int, int] = {}
        prompt_tokens = cached = 0

        def usage() -> dict:
            return self.usage(prompt_tokens, sum(sent_tokens.values()), cached)

        def chunk(index: int, delta: dict, c: CompletionOutput | None = None, logprobs=None,
                  token_ids: list[int] | None = None) -> str:
            choice = {"index": index, "delta": delta, "logprobs": logprobs,
                      "finish_reason": c.finish_reason if c else None, "stop_reason": c.stop_reason if c else None}
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
        async for _, out in merge_streams([stream]):
            prompt_tokens = len(out.prompt_token_ids)
            cached = getattr(out, "num_cached_tokens", 0) or 0
            for c in out.outputs:
                done_text, done_tokens = sent_text.get(c.index, 0), sent_tokens.get(c.index, 0)
                delta = c.text[done_text:]
                new_ids = c.token_ids[done_tokens:]
                # A chunk only when it carries text, tokens the client asked to see, or the end.
                shows_tokens = new_ids and (req.logprobs or req.return_token_ids)
                if not delta and not shows_tokens and c.finish_reason is None:
                    continue
                sent_text[c.index], sent_tokens[c.index] = len(c.text), len(c.token_ids)
                lps = c.logprobs[done_tokens:] if c.logprobs is not None else None
                yield chunk(c.index, {"content": delta}, c, self.logprobs(req, new_ids, lps),
                            list(new_ids) if req.return_token_ids else None)
        if include_usage:
            yield sse({"id": request_id, "object": "chat.completion.chunk", "created": created,
                       "model": self.model_name, "choices": [], "usage": usage()})
