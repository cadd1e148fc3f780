"""Engine replicas as Ray actors behind the replica router: data parallelism.

Each replica is a Ray actor holding a whole engine (`AsyncLLMEngine` over an `LLMEngine`; a
replica may itself run tensor parallelism). `ReplicaSet.add_request` routes a request
(serving/router.py), waits for the replica to accept it (a bad request raises the engine's
own error, as a local engine would), and returns a stream of its outputs, sent back by the actor
through a Ray streaming generator. When a replica dies it leaves the rotation: a request that had
received no output yet is added again on another replica, one that had output ends with
ReplicaDiedError. Ray is started locally when no instance is running (and shut down again by
`shutdown`), or joined at `ray_address` so that replicas land on other machines of a cluster.

`ReplicaSet` offers what the OpenAI server asks of an `AsyncLLMEngine` (`add_request`, `stats`,
`call`, `compile_grammar`, `start`, `shutdown`, ...), so `pagellm serve --data-parallel-size N`
puts it where the single engine goes. Its `stats()` sums the replicas' (polled every second) and
lists each under "replicas".

Requests and outputs cross process boundaries through Ray's own serialization: the actors are
this process's children (or its cluster's), never a source of untrusted bytes.
"""
from __future__ import annotations

import asyncio
import logging
import os
import time
from dataclasses import replace
from typing import Any, AsyncIterator, Callable

from pagellm.core.stats import EngineStats, ReplicaStats, summed
from pagellm.engine.async_engine import EngineDeadError
from pagellm.serving.router import NoReplicaError, Router
from pagellm.outputs import RequestOutput

logger = logging.getLogger(__name__)


class ReplicaDiedError(EngineDeadError):
    """The replica serving a request died after the request had received output."""


def _replica_class():
    import ray

    @ray.remote
    class EngineReplica:
        """One engine in its own process."""

        def __init__(self, options: dict, threads: int | None, max_waiting_requests: int | None) -> None:
            import torch

            from pagellm.config import make_config
            from pagellm.engine.async_engine import AsyncLLMEngine

            if threads:
                torch.set_num_threads(threads)
            self.engine = AsyncLLMEngine.from_config(make_config(**options), max_waiting_requests=max_waiting_requests)
            self._started = False

        def ready(self) -> int:
            return os.getpid()

        def _start(self) -> None:
            if not self._started:  # the engine's outputs go to this actor's event loop
                self.engine.start()
                self._started = True

        async def generate(self, request_id: str, prompt: Any, params: Any):
            """None once the engine accepted the request (or its error), then its outputs."""
            self._start()
            stream = await self.engine.add_request(request_id, prompt, params)
            yield None
            async with stream:
                async for out in stream:
                    yield out

        async def abort(self, request_id: str) -> None:
            self.engine.abort(request_id)

        async def abort_all(self, reason: str) -> None:
            if self._started:
                self.engine.abort_all(reason)

        async def stats(self) -> EngineStats:
            return self.engine.stats()

        def cache_config(self) -> dict:
            return self.engine.engine.cache_config()

        async def call(self, fn: Callable) -> Any:
            self._start()
            return await self.engine.call(fn)

        async def compile_grammar(self, spec: Any) -> None:
            await self.engine.compile_grammar(spec)

        async def shutdown(self) -> None:
            if self._started:
                await self.engine.shutdown()
            self.engine.engine.shutdown()

    return EngineReplica


class ReplicaStream:
    """One request's outputs from its replica; the interface of async_engine.RequestStream."""

    def __init__(self, owner: ReplicaSet, request_id: str, prompt: Any, token_ids: list[int], params: Any,
                 replica: int, outputs) -> None:
        self._owner, self.request_id, self._prompt, self._params = owner, request_id, prompt, params
        self._token_ids = token_ids  # what the router routes by, kept for a retry elsewhere
        self.replica, self._outputs = replica, outputs
        self.finished = False
        self.streamed = False

    def __aiter__(self) -> ReplicaStream:
        return self

    async def __anext__(self) -> RequestOutput:
        import ray

        if self.finished:
            raise StopAsyncIteration
        while True:
            try:
                out = await (await self._outputs.__anext__())
                break
            except StopAsyncIteration:
                self._end()
                raise
            except ray.exceptions.RayActorError as e:
                self._owner._died(self.replica, e)
                if self.streamed:
                    self._end()
                    raise ReplicaDiedError(f"engine replica {self.replica} died while serving request "
                                           f"{self.request_id!r}") from None
                # Nothing reached the client: the request starts again on another replica.
                self._owner.router.finished(self.replica)
                self.replica, self._outputs = await self._owner._start(self.request_id, self._prompt,
                                                                       self._token_ids, self._params)
            except ray.exceptions.RayTaskError as e:
                self._end()
                raise e.as_instanceof_cause() from None
        self.streamed = True
        self._owner._observe("on_outputs", [out], time.time())
        if out.finished:
            self._end()
        return out

    def _end(self) -> None:
        if not self.finished:
            self.finished = True
            self._owner._streams.discard(self)
            self._owner.router.finished(self.replica)

    def abort(self) -> None:
        if not self.finished:
            self._end()
            self._owner._abort(self.replica, self.request_id)

    async def __aenter__(self) -> ReplicaStream:
        return self

    async def __aexit__(self, *exc: object) -> None:
        self.abort()


