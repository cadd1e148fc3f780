"""Engine replicas as Ray actors behind the replica router: data parallelism.

Each replica is a Ray actor holding a whole engine (`AsyncLLMEngine` over an `LLMEngine`; a
replica may itself run tensor parallelism). `ReplicaSet.generate` routes a request
(entrypoints/router.py), streams its outputs back from the actor (a Ray streaming generator), and
when a replica dies takes it out of rotation: a request that had received nothing yet is retried
on another replica, one that had streamed output ends with ReplicaDiedError. Ray is started
locally when no instance is running (and shut down again by `shutdown`), or joined at
`ray_address` so that replicas land on other machines of a cluster.

Requests and outputs cross process boundaries through Ray's own serialization: the actors are
this process's children (or its cluster's), never a source of untrusted bytes.
"""
from __future__ import annotations

import logging
import os
from typing import Any, AsyncIterator

from pagellm.entrypoints.router import NoReplicaError, Router
from pagellm.outputs import RequestOutput

logger = logging.getLogger(__name__)


class ReplicaDiedError(RuntimeError):
    """The replica serving a request died after the request had received output."""


def _replica_class():
    import ray

    @ray.remote
    class EngineReplica:
        """One engine in its own process."""

        def __init__(self, options: dict, threads: int | None) -> None:
            import torch

            from pagellm.config import make_config
            from pagellm.engine.async_engine import AsyncLLMEngine
            from pagellm.engine.llm_engine import LLMEngine

            if threads:
                torch.set_num_threads(threads)
            self.engine = AsyncLLMEngine(LLMEngine(make_config(**options)))
            self._started = False

        def ready(self) -> int:
            return os.getpid()

        async def generate(self, request_id: str, prompt: Any, params: Any):
            if not self._started:  # the engine's outputs go to this actor's event loop
                self.engine.start()
                self._started = True
            async for out in self.engine.generate(request_id, prompt, params):
                yield out

        async def abort(self, request_id: str) -> None:
            self.engine.abort(request_id)

        async def stats(self) -> dict:
            return self.engine.stats()

    return EngineReplica


class ReplicaSet:
    def __init__(self, options: dict, num_replicas: int, policy: str = "cache_aware",
                 ray_address: str | None = None, threads_per_replica: int | None = None) -> None:
        """`options`: engine options (pagellm.config) for every replica. `threads_per_replica`:
        torch threads in each (default: this machine's cores shared out, at least 1)."""
        import ray

        from pagellm.config import make_config
        from pagellm.model.loader import load_model_source

        config = make_config(**options)  # a bad option fails here, before any process starts
        self.tokenizer = load_model_source(config.model, config.load_format, "none").tokenizer
        self._owns_ray = not ray.is_initialized()
        if self._owns_ray:
            ray.init(address=ray_address, include_dashboard=False, log_to_driver=False, configure_logging=False)
        threads = threads_per_replica or max(1, (os.cpu_count() or 1) // num_replicas)
        actor = _replica_class()
        self.replicas = [actor.options(num_cpus=0).remote(options, threads) for _ in range(num_replicas)]
        self.pids = []
        try:
            self.pids = ray.get([r.ready.remote() for r in self.replicas])
        except BaseException:
            self.shutdown()
            raise
        self.router = Router(num_replicas, policy, config.block_size)

    def _token_ids(self, prompt: Any) -> list[int]:
        if isinstance(prompt, dict) and "prompt_token_ids" in prompt:
            return list(prompt["prompt_token_ids"])
        text = prompt["prompt"] if isinstance(prompt, dict) else prompt
        return self.tokenizer.encode(text)

    async def generate(self, request_id: str, prompt: Any, params: Any) -> AsyncIterator[RequestOutput]:
        """The request's outputs from the replica the router picks (retried elsewhere if that one
        dies before sending anything)."""
        import ray

        token_ids = self._token_ids(prompt)
        while True:
            replica = self.router.route(token_ids)  # raises NoReplicaError when none is left
            streamed = False
            try:
                stream = self.replicas[replica].generate.options(num_returns="streaming").remote(
                    request_id, prompt, params)
                async for ref in stream:
                    out = await ref
                    streamed = True
                    yield out
                return
            except ray.exceptions.RayActorError as e:
                self._out_of_rotation(replica, e)
                if streamed:
                    raise ReplicaDiedError(f"engine replica {replica} died while serving request "
                                           f"{request_id!r}") from None
            finally:
                self.router.finished(replica)

    def _out_of_rotation(self, replica: int, error: BaseException) -> None:
        if replica in self.router.alive:
            logger.error("engine replica %d died (%s); it is out of rotation", replica, type(error).__name__)
        self.router.remove(replica)

    async def stats(self) -> list[dict | None]:
        """Each replica's engine stats (None for one out of rotation)."""
        out: list[dict | None] = []
        for i, r in enumerate(self.replicas):
            out.append(await r.stats.remote() if i in self.router.alive else None)
        return out

    def kill(self, replica: int) -> None:
        """End a replica's process (for tests and drills: the set finds out as a real death)."""
        import ray

        ray.kill(self.replicas[replica], no_restart=True)

    def shutdown(self) -> None:
        import ray

        for r in self.replicas:
            try:
                ray.kill(r, no_restart=True)
            except Exception:  # already gone
                pass
        self.replicas = []
        if self._owns_ray and ray.is_initialized():
            ray.shutdown()


__all__ = ["ReplicaSet", "ReplicaDiedError", "NoReplicaError"]
