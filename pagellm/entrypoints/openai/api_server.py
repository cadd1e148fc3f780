"""The FastAPI app: routes, error handlers, middleware, and `run_server` for `pagellm serve`."""
from __future__ import annotations

import argparse
import asyncio
import contextlib
import logging
import os
import re
import socket
import time
from dataclasses import dataclass

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.responses import Response

from pagellm.engine.async_engine import AsyncLLMEngine
from pagellm.entrypoints.anthropic.protocol import CountTokensRequest, MessagesRequest
from pagellm.entrypoints.anthropic.serving_messages import AnthropicServingMessages
from pagellm.entrypoints.ollama.protocol import ChatRequest as OllamaChatRequest
from pagellm.entrypoints.ollama.protocol import EmbedRequest as OllamaEmbedRequest
from pagellm.entrypoints.ollama.protocol import LegacyEmbeddingsRequest as OllamaLegacyEmbeddingsRequest
from pagellm.entrypoints.ollama.protocol import GenerateRequest as OllamaGenerateRequest
from pagellm.entrypoints.ollama.protocol import ShowRequest as OllamaShowRequest
from pagellm.entrypoints.ollama.serving_ollama import OllamaServing
from pagellm.entrypoints.openai import dashboard
from pagellm.entrypoints.openai.errors import OpenAIError, bad_request, check_request_text, validation_error
from pagellm.entrypoints.openai.metrics import ServerMetrics
from pagellm.entrypoints.openai.middleware import APIKeyMiddleware, APIRequestCountMiddleware, BodyLimitMiddleware
from pagellm.entrypoints.openai.protocol import (ChatCompletionRequest, CompletionRequest, DetokenizeRequest,
                                                 EmbeddingRequest, RerankRequest, ScoreRequest, TokenizeRequest)
from pagellm.entrypoints.openai.serving_chat import OpenAIServingChat
from pagellm.entrypoints.openai.serving_completion import OpenAIServingCompletion
from pagellm.entrypoints.openai.serving_embedding import OpenAIServingEmbedding
from pagellm.entrypoints.openai.serving_engine import ClientDisconnected
from pagellm.entrypoints.openai.serving_score import OpenAIServingScore
from pagellm.entrypoints.openai.shutdown import Drain, DrainingServer, DrainMiddleware
from pagellm.entrypoints.responses.protocol import ResponsesRequest
from pagellm.entrypoints.responses.serving_responses import OpenAIServingResponses
from pagellm.version import __version__

logger = logging.getLogger("pagellm.server")

SOCKET_SEND_BUFFER = 256 << 10  # bytes a connection's socket holds unsent (the kernel doubles it)


@dataclass
class ServerConfig:
    served_model_names: list[str]
    api_key: str | None = None
    max_request_body_bytes: int = 4 << 20
    # n and best_of above this are refused (None: only the engine's max_num_seqs bounds them).
    max_seqs_per_request: int | None = None
    # --enable-auto-tool-choice's --tool-call-parser (None: tool_choice "auto" is refused).
    tool_call_parser: str | None = None
    # --reasoning-parser, `auto` resolved from the chat template (None: replies are not split).
    reasoning_parser: str | None = None
    # structured_outputs_config's enable_in_reasoning: a grammar covers the reasoning too (False: it
    # starts where the answer starts).
    grammar_in_reasoning: bool = False
    # --classifier-from-token (None: /score and /rerank are cosines of embeddings).
    classifier_from_token: list[str] | None = None


def default_model_name(model_path: str) -> str:
    """`.../SmolLM2-135M-Instruct.Q4_1.gguf` -> `SmolLM2-135M-Instruct`; a directory -> its name."""
    name = os.path.basename(os.path.normpath(model_path))
    name = re.sub(r"\.gguf$", "", name, flags=re.IGNORECASE)
    name = re.sub(r"[.-](I?Q\d\w*|F16|F32|BF16)$", "", name, flags=re.IGNORECASE)
    return name or "model"


