"""The engine on a thread of its own, driven from asyncio.

`LLMEngine` is not thread-safe and `step()` blocks for up to a second, so one thread owns
the engine: it drains a queue of commands (add, abort, call), steps while work is pending
and otherwise sleeps on the queue. Each step's outputs go back to the event loop in one
`call_soon_threadsafe`, onto a per-request `asyncio.Queue`; the event loop never blocks.

The engine is best built on that same thread (`AsyncLLMEngine.from_config`): GNU OpenMP keeps
a team of worker threads for every thread that has run a parallel region, and once it manages
more threads than the machine has CPUs its workers stop spinning between regions and sleep on a
futex instead. A model loaded on the main thread and stepped on another leaves two teams; on
2 CPUs every parallel region then pays for waking a worker, and decode steps took twice as
long as the same steps run offline (hundreds of context switches a step against ~3).

A request whose consumer goes away (cancelled, closed, or `abort()`) is aborted at once
and its blocks return to the pool. So is one whose consumer stops taking its outputs (a
streaming client that never reads: the server's writer blocks on the socket): once
`max_stream_buffer` outputs wait in its stream, the request ends with finish_reason "abort" and
what it had generated (outputs are cumulative, so the ones dropped meanwhile lose nothing), and
the engine never waits for it. A request that fails in a step (the engine finds which
one; see `LLMEngine.step`) fails alone and the others carry on. If `step()` itself raises,
all live requests fail and the engine goes on serving the next ones if it can; if it raises
an `EngineFatalError` (a tensor-parallel rank died), the engine is dead: every request fails
with EngineDeadError and none is accepted (the server then exits, see openai/shutdown.py).
"""
from __future__ import annotations

import asyncio
import dataclasses
import logging
import queue
import threading
import time
from collections.abc import AsyncIterator, Callable
from concurrent.futures import Future
from typing import Any, Protocol

from pagellm.config import EngineConfig
from pagellm.core.stats import EngineStats
from pagellm.engine.llm_engine import LLMEngine, PromptType
from pagellm.errors import EngineFatalError
from pagellm.engine.stats_logger import StatsLogger, log_added, log_finished, request_logger
from pagellm.outputs import RequestOutput
from pagellm.beam_search import BeamSearchParams
from pagellm.pooling_params import PoolingParams
from pagellm.sampling_params import SamplingParams, StructuredOutputsParams

RequestParams = SamplingParams | BeamSearchParams | PoolingParams

logger = logging.getLogger("pagellm.async_engine")


class QueueFullError(RuntimeError):
    """Too many requests are waiting for their first token; try again later (HTTP 503)."""


class EngineDeadError(RuntimeError):
    """The engine thread has stopped; no request can be served (HTTP 503)."""


class EngineStepError(RuntimeError):
    """The request failed while it was generated (HTTP 500); the message says why."""


class RequestAborted(RuntimeError):
    """The request was aborted before it finished."""


def num_sequences(params: RequestParams) -> int:
    """The n a request's outputs have: its samples, or its beams (one for an embedding)."""
    if isinstance(params, PoolingParams):
        return 1
    return params.beam_width if isinstance(params, BeamSearchParams) else params.n


def max_new_tokens(params: RequestParams) -> int | None:
    """The tokens a request may generate at most (None: up to the context; 0 for an embedding)."""
    return 0 if isinstance(params, PoolingParams) else params.max_tokens


class StepObserver(Protocol):
    """Called on the engine thread, in step order: the hook for metrics."""

    def on_added(self, request_id: str, params: RequestParams, num_prompt_tokens: int) -> None: ...

    def on_step(self, num_tokens: int) -> None: ...

    def on_outputs(self, outputs: list[RequestOutput], now: float) -> None: ...

    def on_abort(self, request_id: str, now: float) -> None: ...

    def on_error(self, request_id: str, now: float) -> None: ...


