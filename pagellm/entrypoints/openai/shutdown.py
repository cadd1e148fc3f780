"""How `pagellm serve` ends.

Graceful shutdown: the first SIGTERM or SIGINT stops admitting (new requests get 503 with
Retry-After, /health says draining), lets the requests in flight finish for up to
`--shutdown-timeout` seconds, then ends the rest with finish_reason "abort" (a stream gets its
final chunk and [DONE]) and lets uvicorn close; the app's lifespan then stops the engine (its
tensor-parallel ranks, replicas and disk tier) and the process exits 0. A second signal exits at
once.

A dead engine (a tensor-parallel rank died, the engine thread failed): its requests have failed
and new ones get 503; with `--exit-on-engine-death` (the default) the server logs the cause once
and exits with status 1 after ENGINE_DEATH_GRACE_SECONDS, so that a supervisor restarts it."""
from __future__ import annotations

import asyncio
import json
import logging
import signal
import time
from types import FrameType
from typing import Any

import uvicorn

logger = logging.getLogger("pagellm.server")

# What a client refused while the server drains should wait before trying again (another
# replica behind a load balancer, or this one restarted).
DRAIN_RETRY_AFTER_SECONDS = 5
# After the in-flight requests are aborted, how long their final chunks get to reach the clients.
_FLUSH_SECONDS = 2.0
# Paths still answered while draining: the state of the process, not new work.
_OPEN_WHILE_DRAINING = ("/metrics",)
# How long a server whose engine died keeps answering 503 before it exits: enough for the failed
# requests' answers to reach their clients and for a health check to see it.
ENGINE_DEATH_GRACE_SECONDS = 2.0


class Drain:
    """The server's shutdown state, shared by the middleware, the signal handler and the task
    that ends the requests in flight."""

    def __init__(self, timeout: float, exit_on_engine_death: bool = True) -> None:
        if timeout < 0:
            raise ValueError(f"--shutdown-timeout must be >= 0 seconds, got {timeout}")
        self.timeout = timeout
        self.exit_on_engine_death = exit_on_engine_death
        self.exit_code = 0
        self.draining = False
        self.in_flight = 0
        self.started: float | None = None
        self.server: uvicorn.Server | None = None  # set by run_server; told to close when drained

    def begin(self) -> None:
        if not self.draining:
            self.draining, self.started = True, time.monotonic()

    async def run(self, engine: Any) -> None:
        """Wait for the drain to begin, then for the requests in flight (up to the timeout), then
        abort what is left and tell uvicorn to close. Or, if the engine dies first, close with
        status 1 after a grace period."""
        while not self.draining:
            if self.exit_on_engine_death and not engine.is_running and engine.dead_error is not None:
                # The engine logged its cause; this says what follows from it.
                logger.error("exiting with status 1 in %g s: the engine is dead", ENGINE_DEATH_GRACE_SECONDS)
                self.exit_code = 1
                await asyncio.sleep(ENGINE_DEATH_GRACE_SECONDS)
                if self.server is not None:
                    self.server.should_exit = True
                return
            await asyncio.sleep(0.05)
        logger.info("shutting down: %d requests in flight, waiting up to %g s for them to finish",
                    self.in_flight, self.timeout)
        deadline = self.started + self.timeout
        while self.in_flight and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        if self.in_flight:
            logger.info("aborting %d requests still in flight after %g s", self.in_flight, self.timeout)
            engine.abort_all("the server is shutting down")
            flush = time.monotonic() + _FLUSH_SECONDS
            while self.in_flight and time.monotonic() < flush:
                await asyncio.sleep(0.05)
        if self.server is not None:
            self.server.should_exit = True


class DrainMiddleware:
    """Counts the requests in flight (a stream until its last byte) and refuses new ones while
    the server drains: 503 with Retry-After, in OpenAI's error shape; /health says draining."""

    def __init__(self, app: Any, drain: Drain) -> None:
        self.app, self.drain = app, drain

    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        path = scope.get("path", "")
        if self.drain.draining and path not in _OPEN_WHILE_DRAINING:
            if path == "/health":
                body = {"status": "draining"}
            else:
                body = {"error": {"message": "The server is shutting down; retry later, or elsewhere",
                                  "type": "service_unavailable", "param": None, "code": "server_shutting_down"}}
            await _json(send, 503, body, {"retry-after": str(DRAIN_RETRY_AFTER_SECONDS)})
            return
        self.drain.in_flight += 1
        try:
            await self.app(scope, receive, send)
        finally:
            self.drain.in_flight -= 1


async def _json(send: Any, status: int, body: dict, headers: dict[str, str]) -> None:
    data = json.dumps(body).encode()
    raw = [(b"content-type", b"application/json"), (b"content-length", str(len(data)).encode())]
    raw += [(k.encode(), v.encode()) for k, v in headers.items()]
    await send({"type": "http.response.start", "status": status, "headers": raw})
    await send({"type": "http.response.body", "body": data})


class DrainingServer(uvicorn.Server):
    """uvicorn, with the first signal handed to the drain instead of closing at once; the second
    closes at once. Unlike uvicorn's own handler this one does not re-raise the signal after
    shutdown, so a drained server exits 0."""

    def __init__(self, config: uvicorn.Config, drain: Drain) -> None:
        super().__init__(config)
        self.drain = drain

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        if self.drain.draining:
            logger.warning("second %s: exiting now", signal.Signals(sig).name)
            self.force_exit = self.should_exit = True
            return
        self.drain.begin()
