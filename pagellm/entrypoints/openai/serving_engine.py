"""What the completion and chat endpoints share: the model-name check, the sampling
parameters, context-length checks, logprob and usage shapes, and the plumbing from HTTP
requests to engine streams (error mapping, disconnects, several prompts at once)."""
from __future__ import annotations

import asyncio
import contextlib
import json
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import TypeVar

from starlette.requests import Request

from pagellm.beam_search import BeamSearchParams
from pagellm.engine.async_engine import (AsyncLLMEngine, EngineDeadError, EngineStepError, QueueFullError,
                                         RequestAborted, RequestStream)
from pagellm.entrypoints.openai.errors import OpenAIError, bad_request, check_request_text
from pagellm.entrypoints.openai.protocol import MAX_LOGPROBS, SamplingFields
from pagellm.outputs import Logprob, RequestOutput
from pagellm.entrypoints.openai.structured import parse_structured_outputs
from pagellm.sampling_params import (OPENAI_FIELDS, ReasoningBudget, ReasoningSection, SamplingParams,
                                     StructuredOutputsParams)

T = TypeVar("T")
# Request fields that mean nothing to beam search (sent with use_beam_search, a 400 names them).
BEAM_SEARCH_CONFLICTS = (set(OPENAI_FIELDS) - {"ignore_eos", "skip_special_tokens"}) | {
    "logprobs", "top_logprobs", "logit_bias", "best_of", "prompt_logprobs", "response_format", "structured_outputs",
    "guided_json", "guided_regex", "guided_choice", "guided_grammar", "tool_choice", "echo", "thinking_token_budget"}
# Retry-After for a full queue: a step takes well under a second, a request a few seconds.
RETRY_AFTER_SECONDS = 1


def random_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


def sse(obj: dict) -> str:
    return f"data: {json.dumps(obj, ensure_ascii=False, separators=(',', ':'))}\n\n"


SSE_DONE = "data: [DONE]\n\n"


class ClientDisconnected(Exception):
    """The HTTP client went away before its answer was ready."""


def engine_error(e: BaseException) -> OpenAIError | None:
    """The HTTP answer for an exception out of the engine, or None for an unexpected one."""
    if isinstance(e, OpenAIError):
        return e
    if isinstance(e, QueueFullError):
        return OpenAIError(503, f"The server is overloaded: {e}", code="server_overloaded",
                           headers={"Retry-After": str(RETRY_AFTER_SECONDS)})
    if isinstance(e, EngineDeadError):
        return OpenAIError(503, str(e), code="engine_unavailable")
    if isinstance(e, EngineStepError):
        return OpenAIError(500, str(e), code="internal_error")
    if isinstance(e, RequestAborted):
        return OpenAIError(500, str(e), code="aborted")
    if isinstance(e, ValueError):
        return bad_request(e)
    return None


def token_bias(logit_bias: dict[str, float] | None) -> dict[int, float] | None:
    """OpenAI's logit_bias keys are token ids written as strings."""
    if not logit_bias:
        return None
    out = {}
    for key, bias in logit_bias.items():
        try:
            out[int(key)] = bias
        except ValueError:
            raise bad_request(f"logit_bias keys must be token ids, got {key!r}", param="logit_bias") from None
    return out