class RequestStream:
    """The outputs of one request, in order; iterate it with `async for`.

    Leaving it before the last output (an exception, `break`, a cancelled task) must be
    followed by `abort()`; `AsyncLLMEngine.generate` and `async with` do that.
    """

    def __init__(self, engine: AsyncLLMEngine, request_id: str) -> None:
        self.request_id = request_id
        self.finished = False
        self.stalled = False  # its consumer fell max_stream_buffer outputs behind: being aborted
        self._engine = engine
        self._queue: asyncio.Queue = asyncio.Queue()

    def __aiter__(self) -> RequestStream:
        return self

    async def __anext__(self) -> RequestOutput:
        if self.finished:
            raise StopAsyncIteration
        try:
            item = await self._queue.get()
        except BaseException:  # cancelled: whoever waited for this request is gone
            self.abort()
            raise
        if isinstance(item, BaseException):
            self.finished = True
            raise item
        if item.finished:
            self.finished = True
        return item

    def abort(self) -> None:
        if not self.finished:
            self.finished = True
            self._engine.abort(self.request_id)

    async def __aenter__(self) -> RequestStream:
        return self

    async def __aexit__(self, *exc: object) -> None:
        self.abort()


class EngineThread:
    """One daemon thread that runs the callables submitted to it, one after another: the
    engine's construction, then its loop. A daemon, so that an engine never shut down does
    not keep the interpreter from exiting (a ThreadPoolExecutor's worker would)."""

    def __init__(self, name: str = "pagellm-engine") -> None:
        self._jobs: queue.SimpleQueue = queue.SimpleQueue()
        self._thread = threading.Thread(target=self._work, name=name, daemon=True)
        self._thread.start()

    def submit(self, fn: Callable, *args: Any) -> Future:
        future: Future = Future()
        self._jobs.put((future, fn, args))
        return future

    def stop(self) -> None:
        """Let the thread end once the jobs before this call are done."""
        self._jobs.put(None)

    def join(self, timeout: float | None = None) -> bool:
        """Wait for the thread to end (after `stop`); whether it has."""
        self._thread.join(timeout)
        return not self._thread.is_alive()

    def _work(self) -> None:
        while (job := self._jobs.get()) is not None:
            future, fn, args = job
            if not future.set_running_or_notify_cancel():
                continue
            try:
                future.set_result(fn(*args))
            except BaseException as e:  # the caller gets it from the future
                future.set_exception(e)