class ReplicaSet:
    def __init__(self, options: dict, num_replicas: int, policy: str = "cache_aware",
                 ray_address: str | None = None, threads_per_replica: int | None = None,
                 max_waiting_requests: int | None = None, observer: Any = None) -> None:
        """`options`: engine options (pagellm.config) for every replica. `threads_per_replica`:
        torch threads in each (default: this machine's cores shared out, at least 1).
        `max_waiting_requests`: per replica. `observer`: the metrics' StepObserver hooks, called
        here as outputs arrive (async_engine.StepObserver; on_step is not seen from here)."""
        import ray

        from pagellm.config import make_config
        from pagellm.engine.input_processor import resolve_max_model_len
        from pagellm.loader.source import load_model_source

        self.config = make_config(**options)  # a bad option fails here, before any process starts
        source = load_model_source(self.config.model, self.config.load_format, "none")
        self.tokenizer = source.tokenizer
        self.model_path = source.path
        self.max_model_len = resolve_max_model_len(self.config.max_model_len, source.arch.max_position_embeddings)
        self.observer = observer
        self._owns_ray = not ray.is_initialized()
        if self._owns_ray:
            try:
                ray.init(address=ray_address, include_dashboard=False, log_to_driver=False, configure_logging=False)
            except ConnectionError as e:
                if ray_address is None:
                    raise
                # Ray >= 2.59 turns token authentication on for clusters started with `ray start`,
                # but not for a client joining one: the bare error does not say so.
                raise ConnectionError(
                    f"could not join the Ray cluster at --ray-address {ray_address} ({e}). If the cluster uses "
                    "token authentication (the default of `ray start` since Ray 2.59), set RAY_AUTH_MODE=token "
                    "here too, with its token in ~/.ray/auth_token or RAY_AUTH_TOKEN") from None
        threads = threads_per_replica or max(1, (os.cpu_count() or 1) // num_replicas)
        actor = _replica_class()
        self.replicas = [actor.options(num_cpus=0).remote(options, threads, max_waiting_requests)
                         for _ in range(num_replicas)]
        self.pids: list[int] = []
        try:
            self.pids = ray.get([r.ready.remote() for r in self.replicas])
            self._replica_stats: list[EngineStats | None] = ray.get([r.stats.remote() for r in self.replicas])
            self.cache_config: dict = ray.get(self.replicas[0].cache_config.remote())  # each replica's the same
        except BaseException:
            self.close()
            raise
        self.router = Router(num_replicas, policy, self.config.block_size)
        self._streams: set[ReplicaStream] = set()
        self._poller: asyncio.Task | None = None
        self._dead: BaseException | None = None

    # ---- requests ------------------------------------------------------------------------------
    def _token_ids(self, prompt: Any) -> list[int]:
        if isinstance(prompt, dict) and prompt.get("prompt_token_ids") is not None:
            return list(prompt["prompt_token_ids"])
        text = prompt["prompt"] if isinstance(prompt, dict) else prompt
        return self.tokenizer.encode(text)

    async def _start(self, request_id: str, prompt: Any, token_ids: list[int], params: Any):
        """(replica, its output generator) once a live replica accepted the request."""
        import ray

        while True:
            replica = self.router.route(token_ids)  # raises NoReplicaError when none is left
            outputs = self.replicas[replica].generate.options(num_returns="streaming").remote(
                request_id, prompt, params)
            try:
                await (await outputs.__anext__())  # accepted (or the engine's error for this request)
                return replica, outputs
            except ray.exceptions.RayActorError as e:
                self.router.finished(replica)
                self._died(replica, e)
            except ray.exceptions.RayTaskError as e:
                self.router.finished(replica)
                raise e.as_instanceof_cause() from None
            except BaseException:
                self.router.finished(replica)
                raise

    async def add_request(self, request_id: str, prompt: Any, params: Any) -> ReplicaStream:
        """Hand a request to a replica; returns once it accepted it. Raises what its engine raises
        (ValueError, QueueFullError), or NoReplicaError when no replica is left."""
        token_ids = self._token_ids(prompt)  # once: routing, a retry elsewhere and the metrics use it
        replica, outputs = await self._start(request_id, prompt, token_ids, params)
        stream = ReplicaStream(self, request_id, prompt, token_ids, params, replica, outputs)
        self._streams.add(stream)
        self._observe("on_added", request_id, params, len(token_ids))
        return stream

    async def generate(self, request_id: str, prompt: Any, params: Any) -> AsyncIterator[RequestOutput]:
        stream = await self.add_request(request_id, prompt, params)
        async with stream:
            async for out in stream:
                yield out

    def abort(self, request_id: str) -> None:
        for s in list(self._streams):
            if s.request_id == request_id:
                s.abort()

    def abort_all(self, reason: str) -> None:
        """End every request in flight on every replica (AsyncLLMEngine.abort_all)."""
        for i in self.router.alive:
            try:
                self.replicas[i].abort_all.remote(reason)
            except Exception:  # a replica that died meanwhile has nothing left to end
                pass

    def _abort(self, replica: int, request_id: str) -> None:
        if replica in self.router.alive:
            self.replicas[replica].abort.remote(request_id)
        self._observe("on_abort", request_id, time.time())

    def _died(self, replica: int, error: BaseException) -> None:
        if replica in self.router.alive:
            logger.error("engine replica %d died (%s); it is out of rotation", replica, type(error).__name__)
            self.router.remove(replica)
            self._replica_stats[replica] = None
        if not self.router.alive:
            self._dead = NoReplicaError("every engine replica has died")

    def _observe(self, hook: str, *args: Any) -> None:
        if self.observer is not None:
            getattr(self.observer, hook)(*args)

    # ---- what the server asks of an engine -----------------------------------------------------------
    def start(self, loop: asyncio.AbstractEventLoop | None = None) -> None:
        """Start polling the replicas' stats (each second) on the running event loop."""
        self._poller = (loop or asyncio.get_running_loop()).create_task(self._poll())

    async def _poll(self) -> None:
        while True:
            await self.poll_stats()
            await asyncio.sleep(1.0)

    async def poll_stats(self) -> None:
        """Ask every live replica for its stats now (a dead one leaves the rotation)."""
        import ray

        for i in list(self.router.alive):
            try:
                self._replica_stats[i] = await self.replicas[i].stats.remote()
                self.router.report_kv_usage(i, self._replica_stats[i].kv.usage)
            except ray.exceptions.RayActorError as e:
                self._died(i, e)

    @property
    def is_running(self) -> bool:
        return bool(self.router.alive)

    @property
    def dead_error(self) -> BaseException | None:
        return self._dead

    @property
    def num_unstarted(self) -> int:
        return sum(1 for s in self._streams if not s.streamed)

    def stats(self) -> EngineStats:
        """The replicas' stats summed (as of their last poll), each one's in `replicas`."""
        total = summed([s for s in self._replica_stats if s is not None])
        each = [ReplicaStats(i, i in self.router.alive, self.pids[i], self.router.in_flight[i], s)
                for i, s in enumerate(self._replica_stats)]
        return replace(total, replicas=each, router=self.router.stats())

    async def call(self, fn: Callable) -> Any:
        """`fn(engine)` on the first live replica's engine (the dashboard's view is that replica's)."""
        if not self.router.alive:
            raise NoReplicaError("no engine replica is serving")
        return await self.replicas[self.router.alive[0]].call.remote(fn)

    async def compile_grammar(self, spec: Any) -> None:
        import ray

        if not self.router.alive:
            raise NoReplicaError("no engine replica is serving")
        try:
            await self.replicas[self.router.alive[0]].compile_grammar.remote(spec)
        except ray.exceptions.RayTaskError as e:
            raise e.as_instanceof_cause() from None

    def model_cost(self) -> dict | None:
        return None

    def kill(self, replica: int) -> None:
        """End a replica's process (for tests and drills: the set finds out as a real death)."""
        import ray

        ray.kill(self.replicas[replica], no_restart=True)

    async def shutdown(self) -> None:  # the server's lifespan: stop polling; the set stays until close()
        if self._poller is not None:
            self._poller.cancel()
            self._poller = None

    def close(self) -> None:
        """End every replica and, if this set started Ray, Ray itself."""
        import ray

        alive = self.router.alive if hasattr(self, "router") else range(len(self.replicas))
        for i, r in enumerate(self.replicas):
            try:
                if i in alive:
                    ray.get(r.shutdown.remote(), timeout=30)
            except Exception:  # gone already, or stuck: killed below
                pass
            try:
                ray.kill(r, no_restart=True)
            except Exception:
                pass
        self.replicas = []
        if self._owns_ray and ray.is_initialized():
            ray.shutdown()


__all__ = ["ReplicaSet", "ReplicaStream", "ReplicaDiedError", "NoReplicaError"]