def build_app(engine: AsyncLLMEngine, metrics: ServerMetrics, config: ServerConfig,
              drain: Drain | None = None) -> FastAPI:
    """The app around an engine that is not started yet; the app's lifespan starts and stops it.
    `drain`: the graceful shutdown that `run_server` drives from its signals (shutdown.py)."""
    model_name = config.served_model_names[0]
    completions = OpenAIServingCompletion(engine, config.served_model_names, config.max_seqs_per_request)
    chat = OpenAIServingChat(engine, config.served_model_names, config.max_seqs_per_request,
                             tool_call_parser=config.tool_call_parser, reasoning_parser=config.reasoning_parser,
                             grammar_in_reasoning=config.grammar_in_reasoning)
    messages = AnthropicServingMessages(chat)
    embeddings = OpenAIServingEmbedding(engine, config.served_model_names)
    scores = OpenAIServingScore(embeddings, config.classifier_from_token)
    responses = OpenAIServingResponses(chat)
    ollama = OllamaServing(chat, embeddings)
    created = int(time.time())

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI):
        engine.start()
        draining = asyncio.create_task(drain.run(engine)) if drain is not None else None
        try:
            yield
        finally:
            if draining is not None:
                draining.cancel()
            await engine.shutdown()
            engine.close()  # the engine's own resources: its KV tier's file, tensor-parallel ranks, replicas

    app = FastAPI(title="pagellm", version=__version__, lifespan=lifespan)

    @app.exception_handler(OpenAIError)
    async def openai_error(request: Request, e: OpenAIError) -> Response:
        return e.response_for(request.url.path)

    @app.exception_handler(RequestValidationError)
    async def invalid_body(request: Request, e: RequestValidationError) -> Response:
        # FastAPI answers 422; OpenAI (and vLLM) answer 400 for a malformed body.
        return validation_error(list(e.errors()), getattr(e, "body", None)).response_for(request.url.path)

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request: Request, e: StarletteHTTPException) -> Response:
        return OpenAIError(e.status_code, str(e.detail),
                           headers=getattr(e, "headers", None)).response_for(request.url.path)

    @app.exception_handler(ClientDisconnected)
    async def client_gone(_: Request, e: ClientDisconnected) -> Response:
        return Response(status_code=499)  # nobody is listening; nginx's "client closed request"

    @app.exception_handler(Exception)
    async def internal_error(request: Request, e: Exception) -> Response:
        logger.exception("internal error")
        return OpenAIError(500, f"Internal server error: {type(e).__name__}: {e}",
                           code="internal_error").response_for(request.url.path)

    @app.get("/health")
    async def health() -> Response:
        if not engine.is_running:
            error = engine.dead_error
            raise OpenAIError(503, f"the engine is not running{f': {error!r}' if error else ''}",
                              code="engine_unavailable")
        replicas = engine.stats().replicas
        if replicas is not None:  # --data-parallel-size: which replicas serve
            from fastapi.responses import JSONResponse

            return JSONResponse({"replicas": [{"replica": r.replica, "alive": r.alive, "pid": r.pid,
                                               "in_flight": r.in_flight} for r in replicas]})
        return Response(status_code=200)

    @app.get("/version")
    async def version() -> dict:
        return {"version": __version__}

    @app.get("/v1/models")
    async def models() -> dict:
        return {"object": "list", "data": [
            {"id": name, "object": "model", "created": created, "owned_by": "pagellm", "root": engine.model_path,
             "parent": None, "max_model_len": engine.max_model_len, "permission": []}
            for name in config.served_model_names]}

    @app.post("/v1/completions")
    async def create_completion(req: CompletionRequest, raw_request: Request) -> Response:
        return await completions.create_completion(req, raw_request)

    @app.post("/v1/chat/completions")
    async def create_chat_completion(req: ChatCompletionRequest, raw_request: Request) -> Response:
        return await chat.create_chat_completion(req, raw_request)

    @app.post("/v1/embeddings")
    async def create_embedding(req: EmbeddingRequest, raw_request: Request) -> dict:
        return await embeddings.create_embedding(req, raw_request)

    @app.post("/v1/score")
    @app.post("/score")
    async def create_score(req: ScoreRequest, raw_request: Request) -> dict:
        return await scores.create_score(req, raw_request)

    @app.post("/v1/rerank")
    @app.post("/v2/rerank")
    @app.post("/rerank")
    async def create_rerank(req: RerankRequest, raw_request: Request) -> dict:
        return await scores.create_rerank(req, raw_request)

    @app.post("/v1/messages")
    async def create_message(req: MessagesRequest, raw_request: Request) -> Response:
        return await messages.create_message(req, raw_request)

    @app.post("/v1/messages/count_tokens")
    async def count_message_tokens(req: CountTokensRequest) -> dict:
        return messages.count_tokens(req)

    @app.post("/v1/responses")
    async def create_response(req: ResponsesRequest, raw_request: Request) -> Response:
        return await responses.create_response(req, raw_request)

    @app.get("/v1/responses/{response_id}")
    async def retrieve_response(response_id: str) -> dict:
        return responses.retrieve(response_id)

    @app.delete("/v1/responses/{response_id}")
    async def delete_response(response_id: str) -> dict:
        return responses.delete(response_id)

    # Ollama's API: /api/..., errors in its shape ({"error": message}).
    @app.post("/api/chat")
    async def ollama_chat(req: OllamaChatRequest, raw_request: Request) -> Response:
        return await ollama.create_chat(req, raw_request)

    @app.post("/api/generate")
    async def ollama_generate(req: OllamaGenerateRequest, raw_request: Request) -> Response:
        return await ollama.generate(req, raw_request)

    @app.get("/api/tags")
    async def ollama_tags() -> dict:
        return await ollama.tags()

    @app.get("/api/ps")
    async def ollama_ps() -> dict:
        return await ollama.ps()

    @app.post("/api/show")
    async def ollama_show(req: OllamaShowRequest) -> dict:
        return await ollama.show(req)

    @app.get("/api/version")
    async def ollama_version() -> dict:
        return ollama.version()

    @app.post("/api/embed")
    async def ollama_embed(req: OllamaEmbedRequest, raw_request: Request) -> dict:
        return await ollama.embed(req, raw_request)

    @app.post("/api/embeddings")
    async def ollama_legacy_embeddings(req: OllamaLegacyEmbeddingsRequest, raw_request: Request) -> dict:
        return await ollama.legacy_embeddings(req, raw_request)

    @app.post("/api/pull")
    @app.post("/api/push")
    @app.post("/api/create")
    @app.post("/api/copy")
    @app.delete("/api/delete")
    async def ollama_manage(raw_request: Request) -> Response:
        raise OpenAIError(501, f"{raw_request.url.path} is not supported: pagellm serves the one model it was "
                               f"started with ({model_name}); it pulls, creates and deletes no models",
                          code="not_implemented")

    @app.post("/tokenize")
    async def tokenize(req: TokenizeRequest) -> dict:
        completions.check_model(req.model)
        if (req.prompt is None) == (req.messages is None):
            raise bad_request("give exactly one of prompt and messages", param="prompt")
        if req.messages is not None:
            ids = chat.render(req.messages, req.add_generation_prompt,
                              continue_final_message=req.continue_final_message)
        else:
            check_request_text("prompt", req.prompt)
            ids = engine.tokenizer.encode(req.prompt, add_special_tokens=req.add_special_tokens) if req.prompt else []
        strs = [engine.tokenizer.id_to_token(i) for i in ids] if req.return_token_strs else None
        return {"count": len(ids), "max_model_len": engine.max_model_len, "tokens": ids, "token_strs": strs}

    @app.post("/detokenize")
    async def detokenize(req: DetokenizeRequest) -> dict:
        completions.check_model(req.model)
        vocab = engine.tokenizer.vocab_size
        bad = next((t for t in req.tokens if not 0 <= t < vocab), None)
        if bad is not None:
            raise bad_request(f"tokens contains {bad}, outside the vocabulary [0, {vocab})", param="tokens")
        # Special tokens stay (as vLLM's /detokenize): the ids of a rendered chat template round-trip.
        return {"prompt": engine.tokenizer.decode(req.tokens, skip_special_tokens=False)}

    @app.get("/metrics")
    async def prometheus_metrics() -> Response:
        from prometheus_client import CONTENT_TYPE_LATEST

        return Response(metrics.render(), media_type=CONTENT_TYPE_LATEST)

    dashboard.register(app, engine, metrics, model_name)

    # Outermost first: the key is checked before a large body is read.
    app.add_middleware(BodyLimitMiddleware, max_bytes=config.max_request_body_bytes)
    if config.api_key:
        app.add_middleware(APIKeyMiddleware, api_key=config.api_key)
    if drain is not None:  # a draining server refuses before anything else
        app.add_middleware(DrainMiddleware, drain=drain)
    # Outermost of all, so that every answer is counted: a refused key, a draining server's 503.
    app.add_middleware(APIRequestCountMiddleware, count=metrics.count_api_request)
    return app