class AsyncLLMEngine:
    """`LLMEngine` for asyncio: `add_request` / `generate` give each request its own stream."""

    def __init__(self, engine: LLMEngine, *, max_waiting_requests: int | None = None,
                 max_stream_buffer: int | None = None, observer: StepObserver | None = None,
                 stats_interval: float = 5.0, thread: EngineThread | None = None) -> None:
        """`max_stream_buffer`: outputs a request's stream may hold unread before the request is
        aborted (None: no bound). `thread`: the thread that built `engine` (see `from_config`), to
        step it on; default a new one."""
        if max_waiting_requests is not None and max_waiting_requests < 0:
            raise ValueError(f"max_waiting_requests must be >= 0 or None, got {max_waiting_requests}")
        if max_stream_buffer is not None and max_stream_buffer < 1:
            raise ValueError(f"max_stream_buffer must be >= 1 or None, got {max_stream_buffer}")
        self.engine = engine
        self.tokenizer = engine.tokenizer
        self.max_model_len = engine.max_model_len
        self.model_path = engine.model_path
        self.max_waiting_requests = max_waiting_requests
        self.max_stream_buffer = max_stream_buffer
        self.num_stalled_streams = 0  # requests aborted because their consumer stopped reading
        self.observer = observer  # may be set until start(); called on the engine thread
        self._commands: queue.SimpleQueue = queue.SimpleQueue()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread = thread or EngineThread()
        self._running: Future | None = None  # the engine loop, once started
        self._dead: BaseException | None = None
        # Event-loop side: the open streams, and those still waiting for their first output.
        self._streams: dict[str, RequestStream] = {}
        self._unstarted: set[str] = set()
        # Engine-thread side: the requests the engine holds.
        self._live: set[str] = set()
        self._stats: EngineStats = engine.stats()
        self._stats_logger = StatsLogger(stats_interval)
        # Steps whose step() raised (the engine's own count covers the failures it isolated).
        self.num_unisolated_failures = 0

    @classmethod
    def from_config(cls, config: EngineConfig, **kwargs: Any) -> AsyncLLMEngine:
        """Build the engine on the thread that will step it, so that one OpenMP team serves both
        (see the module's docstring). Blocks until the model is loaded; raises what loading raised."""
        thread = EngineThread()
        try:
            engine = thread.submit(LLMEngine, config).result()
        except BaseException:
            thread.stop()
            raise
        return cls(engine, thread=thread, **kwargs)

    # ---- life cycle ------------------------------------------------------------------------
    def start(self, loop: asyncio.AbstractEventLoop | None = None) -> None:
        """Start the engine thread; outputs are delivered on `loop` (default: the running one)."""
        if self._running is not None:
            raise RuntimeError("the engine is already started")
        self._loop = loop or asyncio.get_running_loop()
        self._running = self._thread.submit(self._run)

    async def shutdown(self) -> None:
        """Stop the engine thread after its current step; open requests fail."""
        if self._running is None:
            return
        self._commands.put(("stop",))
        self._thread.stop()
        await asyncio.wrap_future(self._running)
        self._fail(list(self._streams), EngineDeadError("the engine has shut down"))

    def close(self) -> None:
        """Release the engine's own resources (its KV tier's file, tensor-parallel ranks) and its
        thread, after shutdown."""
        self.engine.shutdown()
        self._thread.stop()

    @property
    def is_running(self) -> bool:
        return self._running is not None and not self._running.done() and self._dead is None

    @property
    def dead_error(self) -> BaseException | None:
        return self._dead

    # ---- requests --------------------------------------------------------------------------
    @property
    def num_unstarted(self) -> int:
        """Requests that have not produced their first output yet (queued, or in prefill)."""
        return len(self._unstarted)

    async def add_request(self, request_id: str, prompt: PromptType, params: RequestParams) -> RequestStream:
        """Hand a request to the engine; returns once the engine accepted it.

        Raises ValueError for bad input (the engine's message), QueueFullError when
        `max_waiting_requests` are already waiting, EngineDeadError when the engine is gone.
        """
        self._check_alive()
        if request_id in self._streams:
            raise ValueError(f"request_id {request_id!r} is already in use")
        if self.max_waiting_requests is not None and len(self._unstarted) >= self.max_waiting_requests:
            raise QueueFullError(f"{len(self._unstarted)} requests are already waiting "
                                 f"(max_waiting_requests is {self.max_waiting_requests}); retry later")
        stream = RequestStream(self, request_id)
        self._streams[request_id] = stream
        self._unstarted.add(request_id)
        accepted = self._loop.create_future()
        self._commands.put(("add", request_id, prompt, params, accepted, time.time()))
        try:
            await accepted
        except BaseException:
            stream.abort()
            raise
        return stream

    async def generate(self, request_id: str, prompt: PromptType,
                       params: SamplingParams) -> AsyncIterator[RequestOutput]:
        """The outputs of one request, cumulative as `LLMEngine.step` returns them.

        The request is aborted as soon as the consumer stops early: cancelled while waiting
        for an output, or closing the generator (`contextlib.aclosing`, or when it is collected).
        """
        stream = await self.add_request(request_id, prompt, params)
        try:
            async for out in stream:
                yield out
        finally:
            stream.abort()

    def abort(self, request_id: str) -> None:
        """Abort a request now: its stream ends with RequestAborted and its blocks are freed."""
        stream = self._streams.pop(request_id, None)
        self._unstarted.discard(request_id)
        if stream is None:
            return
        stream._queue.put_nowait(RequestAborted(f"request {request_id!r} was aborted"))
        self._commands.put(("abort", request_id))

    def abort_all(self, reason: str) -> None:
        """End every request in flight now with what it has generated, finish_reason "abort"
        (a stream gets that as its last output; best_of and beam searches end with RequestAborted
        and `reason`). For a server that shuts down."""
        self._commands.put(("abort_with_outputs", None, reason))

    async def call(self, fn: Callable[[LLMEngine], Any]) -> Any:
        """Run `fn(engine)` on the engine thread between two steps and return its result."""
        self._check_alive()
        fut = self._loop.create_future()
        self._commands.put(("call", fn, fut))
        return await fut

    async def compile_grammar(self, spec: StructuredOutputsParams) -> None:
        """Compile a structured output's grammar in a worker thread, neither on the event loop nor
        between the engine's steps; the engine finds it in its cache when the request is added.
        Raises ValueError when the schema, regex or grammar is not valid."""
        await asyncio.to_thread(lambda: self.engine.grammars.compile(spec))

    def stats(self) -> EngineStats:
        """The engine's stats as of its last step (never waits for the engine)."""
        return dataclasses.replace(self._stats, num_unstarted=len(self._unstarted),
                                   num_stalled_streams=self.num_stalled_streams,
                                   num_step_failures=self._stats.num_step_failures + self.num_unisolated_failures)

    def _check_alive(self) -> None:
        if self._dead is not None:
            raise EngineDeadError(f"the engine has stopped: {self._dead!r}")
        if self._running is None or self._running.done() or self._loop is None:
            raise EngineDeadError("the engine is not started")

    # ---- event-loop side of the hand-over --------------------------------------------------
    def _deliver(self, outputs: list[RequestOutput]) -> None:
        for out in outputs:
            stream = self._streams.get(out.request_id)
            if stream is None:  # aborted meanwhile
                continue
            self._unstarted.discard(out.request_id)
            if out.finished:
                del self._streams[out.request_id]
            elif stream.stalled:  # its abort is on the way, and its last output will hold these tokens
                continue
            elif self.max_stream_buffer is not None and stream._queue.qsize() >= self.max_stream_buffer:
                self._stalled(stream)
                continue
            stream._queue.put_nowait(out)

    def _stalled(self, stream: RequestStream) -> None:
        stream.stalled = True
        self.num_stalled_streams += 1
        reason = (f"its client read none of its last {self.max_stream_buffer} outputs (max_stream_buffer); "
                  f"aborted to free its KV blocks")
        logger.warning("request %s: %s", stream.request_id, reason)
        self._commands.put(("abort_with_outputs", [stream.request_id], reason))

    def _end_aborted(self, outputs: list[RequestOutput], reason: str) -> None:
        self._deliver([o for o in outputs if o.error is None])
        self._fail([o.request_id for o in outputs if o.error is not None], RequestAborted(reason))

    def _fail(self, request_ids: list[str], error: BaseException) -> None:
        for rid in request_ids:
            self._unstarted.discard(rid)
            stream = self._streams.pop(rid, None)
            if stream is not None:
                stream._queue.put_nowait(error)

    @staticmethod
    def _resolve(fut: asyncio.Future, result: Any, error: BaseException | None) -> None:
        if fut.done():  # the awaiting task was cancelled
            return
        if error is not None:
            fut.set_exception(error)
        else:
            fut.set_result(result)

    def _to_loop(self, fn: Callable, *args: Any) -> None:
        try:
            self._loop.call_soon_threadsafe(fn, *args)
        except RuntimeError:  # the loop is closed: nobody is left to tell
            pass

    # ---- the engine thread -----------------------------------------------------------------
    def _run(self) -> None:
        try:
            while True:
                busy = self.engine.has_unfinished_requests()
                for cmd in self._drain(block=not busy):
                    if cmd[0] == "stop":
                        return
                    self._handle(cmd)
                if self.engine.has_unfinished_requests():
                    self._step()
                self._stats = self.engine.stats()
                self._stats_logger.maybe_log(self._stats)
        except BaseException as e:  # a fatal step, or a bug outside step(): nothing can be trusted any more
            logger.exception("the engine is dead: %r", e)
            self._dead = e
            self._to_loop(self._fail_all, EngineDeadError(f"the engine is dead: {e!r}"))

    def _fail_all(self, error: BaseException) -> None:
        self._fail(list(self._streams), error)

    def _drain(self, block: bool) -> list[tuple]:
        cmds = [self._commands.get()] if block else []
        while True:
            try:
                cmds.append(self._commands.get_nowait())
            except queue.Empty:
                return cmds

    def _handle(self, cmd: tuple) -> None:
        kind = cmd[0]
        if kind == "add":
            _, rid, prompt, params, fut, arrival = cmd
            try:
                if isinstance(params, BeamSearchParams):  # one output, when the search ends
                    req = self.engine.add_beam_request(rid, prompt, params, arrival_time=arrival)
                elif isinstance(params, PoolingParams):  # one output, its embedding
                    req = self.engine.add_pooling_request(rid, prompt, params, arrival_time=arrival)
                else:
                    req = self.engine.add_request(rid, prompt, params, arrival_time=arrival)
            except Exception as e:
                self._to_loop(self._resolve, fut, None, e)
            else:
                self._live.add(rid)
                self._observe("on_added", rid, params, req.num_prompt_tokens)
                ids = prompt.get("prompt_token_ids") if isinstance(prompt, dict) else None
                log_added(rid, len(ids) if ids is not None else None, max_new_tokens(params), num_sequences(params))
                self._to_loop(self._resolve, fut, None, None)
        elif kind == "abort":
            rid = cmd[1]
            if rid in self._live:
                self._live.discard(rid)
                self.engine.abort_request(rid)
                request_logger.info("request %s aborted", rid)
                if self.observer is not None:
                    self.observer.on_abort(rid, time.time())
        elif kind == "abort_with_outputs":  # some requests (None: all) end with what they have
            _, rids, reason = cmd
            rids = sorted(self._live) if rids is None else [r for r in rids if r in self._live]
            self._live.difference_update(rids)
            outputs = self.engine.abort_with_outputs(rids, reason)
            now = time.time()
            for out in outputs:
                request_logger.info("request %s aborted: %s", out.request_id, reason)
                if self.observer is not None:
                    self.observer.on_abort(out.request_id, now)
            self._to_loop(self._end_aborted, outputs, reason)
        elif kind == "call":
            _, fn, fut = cmd
            try:
                result = fn(self.engine)
            except Exception as e:
                self._to_loop(self._resolve, fut, None, e)
            else:
                self._to_loop(self._resolve, fut, result, None)

    def _observe(self, hook: str, *args: Any) -> None:
        if self.observer is not None:
            try:
                getattr(self.observer, hook)(*args)
            except Exception:  # metrics must never take the engine down
                logger.exception("step observer failed in %s", hook)

    def _step(self) -> None:
        core = self.engine.core
        tokens_before = core.num_prompt_tokens_computed + core.num_generation_tokens
        try:
            outputs = self.engine.step()
        except EngineFatalError:
            raise  # no step can run any more: _run marks the engine dead and fails every request
        except Exception as e:
            self.num_unisolated_failures += 1
            failed = sorted(self._live)
            logger.exception("engine step raised; failing all %d live requests", len(failed))
            # Aborting frees their blocks; if even that fails the engine's state is lost.
            self.engine.abort_request(failed)
            self._live.clear()
            if self.observer is not None:
                for rid in failed:
                    self.observer.on_error(rid, time.time())
            self._to_loop(self._fail, failed, EngineStepError(f"internal error while generating: {e!r}"))
            return
        self._observe("on_step", core.num_prompt_tokens_computed + core.num_generation_tokens - tokens_before)
        errored = [o for o in outputs if o.error is not None]
        if errored:
            outputs = [o for o in outputs if o.error is None]
            for o in errored:
                self._live.discard(o.request_id)
                logger.error("request %s failed: %s", o.request_id, o.error)
                if self.observer is not None:
                    self.observer.on_error(o.request_id, time.time())
                self._to_loop(self._fail, [o.request_id], EngineStepError(f"error while generating: {o.error}"))
        now = time.time()
        for out in outputs:
            if out.finished:
                self._live.discard(out.request_id)
                log_finished(out, now)
        if self.observer is not None:
            try:
                self.observer.on_outputs(outputs, time.time())
            except Exception:  # metrics must never take the engine down
                logger.exception("step observer failed")
        if outputs:
            self._to_loop(self._deliver, outputs)
