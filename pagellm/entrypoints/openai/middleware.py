"""Plain ASGI middleware (not Starlette's BaseHTTPMiddleware, which would get between a
streaming response and the client's disconnect): the API key, the body size limit, and the
count of requests per client API."""
from __future__ import annotations

import hmac

from collections.abc import Callable

from starlette.types import ASGIApp, Message, Receive, Scope, Send

from pagellm.entrypoints.openai.errors import OpenAIError

# Paths that need the API key when one is set; health, metrics and the dashboard stay open.
PROTECTED_PREFIXES = ("/v1/", "/v2/", "/api/", "/tokenize", "/detokenize", "/score", "/rerank")


class APIKeyMiddleware:
    def __init__(self, app: ASGIApp, api_key: str) -> None:
        self.app = app
        self.expected = f"Bearer {api_key}".encode()
        self.key = api_key.encode()

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http" and scope["method"] != "OPTIONS" and scope["path"].startswith(PROTECTED_PREFIXES):
            headers = dict(scope["headers"])
            given = headers.get(b"authorization", b"")
            # Compared in constant time, so the key cannot be guessed byte by byte from timings.
            # Anthropic's clients send the key as x-api-key.
            if not (hmac.compare_digest(given, self.expected)
                    or hmac.compare_digest(headers.get(b"x-api-key", b""), self.key)):
                error = OpenAIError(401, "Invalid or missing API key; send it as `Authorization: Bearer <key>` "
                                         "(or `x-api-key: <key>`).",
                                    code="invalid_api_key", headers={"WWW-Authenticate": "Bearer"})
                await error.response_for(scope["path"])(scope, receive, send)
                return
        await self.app(scope, receive, send)


class BodyLimitMiddleware:
    """Answers 413 for a request body over `max_bytes`, declared (Content-Length) or streamed."""

    def __init__(self, app: ASGIApp, max_bytes: int) -> None:
        self.app = app
        self.max_bytes = max_bytes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope["method"] in ("GET", "HEAD", "OPTIONS"):
            await self.app(scope, receive, send)
            return
        declared = dict(scope["headers"]).get(b"content-length")
        if declared is not None and declared.isdigit() and int(declared) > self.max_bytes:
            await self._reject(scope, receive, send)
            return
        # Read the whole body first (it is small by construction), then replay it to the app.
        chunks, size = [], 0
        while True:
            message = await receive()
            if message["type"] != "http.request":  # the client left while sending
                return
            chunks.append(message.get("body", b""))
            size += len(chunks[-1])
            if size > self.max_bytes:
                await self._reject(scope, receive, send)
                return
            if not message.get("more_body", False):
                break
        body = b"".join(chunks)
        replayed = False

        async def replay() -> Message:
            nonlocal replayed
            if not replayed:
                replayed = True
                return {"type": "http.request", "body": body, "more_body": False}
            return await receive()

        await self.app(scope, replay, send)

    async def _reject(self, scope: Scope, receive: Receive, send: Send) -> None:
        error = OpenAIError(413, f"The request body is larger than the server's limit of {self.max_bytes} bytes.",
                            code="request_too_large", headers={"Connection": "close"})
        await error.response_for(scope["path"])(scope, receive, send)


# The client API each route belongs to (the `api` label of pagellm:api_requests_total); a path
# ending in "/" names every path under it. Health, metrics and the dashboard are no client API.
API_OF_ROUTE = {
    "/v1/chat/completions": "openai_chat",
    "/v1/completions": "openai_completions",
    "/v1/embeddings": "openai_embeddings",
    "/v1/models": "openai_models",
    "/v1/responses": "responses",
    "/v1/responses/": "responses",
    "/v1/messages": "anthropic_messages",
    "/v1/messages/count_tokens": "anthropic_count_tokens",
    "/v1/rerank": "rerank",
    "/v2/rerank": "rerank",
    "/rerank": "rerank",
    "/v1/score": "score",
    "/score": "score",
    "/tokenize": "tokenize",
    "/detokenize": "tokenize",
    "/api/chat": "ollama_chat",
    "/api/generate": "ollama_generate",
    "/api/embed": "ollama_embed",
    "/api/embeddings": "ollama_embed",
    "/api/": "ollama_models",  # tags, ps, show, version, and the model management it refuses
}


def api_of(path: str) -> str | None:
    """The client API a request path belongs to (None: none)."""
    if path in API_OF_ROUTE:
        return API_OF_ROUTE[path]
    return next((api for route, api in API_OF_ROUTE.items() if route.endswith("/") and path.startswith(route)), None)


class APIRequestCountMiddleware:
    """Calls `count(api, status)` once per request to a client API, when its response starts
    (a stream counts its status, 200, not how it ended)."""

    def __init__(self, app: ASGIApp, count: Callable[[str, int], None]) -> None:
        self.app = app
        self.count = count

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        api = api_of(scope["path"]) if scope["type"] == "http" else None
        if api is None:
            await self.app(scope, receive, send)
            return

        async def counted(message: Message) -> None:
            if message["type"] == "http.response.start":
                self.count(api, message["status"])
            await send(message)

        await self.app(scope, receive, counted)
