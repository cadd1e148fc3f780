"""POST /v1/completions: one or many prompts (text or token ids), streamed or not."""
from __future__ import annotations

from collections.abc import AsyncIterator
from dataclasses import replace

from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse

from pagellm.engine.async_engine import RequestStream
from pagellm.entrypoints.openai.errors import bad_request
from pagellm.entrypoints.openai.protocol import CompletionRequest
from pagellm.entrypoints.openai.serving_engine import (OpenAIServing, guarded_sse, merge_streams,
                                                       random_id, sse)
from pagellm.outputs import CompletionOutput, RequestOutput


class OpenAIServingCompletion(OpenAIServing):
    async def create_completion(self, req: CompletionRequest, raw_request: Request) -> Response:
        self.check_model(req.model)
        self.check_common(req, best_of=req.best_of)
        if req.suffix:
            raise bad_request("suffix is not supported", param="suffix")
        self.check_logprobs(req.logprobs, "logprobs")
        self.check_logprobs(req.prompt_logprobs, "prompt_logprobs")
        if req.max_tokens == 0 and not req.echo:
            raise bad_request("max_tokens must be >= 1, got 0 (0 is allowed only with echo, to score the prompt)",
                              param="max_tokens")
        if req.stream and (req.prompt_logprobs is not None or req.echo and (req.logprobs is not None
                                                                            or req.max_tokens == 0)):
            raise bad_request("prompt logprobs (prompt_logprobs, or echo with logprobs or with max_tokens 0) are "
                              "not available when streaming; send stream: false", param="stream")
        if req.stream and req.best_of is not None and req.best_of != req.n:
            raise bad_request("best_of must equal n when streaming", param="best_of")
        prompts = self.parse_prompts(req.prompt)
        if req.truncate_prompt_tokens is not None:  # a cut prompt's text is re-decoded (for echo)
            prompts = [(text, cut) if len(cut := self.truncate(ids, req.truncate_prompt_tokens)) == len(ids)
                       else (None, cut) for text, ids in prompts]
        # Echoed logprobs cover the prompt too: its tokens' logprobs are computed during prefill.
        scored = [k for k in (req.prompt_logprobs, req.logprobs if req.echo else None) if k is not None]
        # max_tokens 0 runs one token (the engine always samples one) that the response leaves out.
        max_tokens = 1 if req.max_tokens == 0 else req.max_tokens
        if req.use_beam_search:
            params = [self.beam_search_params(req, self.resolve_max_tokens(len(ids), max_tokens, req.n, "prompt"))
                      for _, ids in prompts]
        else:
            structured = await self.structured_outputs(req)
            params = [self.sampling_params(req, max_tokens=self.resolve_max_tokens(len(ids), max_tokens, req.n,
                                                                                   "prompt"),
                                           logprobs=req.logprobs, best_of=req.best_of,
                                           prompt_logprobs=max(scored) if scored else None, structured=structured)
                      for _, ids in prompts]
        request_id = random_id("cmpl")
        streams = await self.add_requests(request_id, prompts, params)
        texts = [text if text is not None else self.tokenizer.decode(ids, skip_special_tokens=False)
                 for text, ids in prompts]
        if req.stream:
            return StreamingResponse(guarded_sse(self.events(req, request_id, streams, texts), streams),
                                     media_type="text/event-stream")
        finals = await self.collect(raw_request, streams)
        return JSONResponse(self.response(req, request_id, finals, texts))

    def choice(self, req: CompletionRequest, index: int, c: CompletionOutput, text: str,
               token_ids: list[int], logprobs, offset: int, prompt_logprobs: list | None = None) -> dict:
        lp = None
        if req.logprobs is not None and logprobs is not None:
            lp = self.completion_logprobs(token_ids, logprobs, req.logprobs, offset)
        out = {"index": index, "text": text, "logprobs": lp, "finish_reason": c.finish_reason,
               "stop_reason": c.stop_reason}
        if req.prompt_logprobs is not None:
            out["prompt_logprobs"] = self.prompt_logprobs_json(prompt_logprobs)
        return out

    def response(self, req: CompletionRequest, request_id: str, finals: list[RequestOutput],
                 texts: list[str]) -> dict:
        choices, prompt_tokens, completion_tokens, cached = [], 0, 0, 0
        for i, out in enumerate(finals):
            prompt_tokens += len(out.prompt_token_ids)
            cached += getattr(out, "num_cached_tokens", 0) or 0
            for c in sorted(out.outputs, key=lambda c: c.index):
                text, ids, lps = c.text, c.token_ids, c.logprobs
                if req.max_tokens == 0:  # the prompt scored, nothing generated
                    text, ids, lps = "", [], [] if lps is not None else None
                    c = replace(c, finish_reason="length", stop_reason=None)
                completion_tokens += len(ids)
                generated = ids
                if req.echo:
                    text = texts[i] + text
                    if lps is not None:  # the prompt's tokens and logprobs first, as in OpenAI's legacy API
                        ids, lps = out.prompt_token_ids + ids, out.prompt_logprobs + lps
                choice = self.choice(req, i * req.n + c.index, c, text, ids, lps, 0, out.prompt_logprobs)
                if req.return_token_ids:
                    choice["token_ids"] = list(generated)
                    choice["prompt_token_ids"] = list(out.prompt_token_ids)
                choices.append(choice)
        return {"id": request_id, "object": "text_completion", "created": self.now(), "model": self.model_name,
                "choices": choices, "usage": self.usage(prompt_tokens, completion_tokens, cached)}

    async def events(self, req: CompletionRequest, request_id: str, streams: list[RequestStream],
                     texts: list[str]) -> AsyncIterator[str]:
        """The chunks of a streamed answer (sent through guarded_sse)."""
        created = self.now()
        include_usage = bool(req.stream_options and req.stream_options.include_usage)
        continuous = include_usage and req.stream_options.continuous_usage_stats
        sent_text: dict[tuple[int, int], int] = {}
        sent_tokens: dict[tuple[int, int], int] = {}
        ended: set[tuple[int, int]] = set()  # choices whose finish_reason has been sent
        # Where the next token's text starts: the text of the tokens sent so far, which runs ahead
        # of the text sent while a possible stop string is held back.
        next_offset: dict[tuple[int, int], int] = {}
        prompt_tokens: dict[int, int] = {}
        cached: dict[int, int] = {}

        def usage() -> dict:
            return self.usage(sum(prompt_tokens.values()), sum(sent_tokens.values()), sum(cached.values()))

        async for i, out in merge_streams(streams):
            prompt_tokens[i] = len(out.prompt_token_ids)
            cached[i] = getattr(out, "num_cached_tokens", 0) or 0
            for c in out.outputs:
                key = (i, c.index)
                if key in ended:
                    continue  # its last chunk is sent; later outputs of the request still list it
                first = key not in sent_text
                done_text, done_tokens = sent_text.get(key, 0), sent_tokens.get(key, 0)
                delta = c.text[done_text:]
                new_ids = c.token_ids[done_tokens:]
                # A chunk only when it carries text, tokens the client asked to see, or the end:
                # tokens whose text is held back (a possible stop string) wait for the next one.
                shows_tokens = new_ids and (req.logprobs is not None or req.return_token_ids)
                if not delta and not shows_tokens and c.finish_reason is None and not (req.echo and first):
                    continue
                sent_text[key], sent_tokens[key] = len(c.text), len(c.token_ids)
                prefix = texts[i] if req.echo and first else ""
                offset = next_offset.get(key, len(texts[i]) if req.echo else 0)
                lps = c.logprobs[done_tokens:] if c.logprobs is not None else None
                choice = self.choice(req, i * req.n + c.index, c, prefix + delta, new_ids, lps, offset)
                if req.return_token_ids:
                    choice["token_ids"] = list(new_ids)
                    if first:
                        choice["prompt_token_ids"] = list(out.prompt_token_ids)
                if choice["logprobs"] and choice["logprobs"]["tokens"]:
                    next_offset[key] = choice["logprobs"]["text_offset"][-1] + len(choice["logprobs"]["tokens"][-1])
                chunk = {"id": request_id, "object": "text_completion", "created": created,
                         "model": self.model_name, "choices": [choice]}
                if continuous:
                    chunk["usage"] = usage()
                if c.finish_reason is not None:
                    ended.add(key)
                yield sse(chunk)
        if include_usage:
            yield sse({"id": request_id, "object": "text_completion", "created": created,
                       "model": self.model_name, "choices": [], "usage": usage()})