def build_server(args: argparse.Namespace, drain: Drain | None = None) -> tuple[FastAPI, AsyncLLMEngine, ServerConfig]:
    from pagellm.config import EngineConfig, engine_kwargs

    if args.data_parallel_size > 1:
        engine, metrics, names = _replica_server(args)
    else:
        # Loaded on the engine's own thread, which then steps it (async_engine.py says why).
        engine = AsyncLLMEngine.from_config(EngineConfig(**engine_kwargs(args)),
                                            max_waiting_requests=args.max_waiting_requests,
                                            max_stream_buffer=args.max_stream_buffer)
        llm_engine = engine.engine
        names = args.served_model_name or [default_model_name(llm_engine.model_path)]
        metrics = ServerMetrics(names[0], max_model_len=llm_engine.max_model_len,
                                max_num_batched_tokens=llm_engine.config.max_num_batched_tokens,
                                cache_info=llm_engine.cache_config(), model_cost=llm_engine.model_cost())
        engine.observer = metrics
    metrics.bind(engine.stats)
    per_request = args.max_seqs_per_request or max(1, args.max_num_seqs // 2)
    config = ServerConfig(served_model_names=names, api_key=args.api_key,
                          max_request_body_bytes=args.max_request_body_bytes,
                          max_seqs_per_request=min(per_request, args.max_num_seqs),
                          tool_call_parser=args.tool_call_parser if args.enable_auto_tool_choice else None,
                          reasoning_parser=resolve_reasoning_parser(args.reasoning_parser,
                                                                    engine.tokenizer.chat_template),
                          grammar_in_reasoning=bool((args.structured_outputs_config or {}).get("enable_in_reasoning")),
                          classifier_from_token=args.classifier_from_token)
    return build_app(engine, metrics, config, drain), engine, config


def resolve_reasoning_parser(name: str | None, chat_template: str | None) -> str | None:
    """--reasoning-parser: a parser's name, or `auto`: the one the chat template's markers call for."""
    from pagellm.entrypoints.openai.reasoning import parser_for_template

    if name != "auto":
        return name
    picked = parser_for_template(chat_template)
    logger.info("--reasoning-parser auto: %s", picked or "the chat template marks no reasoning; replies are not split")
    return picked


def _replica_server(args: argparse.Namespace):
    """--data-parallel-size N: N engine replicas on Ray behind the router (serving/replicas.py)."""
    from pagellm.config import engine_kwargs
    from pagellm.serving.replicas import ReplicaSet

    options = engine_kwargs(args)
    replicas = ReplicaSet(options, args.data_parallel_size, args.router_policy, ray_address=args.ray_address,
                          max_waiting_requests=args.max_waiting_requests)
    names = args.served_model_name or [default_model_name(replicas.model_path)]
    metrics = ServerMetrics(names[0], max_model_len=replicas.max_model_len,
                            max_num_batched_tokens=replicas.config.max_num_batched_tokens,
                            cache_info={**replicas.cache_config, "data_parallel_size": args.data_parallel_size})
    replicas.observer = metrics
    return replicas, metrics, names


def run_server(args: argparse.Namespace) -> int:
    import uvicorn

    logging.basicConfig(level=args.log_level.upper(), format="%(levelname)s %(asctime)s %(name)s: %(message)s")
    drain = Drain(args.shutdown_timeout, exit_on_engine_death=args.exit_on_engine_death)
    app, engine, config = build_server(args, drain)
    stats = engine.stats()
    logger.info("serving %s as %r on http://%s:%d (%s; KV pool: %d blocks of %d tokens, max_model_len %d); "
                "block map at /dashboard", engine.model_path, config.served_model_names[0], args.host, args.port,
                f"{args.data_parallel_size} replicas on Ray, router {args.router_policy}"
                if args.data_parallel_size > 1 else
                f"{str(engine.engine.dtype).removeprefix('torch.')} on {engine.engine.device}",
                stats.kv.total_blocks, stats.kv.block_size, engine.max_model_len)
    server = DrainingServer(uvicorn.Config(app, host=args.host, port=args.port, log_level=args.log_level,
                                           access_log=not args.disable_access_log, timeout_graceful_shutdown=5),
                            drain)
    drain.server = server
    sock = server.config.bind_socket()
    # Connections inherit this from the listening socket. Left to the kernel, a socket's send buffer
    # grows to net.ipv4.tcp_wmem's largest (4 MiB by default) even towards a client that reads
    # nothing, which would hide such a client from --max-stream-buffer for thousands of tokens.
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, SOCKET_SEND_BUFFER)
    server.run(sockets=[sock])
    if server.force_exit:  # a second signal: uvicorn skipped the lifespan's shutdown
        engine.close()
        return 1
    return drain.exit_code
