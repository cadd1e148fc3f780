"""Ollama's API: /api/chat and /api/generate as an adapter onto the chat endpoint's path
(protocol.chat_request; a raw generate onto the completions path), their replies put back into
Ollama's shape (message.thinking, message.tool_calls with arguments as objects, done_reason,
durations in nanoseconds) and streamed as NDJSON, one object a line; and the model listing
endpoints (/api/tags, /api/show, /api/ps, /api/version) for the one served model."""
from __future__ import annotations

import json
import os
import re
import time
from collections.abc import AsyncIterator
from datetime import datetime, timezone

from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse

from pagellm.entrypoints.ollama.protocol import (OPTIONS, ChatRequest, EmbedRequest, GenerateRequest,
                                                 LegacyEmbeddingsRequest, ShowRequest, chat_request, check_fields,
                                                 raw_request, renamed, sampling)
from pagellm.entrypoints.openai.errors import OpenAIError, bad_request
from pagellm.entrypoints.openai.protocol import EmbeddingRequest
from pagellm.entrypoints.openai.serving_chat import ChatRun, OpenAIServingChat
from pagellm.entrypoints.openai.serving_embedding import OpenAIServingEmbedding
from pagellm.entrypoints.openai.serving_engine import guarded_sse, merge_streams, random_id
from pagellm.entrypoints.openai.tool_calls import ToolPlan
from pagellm.outputs import RequestOutput

# The Ollama release whose API this adapter follows (its clients read /api/version to decide
# which fields they may send).
OLLAMA_API_VERSION = "0.12.0"


def now() -> str:
    return datetime.now(timezone.utc).isoformat().replace("+00:00", "Z")


def _ns(seconds: float) -> int:
    return max(0, int(seconds * 1e9))


def stats(out: RequestOutput, started: float) -> dict:
    """Ollama's counts and durations (nanoseconds): prompt_eval is the prefill, to the first token."""
    m = out.metrics
    first = m.first_token_time or m.arrival_time
    end = m.finished_time or time.time()
    return {"total_duration": _ns(time.time() - started), "load_duration": 0,
            "prompt_eval_count": len(out.prompt_token_ids), "prompt_eval_duration": _ns(first - m.arrival_time),
            "eval_count": len(out.outputs[0].token_ids), "eval_duration": _ns(end - first)}


def tool_calls(calls: list[dict]) -> list[dict]:
    """Chat tool calls in Ollama's shape: arguments as an object, not JSON text."""
    out = []
    for call in calls:
        fn = call["function"]
        try:
            args = json.loads(fn["arguments"])
        except json.JSONDecodeError:
            args = fn["arguments"]  # the model's text as it wrote it; never dropped
        out.append({"function": {"name": fn["name"], "arguments": args}})
    return out


def _disk_size(path: str) -> int:
    if os.path.isdir(path):
        return sum(os.path.getsize(os.path.join(root, f)) for root, _, files in os.walk(path) for f in files)
    return os.path.getsize(path) if os.path.exists(path) else 0


def _describe(engine) -> dict:
    """What /api/show and /api/tags say about the model, read on the engine's side (a replica's too)."""
    arch = engine.arch
    return {"architecture": arch.architecture, "hidden_size": arch.hidden_size, "layers": arch.num_hidden_layers,
            "heads": arch.num_attention_heads, "kv_heads": arch.num_key_value_heads, "vocab_size": arch.vocab_size,
            "device": str(engine.device)}