class OpenAIServing:
    """Base of the endpoint handlers: one engine, the names it is served under."""

    def __init__(self, engine: AsyncLLMEngine, served_model_names: list[str],
                 max_seqs_per_request: int | None = None) -> None:
        self.engine = engine
        self.max_seqs_per_request = max_seqs_per_request
        self.served_model_names = served_model_names
        self.model_name = served_model_names[0]
        self.tokenizer = engine.tokenizer
        self.max_model_len = engine.max_model_len
        kv = engine.stats().kv
        self.pool_tokens = kv.total_blocks * kv.block_size

    # ---- validation ------------------------------------------------------------------------
    def check_model(self, model: str | None) -> None:
        if model and model not in self.served_model_names:
            raise OpenAIError(404, f"The model `{model}` does not exist. This server serves "
                                   f"{', '.join(repr(n) for n in self.served_model_names)}.",
                              param="model", code="model_not_found")

    def check_common(self, req: SamplingFields, best_of: int | None = None) -> None:
        for name, why in req.unsupported_fields():  # never silently ignored
            raise bad_request(f"{name} is not supported: {why}", param=name)
        if req.stream_options is not None and not req.stream:
            raise bad_request("stream_options can only be set when stream is true", param="stream_options")
        cap = self.max_seqs_per_request
        for name, value in (("n", req.n), ("best_of", best_of)):
            if cap is not None and isinstance(value, int) and value > cap:
                raise bad_request(f"{name} must be <= {cap} on this server (--max-seqs-per-request: one request "
                                  f"may hold at most that many of the engine's sequence slots, so that the others "
                                  f"keep being admitted), got {value}", param=name)

    def resolve_max_tokens(self, prompt_len: int, max_tokens: int | None, n: int, what: str) -> int:
        """Check the prompt (plus max_tokens, when given) fits the context; default max_tokens.

        Without max_tokens a request may run to the end of the context, as in vLLM, but no
        further than the KV pool can hold, so that an unbounded request is never refused.
        """
        limit = self.max_model_len
        if prompt_len >= limit:
            raise bad_request(
                f"This model's maximum context length is {limit} tokens. However, your {what} has "
                f"{prompt_len} tokens, which leaves no room for a completion. Please reduce the length of "
                f"the {what}.", param=what, code="context_length_exceeded")
        if max_tokens is None:
            return max(1, min(limit - prompt_len, (self.pool_tokens - prompt_len) // max(1, n)))
        if isinstance(max_tokens, int) and max_tokens >= 1 and prompt_len + max_tokens > limit:
            raise bad_request(
                f"This model's maximum context length is {limit} tokens. However, you requested "
                f"{prompt_len + max_tokens} tokens ({prompt_len} in the {what}, {max_tokens} in the "
                f"completion). Please reduce the length of the {what} or completion.",
                param="max_tokens", code="context_length_exceeded")
        return max_tokens

    async def structured_outputs(self, req: SamplingFields, forced: StructuredOutputsParams | None = None,
                                 forced_by: str = "") -> StructuredOutputsParams | None:
        """The request's structured-output constraint (or `forced`, the one `forced_by` implies),
        its grammar compiled off the event loop and off the engine's loop; a 400 naming the field
        if it is not valid."""
        spec, field = parse_structured_outputs(req)
        if forced is not None:
            if spec is not None:
                raise bad_request(f"{field} cannot be combined with {forced_by}: both constrain the reply",
                                  param=field)
            spec, field = forced, forced_by
        if spec is not None:
            try:
                await self.engine.compile_grammar(spec)
            except ValueError as e:
                spelled = {"structured_outputs": f"structured_outputs.{spec.kind}",
                           "response_format": "response_format.json_schema.schema"}.get(field, field)
                raise bad_request(str(e).replace(f"structured_outputs.{spec.kind}", spelled), param=field) from None
        return spec

    @staticmethod
    def sampling_params(req: SamplingFields, *, max_tokens: int, logprobs: int | None,
                        best_of: int | None = None, prompt_logprobs: int | None = None,
                        structured: StructuredOutputsParams | None = None,
                        reasoning_budget: ReasoningBudget | None = None,
                        reasoning_section: ReasoningSection | None = None) -> SamplingParams:
        # A field sent as null means its default, as in OpenAI's API.
        shared = {name: getattr(req, name) for name in OPENAI_FIELDS if getattr(req, name) is not None}
        try:
            return SamplingParams(n=req.n, best_of=best_of, max_tokens=max_tokens, logprobs=logprobs,
                                  prompt_logprobs=prompt_logprobs, logit_bias=token_bias(req.logit_bias),
                                  structured_outputs=structured, reasoning_budget=reasoning_budget,
                                  reasoning_section=reasoning_section, **shared)
        except (ValueError, TypeError) as e:
            raise bad_request(str(e)) from None

    @staticmethod
    def beam_search_params(req: SamplingFields, max_tokens: int) -> BeamSearchParams:
        """use_beam_search: n beams, max_tokens, ignore_eos and length_penalty. Anything else that
        shapes sampling was sent for nothing (beam search samples nothing): a 400 names it."""
        if req.stream:
            raise bad_request("use_beam_search is not available when streaming; send stream: false",
                              param="use_beam_search")
        sent = {name for name in req.model_fields_set if getattr(req, name, None) is not None}
        for name in sorted(sent & BEAM_SEARCH_CONFLICTS):
            if getattr(req, name) not in (False, []):
                raise bad_request(f"{name} cannot be combined with use_beam_search: beam search keeps the n "
                                  f"most likely continuations and samples nothing (it takes n, max_tokens, "
                                  f"ignore_eos and length_penalty)", param=name)
        try:
            return BeamSearchParams(beam_width=req.n, max_tokens=max_tokens, length_penalty=req.length_penalty,
                                    ignore_eos=bool(req.ignore_eos))
        except ValueError as e:
            raise bad_request(str(e), param="n") from None

    def parse_prompts(self, prompt, field: str = "prompt",
                      add_special_tokens: bool = True) -> list[tuple[str | None, list[int]]]:
        """(text or None, token ids) of each prompt in an OpenAI prompt field (`prompt`, `input`): a
        string, a list of token ids, or a list of either; an empty one is a 400 naming `field`."""
        if isinstance(prompt, str):
            items = [prompt]
        elif prompt and all(isinstance(t, int) for t in prompt):
            items = [prompt]
        else:
            items = list(prompt)
        if not items:
            raise bad_request(f"{field} must not be empty", param=field)
        out = []
        for item in items:
            if isinstance(item, str):
                check_request_text(field, item)
                out.append((item, self.tokenizer.encode(item, add_special_tokens=add_special_tokens) if item else []))
            else:
                out.append((None, list(item)))
            if not out[-1][1]:
                raise bad_request(f"{field} must not be empty", param=field)
        return out

    @staticmethod
    def truncate(ids: list[int], keep: int | None) -> list[int]:
        """vLLM's truncate_prompt_tokens: only the prompt's last `keep` tokens (None: all)."""
        if keep is None:
            return ids
        if isinstance(keep, bool) or not isinstance(keep, int) or keep < 1:
            raise bad_request(f"truncate_prompt_tokens must be an integer >= 1, got {keep!r}",
                              param="truncate_prompt_tokens")
        return ids[-keep:]

    @staticmethod
    def check_logprobs(value: int | None, name: str) -> None:
        if value is not None and not 0 <= value <= MAX_LOGPROBS:
            raise bad_request(f"{name} must be in [0, {MAX_LOGPROBS}], got {value}", param=name)

    # ---- engine plumbing -------------------------------------------------------------------
    async def add_requests(self, base_id: str, prompts: list[tuple[str | None, list[int]]],
                           params: list[SamplingParams | BeamSearchParams]) -> list[RequestStream]:
        """Add every prompt (as `<base_id>-<i>`); if any is refused, none stays."""
        tasks = [asyncio.ensure_future(self.engine.add_request(
                     f"{base_id}-{i}", {"prompt": text, "prompt_token_ids": ids}, p))
                 for i, ((text, ids), p) in enumerate(zip(prompts, params))]
        results = await asyncio.gather(*tasks, return_exceptions=True)
        streams = [r for r in results if not isinstance(r, BaseException)]  # RequestStream, or a replica's
        self._fail_together(results, streams)
        return streams

    @staticmethod
    async def last_output(stream: RequestStream) -> RequestOutput:
        final = None
        async with stream:
            async for out in stream:
                final = out
        assert final is not None and final.finished
        return final

    async def collect(self, raw_request: Request, streams: list[RequestStream]) -> list[RequestOutput]:
        """The final output of each stream; aborts them all if the client disconnects or one fails."""
        try:
            results = await until_disconnected(raw_request, asyncio.gather(
                *(self.last_output(s) for s in streams), return_exceptions=True))
        except BaseException:
            for s in streams:
                s.abort()
            raise
        self._fail_together(results, streams)
        return results

    @staticmethod
    def _fail_together(results: list, streams: list[RequestStream]) -> None:
        """If any result is an exception, abort every stream and raise the first one (as an API
        error where it maps to one)."""
        failure = next((r for r in results if isinstance(r, BaseException)), None)
        if failure is not None:
            for s in streams:
                s.abort()
            raise engine_error(failure) or failure

    # ---- shapes ----------------------------------------------------------------------------
    def token_text(self, token_id: int, lp: Logprob | None) -> str:
        if lp is not None and lp.decoded_token is not None:
            return lp.decoded_token
        return self.tokenizer.decode([token_id], skip_special_tokens=False)

    def completion_logprobs(self, token_ids: list[int], logprobs: list[dict[int, Logprob]], num_top: int,
                            text_offset: int) -> dict:
        """The legacy completions shape: tokens, token_logprobs, top_logprobs, text_offset."""
        tokens, token_lps, tops, offsets = [], [], [], []
        for tid, entry in zip(token_ids, logprobs):
            if entry is None:  # an echoed prompt's first token: nothing precedes it, no logprob
                text = self.token_text(tid, None)
                tokens.append(text)
                token_lps.append(None)
                tops.append(None)
                offsets.append(text_offset)
                text_offset += len(text)
                continue
            lp = entry.get(tid)
            text = self.token_text(tid, lp)
            tokens.append(text)
            token_lps.append(max(lp.logprob, -9999.0) if lp is not None else None)
            top = {}
            for other_id, other in sorted(entry.items(), key=lambda kv: -kv[1].logprob)[:max(num_top, 1)]:
                top[self.token_text(other_id, other)] = max(other.logprob, -9999.0)
            if lp is not None:  # vLLM lists the sampled token among the top ones too
                top.setdefault(text, max(lp.logprob, -9999.0))
            tops.append(top)
            offsets.append(text_offset)
            text_offset += len(text)
        return {"tokens": tokens, "token_logprobs": token_lps, "top_logprobs": tops, "text_offset": offsets}

    def chat_logprobs(self, token_ids: list[int], logprobs: list[dict[int, Logprob]], num_top: int) -> dict:
        """The chat shape: {"content": [{token, logprob, bytes, top_logprobs: [...]}]}."""
        def item(tid: int, lp: Logprob | None, value: float | None) -> dict:
            text = self.token_text(tid, lp)
            return {"token": text, "logprob": max(value, -9999.0) if value is not None else -9999.0,
                    "bytes": list(text.encode("utf-8", errors="replace"))}

        content = []
        for tid, entry in zip(token_ids, logprobs):
            lp = entry.get(tid)
            top = sorted(entry.items(), key=lambda kv: -kv[1].logprob)[:num_top]
            content.append({**item(tid, lp, lp.logprob if lp else None),
                            "top_logprobs": [item(t, other, other.logprob) for t, other in top]})
        return {"content": content}

    @staticmethod
    def prompt_logprobs_json(prompt_logprobs: list | None) -> list | None:
        """RequestOutput.prompt_logprobs as vLLM's server shows them: per prompt token, None or
        {token id (a string): {logprob, rank, decoded_token}}."""
        if prompt_logprobs is None:
            return None
        return [None if entry is None else
                {str(tid): {"logprob": max(lp.logprob, -9999.0), "rank": lp.rank, "decoded_token": lp.decoded_token}
                 for tid, lp in entry.items()}
                for entry in prompt_logprobs]

    @staticmethod
    def usage(prompt_tokens: int, completion_tokens: int, cached_tokens: int) -> dict:
        return {"prompt_tokens": prompt_tokens, "total_tokens": prompt_tokens + completion_tokens,
                "completion_tokens": completion_tokens, "prompt_tokens_details": {"cached_tokens": cached_tokens}}

    @staticmethod
    def now() -> int:
        return int(time.time())


async def wait_for_disconnect(raw_request: Request) -> None:
    """Returns when the client has gone away (the body has been read already)."""
    while True:
        message = await raw_request.receive()
        if message["type"] == "http.disconnect":
            return


async def until_disconnected(raw_request: Request, work: Awaitable[T]) -> T:
    """Await `work`, unless the client disconnects first: then cancel it, raise ClientDisconnected."""
    task = asyncio.ensure_future(work)
    watcher = asyncio.ensure_future(wait_for_disconnect(raw_request))
    try:
        await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
    except BaseException:  # this handler itself was cancelled
        task.cancel()
        raise
    finally:
        watcher.cancel()
    if task.done():
        return task.result()
    task.cancel()
    with contextlib.suppress(BaseException):
        await task
    raise ClientDisconnected()


_END = object()


async def guarded_sse(events: AsyncIterator[str], streams: list[RequestStream], *,
                      error_event: Callable[[OpenAIError], str] = OpenAIError.sse,
                      done: str | None = SSE_DONE) -> AsyncIterator[str]:
    """An SSE body as sent: `events`, then `done` (OpenAI's `[DONE]`; None: nothing). An engine
    failure ends the events with `error_event(error)` (anything else propagates); the streams
    are aborted however it ends, so a client that went away frees its requests' blocks at once."""
    try:
        async for event in events:
            yield event
    except Exception as e:
        error = engine_error(e)
        if error is None:
            raise
        yield error_event(error)
    finally:
        await events.aclose()
        for s in streams:
            s.abort()
    if done is not None:
        yield done


async def merge_streams(streams: list[RequestStream]) -> AsyncIterator[tuple[int, RequestOutput]]:
    """Outputs of several streams as they come, tagged with the stream's index. The pumps wait
    while the merged queue is full, so a consumer that stops leaves the outputs in the streams,
    whose bound (max_stream_buffer) then aborts them."""
    if len(streams) == 1:
        async for out in streams[0]:
            yield 0, out
        return
    merged: asyncio.Queue = asyncio.Queue(maxsize=len(streams))

    async def pump(i: int, stream: RequestStream) -> None:
        try:
            async for out in stream:
                await merged.put((i, out))
            end = _END
        except Exception as e:
            end = e
        await merged.put((i, end))  # not on cancellation: then the consumer is gone

    tasks = [asyncio.ensure_future(pump(i, s)) for i, s in enumerate(streams)]
    try:
        remaining = len(streams)
        while remaining:
            i, item = await merged.get()
            if item is _END:
                remaining -= 1
            elif isinstance(item, BaseException):
                raise item
            else:
                yield i, item
    finally:
        for t in tasks:
            t.cancel()
        for s in streams:
            s.abort()