class OllamaServing:
    def __init__(self, chat: OpenAIServingChat, embeddings: OpenAIServingEmbedding) -> None:
        self.chat = chat
        self.embeddings = embeddings
        self._card: dict | None = None

    # ---- generation --------------------------------------------------------------------------
    def check_model(self, model: str) -> None:
        # Ollama's names carry a tag; the one served model is its own latest.
        self.chat.check_model(model.removesuffix(":latest"))

    async def create_chat(self, req: ChatRequest, raw_request: Request) -> Response:
        started = time.time()
        self.check_model(req.model)
        if not req.messages:  # Ollama's way to load a model: nothing to say
            return JSONResponse({"model": req.model, "created_at": now(),
                                 "message": {"role": "assistant", "content": ""}, "done": True, "done_reason": "load"})
        run = await self._start_chat(req)
        return await self._answer(req, run, raw_request, started, chat=True)

    async def embed(self, req: EmbedRequest, raw_request: Request) -> dict:
        """/api/embed onto /v1/embeddings: one vector per input. `truncate` keeps an over-long
        input's last max_model_len tokens (the embeddings endpoint's truncate_prompt_tokens)."""
        started = time.time()
        result = await self.embeddings.create_embedding(self._embedding_request(req, req.input, req.truncate,
                                                                                req.dimensions), raw_request)
        return {"model": req.model, "embeddings": [d["embedding"] for d in result["data"]],
                "total_duration": _ns(time.time() - started), "load_duration": 0,
                "prompt_eval_count": result["usage"]["prompt_tokens"]}

    async def legacy_embeddings(self, req: LegacyEmbeddingsRequest, raw_request: Request) -> dict:
        """/api/embeddings: one prompt, one `embedding`."""
        result = await self.embeddings.create_embedding(self._embedding_request(req, req.prompt, True, None),
                                                        raw_request)
        return {"embedding": result["data"][0]["embedding"]}

    def _embedding_request(self, req: EmbedRequest | LegacyEmbeddingsRequest, texts: str | list[str],
                           truncate: bool, dimensions: int | None) -> EmbeddingRequest:
        """The embeddings endpoint's request for an Ollama one, its fields and options checked: an
        embedding samples nothing, so a sampling option is refused rather than ignored (num_ctx is
        checked against the context as on the other routes)."""
        self.check_model(req.model)
        check_fields(req)
        sampling(req.options, self.chat.max_model_len)  # unknown options and num_ctx, as on /api/chat
        for name, value in sorted((req.options or {}).items()):
            if name in OPTIONS and value is not None:
                raise bad_request(f"options.{name} is not supported on an embedding: nothing is sampled",
                                  param=f"options.{name}")
        return EmbeddingRequest(input=texts, dimensions=dimensions,
                                truncate_prompt_tokens=self.chat.max_model_len if truncate else None)

    async def generate(self, req: GenerateRequest, raw_request: Request) -> Response:
        started = time.time()
        self.check_model(req.model)
        if not req.prompt:  # Ollama's way to load a model
            return JSONResponse({"model": req.model, "created_at": now(), "response": "", "done": True,
                                 "done_reason": "load"})
        run = await (self._start_raw(req) if req.raw else self._start_chat(req))
        return await self._answer(req, run, raw_request, started, chat=False)

    async def _start_chat(self, req: ChatRequest | GenerateRequest) -> ChatRun:
        chat = self.chat
        try:
            chat_req = chat_request(req, chat.tokenizer.chat_template, chat.reasoning is not None, chat.max_model_len,
                                    chat.tool_call_parser)
            chat_req.model = None  # checked above, with its tag
            return await chat.start(chat_req, id_prefix="ollama")
        except OpenAIError as e:
            raise renamed(e) from None

    async def _start_raw(self, req: GenerateRequest) -> ChatRun:
        """A raw prompt: tokenized as it is and run as a completion."""
        chat = self.chat
        try:
            creq = raw_request(req, chat.max_model_len)
            chat.check_common(creq)
            ids = chat.tokenizer.encode(creq.prompt)
            max_tokens = chat.resolve_max_tokens(len(ids), creq.max_tokens, 1, "prompt")
            structured = await chat.structured_outputs(creq)
            params = chat.sampling_params(creq, max_tokens=max_tokens, logprobs=None, structured=structured)
        except OpenAIError as e:
            raise renamed(e) from None
        request_id = random_id("ollama")
        streams = await chat.add_requests(request_id, [(creq.prompt, ids)], [params])
        return ChatRun(request_id, streams, ToolPlan("none"), None, len(ids))

    async def _answer(self, req: ChatRequest | GenerateRequest, run: ChatRun, raw_request: Request, started: float,
                      chat: bool) -> Response:
        if req.stream:
            return StreamingResponse(guarded_sse(self.lines(req, run, started, chat), run.streams,
                                                 error_event=OpenAIError.ollama_line, done=None),
                                     media_type="application/x-ndjson")
        (final,) = await self.chat.collect(raw_request, run.streams)
        (c,) = final.outputs
        reply, _ = self.chat.reply(run.tools, c.text, c.finish_reason, run.thinking)
        delta = {k: v for k, v in reply.items() if k != "role" and v}
        body = self.chunk(req, delta, chat)
        body.update(done=True, done_reason=c.finish_reason, **stats(final, started))
        return JSONResponse(body)

    def chunk(self, req: ChatRequest | GenerateRequest, delta: dict, chat: bool) -> dict:
        """One object of the reply: a chat message or a generate response, from an OpenAI-shaped delta."""
        body: dict = {"model": req.model, "created_at": now()}
        if chat:
            message = {"role": "assistant", "content": delta.get("content") or ""}
            if delta.get("reasoning_content"):
                message["thinking"] = delta["reasoning_content"]
            if delta.get("tool_calls"):
                message["tool_calls"] = tool_calls(delta["tool_calls"])
            body["message"] = message
        else:
            body["response"] = delta.get("content") or ""
            if delta.get("reasoning_content"):
                body["thinking"] = delta["reasoning_content"]
        body["done"] = False
        return body

    async def lines(self, req: ChatRequest | GenerateRequest, run: ChatRun, started: float,
                    chat: bool) -> AsyncIterator[str]:
        """NDJSON: a line per delta, then the done line with the reason and the durations."""
        deltas = self.chat.choice_deltas(run.tools, run.thinking)
        async for _, out in merge_streams(run.streams):
            (c,) = out.outputs
            finished = c.finish_reason is not None
            delta, _ = deltas.advance(c.text, finished, c.finish_reason)
            if delta:
                yield json.dumps(self.chunk(req, delta, chat), ensure_ascii=False) + "\n"
            if finished:
                last = self.chunk(req, {}, chat)
                last.update(done=True, done_reason=c.finish_reason, **stats(out, started))
                yield json.dumps(last, ensure_ascii=False) + "\n"
                return

    # ---- the model ---------------------------------------------------------------------------
    async def card(self) -> dict:
        """The served model as Ollama describes one (read once: it does not change)."""
        if self._card is None:
            engine = self.chat.engine
            info = await engine.call(_describe)
            path = engine.model_path
            quant = re.search(r"[.-](I?Q\d\w*|F16|F32|BF16)\.gguf$", path, flags=re.IGNORECASE)
            details = {"parent_model": "", "format": "gguf" if path.lower().endswith(".gguf") else "safetensors",
                       "family": info["architecture"], "families": [info["architecture"]], "parameter_size": "",
                       "quantization_level": quant.group(1).upper() if quant else ""}
            modified = os.path.getmtime(path) if os.path.exists(path) else time.time()
            self._card = {"info": info, "details": details, "size": _disk_size(path),
                          "modified_at": datetime.fromtimestamp(modified, timezone.utc).isoformat()}
        return self._card

    async def tags(self) -> dict:
        card = await self.card()
        return {"models": [{"name": name, "model": name, "modified_at": card["modified_at"], "size": card["size"],
                            "details": card["details"]} for name in self.chat.served_model_names]}

    async def ps(self) -> dict:
        card = await self.card()
        on_gpu = card["info"]["device"].startswith("cuda")
        return {"models": [{"name": name, "model": name, "size": card["size"],
                            "size_vram": card["size"] if on_gpu else 0, "details": card["details"],
                            "context_length": self.chat.max_model_len} for name in self.chat.served_model_names]}

    async def show(self, req: ShowRequest) -> dict:
        check_fields(req)
        name = req.model or req.name
        if not name:
            raise bad_request("model is required", param="model")
        if req.verbose:
            raise bad_request("verbose is not supported: the tokenizer's vocabulary is not listed", param="verbose")
        self.check_model(name)
        card = await self.card()
        info = card["info"]
        arch = info["architecture"]
        capabilities = ["completion"] + (["tools"] if self.chat.tool_call_parser else []) + \
            (["thinking"] if self.chat.reasoning is not None else [])
        return {"modelfile": f"FROM {self.chat.engine.model_path}\n", "parameters": "",
                "template": self.chat.tokenizer.chat_template or "", "details": card["details"],
                "model_info": {"general.architecture": arch, f"{arch}.context_length": self.chat.max_model_len,
                               f"{arch}.embedding_length": info["hidden_size"], f"{arch}.block_count": info["layers"],
                               f"{arch}.attention.head_count": info["heads"],
                               f"{arch}.attention.head_count_kv": info["kv_heads"],
                               f"{arch}.vocab_size": info["vocab_size"]},
                "capabilities": capabilities, "modified_at": card["modified_at"]}

    @staticmethod
    def version() -> dict:
        return {"version": OLLAMA_API_VERSION}
